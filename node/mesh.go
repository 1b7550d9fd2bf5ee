package node

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/protocol"
	"github.com/ollama/ollama/ml"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/ggufstage/gguf"
	"github.com/meshnode/meshnode/mlxstage"
	"github.com/meshnode/meshnode/mlxstage/ops"
	"github.com/meshnode/meshnode/mlxstage/safetensors"
	"github.com/meshnode/meshnode/node/admin"
	"github.com/meshnode/meshnode/node/host"
	"github.com/meshnode/meshnode/node/membership"
	"github.com/meshnode/meshnode/node/pipeline"
	"github.com/meshnode/meshnode/node/planner"
	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/node/scheduler"
	"github.com/meshnode/meshnode/node/weights"
	"github.com/meshnode/meshnode/node/wire"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// libp2p protocols a node speaks besides the join helper.
const (
	StageProtocol  protocol.ID = "/meshnode/stage/1"  // gRPC StageService
	RangesProtocol protocol.ID = "/meshnode/ranges/1" // weight byte ranges
)

// mesh is a node's part in the mesh: it plans, loads its stage, serves it
// to the other stages, and builds the pipeline its own requests run on.
// One goroutine (run) makes every decision; the rest only reads.
type mesh struct {
	vocabs   vocabCache
	cfg      Config
	log      *zap.Logger
	host     *host.Host
	ml       *membership.Membership
	conns    *pipeline.Conns
	selfConn grpc.ClientConnInterface // this node's own stage, in process
	files    weights.FileIndex
	grpcSrv  *grpc.Server
	mux      *stageMux
	// The local socket that nodes on this machine reach the stage by
	// (Config.LocalHops); nil without one.
	sockLn    *host.LocalListener
	sockSrv   *pipeline.SocketServer
	localHost string // socketHostID, with a socket
	budget    uint64
	speed     float64
	self      string

	pubMu sync.Mutex // publish's turn

	// sliceFetched is what each slice fetched in this process cost, by
	// path, so that a slice made again after a replan (already in the data
	// dir) still reports the bytes that came over the network for it.
	sliceMu      sync.Mutex
	sliceFetched map[string]uint64

	mu     sync.Mutex
	model  *meshModel
	local  *localStage
	plan   planner.Plan
	route  []pipeline.Hop
	pipe   scheduler.Pipeline // what requests run on now; nil until ready
	remote *pipeline.Pipeline // pipe, when it spans other nodes
	// ran is the model a pipeline last ran, so that a missing one is told
	// apart: a replan of a model that ran (its stages moving) rather than
	// a model not yet served.
	ran    *meshModel
	events []MeshEvent
	// gpuHint is the last GPU-sharing hint given (hintGPUShare).
	gpuHint string
	meta    membership.Meta
	// draining is set when the node is leaving on purpose.
	draining bool
	probed   bool // GPUs looked for

	obs     *observer // status and metrics
	planErr error     // why the last placement failed

	// mlxDevice is where this node runs MLX stages ("metal", or
	// "emulated" under the test hook); "" when it cannot run them.
	mlxDevice string

	lastReload time.Time // when a broken stage was last dropped for reloading
}

// reloadBackoff spaces reloads of a stage that keeps breaking (an
// allocation that fails every time, say), so that the node does not spend
// its life loading.
var reloadBackoff = 30 * time.Second

// brokenErr says why an engine can no longer run (ggufstage.ErrBroken
// after a panic inside ggml), or nil.
func brokenErr(e stage.Engine) error {
	if b, ok := e.(interface{ Broken() error }); ok {
		return b.Broken()
	}
	return nil
}

// meshModel is the model the mesh serves.
type meshModel struct {
	ref    membership.ModelRef
	info   modelInfo
	path   string   // the full file (GGUF) or directory (safetensors), when this node holds it
	header string   // ggml: a GGUF of the model's metadata alone (tokenizer)
	st     *stModel // mlx: the safetensors model's files; nil for a GGUF
}

// stModel is a safetensors model, which the mlx engine runs.
type stModel struct {
	// files opens the model's files: the directory on the node that holds
	// it; elsewhere the small files copied (hash-checked) into the data
	// directory, and the shards read by range from peers with ctx.
	files func(ctx context.Context) safetensors.Opener
}

// modelInfo is what the mesh needs to know of a model, whichever engine
// runs it: its shape, and its bytes as the planner places them.
type modelInfo struct {
	Arch                string
	Layers, Embd, Vocab int
	perLayer            []uint64 // weight bytes of each block
	embed, head, kv     uint64   // embedding; output norm and head; K+V per token per layer
}

func ggufInfo(mi ggufstage.ModelInfo) modelInfo {
	per, embed, head, kv := mi.Sizes()
	return modelInfo{Arch: mi.Arch, Layers: mi.Layers, Embd: mi.Embd, Vocab: mi.Vocab,
		perLayer: per, embed: embed, head: head, kv: kv}
}

func mlxInfo(mi mlxstage.ModelInfo) modelInfo {
	per, embed, head, kv := mi.Sizes()
	c := mi.Config
	return modelInfo{Arch: c.Arch, Layers: c.Layers, Embd: c.Hidden, Vocab: c.Vocab,
		perLayer: per, embed: embed, head: head, kv: kv}
}

// localStage is the layer range this node serves.
type localStage struct {
	start, end int
	engine     stage.Engine
	server     *pipeline.Server
	slice      string
	fetched    uint64          // bytes fetched from peers for the slice in this run (sliceCost)
	observed   *observedEngine // engine, measured: what the server and a local pipe run on
}

// MeshEvent is something that happened, for status and logs.
type MeshEvent = admin.Event

func (m *mesh) event(kind, format string, args ...any) {
	m.record(false, kind, fmt.Sprintf(format, args...))
}

// warnEvent is an event that the log shows as a warning.
func (m *mesh) warnEvent(kind, format string, args ...any) {
	m.record(true, kind, fmt.Sprintf(format, args...))
}

func (m *mesh) record(warn bool, kind, text string) {
	ev := MeshEvent{Time: time.Now(), Kind: kind, Text: text}
	if warn {
		m.log.Warn(ev.Text, zap.String("event", kind))
	} else {
		m.log.Info(ev.Text, zap.String("event", kind))
	}
	if m.obs != nil {
		m.obs.onEvent(kind, ev.Text)
	}
	m.mu.Lock()
	m.events = append(m.events, ev)
	if len(m.events) > 200 {
		m.events = m.events[len(m.events)-200:]
	}
	m.mu.Unlock()
}

// startMesh brings up identity, transport, gossip and the stage service.
func startMesh(ctx context.Context, cfg Config, log *zap.Logger) (*mesh, error) {
	key, err := meshKey(cfg)
	if err != nil {
		return nil, err
	}
	hc := host.Config{DataDir: cfg.DataDir, Listen: cfg.Listen, MeshKey: key, Logger: log.Named("p2p"), MDNS: cfg.MDNS, BusyPoll: busyPollWindow(cfg.BusyPoll, false)}
	if len(cfg.AllowPeers) > 0 {
		allowed := map[peer.ID]bool{}
		for _, s := range cfg.AllowPeers {
			id, err := peer.Decode(s)
			if err != nil {
				return nil, fmt.Errorf("--allow-peer %q: %w", s, err)
			}
			allowed[id] = true
		}
		hc.Allow = func(id peer.ID) bool { return allowed[id] }
	}
	h, err := host.New(ctx, hc)
	if err != nil {
		return nil, fmt.Errorf("starting libp2p host: %w", err)
	}
	m := &mesh{cfg: cfg, log: log, host: h, self: h.ID().String()}
	m.obs = newObserver(m)
	m.budget = availableMemory()
	if cfg.MaxMemory > 0 {
		m.budget = min(m.budget, cfg.MaxMemory)
	}
	m.speed = measureSpeed()

	gossipPort := cfg.GossipPort
	if gossipPort == 0 {
		gossipPort = membership.DefaultPort
	}
	if gossipPort < 0 {
		gossipPort = 0
	}
	m.mlxDevice = cfg.mlxDevice()
	m.meta = membership.Meta{Engine: membership.EngineGGML, Engines: m.engines(), Backend: "cpu", Compute: computeID("cpu"),
		MemTotal: totalMemory(), MemFree: m.budget, Speed: m.speed, State: membership.NodeLoading}
	if name, err := os.Hostname(); err == nil {
		m.meta.Name = name
	}
	for _, a := range h.Addrs() {
		m.meta.Addrs = append(m.meta.Addrs, a.String())
	}
	m.meta.Pins = cfg.pins()
	if cfg.LocalHops != ggufstage.Off {
		if ln, err := h.ListenLocal(); err != nil {
			if cfg.LocalHops == ggufstage.On {
				h.Close()
				return nil, fmt.Errorf("--local-hops on: %w", err)
			}
			log.Warn("stages on this machine will reach this node over TCP", zap.Error(err))
		} else {
			m.sockLn, m.localHost = ln, socketHostID()
			m.meta.LocalHost, m.meta.LocalSocket = m.localHost, ln.Path()
		}
	}
	ml, err := membership.New(membership.Config{
		Name: m.self, BindAddr: cfg.GossipBind, BindPort: gossipPort, PortFallback: cfg.GossipPort == 0,
		SecretKey: key.GossipKey(), Logger: log.Named("gossip"),
		Meta: func() membership.Meta { return m.meta },
	})
	if err != nil {
		if m.sockLn != nil {
			m.sockLn.Close()
		}
		h.Close()
		return nil, fmt.Errorf("starting gossip: %w", err)
	}
	m.ml = ml
	h.ServeGossipAddrs(ml.Port(), nil)
	h.LibP2P().SetStreamHandler(StatsProtocol, m.obs.serveStats)

	// Weights are served to peers by byte range; stages by gRPC. Both ride
	// on libp2p streams, so both are private to the mesh.
	h.LibP2P().SetStreamHandler(RangesProtocol, func(s network.Stream) {
		if err := weights.ServeRanges(s, &m.files); err != nil {
			log.Debug("weight range stream", zap.Error(err))
		}
	})
	m.conns = pipeline.NewConns(grpc.WithContextDialer(h.GRPCDialer(StageProtocol)), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithStatsHandler(hopStats{m.obs}))
	m.mux = &stageMux{}
	// libp2p cannot dial its own peer; a stage on this node is reached in
	// process, which also keeps the first hop of its pipelines off gRPC's
	// transport.
	m.selfConn = pipeline.InProcess(m.mux)
	m.grpcSrv = grpc.NewServer(append(wire.ServerOptions(), grpc.StatsHandler(hopStats{m.obs}))...)
	meshnodev1.RegisterStageServiceServer(m.grpcSrv, m.mux)
	ln := h.Listen(StageProtocol)
	go m.grpcSrv.Serve(ln) // stopped in close
	if m.sockLn != nil {
		m.sockSrv = pipeline.NewSocketServer(m.mux, pipeline.SocketServerConfig{Count: m.obs.hopBytes})
		go m.sockSrv.Serve(m.sockLn) // stopped in close
	}

	for _, addr := range cfg.Join {
		if err := m.join(ctx, addr); err != nil {
			m.close()
			return nil, err
		}
	}
	return m, nil
}

// libp2p already authenticates and encrypts every stream, so gRPC runs
// without TLS of its own over them.
func (m *mesh) dial(ctx context.Context, to string) (grpc.ClientConnInterface, error) {
	if to == m.self {
		return m.selfConn, nil
	}
	cc, err := m.conns.Dial(ctx, "passthrough:///"+to)
	if err != nil || m.sockLn == nil {
		return cc, err
	}
	path := m.localSocketOf(to)
	id, perr := peer.Decode(to)
	if path == "" || perr != nil {
		return cc, nil
	}
	// A node on this machine: its stage's streams go over its local
	// socket, the rest (Info) and any stream the socket cannot take over
	// libp2p.
	return pipeline.OverSockets(pipeline.SocketConfig{
		Dial: func(ctx context.Context) (net.Conn, error) {
			c, err := m.host.DialLocal(ctx, path, id)
			if err == nil {
				m.obs.metrics.LocalStream(to)
			}
			return c, err
		},
		Other: cc,
		OnFallback: func(err error) {
			m.log.Warn("reaching a stage on this machine over TCP: its local socket failed", zap.String("peer", to), zap.Error(err))
		},
		Count: func(dir string, n int) { m.obs.hopBytes(to, dir, n) },
	}), nil
}

// localSocketOf is the local socket of peer when it runs on this machine
// (and network namespace), else "".
func (m *mesh) localSocketOf(peer string) string {
	for _, mem := range m.ml.Members() {
		md := mem.Meta
		if md.PeerID == peer && md.LocalHost == m.localHost && md.LocalSocket != "" {
			return md.LocalSocket
		}
	}
	return ""
}

func meshKey(cfg Config) (host.MeshKey, error) {
	if cfg.MeshKey != "" {
		k, err := host.ParseMeshKey(cfg.MeshKey)
		if err != nil {
			return k, fmt.Errorf("--mesh-key: %w", err)
		}
		if err := host.SaveMeshKey(cfg.DataDir, k); err != nil {
			return k, err
		}
		return k, nil
	}
	if len(cfg.Join) > 0 {
		if k, err := host.LoadMeshKey(cfg.DataDir); err == nil {
			return k, nil
		}
		return host.MeshKey{}, errors.New("joining a mesh needs its key: pass --mesh-key (printed by the first node's 'meshnode serve')")
	}
	k, _, err := host.LoadOrCreateMeshKey(cfg.DataDir)
	return k, err
}

// join connects to a node of the mesh and joins its gossip.
func (m *mesh) join(ctx context.Context, addr string) error {
	cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	id, err := m.host.Connect(cctx, addr)
	if err != nil {
		return fmt.Errorf("joining %s: %w", addr, err)
	}
	gaddrs, err := m.host.FetchGossipAddrs(cctx, id)
	if err != nil {
		return fmt.Errorf("joining %s: asking for its gossip address: %w", addr, err)
	}
	if _, err := m.ml.Join(gaddrs); err != nil {
		return fmt.Errorf("joining %s's gossip at %v: %w", addr, gaddrs, err)
	}
	m.event("join", "joined the mesh through %s", id)
	return nil
}

func (m *mesh) close() {
	m.mu.Lock()
	remote, local := m.remote, m.local
	m.remote, m.local, m.pipe = nil, nil, nil
	m.mu.Unlock()
	if remote != nil {
		remote.Close()
	}
	if m.grpcSrv != nil {
		m.grpcSrv.Stop()
	}
	if m.sockSrv != nil {
		m.sockSrv.Stop()
	}
	if m.sockLn != nil {
		m.sockLn.Close()
	}
	if local != nil {
		local.close()
	}
	if m.conns != nil {
		m.conns.Close()
	}
	if m.ml != nil {
		m.ml.Leave(2 * time.Second)
		m.ml.Close()
	}
	m.host.Close()
}

func (l *localStage) close() {
	if l.server != nil {
		l.server.Close()
	}
	if l.engine != nil {
		l.engine.Close()
	}
}

// engines lists the engine families this node can run, for the planner:
// ggml always, mlx where MLX runs (or under the test hook).
func (m *mesh) engines() []string {
	if m.mlxDevice != "" {
		return []string{membership.EngineGGML, membership.EngineMLX}
	}
	return []string{membership.EngineGGML}
}

// setModel makes mm the mesh's model as this node knows it, and announces
// the engine its layers will run on.
func (m *mesh) setModel(mm *meshModel) {
	engine := mm.ref.NeedsEngine()
	m.mu.Lock()
	m.model = mm
	m.meta.Models = []membership.ModelRef{mm.ref}
	offers := m.meta.Offers(engine)
	if offers && engine == membership.EngineMLX {
		m.meta.Engine, m.meta.Backend = engine, m.mlxDevice
		m.meta.Compute = computeID(m.mlxDevice)
	}
	m.mu.Unlock()
	if !offers {
		m.event("engine", "this node cannot run the %s engine that %s needs: the mesh gives it no layers, and it serves the API for the nodes that can", engine, mm.ref.Name)
	}
}

// addLocalModel makes this node the holder of a model file (or of a
// safetensors directory): it is hashed, indexed for peers, and announced.
func (m *mesh) addLocalModel(path string) (*meshModel, error) {
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		return m.addLocalDir(path)
	}
	info, err := ggufstage.ReadInfo(path)
	if err != nil {
		return nil, err
	}
	id, err := ggufstage.ContentHash(path, m.cfg.DataDir, m.cfg.Progress)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if err := m.files.Add(id, f, st.Size()); err != nil {
		f.Close()
		return nil, err
	}
	mm := &meshModel{
		ref: membership.ModelRef{ID: id, Name: modelName(path), HasFile: true,
			Split: m.cfg.Split, Context: m.cfg.Context, Parallel: m.cfg.Parallel},
		info: ggufInfo(info), path: path, header: path,
	}
	m.setModel(mm)
	return mm, nil
}

// addLocalDir makes this node the holder of a safetensors model directory:
// the files serving it reads are hashed into a manifest, whose hash is the
// model's ID; peers read the manifest by that ID and each file by its own
// hash, as they read a GGUF.
func (m *mesh) addLocalDir(dir string) (*meshModel, error) {
	open := safetensors.Dir(dir)
	info, err := mlxstage.ReadInfo(open, mlxstage.QuantNone)
	if err != nil {
		return nil, fmt.Errorf("reading the model in %s: %w", dir, err)
	}
	man, err := mlxstage.BuildManifest(dir, func(p string) (string, error) {
		return ggufstage.ContentHash(p, m.cfg.DataDir, m.cfg.Progress) // any file: remembered by path, size and mtime
	})
	if err != nil {
		return nil, err
	}
	enc := man.Encode()
	id := man.ID()
	if err := m.files.Add(id, bytes.NewReader(enc), int64(len(enc))); err != nil {
		return nil, fmt.Errorf("serving the manifest of %s: %w", dir, err)
	}
	for _, f := range man.Files {
		fh, err := os.Open(filepath.Join(dir, filepath.FromSlash(f.Name)))
		if err != nil {
			return nil, fmt.Errorf("serving %s to peers: %w", f.Name, err)
		}
		if err := m.files.Add(f.SHA256, fh, f.Size); err != nil {
			fh.Close()
			return nil, fmt.Errorf("serving %s to peers: %w", f.Name, err)
		}
	}
	mm := &meshModel{
		ref: membership.ModelRef{ID: id, Name: modelName(dir), HasFile: true, Engine: membership.EngineMLX,
			Split: m.cfg.Split, Context: m.cfg.Context, Parallel: m.cfg.Parallel},
		info: mlxInfo(info), path: dir,
		st: &stModel{files: func(context.Context) safetensors.Opener { return open }},
	}
	m.setModel(mm)
	return mm, nil
}

// learnDir adopts a safetensors model that peers hold: its manifest
// (checked against the model's ID) and small files (config, tokenizer,
// index; each checked against its hash) are copied into the data
// directory, and the shards stay on the peers, read by range when a stage
// loads.
func (m *mesh) learnDir(ctx context.Context, ref membership.ModelRef) (*meshModel, error) {
	src, err := m.openSource(ctx, ref) // the manifest is served under the model's ID
	if err != nil {
		return nil, err
	}
	enc, err := readSmall(src, mlxstage.MaxManifest)
	closeSource(src)
	if err != nil {
		return nil, fmt.Errorf("reading the model's manifest from %s: %w", src, err)
	}
	if sum := sha256.Sum256(enc); hex.EncodeToString(sum[:]) != ref.ID {
		return nil, fmt.Errorf("%s sent a manifest that is not that of model %s", src, ref.ID)
	}
	man, err := mlxstage.ParseManifest(enc)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(m.cfg.DataDir, "models", ref.ID[:16]+"-hf")
	for _, f := range man.Files {
		if !f.Weights() {
			if err := m.copyFile(ctx, ref, f, filepath.Join(dir, filepath.FromSlash(f.Name))); err != nil {
				return nil, err
			}
		}
	}
	local := safetensors.Dir(dir)
	files := func(ctx context.Context) safetensors.Opener {
		return man.Opener(func(f mlxstage.ManifestFile) (safetensors.Source, error) {
			if !f.Weights() {
				return local(f.Name)
			}
			src, err := m.openPeerFile(ctx, ref.ID, f.SHA256)
			if err != nil {
				return nil, err // not a nil *PeerSource in an interface
			}
			return src, nil
		})
	}
	info, err := mlxstage.ReadInfo(files(ctx), mlxstage.QuantNone) // reads the shards' headers
	if err != nil {
		return nil, fmt.Errorf("reading model %s from peers: %w", ref.Name, err)
	}
	ref.HasFile = false
	mm := &meshModel{ref: ref, info: mlxInfo(info), st: &stModel{files: files}}
	m.setModel(mm)
	return mm, nil
}

// copyFile copies a small file of a safetensors model from a peer to path,
// checking its hash; a copy already there with the right hash is kept.
func (m *mesh) copyFile(ctx context.Context, ref membership.ModelRef, f mlxstage.ManifestFile, path string) error {
	if b, err := os.ReadFile(path); err == nil && sha256Hex(b) == f.SHA256 {
		return nil
	}
	src, err := m.openPeerFile(ctx, ref.ID, f.SHA256)
	if err != nil {
		return fmt.Errorf("fetching %s of %s: %w", f.Name, ref.Name, err)
	}
	b, err := readSmall(src, 64<<20)
	src.Close()
	if err != nil {
		return fmt.Errorf("fetching %s of %s: %w", f.Name, ref.Name, err)
	}
	if sha256Hex(b) != f.SHA256 {
		return fmt.Errorf("fetching %s of %s: %s sent other content than the manifest's", f.Name, ref.Name, src)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("saving %s of %s: %w", f.Name, ref.Name, err)
	}
	tmp := path + ".part"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("saving %s of %s: %w", f.Name, ref.Name, err)
	}
	return os.Rename(tmp, path)
}

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// readSmall reads the whole of a source of at most limit bytes.
func readSmall(src safetensors.Source, limit int64) ([]byte, error) {
	if src.Size() > limit {
		return nil, fmt.Errorf("%d bytes, over the %d limit", src.Size(), limit)
	}
	b := make([]byte, src.Size())
	if len(b) == 0 {
		return b, nil
	}
	n, err := src.ReadAt(b, 0)
	if n == len(b) {
		return b, nil // io.ReaderAt may say io.EOF with the last byte
	}
	if err == nil {
		err = io.ErrUnexpectedEOF
	}
	return nil, err
}

// learnModel finds the mesh's model in a peer's announcement and reads its
// header from a peer that holds the file, or from its public source.
func (m *mesh) learnModel(ctx context.Context) (*meshModel, error) {
	for _, mem := range m.ml.Members() {
		if mem.Meta.PeerID == m.self {
			continue
		}
		for _, ref := range mem.Meta.Models {
			if !ref.HasFile && ref.Source == "" {
				continue
			}
			if ref.NeedsEngine() == membership.EngineMLX {
				mm, err := m.learnDir(ctx, ref)
				if err != nil {
					m.log.Warn("learning the model from its holders", zap.String("model", ref.Name), zap.Error(err))
					continue
				}
				m.event("model", "learned model %s (%s, %d layers, safetensors) from %s", ref.Name, mm.info.Arch, mm.info.Layers, shortID(mem.Meta.PeerID))
				return mm, nil
			}
			src, err := m.openSource(ctx, ref)
			if err != nil {
				m.log.Warn("reading the model header", zap.String("model", ref.Name), zap.Error(err))
				continue
			}
			mm, err := m.adoptModel(ref, src)
			if err != nil {
				return nil, fmt.Errorf("model %s from %s: %w", ref.Name, mem.Meta.PeerID, err)
			}
			m.event("model", "learned model %s (%s, %d layers) from %s", ref.Name, mm.info.Arch, mm.info.Layers, shortID(mem.Meta.PeerID))
			return mm, nil
		}
	}
	return nil, nil
}

// adoptModel makes a model whose file this node does not hold its own:
// header read from src, kept as a tensor-less GGUF for the tokenizer.
func (m *mesh) adoptModel(ref membership.ModelRef, src weights.RangeSource) (*meshModel, error) {
	defer closeSource(src)
	f, err := gguf.Read(ioSection(src), src.Size())
	if err != nil {
		return nil, err
	}
	info, err := ggufstage.InfoOf(f)
	if err != nil {
		return nil, err
	}
	header, err := writeHeaderOnly(f, filepath.Join(m.cfg.DataDir, "models"), ref.ID)
	if err != nil {
		return nil, err
	}
	ref.HasFile = false
	mm := &meshModel{ref: ref, info: ggufInfo(info), header: header}
	m.setModel(mm)
	return mm, nil
}

func closeSource(src weights.RangeSource) {
	if c, ok := src.(io.Closer); ok {
		c.Close()
	}
}

// addRemoteModel serves a model that lives on Hugging Face: only its
// header is read now; each node fetches its own layers' bytes.
func (m *mesh) addRemoteModel(ctx context.Context, url string) (*meshModel, error) {
	ref, err := weights.ParseHFURL(url)
	if err != nil {
		return nil, err
	}
	src, err := weights.OpenHF(ctx, ref, weights.HFOptions{})
	if err != nil {
		return nil, err
	}
	return m.adoptModel(membership.ModelRef{ID: src.ID(), Name: modelName(ref.File), Source: url,
		Split: m.cfg.Split, Context: m.cfg.Context, Parallel: m.cfg.Parallel}, src)
}

// openSource opens the model's bytes: from a peer holding the file when
// the ref says so, else from its public source.
func (m *mesh) openSource(ctx context.Context, ref membership.ModelRef) (weights.RangeSource, error) {
	src, errs := m.openHolder(ctx, ref.ID, ref.ID)
	if src != nil {
		return src, nil
	}
	if ref.Source != "" {
		hf, err := weights.ParseHFURL(ref.Source)
		if err != nil {
			return nil, err
		}
		src, err := weights.OpenHF(ctx, hf, weights.HFOptions{})
		if err != nil {
			return nil, err
		}
		if src.ID() != ref.ID {
			return nil, fmt.Errorf("%s now has content %s, the mesh serves %s", ref.Source, src.ID(), ref.ID)
		}
		return src, nil
	}
	if len(errs) == 0 {
		return nil, errors.New("no peer holds the model file and it has no public source")
	}
	return nil, errors.Join(errs...)
}

// openHolder opens file fileID on the first peer that holds model modelID
// and answers, and else says why each failed.
func (m *mesh) openHolder(ctx context.Context, modelID, fileID string) (*weights.PeerSource, []error) {
	var errs []error
	for _, mem := range m.ml.Members() {
		if mem.Meta.PeerID == m.self {
			continue
		}
		for _, r := range mem.Meta.Models {
			if r.ID == modelID && r.HasFile {
				src, err := m.openPeer(ctx, mem.Meta.PeerID, fileID)
				if err == nil {
					return src, nil
				}
				errs = append(errs, err)
			}
		}
	}
	return nil, errs
}

// openPeerFile opens one file of a safetensors model (by its hash) on a
// peer that holds the model's directory.
func (m *mesh) openPeerFile(ctx context.Context, modelID, fileID string) (*weights.PeerSource, error) {
	src, errs := m.openHolder(ctx, modelID, fileID)
	if src != nil {
		return src, nil
	}
	if len(errs) == 0 {
		return nil, errors.New("no peer holds the model's files")
	}
	return nil, errors.Join(errs...)
}

// writeHeaderOnly keeps a model's metadata as a GGUF with no tensors, so a
// node that holds no layers can still tokenize and template.
func writeHeaderOnly(f *gguf.File, dir, id string) (string, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	path := filepath.Join(dir, id[:16]+".header.gguf")
	out, err := os.Create(path)
	if err != nil {
		return "", err
	}
	if _, err := gguf.Write(out, f.KVs, nil, f.Alignment); err != nil {
		out.Close()
		return "", fmt.Errorf("writing model header: %w", err)
	}
	return path, out.Close()
}

func (m *mesh) openPeer(ctx context.Context, peerID, fileID string) (*weights.PeerSource, error) {
	pid, err := peer.Decode(peerID)
	if err != nil {
		return nil, err
	}
	dial := func(ctx context.Context) (weights.Stream, error) {
		return m.host.LibP2P().NewStream(ctx, pid, RangesProtocol)
	}
	return weights.OpenPeer(ctx, fileID, peerID, dial)
}

// run reconciles the node with the mesh until ctx ends: on every
// membership change and every second.
func (m *mesh) run(ctx context.Context) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	obsDone := make(chan struct{})
	go func() { defer close(obsDone); m.obs.loop(ctx) }()
	defer func() { <-obsDone }()
	m.reconcile(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-m.ml.Events():
			if !ok {
				return
			}
			switch ev.Kind {
			case membership.EventJoin, membership.EventLeave, membership.EventFailed:
				m.obs.onMember(ev)
				m.event(string(ev.Kind), "peer %s %s", ev.Member.Meta.PeerID, ev.Kind)
			}
			// Let a burst of changes settle before planning.
			time.Sleep(200 * time.Millisecond)
		case <-tick.C:
		}
		m.reconcile(ctx)
	}
}

// probeDevice, once a model is known, looks for the GPU this node's layers
// will run on: its free memory is then what the node offers the planner.
func (m *mesh) probeDevice(mm *meshModel) {
	m.mu.Lock()
	done := m.probed
	m.probed = true
	m.mu.Unlock()
	if done || strings.EqualFold(m.cfg.Device, "cpu") || mm.st != nil {
		return // MLX has no devices to choose between: its memory is the machine's
	}
	devs, err := ggufstage.Devices(mm.header)
	if err != nil {
		m.log.Warn("probing GPUs", zap.Error(err))
		return
	}
	for _, d := range devs {
		if m.cfg.Device != "" && !strings.EqualFold(m.cfg.Device, "auto") && !strings.EqualFold(m.cfg.Device, d.Library) {
			continue
		}
		budget := d.FreeMemory
		if m.cfg.MaxMemory > 0 {
			budget = min(budget, m.cfg.MaxMemory)
		}
		// Decode streams a stage's weights once a token: weigh this node by
		// its GPU's bandwidth, not its host CPU's.
		speed := 0.0
		if bw, err := ggufstage.DeviceBandwidth(d); err != nil {
			m.log.Warn("the planner weighs this node by its CPU's memory bandwidth", zap.Error(err))
		} else {
			speed = bw / 1e9
		}
		m.mu.Lock()
		m.budget = budget
		if speed > 0 {
			m.speed, m.meta.Speed = speed, speed
		}
		speed = m.speed
		m.meta.Backend = strings.ToLower(d.Library)
		// ggml numbers GPUs after CUDA_VISIBLE_DEVICES filters them: the
		// PCI address tells two processes' "GPU 0" apart.
		m.meta.Compute = computeID(strings.ToLower(d.Library) + ":" + cmp.Or(d.PCIID, d.ID))
		m.meta.MemFree = budget
		m.meta.MemTotal = d.TotalMemory
		m.mu.Unlock()
		m.event("device", "layers will run on %s %s (%s free, %.0f GB/s)", d.Library, d.Description, HumanBytes(d.FreeMemory), speed)
		if w := busyPollWindow(m.cfg.BusyPoll, true); w != busyPollWindow(m.cfg.BusyPoll, false) {
			// The host is idle while the GPU computes: spend a core to
			// take each hop's message the moment it lands.
			m.host.SetBusyPoll(w)
			m.event("device", "connections busy-poll for %s after each message (--busy-poll)", w)
		}
		m.publish()
		return
	}
}

// learnAddrs tells libp2p where gossip says each member listens, so that
// a stage can reach a peer it was never introduced to.
func (m *mesh) learnAddrs(members []membership.Member) {
	ps := m.host.LibP2P().Peerstore()
	for _, mem := range members {
		if mem.Meta.PeerID == m.self {
			continue
		}
		for _, a := range mem.Meta.Addrs {
			ai, err := peer.AddrInfoFromString(a)
			if err != nil || ai.ID.String() != mem.Meta.PeerID {
				continue
			}
			ps.AddAddrs(ai.ID, ai.Addrs, 10*time.Minute)
		}
	}
}

// planModel describes the model to the planner.
func planModel(mm *meshModel) planner.Model {
	parallel := max(mm.ref.Parallel, 1)
	ctxLen := max(mm.ref.Context, 1)
	return planner.Model{
		ID: mm.ref.ID, Layers: mm.info.Layers, PerLayerBytes: mm.info.perLayer,
		EmbedBytes: mm.info.embed, HeadBytes: mm.info.head, KVPerTokenPerLayer: mm.info.kv,
		KVTokens: ctxLen * parallel, StageOverhead: 64 << 20,
		Engines: []string{mm.ref.NeedsEngine()},
	}
}

// plannerNodes describes the members to the planner for model ref, and
// says whether one of them asked for a split. A member that cannot run the
// engine the model needs keeps its own engine, so that the planner leaves
// it out and counts it.
func plannerNodes(ref membership.ModelRef, members []membership.Member) ([]planner.Node, bool) {
	want := ref.NeedsEngine()
	var nodes []planner.Node
	split := false
	for _, mem := range members {
		md := mem.Meta
		if !mem.Complete {
			continue
		}
		n := planner.Node{ID: md.PeerID, Engine: want, MemBudget: md.MemFree, Speed: md.Speed,
			Ready: md.State != membership.NodeDraining}
		if !md.Offers(want) {
			n.Engine = strings.Join(md.Engines, "+")
			if n.Engine == "" {
				n.Engine = cmp.Or(md.Engine, membership.EngineGGML)
			}
		}
		for _, p := range md.Pins {
			if p.Model == ref.ID || p.Model == "" {
				n.Pin = &planner.Range{Start: p.Start, End: p.End}
			}
		}
		for _, r := range md.Models {
			if r.ID == ref.ID {
				n.HasFile = r.HasFile
				split = split || r.Split
			}
		}
		nodes = append(nodes, n)
	}
	return nodes, split
}

// explainPlanErr says why a model has no placement when no node can run
// its engine at all, which the planner's counts alone leave implicit.
func explainPlanErr(err error, ref membership.ModelRef, nodes []planner.Node) error {
	want := ref.NeedsEngine()
	if !errors.Is(err, planner.ErrNoNodes) || slices.ContainsFunc(nodes, func(n planner.Node) bool { return n.Engine == want }) {
		return err
	}
	hint := ""
	if want == membership.EngineMLX {
		hint = " (a safetensors model directory runs on MLX: Apple Silicon with a build with -tags mlx; serve a GGUF of the model for the other nodes)"
	}
	return fmt.Errorf("no node of the mesh can run the %s engine that %s needs%s: %w", want, ref.Name, hint, err)
}

func (m *mesh) reconcile(ctx context.Context) {
	m.mu.Lock()
	mm := m.model
	m.mu.Unlock()
	if mm == nil {
		var err error
		if mm, err = m.learnModel(ctx); err != nil || mm == nil {
			if err != nil {
				m.log.Warn("learning the mesh's model", zap.Error(err))
			}
			return
		}
		m.publish()
	}

	m.probeDevice(mm)
	members := m.ml.Members()
	m.abortGone(members)
	m.learnAddrs(members)
	nodes, split := plannerNodes(mm.ref, members)
	plan, err := planner.Place(planModel(mm), nodes, planner.Options{Split: split, Headroom: 0.05})
	if err != nil {
		err = explainPlanErr(err, mm.ref, nodes)
		m.setPipe(nil, nil, nil)
		m.mu.Lock()
		changed := len(m.plan.Stages) > 0
		m.plan = planner.Plan{}
		m.planErr = err
		m.mu.Unlock()
		if changed {
			m.event("plan", "no placement: %v", err)
		}
		return
	}
	m.mu.Lock()
	old := m.plan
	m.plan, m.planErr = plan, nil
	m.mu.Unlock()
	if plan.String() != old.String() {
		m.event("plan", "plan for %s: %s", mm.ref.Name, describePlan(plan, members))
	}

	// Serve our share.
	want, serving := plan.StageOf(m.self)
	m.reloadIfBroken()
	m.mu.Lock()
	draining, local := m.draining, m.local
	m.mu.Unlock()
	if draining && !serving && local != nil {
		// Leaving: keep serving our layers to the pipelines that still use
		// them until we exit; the others are moving off them now.
		m.ensurePipeline(ctx, mm, plan, members)
		return
	}
	if err := m.applyStage(ctx, mm, want, serving); err != nil {
		m.event("error", "loading layers [%d,%d): %v", want.Start, want.End, err)
		return
	}
	m.publish()

	// Run our requests on the plan once every stage of it is up.
	m.ensurePipeline(ctx, mm, plan, members)
}

// errLeft is why a pipeline was aborted: a stage's node left the mesh.
var errLeft = errors.New("the node left the mesh")

// abortGone breaks the current pipeline at once when a stage of its route
// is on a node that is no longer a live member (dead, left): its requests
// fail now and the scheduler replays them on the next pipeline, instead
// of waiting out the step timeout, or the graceful close that setPipe
// gives a replaced pipeline, which the gone stage would hold up for 5 s.
func (m *mesh) abortGone(members []membership.Member) {
	m.mu.Lock()
	remote, route := m.remote, m.route
	m.mu.Unlock()
	if remote == nil || remote.Err() != nil {
		return
	}
	alive := map[string]bool{}
	for _, mem := range members {
		alive[mem.Meta.PeerID] = true
	}
	for i, h := range route {
		if !alive[h.Peer] {
			m.log.Warn("a stage of the pipeline left the mesh: moving its requests to the next one",
				zap.String("peer", h.Peer), zap.Int("hop", i))
			remote.Abort(&pipeline.HopError{Hop: i, Peer: h.Peer, Start: h.Start, End: h.End, Err: errLeft})
			return
		}
	}
}

func describePlan(p planner.Plan, members []membership.Member) string {
	names := map[string]string{}
	for _, mem := range members {
		names[mem.Meta.PeerID] = shortID(mem.Meta.PeerID)
	}
	s := ""
	for i, st := range p.Stages {
		if i > 0 {
			s += " → "
		}
		s += fmt.Sprintf("%s [%d,%d)", names[st.Node], st.Start, st.End)
	}
	return s
}

func shortID(id string) string {
	if len(id) > 12 {
		return id[len(id)-6:]
	}
	return id
}

// applyStage loads (or drops) this node's layer range.
func (m *mesh) applyStage(ctx context.Context, mm *meshModel, want planner.Stage, serving bool) (err error) {
	m.mu.Lock()
	cur := m.local
	loading := m.meta.State == membership.NodeLoading
	m.mu.Unlock()
	if cur != nil && serving && cur.start == want.Start && cur.end == want.End {
		if loading {
			// A load for another plan failed meanwhile and left the node
			// announcing "loading": the others wait for it to be ready.
			m.setState(membership.NodeReady)
		}
		return nil
	}
	if !serving {
		if cur != nil {
			m.dropStage(cur)
		}
		m.setState(membership.NodeReady)
		return nil
	}
	m.setState(membership.NodeLoading)
	defer func() {
		if err != nil {
			// Still up, serving what it served before (or nothing): a node
			// left "loading" would keep the others from ever using it, even
			// once the plan comes back to the range it serves.
			m.setState(membership.NodeReady)
		}
	}()
	ls := &localStage{start: want.Start, end: want.End}
	if mm.st != nil {
		if ls.engine, ls.fetched, err = m.openMLX(ctx, mm, want); err != nil {
			return err
		}
	} else {
		if mm.path != "" {
			ls.slice, err = ggufstage.Slice(mm.path, m.cfg.DataDir, want.Start, want.End, m.loadProgress())
		} else {
			ls.slice, ls.fetched, err = m.fetchSlice(ctx, mm, want.Start, want.End)
		}
		if err != nil {
			return err
		}
		opts := ggufstage.Options{
			Threads: m.cfg.Threads, Context: mm.ref.Context, MaxSeqs: max(mm.ref.Parallel, 1),
			BatchSize: m.cfg.BatchTokens, FlashAttention: m.cfg.FlashAttention, BuildAhead: m.cfg.BuildAhead, DecodeGraphs: m.cfg.DecodeGraphs, NoRepack: m.cfg.NoRepack,
			WireDType: m.cfg.WireDType, Device: m.cfg.Device, FusedDecode: m.cfg.FusedDecode,
		}
		if m.cfg.kvF32 {
			opts.KVType = ml.DTypeF32
		}
		var e *ggufstage.Engine
		e, err = ggufstage.Open(ls.slice, want.Start, want.End, opts)
		if err != nil {
			return err
		}
		if on, why := e.Fused(); on {
			m.log.Info("one-row decode passes run on meshnode's fused CUDA kernels")
		} else if why != "" {
			m.log.Info("fused CUDA decode off", zap.String("why", why))
		}
		ls.engine = e
	}
	ls.observed = m.obs.wrapEngine(ls.engine, planModel(mm).StageMemory(want.Start, want.End))
	ls.server, err = pipeline.NewServer(pipeline.ServerConfig{
		Engine: ls.observed, Dial: m.dial, ModelID: mm.ref.Name, ModelHash: mm.ref.ID,
		OnBadPeer:     func(p string, err error) { m.event("bad-peer", "peer %s sent a bad frame: %v", p, err) },
		Vocab:         m.vocabs.of(mm),
		DeviceHandoff: m.deviceHandoff(),
		Logger:        m.log.Named("stage"),
	})
	if err != nil {
		ls.close()
		return err
	}
	// The new stage is up before the old one goes: no moment without one.
	m.mux.set(ls.server)
	m.mu.Lock()
	m.local = ls
	if m.pipe != nil && m.remote == nil {
		m.pipe = nil // a local pipe ran on the old engine
	}
	m.meta.Serving = []membership.Serve{{Model: mm.ref.ID, Start: want.Start, End: want.End}}
	m.mu.Unlock()
	if cur != nil {
		cur.close()
		m.event("unload", "stopped serving layers [%d,%d)", cur.start, cur.end)
	}
	m.setState(membership.NodeReady)
	m.event("load", "serving layers [%d,%d) of %s (%s of weights)", want.Start, want.End, mm.ref.Name, HumanBytes(ls.engine.WeightBytes()))
	return nil
}

// dropStage stops serving a layer range.
// reloadIfBroken drops the local stage when its engine broke, so that
// applyStage loads it afresh: requests on it fail until then, and the
// node would otherwise keep a dead stage for good.
func (m *mesh) reloadIfBroken() {
	m.mu.Lock()
	local := m.local
	m.mu.Unlock()
	if local == nil || time.Since(m.lastReload) < reloadBackoff {
		return
	}
	isBroken := brokenErr
	if m.cfg.stageBroken != nil {
		isBroken = m.cfg.stageBroken
	}
	err := isBroken(local.engine)
	if err == nil {
		return
	}
	m.lastReload = time.Now()
	m.event("error", "layers [%d,%d) broke and are reloaded: %v", local.start, local.end, err)
	m.dropStage(local)
}

func (m *mesh) dropStage(cur *localStage) {
	m.mux.set(nil)
	m.mu.Lock()
	m.local = nil
	if m.pipe != nil && m.remote == nil {
		m.pipe = nil // a local pipe ran on this engine
	}
	m.meta.Serving = nil
	m.mu.Unlock()
	cur.close()
	m.event("unload", "stopped serving layers [%d,%d)", cur.start, cur.end)
}

// openMLX loads a stage of a safetensors model with mlxstage: from the
// directory on the node that holds it, else from peers, which send only
// the headers and the stage's tensors. It returns the bytes read from
// peers.
func (m *mesh) openMLX(ctx context.Context, mm *meshModel, want planner.Stage) (stage.Engine, uint64, error) {
	opts := mlxstage.Options{
		Engine: mlxstage.EngineMLX, Files: mm.st.files(ctx),
		Context: mm.ref.Context, MaxSeqs: max(mm.ref.Parallel, 1), BatchSize: m.cfg.BatchTokens,
		WireDType: m.cfg.WireDType,
	}
	var be ops.Backend
	if m.cfg.mlxBackend != nil {
		var err error
		if be, err = m.cfg.mlxBackend(); err != nil {
			return nil, 0, fmt.Errorf("making the test MLX backend: %w", err)
		}
		opts.Backend = be
	}
	e, err := mlxstage.Open(cmp.Or(mm.path, mm.ref.Name), want.Start, want.End, opts)
	if err != nil {
		if be != nil {
			be.Close()
		}
		return nil, 0, err
	}
	var fetched uint64
	if mm.path == "" {
		fetched = uint64(e.LoadStats().Total())
		m.event("fetch", "read layers [%d,%d) from peers: %s", want.Start, want.End, HumanBytes(fetched))
	}
	if be != nil {
		return ownBackend{e, be}, fetched, nil
	}
	return e, fetched, nil
}

// ownBackend is an engine on a backend it was given (mlxstage does not
// close those), which it closes after itself.
type ownBackend struct {
	*mlxstage.Engine
	be ops.Backend
}

func (e ownBackend) Close() error { return errors.Join(e.Engine.Close(), e.be.Close()) }

// fetchSlice gets a stage's bytes from a peer that holds the model file,
// or from the model's public source.
func (m *mesh) fetchSlice(ctx context.Context, mm *meshModel, start, end int) (string, uint64, error) {
	src, err := m.openSource(ctx, mm.ref)
	if err != nil {
		return "", 0, err
	}
	defer closeSource(src)
	res, err := weights.FetchSliceWith(ctx, src, filepath.Join(m.cfg.DataDir, "slices"), start, end,
		weights.FetchOptions{Progress: weights.Progress(m.loadProgress())})
	if err != nil {
		return "", 0, err
	}
	fetched := m.sliceCost(res)
	switch {
	case res.Reused && fetched == 0:
		m.event("fetch", "layers [%d,%d) already in the data dir, from an earlier run", start, end)
	case res.Reused:
		m.event("fetch", "layers [%d,%d) already in the data dir, fetched earlier in this run: %s", start, end, HumanBytes(fetched))
	default:
		m.event("fetch", "fetched layers [%d,%d) from %s: %s", start, end, src, HumanBytes(fetched))
	}
	return res.Path, fetched, nil
}

// sliceCost is the bytes read from peers or the hub for the slice of res,
// remembered from the fetch that made it when res reused it: 0 for a slice
// made by an earlier run of the node.
func (m *mesh) sliceCost(res weights.FetchResult) uint64 {
	m.sliceMu.Lock()
	defer m.sliceMu.Unlock()
	if res.Reused {
		return m.sliceFetched[res.Path]
	}
	if m.sliceFetched == nil {
		m.sliceFetched = map[string]uint64{}
	}
	m.sliceFetched[res.Path] = res.Fetched
	return res.Fetched
}

// ensurePipeline builds the pipeline for this node's requests when the
// plan's stages are all up, and keeps it while the plan stands.
func (m *mesh) ensurePipeline(ctx context.Context, mm *meshModel, plan planner.Plan, members []membership.Member) {
	route := make([]pipeline.Hop, len(plan.Stages))
	for i, st := range plan.Stages {
		route[i] = pipeline.Hop{Peer: st.Node, Start: st.Start, End: st.End}
	}
	m.mu.Lock()
	same := slices.Equal(route, m.route) && m.pipe != nil && (m.remote == nil || m.remote.Err() == nil)
	local := m.local
	m.mu.Unlock()
	if same {
		return
	}
	serving := map[string]bool{}
	for _, mem := range members {
		if mem.Meta.State != membership.NodeReady {
			continue
		}
		for _, s := range mem.Meta.Serving {
			if s.Model == mm.ref.ID {
				serving[fmt.Sprintf("%s %d %d", mem.Meta.PeerID, s.Start, s.End)] = true
			}
		}
	}
	for _, h := range route {
		if h.Peer == m.self {
			continue // our own stage is up: applyStage just ran
		}
		if !serving[fmt.Sprintf("%s %d %d", h.Peer, h.Start, h.End)] {
			m.setPipe(nil, nil, nil)
			return // not yet: the next reconcile looks again
		}
	}
	// A whole model on this node runs in process: no hop at all.
	if len(route) == 1 && route[0].Peer == m.self && local != nil {
		m.setPipe(route, scheduler.Local(local.observed, m.vocabs.of(mm)), nil)
		m.event("pipeline", "requests run locally on layers [0,%d)", mm.info.Layers)
		return
	}
	pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	p, err := pipeline.New(pctx, pipeline.Config{
		Route: route, Dial: m.dial, Origin: m.self, WireDType: m.cfg.WireDType, ModelHash: mm.ref.ID,
		StepTimeout: 30 * time.Second, Logger: m.log.Named("pipeline"),
		OnBadPeer: func(p string, err error) { m.event("bad-peer", "peer %s sent a bad frame: %v", p, err) },
	})
	if err != nil {
		m.setPipe(nil, nil, nil)
		m.event("error", "building the pipeline %v: %v", route, err)
		return
	}
	m.setPipe(route, p, p)
	m.event("pipeline", "requests run on %d stages", len(route))
	m.hintGPUShare(route)
}

// hintGPUShare warns, once for each set of peers, when this node's CUDA
// stage shares its GPU with other stages of route and MPS is not running.
func (m *mesh) hintGPUShare(route []pipeline.Hop) {
	m.mu.Lock()
	backend := m.meta.Backend
	m.mu.Unlock()
	hint := gpuShareHint(backend, sharingGPU(m.self, backend, route, m.computeOf(route)), mpsRunning())
	m.mu.Lock()
	repeat := hint == m.gpuHint
	m.gpuHint = hint
	m.mu.Unlock()
	if hint == "" || repeat {
		return
	}
	m.warnEvent("gpu", "%s", hint)
}

func (m *mesh) setPipe(route []pipeline.Hop, p scheduler.Pipeline, remote *pipeline.Pipeline) {
	m.mu.Lock()
	old := m.remote
	m.route, m.pipe, m.remote = route, p, remote
	if p != nil {
		m.ran = m.model
	}
	m.mu.Unlock()
	if old != nil && old != remote {
		old.Close()
	}
}

func (m *mesh) setState(state string) {
	m.mu.Lock()
	if m.draining {
		state = membership.NodeDraining // leaving is for good
	}
	m.meta.State = state
	if state != membership.NodeLoading {
		m.meta.LoadPct = 0
	}
	m.mu.Unlock()
	m.publish()
}

// publish gossips the node's metadata. Publishers take turns (pubMu):
// memberlist's UpdateNode reads the local node's state outside its lock
// while a concurrent UpdateNode writes it (a data race that go test -race
// reports when Run and the reconcile loop publish at once), and in turns
// the last publisher's metadata is the one that stays.
func (m *mesh) publish() {
	m.pubMu.Lock()
	defer m.pubMu.Unlock()
	m.mu.Lock()
	meta := m.meta
	m.mu.Unlock()
	if err := m.ml.UpdateMeta(meta); err != nil {
		m.log.Warn("publishing metadata", zap.Error(err))
	}
}

// drain announces that this node is leaving, so that the others plan
// without it (and fetch the layers it served while it still serves them).
func (m *mesh) drain() {
	m.mu.Lock()
	m.draining = true
	m.meta.State = membership.NodeDraining
	m.mu.Unlock()
	m.publish()
	m.event("drain", "draining: the mesh is moving this node's layers elsewhere")
}

// servableWithout reports whether the other ready nodes serve every layer
// of the model between them: then this node can leave without a gap.
func (m *mesh) servableWithout() bool {
	m.mu.Lock()
	mm := m.model
	m.mu.Unlock()
	if mm == nil {
		return true
	}
	covered := make([]bool, mm.info.Layers)
	others := 0
	for _, mem := range m.ml.Members() {
		if mem.Meta.PeerID == m.self || mem.Meta.State == membership.NodeDraining {
			continue
		}
		others++ // loading counts: it is about to take layers over
		if mem.Meta.State != membership.NodeReady {
			continue
		}
		for _, s := range mem.Meta.Serving {
			if s.Model != mm.ref.ID {
				continue
			}
			for l := max(s.Start, 0); l < min(s.End, len(covered)); l++ {
				covered[l] = true
			}
		}
	}
	if others == 0 {
		return true // alone: nobody to hand over to
	}
	for _, c := range covered {
		if !c {
			return false
		}
	}
	return true
}

// current is what a request runs on now.
func (m *mesh) current() scheduler.Pipeline {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.pipe
}

// replanning says whether the model's pipeline is only being rebuilt: it
// ran before, and a placement stands whose stages are (re)loading. A
// request can wait for it (the scheduler waits out a replan, within its
// recovery bound); one for a model that never ran, or that no placement
// fits, is refused at once.
func (m *mesh) replanning() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.pipe == nil && m.ran != nil && m.ran == m.model && m.planErr == nil && len(m.plan.Stages) > 0
}

// stageMux is the StageService a node registers once; the stage behind it
// changes when the plan does.
type stageMux struct {
	meshnodev1.UnimplementedStageServiceServer
	mu  sync.RWMutex
	srv *pipeline.Server
}

func (s *stageMux) set(srv *pipeline.Server) {
	s.mu.Lock()
	s.srv = srv
	s.mu.Unlock()
}

func (s *stageMux) get() (*pipeline.Server, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.srv == nil {
		return nil, status.Error(codes.Unavailable, "this node serves no stage right now")
	}
	return s.srv, nil
}

func (s *stageMux) Forward(stream meshnodev1.StageService_ForwardServer) error {
	srv, err := s.get()
	if err != nil {
		return err
	}
	return srv.Forward(stream)
}

func (s *stageMux) Info(ctx context.Context, req *meshnodev1.InfoRequest) (*meshnodev1.StageInfo, error) {
	srv, err := s.get()
	if err != nil {
		return nil, err
	}
	return srv.Info(ctx, req)
}

// meshPipe is the scheduler's view of the mesh: whatever pipeline is
// current when a sequence opens runs it to the end. A replan breaks the
// sequences still on the old pipeline (they fail; surviving that is the
// reliability layer's job).
type meshPipe struct {
	m    *mesh
	info stage.Info
	mu   sync.Mutex
	seqs map[stage.SeqID]scheduler.Pipeline
	// lanes is Lanes' answer for the pipeline lanesOf, under --pipelining auto.
	lanesOf *pipeline.Pipeline
	lanes   int
}

var errNoPipeline = errors.New("the mesh has no complete pipeline for this model yet")

func (p *meshPipe) Info() stage.Info { return p.info }

func (p *meshPipe) Open(seq stage.SeqID, sp sample.Params, prompt []int32) error {
	cur := p.m.current()
	if cur == nil {
		return errNoPipeline
	}
	if err := cur.Open(seq, sp, prompt); err != nil {
		return err
	}
	p.mu.Lock()
	p.seqs[seq] = cur
	p.mu.Unlock()
	return nil
}

func (p *meshPipe) Forward(ctx context.Context, b *stage.Batch) (sample.Picked, error) {
	pipe, err := p.pipeOf(b)
	if err != nil {
		return sample.Picked{}, err
	}
	start := time.Now()
	picked, err := pipe.Forward(ctx, b)
	if err == nil {
		p.m.obs.stepDone(time.Since(start), len(picked.Tokens))
	}
	return picked, err
}

// Lanes is how many batches are kept in flight: with pipelining, one per
// stage of the current route (or --micro-batches); else one.
//
// --pipelining auto (the default) pipelines a route whose stages all run
// on hardware of their own (Meta.Compute). Stages that share a GPU or a
// machine's cores take turns on it whatever the scheduler does, and the
// turns cost more than the overlap wins: on one H200, two stages of an 8B
// model decoding 32 streams fell from 1682 to 1218 tok/s pipelined, and
// on two CPU stages of one machine ggml's spinning threads starve each
// other. On two H200s, a GPU a stage, pipelining took the 8B model from
// 0.90x one GPU's throughput to 1.13x at 8 streams (0.86x to 1.01x at 32),
// and a 32B one to 1.32x (1.12x).
func (p *meshPipe) Lanes() int {
	r, ok := p.m.current().(*pipeline.Pipeline)
	if !ok {
		return 1
	}
	if p.m.cfg.Pipelining != ggufstage.Auto {
		return p.m.lanesOf(r)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.lanesOf != r {
		p.lanesOf, p.lanes = r, p.m.lanesOf(r)
		if p.lanes > 1 {
			p.m.event("pipeline", "the %d stages run on hardware of their own: a micro-batch in flight on each (--pipelining auto)", p.lanes)
		}
	}
	return p.lanes
}

// lanesOf is how many micro-batches --pipelining keeps in flight through
// r: --micro-batches, by default one per stage; or 1.
func (m *mesh) lanesOf(r *pipeline.Pipeline) int {
	route := r.Route()
	switch {
	case m.cfg.Pipelining == ggufstage.Off:
		return 1
	case m.cfg.Pipelining == ggufstage.On, ownHardware(m.computeOf(route)):
		return pipelinedLanes(len(route), m.cfg.MicroBatches)
	}
	return 1
}

// pipelinedLanes is how many micro-batches a pipelined route of stages
// keeps in flight: microBatches where set (above 0), else one per stage.
func pipelinedLanes(stages, microBatches int) int {
	if microBatches > 0 {
		return microBatches
	}
	return max(stages, 1)
}

// ownHardware says whether every stage runs on hardware no other stage
// uses; an unknown (empty) one may be shared.
func ownHardware(compute []string) bool {
	seen := make(map[string]bool, len(compute))
	for _, c := range compute {
		if c == "" || seen[c] {
			return false
		}
		seen[c] = true
	}
	return true
}

// computeOf is the Compute of each hop's node, "" where unknown.
func (m *mesh) computeOf(route []pipeline.Hop) []string {
	of := map[string]string{}
	for _, mem := range m.ml.Members() {
		of[mem.Meta.PeerID] = mem.Meta.Compute
	}
	m.mu.Lock()
	of[m.self] = m.meta.Compute
	m.mu.Unlock()
	compute := make([]string, len(route))
	for i, h := range route {
		compute[i] = of[h.Peer]
	}
	return compute
}

// Submit sends a batch without waiting for it (pipelining).
func (p *meshPipe) Submit(ctx context.Context, b *stage.Batch) (func(context.Context) (sample.Picked, error), error) {
	pipe, err := p.pipeOf(b)
	if err != nil {
		return nil, err
	}
	r, ok := pipe.(*pipeline.Pipeline)
	if !ok {
		picked, err := pipe.Forward(ctx, b)
		return func(context.Context) (sample.Picked, error) { return picked, err }, nil
	}
	start := time.Now()
	call, err := r.Submit(ctx, b)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context) (sample.Picked, error) {
		res, err := call.Wait(ctx)
		if err != nil {
			return sample.Picked{}, err
		}
		p.m.obs.stepDone(time.Since(start), len(res.Tokens))
		return res.Picked(), nil
	}, nil
}

// pipeOf is the pipeline a batch's sequences were opened on, which must be
// the current one.
func (p *meshPipe) pipeOf(b *stage.Batch) (scheduler.Pipeline, error) {
	p.mu.Lock()
	var pipe scheduler.Pipeline
	for _, s := range b.Seqs {
		q, ok := p.seqs[s]
		if !ok {
			p.mu.Unlock()
			return nil, fmt.Errorf("%w: %d", stage.ErrUnknownSeq, s)
		}
		if pipe == nil {
			pipe = q
		} else if pipe != q {
			p.mu.Unlock()
			return nil, errors.New("pipeline changed under running sequences")
		}
	}
	p.mu.Unlock()
	if pipe != p.m.current() {
		return nil, errors.New("pipeline changed under running sequences (replanned)")
	}
	return pipe, nil
}

func (p *meshPipe) Release(seq stage.SeqID) error {
	p.mu.Lock()
	pipe := p.seqs[seq]
	delete(p.seqs, seq)
	p.mu.Unlock()
	if pipe == nil {
		return nil
	}
	return pipe.Release(seq)
}

// sortedMembers is members by peer ID, for stable output.
func sortedMembers(ms []membership.Member) []membership.Member {
	sort.Slice(ms, func(i, j int) bool { return ms[i].Meta.PeerID < ms[j].Meta.PeerID })
	return ms
}

// HumanBytes formats a byte count in binary units (KiB, MiB, ...), as the
// node's logs and the CLI print sizes.
func HumanBytes(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := uint64(unit), 0
	for v := n / unit; v >= unit; v /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

func ioSection(src weights.RangeSource) *io.SectionReader {
	return io.NewSectionReader(src, 0, src.Size())
}
