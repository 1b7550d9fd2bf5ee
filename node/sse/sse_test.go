package sse

import (
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
)

func TestEach(t *testing.T) {
	stop := errors.New("stop")
	tests := []struct {
		name    string
		stream  string
		stopAt  string // fn returns stop on this event
		events  []string
		wantErr error  // errors.Is
		errText string // or a substring of the error
	}{
		{"events then done", "data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n", "", []string{`{"a":1}`, `{"b":2}`}, nil, ""},
		{"no space after the colon", "data:{}\n\ndata:[DONE]\n", "", []string{"{}"}, nil, ""},
		{"comments are skipped", ": keep-alive\n\ndata: x\n\ndata: [DONE]\n", "", []string{"x"}, nil, ""},
		{"ends without done", "data: x\n\n", "", []string{"x"}, ErrNoDone, ""},
		{"empty stream", "", "", nil, ErrNoDone, ""},
		{"a line that is not an event", "data: x\n\nevent: y\n\n", "", []string{"x"}, nil, "not an event"},
		{"fn stops it", "data: x\n\ndata: y\n\ndata: [DONE]\n", "x", []string{"x"}, stop, ""},
		{"nothing read after done", "data: [DONE]\n\ndata: late\n", "", nil, nil, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			err := Each(strings.NewReader(tc.stream), func(d []byte) error {
				got = append(got, string(d))
				if string(d) == tc.stopAt {
					return stop
				}
				return nil
			})
			switch {
			case tc.errText != "":
				if err == nil || !strings.Contains(err.Error(), tc.errText) {
					t.Errorf("err %v, want one saying %q", err, tc.errText)
				}
			case !errors.Is(err, tc.wantErr):
				t.Errorf("err %v, want %v", err, tc.wantErr)
			}
			if !slices.Equal(got, tc.events) {
				t.Errorf("events %q, want %q", got, tc.events)
			}
		})
	}
}

func TestEachReadError(t *testing.T) {
	r := io.MultiReader(strings.NewReader("data: x\n\n"), errReader{})
	if err := Each(r, func([]byte) error { return nil }); err == nil || errors.Is(err, ErrNoDone) || !strings.Contains(err.Error(), "connection reset") {
		t.Errorf("err %v, want the read error", err)
	}
}

type errReader struct{}

func (errReader) Read([]byte) (int, error) { return 0, errors.New("connection reset") }
