// Package membership is the mesh's gossip: who is in it, alive or not, and
// what each node offers (Meta). It runs hashicorp/memberlist with the node's
// libp2p peer ID as its name.
//
// # Transport
//
// memberlist's own UDP+TCP transport on a port of its own (DefaultPort 4002;
// with PortFallback an OS-chosen one when taken), not libp2p streams: it is
// memberlist's tested path (UDP probes, TCP fallback, push-pull), and failure
// detection then does not depend on the libp2p connection it is supposed to
// judge. All gossip is encrypted and authenticated with AES-256-GCM under
// Config.SecretKey (derive it from the mesh key: host.MeshKey.GossipKey), so
// a node without the mesh key can neither join nor read anything; the node it
// contacts logs "refused gossip: wrong mesh key?". The gossip address is
// exchanged through libp2p (host.JoinProtocol), so join commands carry only
// the libp2p address.
//
// # Metadata
//
// Meta travels in memberlist's node meta (at most 512 bytes) as JSON with
// short keys when it fits. When it does not (many models, many addresses),
// the node meta carries only the small fast-changing fields plus a hash of
// the rest; members whose copy does not match that hash fetch the full Meta
// with a push-pull exchange (Delegate.LocalState/MergeRemoteState, triggered
// as a Join to that one member). Until then the Member is listed with
// Complete false. Every 15 s a push-pull with a random member repairs
// anything missed.
//
// # Failure detection
//
// Probe every 0.5 s with a 0.25 s timeout, suspicion 4×0.5 s×max(1, log10 n)
// (at most twice that while waiting for confirmations), gossip every 100 ms:
// a node that stops is declared failed in about 2.5–4 s on a LAN (tested:
// < 6 s, typically 2.9 s with 3 nodes). See the constants in membership.go.
//
// # Events
//
// Events reports joins, updates, graceful leaves and failures of other
// members on a bounded channel. memberlist's callbacks never block on it:
// when it is full the oldest event is dropped (and counted), so readers see
// the latest news and can always rebuild the full picture from Members.
package membership
