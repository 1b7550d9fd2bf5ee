package hftok

import (
	"container/heap"
)

// pairKey names a merge.
type pairKey struct{ a, b string }

// symbol is one piece of a word during merging, in a linked list.
type symbol struct {
	s          string
	prev, next int
	gen        int // bumped when the symbol changes, to retire stale pairs
}

// candidate is a possible merge of symbol left with the one after it.
type candidate struct {
	rank, left, right int
	lgen, rgen        int
}

type candidates []candidate

func (q candidates) Len() int { return len(q) }
func (q candidates) Less(i, j int) bool {
	if q[i].rank != q[j].rank {
		return q[i].rank < q[j].rank
	}
	return q[i].left < q[j].left
}
func (q candidates) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *candidates) Push(x any)   { *q = append(*q, x.(candidate)) }
func (q *candidates) Pop() any {
	old := *q
	c := old[len(old)-1]
	*q = old[:len(old)-1]
	return c
}

// merge applies BPE to a word split into initial symbols: repeatedly the
// adjacent pair of lowest merge rank (leftmost among equals) is joined,
// until no adjacent pair is a merge. A heap with lazily retired entries
// keeps this O(n log n) in the word's length, which matters for
// SentencePiece-style models that BPE a whole prompt as one word.
func merge(initial []string, ranks map[pairKey]int) []string {
	if len(initial) < 2 {
		return initial
	}
	syms := make([]symbol, len(initial))
	for i, s := range initial {
		syms[i] = symbol{s: s, prev: i - 1, next: i + 1}
	}
	syms[len(syms)-1].next = -1
	q := &candidates{}
	push := func(l int) {
		if l < 0 {
			return
		}
		r := syms[l].next
		if r < 0 {
			return
		}
		if rank, ok := ranks[pairKey{syms[l].s, syms[r].s}]; ok {
			heap.Push(q, candidate{rank, l, r, syms[l].gen, syms[r].gen})
		}
	}
	for i := range syms {
		push(i)
	}
	for q.Len() > 0 {
		c := heap.Pop(q).(candidate)
		l, r := &syms[c.left], &syms[c.right]
		if l.gen != c.lgen || r.gen != c.rgen || l.next != c.right || r.s == "" {
			continue
		}
		l.s += r.s
		l.gen++
		l.next = r.next
		if r.next >= 0 {
			syms[r.next].prev = c.left
		}
		r.s = ""
		r.gen++
		push(l.prev)
		push(c.left)
	}
	out := make([]string, 0, len(initial))
	for i := 0; i >= 0; i = syms[i].next {
		out = append(out, syms[i].s)
	}
	return out
}
