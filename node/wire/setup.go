package wire

import (
	"fmt"
	"math"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// Bounds on a Setup, so that a peer cannot make a stage hold or dial
// without limit.
const (
	MaxRouteHops  = 64   // stages in one route
	MaxPipelineID = 128  // bytes
	MaxPeerName   = 256  // bytes of a peer id or address (origin included)
	MaxHandoff    = 1024 // bytes of a hand-off offer (Setup.Handoff)
)

// Role is what a pipeline's stream is for.
type Role uint8

// Stream roles; see proto/meshnode/v1/stage.proto.
const (
	// RoleForward streams carry work from the previous hop (or the origin)
	// into a stage.
	RoleForward Role = iota + 1
	// RoleReturn streams carry the last stage's replies to the origin.
	RoleReturn
)

func (r Role) String() string {
	switch r {
	case RoleForward:
		return "forward"
	case RoleReturn:
		return "return"
	}
	return fmt.Sprintf("role(%d)", uint8(r))
}

// Hop is one stage of a route.
type Hop struct {
	Peer       string
	Start, End int
	// MaxFrameBytes is the largest message the hop accepts; 0 means
	// MaxFrameBytes, the package constant.
	MaxFrameBytes uint64
}

// Setup starts a pipeline on a stream: the first frame of each of its
// streams.
type Setup struct {
	Role       Role
	PipelineID string
	Origin     string
	Route      []Hop
	// Hop is the index in Route of the stage receiving the Setup.
	Hop          int
	WireDType    stage.DType
	ReturnLogits bool
	// Handoff is the previous hop's offer of a hand-off on a shared GPU
	// (engine-defined handles); HandoffTaken, in the receiver's answer,
	// says it opened them. See proto/meshnode/v1/stage.proto.
	Handoff      []byte
	HandoffTaken bool
}

// Layers is the model's layer count that the route covers.
func (s *Setup) Layers() int {
	if len(s.Route) == 0 {
		return 0
	}
	return s.Route[len(s.Route)-1].End
}

// Last reports whether the receiving stage is the route's last.
func (s *Setup) Last() bool { return s.Hop == len(s.Route)-1 }

// FrameLimit is the largest message to send to hop i: what it advertised,
// capped at what this package's dial options allow.
func (s *Setup) FrameLimit(i int) int {
	n := s.Route[i].MaxFrameBytes
	if n == 0 || n > MaxFrameBytes {
		return MaxFrameBytes
	}
	return int(n)
}

func (s *Setup) check() error {
	switch {
	case s.Role != RoleForward && s.Role != RoleReturn:
		return fmt.Errorf("unknown role %d", uint8(s.Role))
	case s.PipelineID == "" || len(s.PipelineID) > MaxPipelineID:
		return fmt.Errorf("pipeline id of %d bytes, want 1 to %d", len(s.PipelineID), MaxPipelineID)
	case s.Origin == "" || len(s.Origin) > MaxPeerName:
		return fmt.Errorf("origin of %d bytes, want 1 to %d", len(s.Origin), MaxPeerName)
	case len(s.Route) == 0 || len(s.Route) > MaxRouteHops:
		return fmt.Errorf("route of %d hops, want 1 to %d", len(s.Route), MaxRouteHops)
	case s.Hop < 0 || s.Hop >= len(s.Route):
		return fmt.Errorf("hop %d outside the route's %d", s.Hop, len(s.Route))
	case s.WireDType.Size() == 0:
		return fmt.Errorf("unknown wire dtype %d", uint8(s.WireDType))
	case s.Role == RoleReturn && !s.Last():
		return fmt.Errorf("return stream to hop %d, not the last of %d", s.Hop, len(s.Route))
	case len(s.Handoff) > MaxHandoff:
		return fmt.Errorf("hand-off offer of %d bytes, over %d", len(s.Handoff), MaxHandoff)
	case s.Handoff != nil && s.Role != RoleForward:
		return fmt.Errorf("hand-off offer on a %s stream", s.Role)
	}
	next := 0
	for i, h := range s.Route {
		switch {
		case h.Peer == "" || len(h.Peer) > MaxPeerName:
			return fmt.Errorf("hop %d peer of %d bytes, want 1 to %d", i, len(h.Peer), MaxPeerName)
		case h.Start != next:
			return fmt.Errorf("hop %d starts at layer %d, want %d", i, h.Start, next)
		case h.End <= h.Start || h.End > math.MaxInt32:
			return fmt.Errorf("hop %d layer range [%d,%d) is empty or too large", i, h.Start, h.End)
		}
		next = h.End
	}
	return nil
}

var roleToProto = map[Role]meshnodev1.Setup_Role{
	RoleForward: meshnodev1.Setup_ROLE_FORWARD,
	RoleReturn:  meshnodev1.Setup_ROLE_RETURN,
}

// EncodeSetup builds a setup frame (step 0).
func EncodeSetup(s Setup) (*meshnodev1.Frame, error) {
	if err := s.check(); err != nil {
		return nil, fmt.Errorf("%w: setup: %w", ErrBadBatch, err)
	}
	ps := &meshnodev1.Setup{
		Role:         roleToProto[s.Role],
		PipelineId:   s.PipelineID,
		Origin:       s.Origin,
		Hop:          uint32(s.Hop),
		WireDtype:    DTypeToProto(s.WireDType),
		ReturnLogits: s.ReturnLogits,
		Handoff:      s.Handoff,
		HandoffTaken: s.HandoffTaken,
	}
	for _, h := range s.Route {
		ps.Route = append(ps.Route, &meshnodev1.Hop{
			Peer: h.Peer, Start: uint32(h.Start), End: uint32(h.End), MaxFrameBytes: h.MaxFrameBytes,
		})
	}
	return &meshnodev1.Frame{Version: Version, Body: &meshnodev1.Frame_Setup{Setup: ps}}, nil
}

// DecodeSetup validates a setup frame: a known role, bounded names, a
// route of contiguous hops from layer 0, and the receiving hop inside it
// (the last one for a return stream). Whether that hop is the receiver is
// for the receiver to check.
func DecodeSetup(f *meshnodev1.Frame) (Setup, error) {
	if err := checkFrame(f); err != nil {
		return Setup{}, err
	}
	ps := f.GetSetup()
	if ps == nil {
		return Setup{}, wrongBody(f, "setup")
	}
	s := Setup{
		PipelineID:   ps.GetPipelineId(),
		Origin:       ps.GetOrigin(),
		ReturnLogits: ps.GetReturnLogits(),
		Handoff:      ps.GetHandoff(),
		HandoffTaken: ps.GetHandoffTaken(),
	}
	if len(s.Handoff) == 0 {
		s.Handoff = nil
	}
	err := func() error {
		switch ps.GetRole() {
		case meshnodev1.Setup_ROLE_FORWARD:
			s.Role = RoleForward
		case meshnodev1.Setup_ROLE_RETURN:
			s.Role = RoleReturn
		default:
			return fmt.Errorf("unknown role %d", int32(ps.GetRole()))
		}
		// Counted before anything is copied, and before the uint32 fields
		// become ints (which could wrap on 32-bit).
		if len(ps.GetRoute()) > MaxRouteHops {
			return fmt.Errorf("route of %d hops, over %d", len(ps.GetRoute()), MaxRouteHops)
		}
		if ps.GetHop() >= MaxRouteHops {
			return fmt.Errorf("hop %d, over %d", ps.GetHop(), MaxRouteHops)
		}
		s.Hop = int(ps.GetHop())
		dt, err := dtypeFromProto(ps.GetWireDtype())
		if err != nil {
			return err
		}
		s.WireDType = dt
		for i, h := range ps.GetRoute() {
			if h == nil {
				return fmt.Errorf("hop %d is empty", i)
			}
			if h.GetStart() > math.MaxInt32 || h.GetEnd() > math.MaxInt32 {
				return fmt.Errorf("hop %d layer range [%d,%d) too large", i, h.GetStart(), h.GetEnd())
			}
			s.Route = append(s.Route, Hop{
				Peer: h.GetPeer(), Start: int(h.GetStart()), End: int(h.GetEnd()), MaxFrameBytes: h.GetMaxFrameBytes(),
			})
		}
		return s.check()
	}()
	if err != nil {
		return Setup{}, frameErr(f, "setup", err)
	}
	return s, nil
}
