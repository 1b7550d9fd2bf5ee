package node

import (
	"context"
	"errors"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/node/admin"
	"github.com/meshnode/meshnode/node/pipeline"
	"github.com/meshnode/meshnode/stage"
)

// handoffFake is an engine with hand-offs whose passes do nothing.
type handoffFake struct {
	info     stage.Info
	launches int
}

func (f *handoffFake) Info() stage.Info { return f.info }
func (f *handoffFake) Forward(context.Context, *stage.Batch) (*stage.Output, error) {
	return &stage.Output{}, nil
}
func (f *handoffFake) Open(stage.SeqID) error                          { return nil }
func (f *handoffFake) Trim(stage.SeqID, int32) error                   { return nil }
func (f *handoffFake) Release(stage.SeqID) error                       { return nil }
func (f *handoffFake) Close() error                                    { return nil }
func (f *handoffFake) WeightBytes() uint64                             { return 0 }
func (f *handoffFake) ImportHandoff([]byte) (stage.HandoffPort, error) { return fakePort{}, nil }
func (f *handoffFake) ExportHandoff(int) (stage.HandoffPort, []byte, error) {
	return fakePort{}, []byte("offer"), nil
}
func (f *handoffFake) LaunchHandoff(context.Context, *stage.Batch, stage.HandoffPort, stage.HandoffPort) (stage.LaunchedPass, bool, error) {
	f.launches++
	return fakePass{}, true, nil
}

type fakePort struct{}

func (fakePort) Read(int) (*stage.Activation, error) { return nil, errors.New("fake") }
func (fakePort) Close() error                        { return nil }

type fakePass struct{}

func (fakePass) Finish() (*stage.Output, error) { return &stage.Output{}, nil }
func (fakePass) Abandon() error                 { return nil }

// The observed engine passes hand-offs through to an engine that has
// them, counts its passes by direction, and says so for one that has not.
func TestObservedHandoff(t *testing.T) {
	info := stage.Info{Layers: 4, Start: 0, End: 2, Embd: 8, Vocab: 16}
	inner := &handoffFake{info: info}
	o := &observer{metrics: admin.NewMetrics(func() admin.Gauges { return admin.Gauges{} })}
	e := o.wrapEngine(inner, stage.Memory{})
	var h pipeline.HandoffEngine = e
	b := &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{3}, Tokens: []int32{5}}
	tests := []struct {
		name    string
		in, out stage.HandoffPort
	}{
		{name: "out", out: fakePort{}},
		{name: "in", in: fakePort{}},
		{name: "in and out", in: fakePort{}, out: fakePort{}},
	}
	for _, tc := range tests {
		p, ok, err := h.LaunchHandoff(t.Context(), b, tc.in, tc.out)
		if err != nil || !ok {
			t.Fatalf("%s: LaunchHandoff: %v, %v", tc.name, ok, err)
		}
		if _, err := p.Finish(); err != nil {
			t.Fatal(err)
		}
	}
	if inner.launches != len(tests) || e.forwards.Load() != uint64(len(tests)) {
		t.Fatalf("%d launches and %d passes recorded, want %d", inner.launches, e.forwards.Load(), len(tests))
	}
	rec := httptest.NewRecorder()
	o.metrics.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	for _, want := range []string{`meshnode_stage_handoffs_total{direction="in",stage="0-2"} 2`, `meshnode_stage_handoffs_total{direction="out",stage="0-2"} 2`} {
		if !strings.Contains(rec.Body.String(), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	// An engine without hand-offs: the offer fails, a launch declines.
	plain := o.wrapEngine(plainEngine{}, stage.Memory{})
	if _, _, err := plain.ExportHandoff(8); !errors.Is(err, errNoHandoff) {
		t.Errorf("ExportHandoff of an engine without hand-offs: %v", err)
	}
	if _, ok, err := plain.LaunchHandoff(t.Context(), b, nil, fakePort{}); ok || err != nil {
		t.Errorf("LaunchHandoff of an engine without hand-offs: ok %v, %v", ok, err)
	}
}
