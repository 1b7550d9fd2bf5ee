// Package pipeline runs batches across stages that live in different
// processes, over gRPC bidirectional streams (StageService.Forward).
//
// A stage serves its engine with a Server. A node that drives generation
// (the origin) builds a Pipeline over an ordered route of hops that covers
// every layer; the Pipeline is what the scheduler runs batches through.
//
// # Streams
//
// The origin opens a forward stream to hop 0 and a return stream to the
// last hop; each stage that is not last opens a forward stream to the next
// hop. The first frame of every stream is a Setup naming the pipeline
// (origin and id), the route, the receiving hop and the stream's role. Work
// and sequence control flow down the chain of forward streams in order; the
// last stage samples and sends one reply per request, in order, straight to
// the origin on the return stream. Only fatal errors travel up a forward
// stream. proto/meshnode/v1/stage.proto has the details.
//
//	origin ──fwd──▶ hop 0 ──fwd──▶ hop 1 ──fwd──▶ last
//	   ▲                                            │
//	   └────────────────── return ──────────────────┘
//
// Several requests may be in flight at once (Pipeline.Submit), so that
// micro-batch s+1 runs on hop 0 while micro-batch s runs on hop 1.
//
// # Transports
//
// Streams are gRPC's between nodes (over libp2p on a mesh), in process to a
// node's own stage (InProcess), and between nodes of one machine socket
// streams (OverSockets, SocketServer): length-prefixed frames on a
// connection of their own, with gRPC's stream semantics (status codes, half
// close, cancellation), so that Server and Pipeline cannot tell them apart.
// On Linux, over a Unix socket, a stream's messages go through two rings
// of shared memory, one a direction, that the client offers with its open
// message (ring.go); the socket then carries only doorbells for a reader
// asleep, messages too large for a ring, and the end of a peer.
// On socket and in-process streams a stage's handler reads its frames, and
// writes them to a next hop over a socket, itself; on gRPC's, a goroutine
// of the handler's reads for it and another writes. Hops over socket
// streams carry f32 whatever the pipeline's wire dtype.
//
// # Sequences and sampling
//
// Sequence ids belong to the origin; every stage maps (pipeline, id) to an
// engine slot of its own, so pipelines of different origins never collide.
// OPEN carries the sampling parameters and the prompt; the last stage keeps
// one sampler per sequence and the sequence's token history, which it
// updates from the token ids that travel with every batch (so trims and
// replays keep the penalties exact).
//
// # Failure
//
// Every frame is validated before use. A peer that sends a malformed frame
// gets an Error frame with the reason, its stream is closed, and the
// server's OnBadPeer hook is told. A step that fails in an engine fails
// alone: its Error takes the step's place in the order. A stage that dies,
// a broken stream or a reply that does not come within the step timeout
// breaks the pipeline: everything in flight fails with a HopError naming
// the hop, every stage releases the pipeline's sequences as its streams
// end, and rebuilding (a new Pipeline, the history re-prefilled) is the
// caller's job.
package pipeline
