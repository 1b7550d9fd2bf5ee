// Package host is a node's libp2p endpoint: its identity (an Ed25519 key kept
// in the data directory), the mesh key, listeners, dialing, streams as
// net.Conns for gRPC, mDNS discovery and the join-info protocol.
//
// # A private mesh
//
// Every mesh has a 32-byte mesh key (MeshKey, text form "mk1_…" with a
// checksum). Keys for each use are derived from it with HKDF: the
// connection proof key, the link cipher key, the gossip key for membership,
// and the mDNS service tag.
//
// Each TCP connection starts with a 20-byte mesh-key proof from each end
// (guard.go), checked before anything more passes: a wrong key is certain
// and immediate on both ends. The dialer's error wraps ErrMeshKey ("peer
// refused: wrong or missing mesh key") and the listener logs "refused
// connection: wrong mesh key" (or "peer has no mesh key" for a plain libp2p
// peer, or "the peer runs an older meshnode" for a v1 or v2 proof) with the
// remote address. Other failures before authentication wrap ErrHandshake and
// log "refused connection: handshake failed". The peer ID of a refused peer
// is never known, by design.
//
// Then every byte of the libp2p handshake goes through the link cipher:
// AES-256-CTR, one key per direction, derived from the mesh key and both
// proofs' fresh nonces. A peer without the mesh key cannot complete a
// connection, nor learn the node's peer ID or protocols. This is what
// libp2p's private network (pnet) does with XSalsa20, at a fraction of its
// CPU cost. Noise or TLS (libp2p defaults) runs inside and authenticates
// the peers; once an end's handshake is done it ends its link cipher with a
// tag only a key holder can make, and its bytes are then protected by the
// Noise or TLS session alone (guard.go says why that is enough).
//
// Costs accepted:
//   - TCP only: the proof and the link cipher wrap the TCP transport's
//     connections; QUIC would mean an unprotected path.
//   - One extra round trip per connection (each end waits for the other's
//     proof before sending more), negligible on a LAN.
//
// The optional allowlist (Config.Allow) is applied in the connection gater
// after authentication and logged as "refused peer: not in allowlist".
//
// # Local connections
//
// Nodes of one machine, user and network namespace also meet over a Unix
// socket (ListenLocal, DialLocal; local.go), in a directory only the user
// may enter, after a handshake in which each end proves the mesh key and
// its peer ID. What crosses it is not encrypted: it never leaves the
// kernel.
//
// TCP reuseport is off so that a second node on one machine gets its own port
// (fallback to an OS-chosen one) rather than silently sharing 4001.
package host
