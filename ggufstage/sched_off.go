//go:build !repack || !cgo

package ggufstage

import (
	"errors"
	"unsafe"

	"github.com/ollama/ollama/ml"
)

// directSched: without ggml's headers this build computes through
// ollama's Context.Compute and Tensor.Floats (see sched_on.go).
const directSched = false

type schedGraph struct {
	sched, graph unsafe.Pointer
	batch        int
}

func graphOf(ml.Context) unsafe.Pointer { return nil }

var errNoSched = errors.New("ggml scheduler: not in this build")

func (schedGraph) alloc() error                    { return errNoSched }
func (schedGraph) launch() error                   { return errNoSched }
func (schedGraph) reset()                          {}
func (schedGraph) read(ml.Tensor, []float32) error { return errNoSched }

func schedOf(ml.Backend) unsafe.Pointer { return nil }

type schedClone struct{ sched unsafe.Pointer }

func cloneSched(ml.Backend) (*schedClone, error) { return nil, errNoSched }
func (*schedClone) free()                        {}
