package wire

import (
	"errors"
	"fmt"
	"math"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// maxInfoString bounds each name in a StageInfo; a content hash in hex with
// an algorithm prefix is well under it.
const maxInfoString = 256

// Info is what StageService.Info reports: the engine's stage.Info plus the
// model's identity and the stage's transport limits.
type Info struct {
	stage.Info
	// ModelID names the model for people; ModelHash identifies its weights,
	// and two stages join one pipeline only if their hashes are equal.
	ModelID   string
	ModelHash string
	// ProtocolVersion is the highest Frame.version the stage speaks;
	// EncodeInfo fills Version when zero.
	ProtocolVersion uint32
	// MaxFrameBytes is the largest message the stage accepts; EncodeInfo
	// fills MaxFrameBytes (the package constant) when zero. Zero after
	// DecodeInfo means the peer did not say.
	MaxFrameBytes uint64
}

// check validates the parts of Info that a peer relies on.
func (in *Info) check(lim Limits) error {
	i := in.Info
	switch {
	case i.Layers <= 0 || i.Layers > math.MaxInt32:
		return fmt.Errorf("layers %d not in [1,%d]", i.Layers, math.MaxInt32)
	case i.Start < 0 || i.Start >= i.End || i.End > i.Layers:
		return fmt.Errorf("layer range [%d,%d) not within [0,%d)", i.Start, i.End, i.Layers)
	case i.Embd <= 0 || i.Embd > lim.MaxCols:
		return fmt.Errorf("embd %d not in [1,%d]", i.Embd, lim.MaxCols)
	case i.Vocab <= 0 || i.Vocab > lim.MaxVocab:
		return fmt.Errorf("vocab %d not in [1,%d]", i.Vocab, lim.MaxVocab)
	case i.Context < 0 || i.Context > math.MaxInt32:
		return fmt.Errorf("context %d not in [0,%d]", i.Context, math.MaxInt32)
	case i.MaxSeqs < 0 || i.MaxSeqs > math.MaxInt32:
		return fmt.Errorf("max seqs %d not in [0,%d]", i.MaxSeqs, math.MaxInt32)
	case i.WireDType.Size() == 0:
		return fmt.Errorf("unknown wire dtype %d", uint8(i.WireDType))
	case in.ProtocolVersion == 0:
		return errors.New("protocol version 0")
	}
	for _, s := range []struct{ name, v string }{
		{"arch", i.Arch}, {"engine", i.Engine}, {"backend", i.Backend},
		{"model id", in.ModelID}, {"model hash", in.ModelHash},
	} {
		if len(s.v) > maxInfoString {
			return fmt.Errorf("%s is %d bytes, over %d", s.name, len(s.v), maxInfoString)
		}
	}
	return nil
}

// EncodeInfo builds the StageInfo reply for in.
func EncodeInfo(in Info) (*meshnodev1.StageInfo, error) {
	if in.ProtocolVersion == 0 {
		in.ProtocolVersion = Version
	}
	if in.MaxFrameBytes == 0 {
		in.MaxFrameBytes = MaxFrameBytes
	}
	if err := in.check(DefaultLimits()); err != nil {
		return nil, fmt.Errorf("%w: stage info: %w", ErrBadBatch, err)
	}
	i := in.Info
	return &meshnodev1.StageInfo{
		Arch:            i.Arch,
		Layers:          uint32(i.Layers),
		Embd:            uint32(i.Embd),
		Vocab:           uint32(i.Vocab),
		Start:           uint32(i.Start),
		End:             uint32(i.End),
		Context:         uint32(i.Context),
		MaxSeqs:         uint32(i.MaxSeqs),
		WireDtype:       DTypeToProto(i.WireDType),
		Engine:          i.Engine,
		Backend:         i.Backend,
		ModelId:         in.ModelID,
		ModelHash:       in.ModelHash,
		ProtocolVersion: in.ProtocolVersion,
		MaxFrameBytes:   in.MaxFrameBytes,
	}, nil
}

// DecodeInfo validates a peer's StageInfo against lim.
func DecodeInfo(p *meshnodev1.StageInfo, lim Limits) (Info, error) {
	if p == nil {
		return Info{}, fmt.Errorf("%w: nil stage info", ErrBadFrame)
	}
	lim = lim.resolved()
	// uint32 fields above MaxInt32 would wrap an int on 32-bit platforms.
	for _, v := range []struct {
		name string
		v    uint32
	}{
		{"layers", p.GetLayers()}, {"embd", p.GetEmbd()}, {"vocab", p.GetVocab()},
		{"start", p.GetStart()}, {"end", p.GetEnd()}, {"context", p.GetContext()},
		{"max seqs", p.GetMaxSeqs()},
	} {
		if v.v > math.MaxInt32 {
			return Info{}, fmt.Errorf("%w: stage info: %s %d too large", ErrBadFrame, v.name, v.v)
		}
	}
	dt, err := dtypeFromProto(p.GetWireDtype())
	if err != nil {
		return Info{}, fmt.Errorf("%w: stage info: wire dtype: %w", ErrBadFrame, err)
	}
	in := Info{
		Info: stage.Info{
			Arch:      p.GetArch(),
			Layers:    int(p.GetLayers()),
			Embd:      int(p.GetEmbd()),
			Vocab:     int(p.GetVocab()),
			Start:     int(p.GetStart()),
			End:       int(p.GetEnd()),
			Context:   int(p.GetContext()),
			MaxSeqs:   int(p.GetMaxSeqs()),
			WireDType: dt,
			Engine:    p.GetEngine(),
			Backend:   p.GetBackend(),
		},
		ModelID:         p.GetModelId(),
		ModelHash:       p.GetModelHash(),
		ProtocolVersion: p.GetProtocolVersion(),
		MaxFrameBytes:   p.GetMaxFrameBytes(),
	}
	if err := in.check(lim); err != nil {
		return Info{}, fmt.Errorf("%w: stage info: %w", ErrBadFrame, err)
	}
	return in, nil
}
