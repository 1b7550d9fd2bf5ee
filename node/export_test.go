package node

import (
	"github.com/meshnode/meshnode/mlxstage/mlx"
	"github.com/meshnode/meshnode/mlxstage/ops"
	"github.com/meshnode/meshnode/stage"
)

// EmulateMLX turns the test hook on in cfg: the node offers the mlx engine
// and runs safetensors stages on mlx.Emulated(), the MLX binding's Go logic
// over a pure-Go emulation of mlx-c, so that the MLX serving path runs
// where MLX does not.
func EmulateMLX(cfg Config) Config {
	cfg.mlxBackend = func() (ops.Backend, error) {
		be, _ := mlx.Emulated()
		return be, nil
	}
	return cfg
}

// BreakStage makes the node ask broken, instead of its stage's engine,
// whether the stage broke (as ggufstage's does after a panic in ggml).
func BreakStage(cfg Config, broken func() error) Config {
	cfg.stageBroken = func(stage.Engine) error { return broken() }
	return cfg
}

// KVF32 gives the node's GGUF stages an f32 KV cache, the precision the
// emulated MLX engine keeps.
func KVF32(cfg Config) Config {
	cfg.kvF32 = true
	return cfg
}
