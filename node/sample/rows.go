package sample

import (
	"runtime"
	"sync"
)

// parallelWork is the logits (rows × vocabulary) below which sampling a
// batch's rows on one goroutine beats handing them out: a core scans about
// a few thousand logits per microsecond, and a goroutine costs about one.
const parallelWork = 1 << 16

// Rows calls fn(i) for every row i of a batch whose rows belong to keys[i]
// (their sequences), each row of vocab logits. It spreads the rows over
// the cores when they are many and large: a 128k-token vocabulary takes a
// core tens of microseconds per row, and 32 rows done one after another
// stall every step of a batch. It runs them one after another when a key
// repeats, since a key's Sampler must not be used by two goroutines.
func Rows[K comparable](keys []K, vocab int, fn func(i int)) {
	n := len(keys)
	workers := min(n, runtime.GOMAXPROCS(0))
	if workers < 2 || n*vocab < parallelWork || !distinct(keys) {
		for i := range n {
			fn(i)
		}
		return
	}
	var wg sync.WaitGroup
	for w := range workers {
		lo, hi := w*n/workers, (w+1)*n/workers
		wg.Go(func() {
			for i := lo; i < hi; i++ {
				fn(i)
			}
		})
	}
	wg.Wait()
}

func distinct[K comparable](keys []K) bool {
	seen := make(map[K]struct{}, len(keys))
	for _, k := range keys {
		if _, dup := seen[k]; dup {
			return false
		}
		seen[k] = struct{}{}
	}
	return true
}
