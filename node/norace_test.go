//go:build !race

package node_test

// raceEnabled: this binary runs under the race detector.
const raceEnabled = false
