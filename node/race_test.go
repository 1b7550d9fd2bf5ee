//go:build race

package node_test

// raceEnabled: this binary runs under the race detector, whose own memory
// (shadow and sync metadata) grows and is never handed back.
const raceEnabled = true
