//go:build !(darwin && arm64 && mlx && cgo)

package mlx

import "github.com/meshnode/meshnode/mlxstage/ops"

const built = false

// New returns ErrUnavailable: this binary has no MLX binding.
func New() (ops.Backend, error) { return nil, ErrUnavailable }
