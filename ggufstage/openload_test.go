package ggufstage

import (
	"context"
	"sync"
	"testing"

	"github.com/meshnode/meshnode/stage"
)

// TestOpenWhileForwarding: a mesh node loads its next layer range while
// its current engine keeps serving. Loading a ggml engine while another
// computes corrupted the running one (a SIGSEGV or a GGML_ASSERT within a
// few hundred loads, every time, before backendMu); now forward passes run
// on through many loads and closes, and give the same hidden states as on
// a quiet engine.
func TestOpenWhileForwarding(t *testing.T) {
	dir := t.TempDir()
	serving, err := Slice(storiesPath, dir, 0, 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	next, err := Slice(storiesPath, dir, 0, 3, nil)
	if err != nil {
		t.Fatal(err)
	}
	opts := Options{Threads: 1, Context: 64, MaxSeqs: 1, WireDType: stage.F32}
	e, err := Open(serving, 0, 2, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()

	forward := func() ([]byte, error) {
		if err := e.Open(1); err != nil {
			return nil, err
		}
		defer e.Release(1)
		out, err := e.Forward(context.Background(), &stage.Batch{
			Seqs: []stage.SeqID{1, 1, 1}, Pos: []int32{0, 1, 2}, Tokens: []int32{1, 2, 3},
		})
		if err != nil {
			return nil, err
		}
		return append([]byte(nil), out.Hidden.Data...), nil
	}
	want, err := forward()
	if err != nil {
		t.Fatal(err)
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var passes int
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			got, err := forward()
			if err != nil {
				t.Errorf("forward pass %d: %v", passes, err)
				return
			}
			if string(got) != string(want) {
				t.Errorf("forward pass %d: hidden states differ from the quiet engine's", passes)
				return
			}
			passes++
		}
	})
	const loads = 150
	for range loads {
		other, err := Open(next, 0, 3, opts)
		if err != nil {
			t.Error(err)
			break
		}
		other.Close()
	}
	close(stop)
	wg.Wait()
	t.Logf("%d forward passes during %d loads", passes, loads)
	if passes == 0 {
		t.Error("no forward pass ran during the loads")
	}
}
