package scheduler

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

const storiesPath = "../../../shared/models/stories260K.gguf"

func TestPlanBatch(t *testing.T) {
	tests := []struct {
		name   string
		ws     []want
		budget int
		want   []int
	}{
		{"decode only", []want{{0}, {0}, {0}}, 8, []int{1, 1, 1}},
		{"decode before prefill", []want{{100}, {0}}, 10, []int{9, 1}},
		{"prefill in arrival order", []want{{5}, {5}, {5}}, 8, []int{5, 3, 0}},
		{"budget smaller than decoders", []want{{0}, {0}, {0}}, 2, []int{1, 1, 0}},
		{"mixed", []want{{0}, {600}, {0}, {20}}, 512, []int{1, 510, 1, 0}},
		{"empty", nil, 512, []int{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := planBatch(tc.ws, tc.budget)
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
			sum := 0
			for _, n := range got {
				sum += n
			}
			if sum > tc.budget {
				t.Fatalf("over budget: %d > %d", sum, tc.budget)
			}
		})
	}
}

type fixture struct {
	eng   *ggufstage.Engine
	tok   *ggufstage.Tokenizer
	sched *Scheduler
	stop  func()
}

// openStories opens the whole stories260K model for maxSeqs sequences,
// and its tokenizer; the caller closes the engine.
func openStories(t *testing.T, maxSeqs int) (*ggufstage.Engine, *ggufstage.Tokenizer) {
	t.Helper()
	eng, err := ggufstage.Open(storiesPath, 0, 5, ggufstage.Options{Threads: 1, MaxSeqs: maxSeqs, Context: 512})
	if err != nil {
		t.Fatal(err)
	}
	tok, err := ggufstage.LoadTokenizer(storiesPath)
	if err != nil {
		eng.Close()
		t.Fatal(err)
	}
	return eng, tok
}

func newFixture(t *testing.T, cfg Config) *fixture {
	t.Helper()
	eng, tok := openStories(t, 8)
	s := New(Local(eng, nil), tok, cfg, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx); close(done) }()
	f := &fixture{eng: eng, tok: tok, sched: s}
	f.stop = func() { cancel(); <-done; eng.Close() }
	t.Cleanup(f.stop)
	return f
}

func greedy() sample.Params {
	p := sample.DefaultParams()
	p.Temperature = 0
	return p
}

func collect(t *testing.T, ch <-chan Event) (string, Event) {
	t.Helper()
	var b strings.Builder
	timeout := time.After(60 * time.Second)
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				t.Fatal("channel closed without a final event")
			}
			b.WriteString(ev.Text)
			if ev.Done || ev.Err != nil {
				return b.String(), ev
			}
		case <-timeout:
			t.Fatal("generation timed out")
		}
	}
}

// reference generates greedily by calling the engine directly, one token
// per pass: what the scheduler must reproduce.
func reference(t *testing.T, f *fixture, prompt []int32, n int) string {
	t.Helper()
	st, err := ggufstage.OpenStock(storiesPath, ggufstage.Options{Threads: 1, MaxSeqs: 1, Context: 512})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	b := stage.Batch{Outputs: []int{len(prompt) - 1}}
	for i, tok := range prompt {
		b.Seqs, b.Pos, b.Tokens = append(b.Seqs, 9), append(b.Pos, int32(i)), append(b.Tokens, tok)
	}
	var out []int32
	for i := range n {
		logits, err := st.Forward(&b)
		if err != nil {
			t.Fatal(err)
		}
		next := stagetest.Argmax(logits)
		if f.tok.IsEOG(next) {
			break
		}
		out = append(out, next)
		b = stage.Batch{Seqs: []stage.SeqID{9}, Pos: []int32{int32(len(prompt) + i)}, Tokens: []int32{next}, Outputs: []int{0}}
	}
	s, err := f.tok.Decode(out)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestGreedyMatchesOllama(t *testing.T) {
	f := newFixture(t, Config{Parallel: 4})
	prompt, err := f.tok.Encode("Once upon a time", true)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := f.sched.Submit(context.Background(), Request{Prompt: prompt, MaxTokens: 48, Sampling: greedy()})
	if err != nil {
		t.Fatal(err)
	}
	got, last := collect(t, ch)
	want := reference(t, f, prompt, 48)
	if got != want {
		t.Fatalf("scheduler text differs from ollama's greedy run:\n got %q\nwant %q", got, want)
	}
	if last.FinishReason != "length" || last.CompletionTokens != 48 || last.PromptTokens != len(prompt) {
		t.Fatalf("final event %+v", last)
	}
	// stories260K writes English: most of what it says is made of letters and spaces.
	letters := 0
	for _, r := range got {
		if r == ' ' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || r == '.' || r == ',' {
			letters++
		}
	}
	if letters < len(got)*9/10 || len(strings.Fields(got)) < 10 {
		t.Fatalf("not English-like: %q", got)
	}
	t.Logf("stories260K: %q", got)
}

func TestConcurrentRequestsBatch(t *testing.T) {
	f := newFixture(t, Config{Parallel: 8})
	prompts := []string{"Once upon a time", "The little dog", "Lily and Tom", "One day, a bird", "The sun was", "Max liked to", "A big red ball", "Sam was sad"}
	want := make([]string, len(prompts))
	toks := make([][]int32, len(prompts))
	for i, p := range prompts {
		toks[i], _ = f.tok.Encode(p, true)
		want[i] = reference(t, f, toks[i], 24)
	}
	var wg sync.WaitGroup
	got := make([]string, len(prompts))
	for i := range prompts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ch, err := f.sched.Submit(context.Background(), Request{Prompt: toks[i], MaxTokens: 24, Sampling: greedy()})
			if err != nil {
				t.Error(err)
				return
			}
			got[i], _ = collect(t, ch)
		}()
	}
	wg.Wait()
	for i := range prompts {
		if got[i] != want[i] {
			t.Errorf("%q: batched %q, alone %q", prompts[i], got[i], want[i])
		}
	}
	if st := f.sched.Stats(); st.Forwards >= uint64(8*24) {
		t.Errorf("%d forward passes for 8×24 tokens: requests were not batched", st.Forwards)
	}
}

func TestStopStringAndCancel(t *testing.T) {
	f := newFixture(t, Config{Parallel: 1, QueueSize: 1})
	prompt, _ := f.tok.Encode("Once upon a time", true)
	full := reference(t, f, prompt, 40)
	words := strings.Fields(full)
	stop := " " + words[4]
	ch, err := f.sched.Submit(context.Background(), Request{Prompt: prompt, MaxTokens: 40, Stop: []string{stop}, Sampling: greedy()})
	if err != nil {
		t.Fatal(err)
	}
	got, last := collect(t, ch)
	if want, _, _ := strings.Cut(full, stop); got != want || last.FinishReason != "stop" {
		t.Fatalf("stop %q: got %q (%s), want %q", stop, got, last.FinishReason, want)
	}

	// A cancelled request frees its slot: with one slot, the next request
	// must still run.
	ctx, cancel := context.WithCancel(context.Background())
	ch, err = f.sched.Submit(ctx, Request{Prompt: prompt, MaxTokens: 400, Sampling: greedy()})
	if err != nil {
		t.Fatal(err)
	}
	<-ch
	cancel()
	for ev := range ch {
		if ev.Done {
			t.Fatal("cancelled request completed")
		}
	}
	ch, err = f.sched.Submit(context.Background(), Request{Prompt: prompt, MaxTokens: 5, Sampling: greedy()})
	if err != nil {
		t.Fatal(err)
	}
	if _, last := collect(t, ch); !last.Done {
		t.Fatalf("after cancel: %+v", last)
	}
}

func TestOverloadAndContext(t *testing.T) {
	f := newFixture(t, Config{Parallel: 1, QueueSize: 1})
	prompt, _ := f.tok.Encode("Once upon a time", true)
	long := make([]int32, 600)
	if _, err := f.sched.Submit(context.Background(), Request{Prompt: long, Sampling: greedy()}); !errors.Is(err, ErrContextLength) {
		t.Fatalf("over-long prompt: %v", err)
	}
	var chans []<-chan Event
	var overloaded bool
	for range 10 {
		ch, err := f.sched.Submit(context.Background(), Request{Prompt: prompt, MaxTokens: 200, Sampling: greedy()})
		if errors.Is(err, ErrOverloaded) {
			overloaded = true
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		chans = append(chans, ch)
	}
	if !overloaded {
		t.Fatal("queue never filled")
	}
	for _, ch := range chans {
		collect(t, ch)
	}
}

// flaky breaks like a mesh pipeline whose stage dies: one forward pass
// fails, then Open is refused for a while (the replan), then all is well.
type flaky struct {
	Pipeline
	mu         sync.Mutex
	calls      int
	failAt     int
	refuseOpen int
}

func (f *flaky) Forward(ctx context.Context, b *stage.Batch) (sample.Picked, error) {
	f.mu.Lock()
	f.calls++
	fail := f.calls == f.failAt
	f.mu.Unlock()
	if fail {
		return sample.Picked{}, errors.New("hop 1: connection reset")
	}
	return f.Pipeline.Forward(ctx, b)
}

func (f *flaky) Open(seq stage.SeqID, p sample.Params, prompt []int32) error {
	f.mu.Lock()
	broken := f.calls >= f.failAt && f.refuseOpen > 0
	if broken {
		f.refuseOpen--
	}
	f.mu.Unlock()
	if broken {
		return errors.New("the mesh has no complete pipeline yet")
	}
	return f.Pipeline.Open(seq, p, prompt)
}

// TestReplayAfterPipelineFailure: a pipeline failure mid-generation is
// invisible to the client: the same text as an uninterrupted run, greedy
// and seeded, also with JSON output, whose constraint resumes after what
// was generated.
func TestReplayAfterPipelineFailure(t *testing.T) {
	seed := int64(7)
	sampled := sample.DefaultParams()
	sampled.Seed = &seed
	withJSON := func(p sample.Params) sample.Params { p.JSON = true; return p }
	for _, tc := range []struct {
		name   string
		params sample.Params
	}{{"greedy", greedy()}, {"seeded", sampled}, {"greedy JSON", withJSON(greedy())}, {"seeded JSON", withJSON(sampled)}} {
		t.Run(tc.name, func(t *testing.T) {
			run := func(failAt int) (string, Event, Stats) {
				eng, tok := openStories(t, 4)
				defer eng.Close()
				pipe := &flaky{Pipeline: Local(eng, storiesVocab(t, tok)), failAt: failAt, refuseOpen: 5}
				s := New(pipe, tok, Config{Parallel: 2, RecoverTimeout: 10 * time.Second}, nil)
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan struct{})
				go func() { s.Run(ctx); close(done) }()
				defer func() { cancel(); <-done }()
				prompt, _ := tok.Encode("Once upon a time", true)
				ch, err := s.Submit(context.Background(), Request{Prompt: prompt, MaxTokens: 40, Sampling: tc.params})
				if err != nil {
					t.Fatal(err)
				}
				text, last := collect(t, ch)
				if !last.Done {
					t.Fatalf("final event %+v", last)
				}
				return text, last, s.Stats()
			}
			want, wantLast, _ := run(-1)
			if !tc.params.JSON && wantLast.CompletionTokens != 40 {
				t.Fatalf("final event %+v", wantLast)
			}
			if j := sample.NewJSON(); tc.params.JSON && !j.Feed([]byte(want)) {
				t.Fatalf("JSON output %q is not an object's prefix", want)
			}
			for _, at := range []int{2, 10, 30} {
				got, last, st := run(at)
				if got != want || last.CompletionTokens != wantLast.CompletionTokens {
					t.Errorf("failure at pass %d:\n got %q (%d tokens)\nwant %q (%d)", at, got, last.CompletionTokens, want, wantLast.CompletionTokens)
				}
				if st.Replays != 1 {
					t.Errorf("failure at pass %d: %d replays, want 1", at, st.Replays)
				}
			}
		})
	}
}

// failing fails the forward passes that fails picks (by 1-based call).
type failing struct {
	Pipeline
	mu    sync.Mutex
	calls int
	fails func(call int) bool
}

func (f *failing) Forward(ctx context.Context, b *stage.Batch) (sample.Picked, error) {
	f.mu.Lock()
	f.calls++
	fail := f.fails(f.calls)
	f.mu.Unlock()
	if fail {
		return sample.Picked{}, errors.New("hop 1: connection reset")
	}
	return f.Pipeline.Forward(ctx, b)
}

// TestRecoveriesBoundFailuresWithoutProgress: MaxRecoveries counts
// failures in a row, not over a request's life. A pipeline that breaks
// again and again, with tokens produced in between, still gives the
// uninterrupted text; one that never gets a token through ends the request
// with an error after MaxRecoveries replays.
func TestRecoveriesBoundFailuresWithoutProgress(t *testing.T) {
	tests := []struct {
		name    string
		fails   func(call int) bool
		wantErr bool
		replays uint64
	}{
		{"five failures with progress between", func(c int) bool { return c%5 == 3 && c < 28 }, false, 5},
		{"every pass fails from the 4th", func(c int) bool { return c >= 4 }, true, 4},
	}
	run := func(fails func(int) bool) (string, Event, Stats) {
		eng, tok := openStories(t, 4)
		defer eng.Close()
		s := New(&failing{Pipeline: Local(eng, nil), fails: fails}, tok, Config{Parallel: 2, RecoverTimeout: 5 * time.Second, MaxRecoveries: 3}, nil)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { s.Run(ctx); close(done) }()
		defer func() { cancel(); <-done }()
		prompt, _ := tok.Encode("Once upon a time", true)
		ch, err := s.Submit(context.Background(), Request{Prompt: prompt, MaxTokens: 24, Sampling: greedy()})
		if err != nil {
			t.Fatal(err)
		}
		text, last := collect(t, ch)
		return text, last, s.Stats()
	}
	want, _, _ := run(func(int) bool { return false })
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, last, st := run(tt.fails)
			if st.Replays != tt.replays {
				t.Errorf("%d replays, want %d", st.Replays, tt.replays)
			}
			if tt.wantErr {
				if last.Err == nil {
					t.Fatalf("the request succeeded (%q) on a pipeline that never works", got)
				}
				return
			}
			if last.Err != nil || !last.Done {
				t.Fatalf("final event %+v", last)
			}
			if got != want {
				t.Errorf("got %q\nwant %q", got, want)
			}
		})
	}
}

// lanes makes a local pipeline look like a route of n stages that takes
// batches without waiting for them; results come back in order.
type lanes struct {
	Pipeline
	n         int
	mu        sync.Mutex
	submitted int
	failAt    int
	log       []string // "submit <rows>" and "wait" in the order they happened
}

func (l *lanes) record(e string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.log = append(l.log, e)
}

func (l *lanes) Lanes() int { return l.n }

func (l *lanes) Submit(ctx context.Context, b *stage.Batch) (func(context.Context) (sample.Picked, error), error) {
	l.mu.Lock()
	l.submitted++
	fail := l.submitted == l.failAt
	l.mu.Unlock()
	if fail {
		return func(context.Context) (sample.Picked, error) { return sample.Picked{}, errors.New("hop 2 stalled") }, nil
	}
	l.record(fmt.Sprintf("submit %d", b.Rows()))
	picked, err := l.Pipeline.Forward(ctx, b)
	return func(context.Context) (sample.Picked, error) { l.record("wait"); return picked, err }, nil
}

const longPrompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. " +
	"One day, she saw a big red ball under a tree. She ran to the ball and picked it up. Her friend Tom came to play with her. " +
	"They threw the ball high in the sky and laughed. Then the sun went down and they went home to eat dinner with mom and dad."

// TestPipelinedPromptChunks: a single long prompt on a route of two stages
// goes in chunks of BatchTokens/2, several in flight before the first
// result is awaited, and generates the text it generates unpipelined.
func TestPipelinedPromptChunks(t *testing.T) {
	eng, tok := openStories(t, 2)
	defer eng.Close()
	ids, _ := tok.Encode(longPrompt, true)
	if len(ids) < 100 {
		t.Fatalf("the long prompt is %d tokens; the test needs over 100", len(ids))
	}
	generate := func(p Pipeline) string {
		s := New(p, tok, Config{Parallel: 1, BatchTokens: 64}, nil)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { s.Run(ctx); close(done) }()
		defer func() { cancel(); <-done }()
		ch, err := s.Submit(context.Background(), Request{Prompt: ids, MaxTokens: 16, Sampling: greedy()})
		if err != nil {
			t.Fatal(err)
		}
		text, _ := collect(t, ch)
		return text
	}
	want := generate(Local(eng, nil))
	l := &lanes{Pipeline: Local(eng, nil), n: 2}
	if got := generate(l); got != want {
		t.Errorf("pipelined: %q, unpipelined %q", got, want)
	}
	// Two chunks of 32 go in before the first is awaited, and the next
	// follows each result at once.
	wantLog := []string{"submit 32", "submit 32", "wait", "submit 32", "wait"}
	if len(l.log) < len(wantLog) || !slices.Equal(l.log[:len(wantLog)], wantLog) {
		t.Errorf("pipeline saw %v, want it to start %v", l.log, wantLog)
	}
	prompt := 0
	for _, e := range l.log {
		var n int
		if _, err := fmt.Sscanf(e, "submit %d", &n); err == nil && n > 1 {
			prompt += n
			if n > 32 {
				t.Errorf("a prompt chunk of %d rows, want at most 32", n)
			}
		}
	}
	if prompt < len(ids)-1 {
		t.Errorf("prompt chunks carried %d rows, want the %d-token prompt", prompt, len(ids))
	}
}

// TestPipelinedMatchesSequential: with batches split into lanes that are in
// flight at once, every request still gets exactly its sequential text,
// also through a failure in the middle.
func TestPipelinedMatchesSequential(t *testing.T) {
	prompts := []string{"Once upon a time", "The little dog", "Lily and Tom", "One day, a bird", "The sun was", "Max liked to", longPrompt}
	run := func(pipe func(Pipeline) Pipeline) ([]string, Stats) {
		eng, tok := openStories(t, 8)
		defer eng.Close()
		// A small batch budget, so that the long prompt goes in chunks.
		s := New(pipe(Local(eng, nil)), tok, Config{Parallel: 8, BatchTokens: 96}, nil)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { s.Run(ctx); close(done) }()
		defer func() { cancel(); <-done }()
		out := make([]string, len(prompts))
		var wg sync.WaitGroup
		for i, p := range prompts {
			ids, _ := tok.Encode(p, true)
			ch, err := s.Submit(context.Background(), Request{Prompt: ids, MaxTokens: 24, Sampling: greedy()})
			if err != nil {
				t.Fatal(err)
			}
			wg.Add(1)
			go func() { defer wg.Done(); out[i], _ = collect(t, ch) }()
		}
		wg.Wait()
		return out, s.Stats()
	}
	want, _ := run(func(p Pipeline) Pipeline { return p })
	for _, tc := range []struct {
		name   string
		n      int
		failAt int
	}{{"3 lanes", 3, 0}, {"2 lanes, failure", 2, 7}} {
		got, st := run(func(p Pipeline) Pipeline { return &lanes{Pipeline: p, n: tc.n, failAt: tc.failAt} })
		for i := range prompts {
			if got[i] != want[i] {
				t.Errorf("%s: %q: %q, sequential %q", tc.name, prompts[i], got[i], want[i])
			}
		}
		if tc.failAt > 0 && st.Replays == 0 {
			t.Errorf("%s: no replay after the failure", tc.name)
		}
	}
}

// TestPipelinedKeepsStagesBusy: on a route of two stages, when the oldest
// batch's tokens come back its lane's next batch goes in before the other
// lane's batch is awaited, so that both stages always hold a batch.
// Submitting a batch per lane and then awaiting both left one idle.
func TestPipelinedKeepsStagesBusy(t *testing.T) {
	eng, tok := openStories(t, 8)
	defer eng.Close()
	l := &lanes{Pipeline: Local(eng, nil), n: 2}
	s := New(l, tok, Config{Parallel: 8, BatchTokens: 96}, nil)
	// Every request is queued before Run starts, so that both lanes fill
	// from the first step.
	var chans []<-chan Event
	for _, p := range []string{"Once upon a time", "The little dog", "Lily and Tom", "One day, a bird", "The sun was", "Max liked to", "Tom had a", "A big cat"} {
		ids, _ := tok.Encode(p, true)
		ch, err := s.Submit(context.Background(), Request{Prompt: ids, MaxTokens: 24, Sampling: greedy()})
		if err != nil {
			t.Fatal(err)
		}
		chans = append(chans, ch)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	for _, ch := range chans {
		collect(t, ch)
	}
	l.mu.Lock()
	log := slices.Clone(l.log)
	l.mu.Unlock()
	var inFlight, waits int
	var before []int // batches in flight as each wait began
	for _, e := range log {
		if e == "wait" {
			before = append(before, inFlight)
			inFlight--
			waits++
		} else {
			inFlight++
		}
	}
	if waits < 20 {
		t.Fatalf("only %d batches: %v", waits, log)
	}
	// Sequences finish at different steps near the end; until half way
	// every lane is generating.
	for i, n := range before[:waits/2] {
		if n != 2 {
			t.Fatalf("wait %d began with %d batches in flight, want 2 (one per stage); pipeline saw %v", i, n, log[:min(len(log), 40)])
		}
	}
}

// TestLaneFor: a new sequence joins the lane with the fewest, so lanes
// stay even when sequences of one lane finish first.
func TestLaneFor(t *testing.T) {
	seqs := func(lanes ...int) []*seq {
		var out []*seq
		for _, l := range lanes {
			out = append(out, &seq{lane: l})
		}
		return out
	}
	tests := []struct {
		name   string
		active []*seq
		lanes  int
		want   int
	}{
		{"none yet", nil, 2, 0},
		{"round robin from even", seqs(0), 2, 1},
		{"fill the emptied lane", seqs(0, 0, 0, 1), 2, 1},
		{"lane 0 emptied", seqs(1, 1, 1), 2, 0},
		{"three lanes, the middle short", seqs(0, 0, 1, 2, 2), 3, 1},
		{"route shrank to one stage", seqs(0, 1, 2), 1, 0},
		{"lanes of a longer route fold", seqs(0, 2, 3), 2, 1}, // 2 and 0 share lane 0
	}
	for _, tt := range tests {
		if got := laneFor(tt.active, tt.lanes); got != tt.want {
			t.Errorf("%s: lane %d, want %d", tt.name, got, tt.want)
		}
	}
}
