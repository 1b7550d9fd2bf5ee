package node

import (
	"testing"

	"github.com/meshnode/meshnode/node/admin"
	"github.com/meshnode/meshnode/node/membership"
)

// TestHopVia: a hop goes over a local socket only between two nodes that
// announce the same local host, the receiving one with a socket.
func TestHopVia(t *testing.T) {
	here := membership.Meta{LocalHost: "aa", LocalSocket: "/tmp/meshnode-0/1.sock"}
	tests := []struct {
		name     string
		from, to membership.Meta
		same     bool
		want     string
	}{
		{"one node", here, here, true, admin.ViaNode},
		{"one machine", here, membership.Meta{LocalHost: "aa", LocalSocket: "/tmp/meshnode-0/2.sock"}, false, admin.ViaLocal},
		{"another machine or namespace", here, membership.Meta{LocalHost: "bb", LocalSocket: "/tmp/meshnode-0/2.sock"}, false, admin.ViaLibp2p},
		{"the sender's local hops off", membership.Meta{}, here, false, admin.ViaLibp2p},
		{"the receiver's local hops off", here, membership.Meta{}, false, admin.ViaLibp2p},
		{"both off", membership.Meta{}, membership.Meta{}, false, admin.ViaLibp2p},
		{"a receiver without a socket", here, membership.Meta{LocalHost: "aa"}, false, admin.ViaLibp2p},
	}
	for _, tt := range tests {
		if got := hopVia(tt.from, tt.to, tt.same); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
}
