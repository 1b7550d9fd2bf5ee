package text

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

// Limits on stop strings, as OpenAI's API has a small limit too: they bound
// the work per pushed piece and the text held back.
const (
	MaxStops     = 16
	MaxStopBytes = 256
)

// ErrInvalidStop is wrapped by NewStopMatcher's errors; the HTTP layer maps
// it to 400.
var ErrInvalidStop = errors.New("invalid stop sequences")

// StopMatcher ends generated text at the first stop string. Text that could
// still be the start of a stop string is held back until it is known not to
// be one, so a stop string is never partly sent; the stop string itself is
// never emitted (as in OpenAI's API).
//
// The output does not depend on how the text is split into pieces: when
// several stop strings occur, the one that is complete first wins (earliest
// end; of those ending together, the one starting first). A StopMatcher is
// not safe for concurrent use.
type StopMatcher struct {
	stops   []string
	maxLen  int
	held    string
	stopped bool
}

// NewStopMatcher builds a matcher for stops; empty strings are ignored.
func NewStopMatcher(stops []string) (*StopMatcher, error) {
	m := &StopMatcher{}
	for i, s := range stops {
		if s == "" {
			continue
		}
		if len(s) > MaxStopBytes {
			return nil, fmt.Errorf("stop sequence %d is %d bytes, over the limit of %d: %w", i, len(s), MaxStopBytes, ErrInvalidStop)
		}
		// Valid UTF-8 stops keep the emitted text cut at character boundaries.
		if !utf8.ValidString(s) {
			return nil, fmt.Errorf("stop sequence %d is not valid UTF-8: %w", i, ErrInvalidStop)
		}
		m.stops = append(m.stops, s)
		m.maxLen = max(m.maxLen, len(s))
	}
	if len(m.stops) > MaxStops {
		return nil, fmt.Errorf("%d stop sequences, over the limit of %d: %w", len(m.stops), MaxStops, ErrInvalidStop)
	}
	return m, nil
}

// Push adds generated text. It returns the text that is safe to send and
// whether a stop string has completed; after that, generation should end and
// further calls return ("", true).
func (m *StopMatcher) Push(text string) (emit string, stopped bool) {
	if m.stopped {
		return "", true
	}
	if len(m.stops) == 0 {
		return text, false
	}
	buf := m.held + text
	start, end := -1, -1
	for _, s := range m.stops {
		// The first occurrence of s is also the first to complete.
		i := strings.Index(buf, s)
		if i < 0 {
			continue
		}
		if e := i + len(s); end < 0 || e < end || (e == end && i < start) {
			start, end = i, e
		}
	}
	if start >= 0 {
		m.stopped, m.held = true, ""
		return buf[:start], true
	}
	keep := m.holdLen(buf)
	// Clone so the held tail does not pin a large pushed piece.
	m.held = strings.Clone(buf[len(buf)-keep:])
	return buf[:len(buf)-keep], false
}

// holdLen is the length of the longest suffix of buf that is a proper prefix
// of some stop string.
func (m *StopMatcher) holdLen(buf string) int {
	for n := min(len(buf), m.maxLen-1); n > 0; n-- {
		suffix := buf[len(buf)-n:]
		for _, s := range m.stops {
			if len(s) > n && strings.HasPrefix(s, suffix) {
				return n
			}
		}
	}
	return 0
}

// Flush returns the held-back text at the end of generation (nothing once
// stopped).
func (m *StopMatcher) Flush() string {
	out := m.held
	m.held = ""
	return out
}

// Stopped reports whether a stop string has completed.
func (m *StopMatcher) Stopped() bool { return m.stopped }
