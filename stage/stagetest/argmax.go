package stagetest

// Argmax is the plain reference argmax that tests check greedy tokens
// against: the first index of the largest value by Go's >, so that +Inf
// beats math.MaxFloat32 and a NaN never beats an earlier value. It is
// deliberately not stage.GreedyPick, whose rule for NaN and +Inf it is
// compared with.
func Argmax(x []float32) int32 {
	best := 0
	for i, v := range x {
		if v > x[best] {
			best = i
		}
	}
	return int32(best)
}
