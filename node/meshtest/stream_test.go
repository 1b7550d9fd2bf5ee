package meshtest

// Streaming clients: one request's stream as a client sees it, a load of
// concurrent clients, and what their texts lost or repeated against the
// greedy reference.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshnode/meshnode/node/sse"
)

// streamClient has no overall timeout: a stream lasts as long as its
// generation; each request's context bounds it.
var streamClient = &http.Client{}

// streamResult is one streamed completion.
type streamResult struct {
	prompt   string
	start    time.Time
	arrivals []time.Time // when each piece of text came
	text     string
	finish   string
	tokens   int // usage.completion_tokens
	end      time.Time
	err      error // an HTTP error, an error event, or a stream cut short
}

// streamComplete asks node n for a greedy completion, streamed, and reads
// the stream to its end. onPiece, if set, is told how many pieces of text
// have come, at each one.
func streamComplete(ctx context.Context, n *meshNode, model, prompt string, maxTokens int, onPiece func(int)) (r streamResult) {
	r = streamResult{prompt: prompt, start: time.Now()}
	defer func() { r.end = time.Now() }()
	body, _ := json.Marshal(map[string]any{
		"model": model, "prompt": prompt, "max_tokens": maxTokens, "temperature": 0,
		"stream": true, "stream_options": map[string]any{"include_usage": true},
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, n.url+"/v1/completions", strings.NewReader(string(body)))
	if err != nil {
		r.err = err
		return r
	}
	req.Header.Set("Content-Type", "application/json")
	if n.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+n.apiKey)
	}
	resp, err := streamClient.Do(req)
	if err != nil {
		r.err = err
		return r
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		var b strings.Builder
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			b.WriteString(sc.Text())
		}
		r.err = fmt.Errorf("%s: %s", resp.Status, b.String())
		return r
	}
	var text strings.Builder
	err = sse.Each(resp.Body, func(data []byte) error {
		var ev sse.Chunk
		if err := json.Unmarshal(data, &ev); err != nil {
			return fmt.Errorf("event %q: %w", data, err)
		}
		if ev.Error != nil {
			return fmt.Errorf("error event after %d pieces: %s", len(r.arrivals), ev.Error.Message)
		}
		if ev.Usage != nil {
			r.tokens = ev.Usage.CompletionTokens
		}
		for _, c := range ev.Choices {
			if c.Text != "" {
				text.WriteString(c.Text)
				r.arrivals = append(r.arrivals, time.Now())
				if onPiece != nil {
					onPiece(len(r.arrivals))
				}
			}
			if c.FinishReason != nil {
				r.finish = *c.FinishReason
			}
		}
		return nil
	})
	r.text = text.String()
	if err != nil {
		r.err = fmt.Errorf("after %d pieces: %w", len(r.arrivals), errors.Join(err, ctx.Err()))
	}
	return r
}

// load is a set of clients that each stream one request after another
// through an entry node until stopped.
type load struct {
	mu      sync.Mutex
	results []streamResult
	running map[int]time.Time // client -> start of its request in flight
	stop    context.CancelFunc
	wg      sync.WaitGroup
}

// startLoad starts clients streaming the prompts round-robin. A request
// runs to its end even after stop; hard bounds each one.
func startLoad(hard context.Context, entry *meshNode, model *testModel, clients int, prompts []string, maxTokens int) *load {
	l := &load{running: map[int]time.Time{}}
	soft, stop := context.WithCancel(hard)
	l.stop = stop
	for c := range clients {
		l.wg.Go(func() {
			for k := c; soft.Err() == nil; k += clients {
				l.mu.Lock()
				l.running[c] = time.Now()
				l.mu.Unlock()
				ctx, cancel := context.WithTimeout(hard, 2*time.Minute)
				r := streamComplete(ctx, entry, model.id, prompts[k%len(prompts)], maxTokens, nil)
				cancel()
				l.mu.Lock()
				delete(l.running, c)
				l.results = append(l.results, r)
				l.mu.Unlock()
				if r.err != nil {
					// A node that refuses connections must not be hammered.
					select {
					case <-soft.Done():
					case <-time.After(200 * time.Millisecond):
					}
				}
			}
		})
	}
	return l
}

// finish stops starting requests and waits for those in flight.
func (l *load) finish() []streamResult {
	l.stop()
	l.wg.Wait()
	return l.snapshot()
}

func (l *load) snapshot() []streamResult {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.results)
}

// inFlight is how many requests are in flight now.
func (l *load) inFlight() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.running)
}

// waitDone waits until n requests started after t have ended (whatever
// their outcome), or fails the test.
func (l *load) waitDone(t *testing.T, after time.Time, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		got := 0
		for _, r := range l.snapshot() {
			if r.start.After(after) {
				got++
			}
		}
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d requests started after %s ended within %s, want %d", got, after.Format(time.StampMilli), timeout, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ---- accounting ----

// tally is what a run of requests did, against the greedy references.
type tally struct {
	started, completed, failed int
	lost, dup                  int // tokens, over the completed requests
	wrong                      []string
	errs                       []string
}

// account compares every request with the reference of its prompt.
func account(t *testing.T, model *testModel, results []streamResult, maxTokens int) tally {
	t.Helper()
	var tl tally
	for _, r := range results {
		tl.started++
		if r.err != nil {
			tl.failed++
			tl.errs = append(tl.errs, fmt.Sprintf("%q at %s: %v", r.prompt, r.start.Format(time.StampMilli), r.err))
			continue
		}
		tl.completed++
		want := model.greedy(t, r.prompt, maxTokens)
		lost, dup := tokenDiff(model.pieces(t, want.ids), r.text, r.tokens)
		if r.text != string([]rune(want.text)) || r.finish != want.finish {
			lost = max(lost, 1) // a different text lost the reference's token somewhere
			tl.wrong = append(tl.wrong, fmt.Sprintf("%q (%s):\n got %q (%d tokens, %s)\nwant %q (%d tokens, %s)",
				r.prompt, r.start.Format(time.StampMilli), r.text, r.tokens, r.finish, want.text, len(want.ids), want.finish))
		}
		tl.lost += lost
		tl.dup += dup
	}
	return tl
}

// tokenDiff aligns a streamed text with the reference's token pieces (a
// longest common subsequence of their runes) and counts the reference's
// tokens that did not come through whole (lost) and the stretches of text
// that are not the reference's (duplicated or foreign tokens, at least
// one each), or the tokens the server counted beyond those it kept.
func tokenDiff(pieces []string, got string, gotTokens int) (lost, dup int) {
	var want []rune
	var owner []int // piece of each reference rune
	for i, p := range pieces {
		for _, r := range string([]rune(p)) {
			want = append(want, r)
			owner = append(owner, i)
		}
	}
	g := []rune(got)
	// lcs[i][j]: the LCS of want[i:] and g[j:].
	lcs := make([][]int, len(want)+1)
	for i := range lcs {
		lcs[i] = make([]int, len(g)+1)
	}
	for i := len(want) - 1; i >= 0; i-- {
		for j := len(g) - 1; j >= 0; j-- {
			if want[i] == g[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	missing := map[int]bool{}
	extraRuns, inRun := 0, false
	i, j := 0, 0
	for i < len(want) || j < len(g) {
		switch {
		case i < len(want) && j < len(g) && want[i] == g[j]:
			i, j, inRun = i+1, j+1, false
		case j < len(g) && (i == len(want) || lcs[i][j+1] >= lcs[i+1][j]):
			if !inRun {
				extraRuns++
			}
			j, inRun = j+1, true
		default:
			missing[owner[i]] = true
			i++
		}
	}
	lost = len(missing)
	dup = max(extraRuns, gotTokens-(len(pieces)-lost))
	return lost, max(dup, 0)
}

// pieces are the text of each token, decoded alone.
func (m *testModel) pieces(t *testing.T, ids []int32) []string {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]string, len(ids))
	for i, id := range ids {
		s, err := m.tok.Decode([]int32{id})
		if err != nil {
			t.Fatal(err)
		}
		out[i] = s
	}
	return out
}

// longestStall is the longest time after t0 without a piece of text in
// any stream, ending with the piece that broke it (the first token after
// the fault, for the fault's stall), and when that piece came. Requests
// still being prefilled count as silence: that is what a client sees.
func longestStall(results []streamResult, t0, end time.Time) (stall time.Duration, resumed time.Time) {
	var all []time.Time
	for _, r := range results {
		all = append(all, r.arrivals...)
	}
	slices.SortFunc(all, func(a, b time.Time) int { return a.Compare(b) })
	prev := t0
	for _, a := range all {
		if !a.After(t0) {
			continue
		}
		if gap := a.Sub(prev); gap > stall {
			stall, resumed = gap, a
		}
		prev = a
	}
	if gap := end.Sub(prev); gap > stall {
		// Silent to the end: not recovered.
		return gap, time.Time{}
	}
	return stall, resumed
}
