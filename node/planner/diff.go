package planner

import (
	"cmp"
	"fmt"
	"slices"
)

// ChangeKind says what a replan did to one node.
type ChangeKind uint8

const (
	Kept   ChangeKind = iota // same range before and after
	Gained                   // no range before, one after
	Lost                     // a range before, none after
	Moved                    // a different range after
)

func (k ChangeKind) String() string {
	switch k {
	case Kept:
		return "kept"
	case Gained:
		return "gained"
	case Lost:
		return "lost"
	case Moved:
		return "moved"
	}
	return fmt.Sprintf("ChangeKind(%d)", uint8(k))
}

// Change is one node's part in a replan. Old is zero for Gained, New for
// Lost.
type Change struct {
	Node     string
	Kind     ChangeKind
	Old, New Range
}

func (c Change) String() string {
	switch c.Kind {
	case Gained:
		return fmt.Sprintf("%s gained %s", c.Node, c.New)
	case Lost:
		return fmt.Sprintf("%s lost %s", c.Node, c.Old)
	case Moved:
		return fmt.Sprintf("%s moved %s -> %s", c.Node, c.Old, c.New)
	}
	return fmt.Sprintf("%s kept %s", c.Node, c.Old)
}

// Diff lists, by node ID, every node that serves a stage in before or
// after, and what happened to it.
func Diff(before, after Plan) []Change {
	var out []Change
	for _, s := range before.Stages {
		c := Change{Node: s.Node, Kind: Lost, Old: s.Range()}
		if t, ok := after.StageOf(s.Node); ok {
			c.New = t.Range()
			c.Kind = Moved
			if c.New == c.Old {
				c.Kind = Kept
			}
		}
		out = append(out, c)
	}
	for _, s := range after.Stages {
		if _, ok := before.StageOf(s.Node); !ok {
			out = append(out, Change{Node: s.Node, Kind: Gained, New: s.Range()})
		}
	}
	slices.SortFunc(out, func(a, b Change) int { return cmp.Compare(a.Node, b.Node) })
	return out
}
