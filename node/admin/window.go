package admin

import (
	"sync"
	"time"
)

// Window sums samples over the last few seconds, in one-second buckets, for
// "now" numbers: tokens per second, mean latency. Safe for concurrent use.
type Window struct {
	mu      sync.Mutex
	span    int // seconds
	sums    []float64
	counts  []uint64
	stamps  []int64 // the second each bucket holds
	started time.Time
	now     func() time.Time
}

// NewWindow keeps the last span seconds.
func NewWindow(span time.Duration) *Window {
	n := max(int(span/time.Second), 1)
	return &Window{span: n, sums: make([]float64, n), counts: make([]uint64, n), stamps: make([]int64, n), started: time.Now(), now: time.Now}
}

// Add records a sample of value v.
func (w *Window) Add(v float64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	sec := w.now().Unix()
	i := int(sec % int64(w.span))
	if w.stamps[i] != sec {
		w.stamps[i], w.sums[i], w.counts[i] = sec, 0, 0
	}
	w.sums[i] += v
	w.counts[i]++
}

// totals sums the buckets still inside the window.
func (w *Window) totals() (sum float64, count uint64, secs float64) {
	now := w.now()
	sec := now.Unix()
	for i := range w.span {
		if sec-w.stamps[i] < int64(w.span) {
			sum += w.sums[i]
			count += w.counts[i]
		}
	}
	// The current second is only partly over; a window younger than its
	// span covers less.
	secs = float64(w.span-1) + float64(now.UnixNano()%1e9)/1e9
	if age := now.Sub(w.started).Seconds(); age < secs {
		secs = age
	}
	return sum, count, max(secs, 1)
}

// Rate is the sum of the samples per second.
func (w *Window) Rate() float64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	sum, _, secs := w.totals()
	return sum / secs
}

// Mean is the mean sample, or 0 without samples.
func (w *Window) Mean() float64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	sum, n, _ := w.totals()
	if n == 0 {
		return 0
	}
	return sum / float64(n)
}
