package main

import (
	"io"
	"testing"

	"github.com/meshnode/meshnode/ggufstage"
)

// TestFlashAttnFlag parses --flash-attn the ways users write it: the bare
// boolean form of earlier versions, a value, a config file's boolean, the
// environment, and nonsense.
func TestFlashAttnFlag(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     string
		want    ggufstage.FlashAttention
		wantErr bool
	}{
		{"default", nil, "", ggufstage.FlashAuto, false},
		{"bare", []string{"--flash-attn"}, "", ggufstage.FlashOn, false},
		{"off", []string{"--flash-attn=off"}, "", ggufstage.FlashOff, false},
		{"false", []string{"--flash-attn=false"}, "", ggufstage.FlashOff, false},
		{"auto", []string{"--flash-attn=auto"}, "", ggufstage.FlashAuto, false},
		{"config file", []string{"--config", ""}, "", ggufstage.FlashOn, false},
		{"environment", nil, "on", ggufstage.FlashOn, false},
		{"nonsense", []string{"--flash-attn=maybe"}, "", ggufstage.FlashAuto, true},
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
			var f nodeFlags
			fs := newFlags("serve [flags]", "test", "")
			fs.SetOutput(io.Discard)
			f.register(fs)
			err := parse(fs, args)
			if (err != nil) != tc.wantErr {
				t.Fatalf("parse %v: %v", args, err)
			}
			if err == nil && f.cfg.FlashAttention != tc.want {
				t.Fatalf("parse %v: flash attention %v, want %v", args, f.cfg.FlashAttention, tc.want)
			}
		})
	}
}
