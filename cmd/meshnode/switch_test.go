package main

import (
	"io"
	"testing"
	"time"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node"
)

// TestFlashAttnFlag parses --flash-attn the ways users write it: the bare
// boolean form of earlier versions, a value, a config file's boolean, the
// environment, and nonsense; then --build-ahead, --decode-graphs and --pipelining.
func TestFlashAttnFlag(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     string
		want    ggufstage.Switch
		wantErr bool
	}{
		{"default", nil, "", ggufstage.Auto, false},
		{"bare", []string{"--flash-attn"}, "", ggufstage.On, false},
		{"off", []string{"--flash-attn=off"}, "", ggufstage.Off, false},
		{"false", []string{"--flash-attn=false"}, "", ggufstage.Off, false},
		{"auto", []string{"--flash-attn=auto"}, "", ggufstage.Auto, false},
		{"config file", []string{"--config", ""}, "", ggufstage.On, false},
		{"environment", nil, "on", ggufstage.On, false},
		{"nonsense", []string{"--flash-attn=maybe"}, "", ggufstage.Auto, true},
	}
	// --build-ahead, --decode-graphs and --pipelining take the same
	// values; each is checked on its own field.
	buildAhead := func(f *nodeFlags) ggufstage.Switch { return f.cfg.BuildAhead }
	decodeGraphs := func(f *nodeFlags) ggufstage.Switch { return f.cfg.DecodeGraphs }
	pipelining := func(f *nodeFlags) ggufstage.Switch { return f.cfg.Pipelining }
	for _, tc := range []struct {
		args  []string
		field func(*nodeFlags) ggufstage.Switch
		want  ggufstage.Switch
	}{
		{nil, buildAhead, ggufstage.Auto},
		{[]string{"--build-ahead=on"}, buildAhead, ggufstage.On},
		{[]string{"--build-ahead=off", "--flash-attn"}, buildAhead, ggufstage.Off},
		{nil, decodeGraphs, ggufstage.Auto},
		{[]string{"--decode-graphs=on"}, decodeGraphs, ggufstage.On},
		{[]string{"--decode-graphs=off"}, decodeGraphs, ggufstage.Off},
		{nil, pipelining, ggufstage.Auto},
		{[]string{"--pipelining"}, pipelining, ggufstage.On}, // a boolean before auto existed
		{[]string{"--pipelining=off"}, pipelining, ggufstage.Off},
	} {
		f, err := parseServe(tc.args)
		if err != nil || tc.field(f) != tc.want {
			t.Errorf("parse %v: %v (%v), want %v", tc.args, tc.field(f), err, tc.want)
		}
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.env != "" {
				t.Setenv("MESHNODE_FLASH_ATTN", tc.env)
			}
			args := tc.args
			if len(args) == 2 && args[0] == "--config" {
				args = []string{"--config", writeFile(t, "m.conf", "flash-attn = true\n")}
			}
			f, err := parseServe(args)
			if (err != nil) != tc.wantErr {
				t.Fatalf("parse %v: %v", args, err)
			}
			if err == nil && f.cfg.FlashAttention != tc.want {
				t.Fatalf("parse %v: flash attention %v, want %v", args, f.cfg.FlashAttention, tc.want)
			}
		})
	}
}

// TestBusyPollFlag parses --busy-poll: auto by default, off, a duration,
// from the environment, and values it must refuse.
func TestBusyPollFlag(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     string
		want    time.Duration
		wantErr bool
	}{
		{"default", nil, "", node.BusyPollAuto, false},
		{"auto", []string{"--busy-poll=auto"}, "", node.BusyPollAuto, false},
		{"off", []string{"--busy-poll=off"}, "", 0, false},
		{"zero", []string{"--busy-poll=0"}, "", 0, false},
		{"duration", []string{"--busy-poll", "5ms"}, "", 5 * time.Millisecond, false},
		{"environment", nil, "40ms", 40 * time.Millisecond, false},
		{"negative", []string{"--busy-poll=-1ms"}, "", node.BusyPollAuto, true},
		{"nonsense", []string{"--busy-poll=fast"}, "", node.BusyPollAuto, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.env != "" {
				t.Setenv("MESHNODE_BUSY_POLL", tc.env)
			}
			f, err := parseServe(tc.args)
			if (err != nil) != tc.wantErr {
				t.Fatalf("parse %v: error %v, want error %v", tc.args, err, tc.wantErr)
			}
			if !tc.wantErr && f.cfg.BusyPoll != tc.want {
				t.Errorf("parse %v: %v, want %v", tc.args, f.cfg.BusyPoll, tc.want)
			}
		})
	}
}

// parseServe parses args as serve's node flags.
func parseServe(args []string) (*nodeFlags, error) {
	var f nodeFlags
	fs := newFlags("serve [flags]", "test", "")
	fs.SetOutput(io.Discard)
	f.register(fs)
	return &f, parse(fs, args)
}
