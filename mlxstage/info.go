package mlxstage

import (
	"fmt"

	"github.com/meshnode/meshnode/mlxstage/safetensors"
	"github.com/meshnode/meshnode/stage"
)

// ModelInfo is what a safetensors model's config.json and headers say
// about it, read without loading any weights: enough for a planner to place
// stages.
type ModelInfo struct {
	Config *Config
	DType  safetensors.DType // type holding most of the weights' bytes
	Quant  QuantPolicy       // what the sizes below assume

	perLayer           []uint64
	embed, norm, head  uint64
	kvPerTokenPerLayer uint64
}

// ReadInfo reads config.json and every shard's header (not the data)
// through open, and sizes the model as the engine would hold it under q.
func ReadInfo(open safetensors.Opener, q QuantPolicy) (ModelInfo, error) {
	cfg, err := ReadConfig(open)
	if err != nil {
		return ModelInfo{}, err
	}
	if err := q.Validate(); err != nil {
		return ModelInfo{}, err
	}
	m, err := safetensors.OpenModel(open)
	if err != nil {
		return ModelInfo{}, err
	}
	defer m.Close()
	mi := ModelInfo{Config: cfg, Quant: q, perLayer: make([]uint64, cfg.Layers)}
	byType := map[safetensors.DType]int64{}
	for _, name := range cfg.StageTensors(0, cfg.Layers) {
		_, t, err := m.Locate(name)
		if err != nil {
			return ModelInfo{}, err
		}
		byType[t.DType] += t.Length
		n := heldBytes(t, q)
		switch l := LayerOf(name); {
		case l >= 0 && l < cfg.Layers:
			mi.perLayer[l] += n
		case name == NameEmbed:
			mi.embed = n
		case name == NameNorm:
			mi.norm = n
		case name == NameHead:
			mi.head = n
		}
	}
	var best int64
	for dt, n := range byType {
		if n > best {
			mi.DType, best = dt, n
		}
	}
	if mi.DType == "" {
		return ModelInfo{}, fmt.Errorf("%w: no weights", ErrConfig)
	}
	// The cache holds keys and values in the activation dtype, which is
	// the weights' type.
	mi.kvPerTokenPerLayer = 2 * uint64(cfg.KVHeads*cfg.HeadDim*mi.DType.Size())
	return mi, nil
}

// heldBytes is the memory a tensor takes once loaded under q: as stored,
// or quantized codes plus a scale and a bias per group in the tensor's type.
func heldBytes(t safetensors.Tensor, q QuantPolicy) uint64 {
	shape := make([]int, len(t.Shape))
	for i, d := range t.Shape {
		shape[i] = int(d)
	}
	qt := q.For(t.Name, shape)
	if qt.None() {
		return uint64(t.Length)
	}
	elems := uint64(t.Elements())
	groups := elems / uint64(qt.GroupSize)
	return elems*uint64(qt.Bits)/8 + 2*groups*uint64(t.DType.Size())
}

// Sizes breaks the model's bytes down the way node/planner places them:
// each block, the embedding (first stage), the final norm and head (last
// stage; for a tied head, the embedding again, which the last stage loads
// too), and K+V bytes per cached token per layer.
func (mi ModelInfo) Sizes() (perLayer []uint64, embed, head, kvPerTokenPerLayer uint64) {
	head = mi.norm + mi.head
	if mi.Config.Tied {
		head += mi.embed
	}
	return mi.perLayer, mi.embed, head, mi.kvPerTokenPerLayer
}

// Memory estimates what a stage [start,end) costs: its weights, K and V per
// cached token, and scratch for a forward pass of batch tokens.
func (mi ModelInfo) Memory(start, end, batch int) (stage.Memory, error) {
	c := mi.Config
	if start < 0 || end > c.Layers || start >= end {
		return stage.Memory{}, fmt.Errorf("layer range [%d,%d) is not inside the model's %d layers", start, end, c.Layers)
	}
	var w uint64
	for l := start; l < end; l++ {
		w += mi.perLayer[l]
	}
	if start == 0 {
		w += mi.embed
	}
	if end == c.Layers {
		w += mi.norm + mi.head
		if c.Tied && start != 0 {
			w += mi.embed
		}
	}
	width := max(uint64(c.Hidden)*4, uint64(c.FFN)*2)
	if end == c.Layers {
		width = max(width, uint64(c.Vocab))
	}
	return stage.Memory{
		Weights:    w,
		KVPerToken: uint64(end-start) * mi.kvPerTokenPerLayer,
		Compute:    uint64(batch) * width * 4 * 2,
	}, nil
}
