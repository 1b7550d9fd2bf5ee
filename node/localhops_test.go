package node_test

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node"
)

// TestLocalHopsOnFailsLoudly: with --local-hops on, a node that cannot
// listen on its local socket (here: a socket directory other users could
// enter) does not start; with auto it starts, over TCP alone.
func TestLocalHopsOnFailsLoudly(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	if err := os.Mkdir(filepath.Join(tmp, "meshnode-"+strconv.Itoa(os.Getuid())), 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(tmp, "meshnode-"+strconv.Itoa(os.Getuid())), 0o777); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		hops   ggufstage.Switch
		starts bool
	}{
		{ggufstage.On, false},
		{ggufstage.Auto, true},
	}
	for _, tt := range tests {
		t.Run(tt.hops.String(), func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			ready := make(chan string, 1)
			done := make(chan error, 1)
			cfg := node.Config{
				Model: modelPath, HTTPAddr: "127.0.0.1:0", Threads: 1, Context: 256, Parallel: 1,
				Listen: []string{"/ip4/127.0.0.1/tcp/0"}, GossipPort: -1, DataDir: t.TempDir(),
				LocalHops: tt.hops, Ready: func(addr string) { ready <- addr },
			}
			go func() { done <- node.Run(ctx, cfg) }()
			select {
			case err := <-done:
				if tt.starts || err == nil || !strings.Contains(err.Error(), "--local-hops on") || !strings.Contains(err.Error(), "open to other users") {
					t.Fatalf("node.Run: %v", err)
				}
			case <-ready:
				if !tt.starts {
					t.Fatal("the node started without its local socket")
				}
				cancel()
				if err := <-done; err != nil {
					t.Fatalf("node.Run after cancel: %v", err)
				}
			case <-time.After(60 * time.Second):
				t.Fatal("the node neither started nor failed")
			}
		})
	}
}
