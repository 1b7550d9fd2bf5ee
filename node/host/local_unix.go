//go:build unix && !linux

package host

import "net"

// checkPeerUser: where the peer's credentials take other calls, the socket
// directory's permissions (localDir) alone keep other users out.
func checkPeerUser(*net.UnixConn) error { return nil }
