//go:build !repack || !cgo

package ggufstage

// repacker is absent from builds without the repack tag: quantized weights
// stay in ggml's plain layout (correct, slower on CPU).
type repacker struct{ own int }

// useX16: meshnode's own X16 kernels need the repack build.
var useX16 = false

func newRepacker() *repacker { return nil }

func (*repacker) take(any, []byte) bool { return false }

func (*repacker) Close() error { return nil }

func (*repacker) count() int { return 0 }

func repackCPU() bool { return false }

// RepackAvailable reports whether this build can repack weights.
const RepackAvailable = false

func x16Check(uint32, int, int, int, int, uint32) float64 { return -1 }

func x16Time(uint32, int, int, int, int, int) (float64, float64) { return -1, -1 }

func x16CPU() bool { return false }

func x16CPUHas() bool { return false }

func cpuAttention() bool { return false }

func attnCheck(int, int, int, int, int, int, uint32, bool) float64 { return -1 }

func attnMoved(int, int, int, int, uint32, bool, bool) int { return -1 }

// allowAlloc needs ggml's internal headers, which only the repack build
// has: without it a dry-run load (Devices) leaves buffer types unable to
// allocate until the next engine loads.
func allowAlloc() {}

func setAttnKernel(bool) {}

// advise: huge pages need the repack build's cgo helpers.
func advise(any) {}
