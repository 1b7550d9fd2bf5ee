// Package host is a node's libp2p endpoint: its identity (an Ed25519 key kept
// in the data directory), the mesh key, listeners, dialing, streams as
// net.Conns for gRPC, mDNS discovery and the join-info protocol.
//
// # A private mesh
//
// Every mesh has a 32-byte mesh key (MeshKey, text form "mk1_…" with a
// checksum). Keys for each use are derived from it with HKDF: the libp2p
// private-network PSK, the connection proof key, the gossip key for
// membership, and the mDNS service tag.
//
// The host runs libp2p's private network (pnet) with the PSK: every byte on a
// connection, the libp2p handshake included, is encrypted with it, so a peer
// with another key or none cannot complete a connection, nor learn the node's
// peer ID or protocols. Noise and TLS (libp2p defaults) run inside.
//
// pnet has no "wrong key" signal (both ends just read noise, and a dial may
// hang until its 5 s timeout), so each TCP connection starts with a 20-byte
// mesh-key proof exchanged before pnet (guard.go). A mismatch is then certain
// and immediate on both ends: the dialer's error wraps ErrMeshKey ("peer
// refused: wrong or missing mesh key") and the listener logs "refused
// connection: wrong mesh key" (or "peer has no mesh key" for a plain libp2p
// peer) with the remote address. Other failures before authentication wrap
// ErrHandshake and log "refused connection: handshake failed". The peer ID of
// a refused peer is never known, by design; no post-connect hello protocol is
// needed.
//
// Costs accepted:
//   - TCP only. libp2p's QUIC transport refuses a PSK ("QUIC doesn't support
//     private networks yet"); QUIC would mean an unprotected path.
//   - One extra round trip per connection (each end waits for the other's
//     proof before sending more), negligible on a LAN.
//
// The optional allowlist (Config.Allow) is applied in the connection gater
// after authentication and logged as "refused peer: not in allowlist".
//
// TCP reuseport is off so that a second node on one machine gets its own port
// (fallback to an OS-chosen one) rather than silently sharing 4001.
package host
