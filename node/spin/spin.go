// Package spin paces the yields of a goroutine that busy-polls.
//
// Why. A poller that yields its P on every empty poll (runtime.Gosched)
// puts itself on the global run queue and wakes an idle thread to look
// for work (wakep), every poll: on a host with many idle Ps that is a
// futex wake-up each few hundred nanoseconds, the poller bouncing from
// thread to thread. On a KVM guest, whose idle vCPUs halt, each wake-up
// is an inter-processor interrupt. There, a two-stage hop whose stages
// took 0.9 ms each cost 79 µs a step outside them with 16 Ps and 45 with
// 2 (BenchmarkWideStep/local/rows=1/compute=900µs on an H200 host, run
// 279). A poller needs to yield only so that what it readied itself runs
// (goready puts a goroutine in the current P's runnext, which no other P
// takes for a while) and so that a P it shares with others is not held
// for long: once when it starts waiting, then every Interval. On that
// host (run 280, 16 Ps) a step there took 1858-1865 µs yielding every
// poll, 1851-1858 every 20 µs, 1849 every 50 µs, and stages that answer
// at once 38-41, 29 and 24-25 µs.
package spin

import (
	"os"
	"runtime"
	"time"
)

// Interval is how long a poller that finds nothing keeps its P between
// yields. MESHNODE_SPIN_YIELD (a duration) sets it; 0 yields every poll.
var Interval = 50 * time.Microsecond

func init() {
	if d, err := time.ParseDuration(os.Getenv("MESHNODE_SPIN_YIELD")); err == nil && d >= 0 {
		Interval = d
	}
}

// Pacer paces one wait's yields. The zero value starts a wait: its first
// empty poll yields.
type Pacer struct {
	next time.Time // the zero time before the wait's first yield
}

// Missed is called after each empty poll, with the time; it yields the P
// on the wait's first empty poll and then once every Interval, and says
// whether it did.
func (p *Pacer) Missed(now time.Time) bool {
	if now.Before(p.next) {
		return false
	}
	p.next = now.Add(Interval)
	runtime.Gosched()
	return true
}
