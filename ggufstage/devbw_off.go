//go:build !repack || !cgo

package ggufstage

import (
	"errors"

	"github.com/ollama/ollama/ml"
)

// DeviceBandwidth needs ggml's headers, which builds with the repack tag
// have; elsewhere the planner weighs a GPU node by its CPU's bandwidth.
func DeviceBandwidth(ml.DeviceInfo) (float64, error) {
	return 0, errors.New("measuring a GPU's bandwidth needs a build with the repack tag")
}
