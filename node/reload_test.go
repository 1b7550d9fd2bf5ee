package node_test

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/meshnode/meshnode/node"
)

// TestBrokenStageReloads: a node whose stage engine broke (ggufstage
// refuses every call after a panic inside ggml) drops the stage and loads
// it again, and then answers as before.
func TestBrokenStageReloads(t *testing.T) {
	var breakNow atomic.Bool
	n := startNode(t, node.BreakStage(node.Config{Model: modelPath}, func() error {
		if breakNow.CompareAndSwap(true, false) {
			return errors.New("forward pass: cudaMalloc failed: out of memory")
		}
		return nil
	}))
	before := complete(t, n.url, modelID, "Once upon a time", 16, false)
	loads := func(st node.Status) (n int) {
		for _, e := range st.Events {
			if e.Kind == "load" {
				n++
			}
		}
		return n
	}
	first := loads(status(t, n.url))
	breakNow.Store(true)
	st := waitStatus(t, n.url, "reloaded its stage", func(st node.Status) bool { return loads(st) > first && st.Local != nil })
	var said bool
	for _, e := range st.Events {
		said = said || (e.Kind == "error" && strings.Contains(e.Text, "broke and are reloaded") && strings.Contains(e.Text, "out of memory"))
	}
	if !said {
		t.Errorf("no event says the stage broke and why: %+v", st.Events)
	}
	waitStatus(t, n.url, "ready to serve", func(st node.Status) bool { return st.Local != nil && len(st.Plan) == 1 })
	if after := complete(t, n.url, modelID, "Once upon a time", 16, false); after.text != before.text {
		t.Errorf("after the reload: %q, before: %q", after.text, before.text)
	}
}
