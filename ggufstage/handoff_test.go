package ggufstage

import (
	"errors"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/stage"
)

// On the CPU no stage can hand off on a device: the offer and the opening
// say why, and a launch declines (ok false) without touching the engine,
// which then runs the batch through Forward as before.
func TestHandoffOnTheCPU(t *testing.T) {
	p := openSplit(t, storiesPath, []int{0, 2, 5}, Options{Threads: 1, MaxSeqs: 1, Context: 64})
	defer p.close()
	first, last := p.stages[0], p.stages[1]
	tests := []struct {
		name string
		call func() error
		want string
	}{
		{name: "offer of the first stage", call: func() error { _, _, err := first.ExportHandoff(8); return err }, want: "fused CUDA"},
		{name: "offer of the last stage", call: func() error { _, _, err := last.ExportHandoff(8); return err }, want: "no hidden output"},
		{name: "opening on the first stage", call: func() error { _, err := first.ImportHandoff([]byte("mnh1")); return err }, want: "takes no hidden states"},
		{name: "opening on the last stage", call: func() error { _, err := last.ImportHandoff([]byte("mnh1")); return err }, want: "fused CUDA"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			if !errors.Is(err, errNoHandoff) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%v, want errNoHandoff saying %q", err, tc.want)
			}
		})
	}
	if err := first.Open(1); err != nil {
		t.Fatal(err)
	}
	b := &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}, Tokens: []int32{1}, Outputs: []int{0}}
	lp, ok, err := first.LaunchHandoff(t.Context(), b, nil, nil)
	if lp != nil || ok || err != nil {
		t.Fatalf("LaunchHandoff on the CPU: %v, %v, %v; want it to decline", lp, ok, err)
	}
	// The engine is free and unchanged: the batch runs as usual.
	out, err := first.Forward(t.Context(), b)
	if err != nil {
		t.Fatal(err)
	}
	out.Release()
	// A malformed batch is an error, not a decline.
	if _, ok, err := first.LaunchHandoff(t.Context(), &stage.Batch{Seqs: []stage.SeqID{1}, Tokens: []int32{1}}, nil, nil); ok || err == nil {
		t.Fatalf("LaunchHandoff of a batch without positions: ok %v, %v", ok, err)
	}
	// So are hidden states on a device into the stage that embeds.
	if _, ok, err := first.LaunchHandoff(t.Context(), b, fakePort{}, nil); ok || err == nil {
		t.Fatalf("LaunchHandoff from a port into the first stage: ok %v, %v", ok, err)
	}
}

type fakePort struct{}

func (fakePort) Read(int) (*stage.Activation, error) { return nil, errors.New("fake") }
func (fakePort) Close() error                        { return nil }
