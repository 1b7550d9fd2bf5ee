package wire

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

func TestSetupHandoff(t *testing.T) {
	offer := bytes.Repeat([]byte{7}, 172)
	tests := []struct {
		name    string
		change  func(*Setup)
		wantErr string
	}{
		{name: "an offer", change: func(s *Setup) { s.Handoff = offer }},
		{name: "an answer", change: func(s *Setup) { s.HandoffTaken = true }},
		{name: "an offer too large", change: func(s *Setup) { s.Handoff = make([]byte, MaxHandoff+1) }, wantErr: "hand-off offer of 1025 bytes"},
		{name: "an offer on a return stream", change: func(s *Setup) { s.Handoff, s.Role, s.Hop = offer, RoleReturn, len(s.Route)-1 }, wantErr: "hand-off offer on a return stream"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := testSetup()
			tc.change(&s)
			f, err := EncodeSetup(s)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("EncodeSetup: %v, want %q", err, tc.wantErr)
				}
				// A peer's frame that says so is refused too.
				s2 := testSetup()
				f, err := EncodeSetup(s2)
				if err != nil {
					t.Fatal(err)
				}
				f.GetSetup().Handoff, f.GetSetup().Role = s.Handoff, roleToProto[s.Role]
				f.GetSetup().Hop = uint32(s.Hop)
				if _, err := DecodeSetup(f); err == nil || !errors.Is(err, ErrBadFrame) {
					t.Fatalf("DecodeSetup: %v, want a bad frame", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got, err := DecodeSetup(f)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Handoff, s.Handoff) || got.HandoffTaken != s.HandoffTaken {
				t.Fatalf("decoded offer %d bytes, taken %v; want %d, %v", len(got.Handoff), got.HandoffTaken, len(s.Handoff), s.HandoffTaken)
			}
		})
	}
}

func TestOnDeviceActivations(t *testing.T) {
	b := &stage.Batch{Seqs: []stage.SeqID{4, 9}, Pos: []int32{3, 7}, Tokens: []int32{11, 12}, Outputs: []int{0, 1}}
	tests := []struct {
		name    string
		change  func(*meshnodev1.Activations)
		wantErr string
	}{
		{name: "as encoded", change: func(*meshnodev1.Activations) {}},
		{name: "with a payload", change: func(a *meshnodev1.Activations) { a.Payload = make([]byte, 2*64*4) }, wantErr: "on the device with 512 payload bytes"},
		{name: "not alone", change: func(a *meshnodev1.Activations) { a.Alone = false }, wantErr: "not alone"},
		{name: "split", change: func(a *meshnodev1.Activations) { a.More = true }, wantErr: "split batch"},
		{name: "rows that do not match", change: func(a *meshnodev1.Activations) { a.Rows = 3 }, wantErr: "3 rows"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := EncodeOnDevice(5, b, 64)
			if err != nil {
				t.Fatal(err)
			}
			tc.change(f.GetActivations())
			got, err := DecodeBatch(f, DefaultLimits())
			if tc.wantErr != "" {
				if err == nil || !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("DecodeBatch: %v, want a bad frame saying %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Hidden != nil || len(got.Seqs) != 2 || got.Pos[1] != 7 || got.Tokens[0] != 11 || len(got.Outputs) != 2 {
				t.Fatalf("decoded %+v", got)
			}
			if f.GetStep() != 5 || !f.GetActivations().GetAlone() {
				t.Fatalf("frame step %d, alone %v", f.GetStep(), f.GetActivations().GetAlone())
			}
		})
	}
	if BodyKind(EncodeHanded(3)) != "handed" {
		t.Errorf("a Handed frame's kind is %q", BodyKind(EncodeHanded(3)))
	}
}
