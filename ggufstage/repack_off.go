//go:build !repack || !cgo

package ggufstage

// repacker is absent from builds without the repack tag: quantized weights
// stay in ggml's plain layout (correct, slower on CPU).
type repacker struct{ own int }

// useQ4X16: meshnode's own Q4_0 kernel needs the repack build.
var useQ4X16 = false

func newRepacker() *repacker { return nil }

func (*repacker) take(any, []byte) bool { return false }

func (*repacker) Close() error { return nil }

func (*repacker) count() int { return 0 }

func repackCPU() bool { return false }

// RepackAvailable reports whether this build can repack weights.
const RepackAvailable = false

func q4x16Check(k, n, m, threads int, seed uint32) float64 { return -1 }
