// Package scheduler admits generation requests and runs them through a
// pipeline with continuous batching: every forward pass carries the next
// token of each decoding sequence plus chunks of prompts still being
// prefilled, and sequences join and leave between passes.
package scheduler

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/node/text"
	"github.com/meshnode/meshnode/stage"
)

// Tokenizer is what the scheduler needs to turn tokens into text.
type Tokenizer interface {
	// Decode returns the bytes of tokens; a single token may be part of a
	// UTF-8 sequence.
	Decode(tokens []int32) (string, error)
	// IsEOG reports whether a token ends generation (EOS, end of turn).
	IsEOG(token int32) bool
}

// Pipeline runs batches through every layer of the model and samples each
// output row where the logits are: on the last stage. Only token ids come
// back. A local engine becomes a Pipeline with Local; a mesh provides one
// that spans several nodes.
type Pipeline interface {
	Info() stage.Info
	// Open starts a sequence whose tokens will be sampled with p, given
	// the prompt for repetition penalties.
	Open(seq stage.SeqID, p sample.Params, prompt []int32) error
	// Forward runs the batch and returns one sampled token per output row,
	// with the log-probabilities of the sequences opened asking for them.
	Forward(ctx context.Context, b *stage.Batch) (sample.Picked, error)
	Release(seq stage.SeqID) error
}

// Submitter is a Pipeline that can hold several batches in flight, each on
// a different stage: pipelining. Lanes is how many are worth keeping in
// flight (the number of stages); Submit sends a batch and returns a
// function that waits for its tokens.
type Submitter interface {
	Lanes() int
	Submit(ctx context.Context, b *stage.Batch) (wait func(context.Context) (sample.Picked, error), err error)
}

// Config sizes the scheduler.
type Config struct {
	Parallel    int // sequences generating at once; at most the pipeline's MaxSeqs
	BatchTokens int // most tokens in one forward pass
	QueueSize   int // requests waiting for a slot before new ones are refused
	// RecoverTimeout bounds how long a sequence whose pipeline broke waits
	// for a new one before its request fails; 0 means 30 s.
	RecoverTimeout time.Duration
	// MaxRecoveries bounds how often one sequence is replayed in a row
	// without producing a token; 0 means 3. A replay that makes progress
	// resets the count, so a long request survives a mesh that loses and
	// regains nodes over its life, while a pipeline that keeps failing
	// ends it.
	MaxRecoveries int
}

// Request is one generation.
type Request struct {
	ID        string
	Prompt    []int32
	MaxTokens int
	Stop      []string
	Sampling  sample.Params
}

// Event is one step of a generation; the last one has Done or Err set.
type Event struct {
	Text string
	// Logprobs are those of the tokens whose text this event (or an earlier
	// one) carries and that no event has listed yet, when the request asked
	// (Sampling.Logprobs). A token whose text a stop string cut off is
	// never listed.
	Logprobs         []TokenLogprob
	Done             bool
	FinishReason     string // "stop" or "length"
	PromptTokens     int
	CompletionTokens int
	Err              error
}

// TokenLogprob is a generated token's log-probability under the model
// (see sample.LogprobOf), with the likeliest alternatives, best first.
type TokenLogprob struct {
	Token   string // the token's bytes; may be part of a UTF-8 character
	Logprob float32
	Top     []TopLogprob
}

// TopLogprob is one of the likeliest tokens at a position.
type TopLogprob struct {
	Token   string
	Logprob float32
}

// Errors returned by Submit.
var (
	ErrOverloaded    = errors.New("too many requests waiting")
	ErrContextLength = errors.New("prompt does not fit the context")
	ErrClosed        = errors.New("scheduler stopped")
)

// Stats are counters for status and metrics.
type Stats struct {
	Active, Waiting  int
	PromptTokens     uint64
	GeneratedTokens  uint64
	Forwards         uint64
	ForwardSeconds   float64
	Requests, Failed uint64
	Replays          uint64 // sequences replayed after a pipeline broke
}

// Scheduler owns the pipeline: only its Run goroutine calls Forward.
type Scheduler struct {
	pipe Pipeline
	tok  Tokenizer
	cfg  Config
	log  *zap.Logger
	info stage.Info

	incoming chan *seq
	nextID   atomic.Uint64

	// Pipelining state, Run's alone.
	fillLane int       // the lane nextGroup tries first
	flights  []*flight // batches in flight, oldest first

	mu     sync.Mutex
	stats  Stats
	closed bool
	done   chan struct{}
}

// New makes a scheduler over a pipeline that covers all layers.
func New(pipe Pipeline, tok Tokenizer, cfg Config, log *zap.Logger) *Scheduler {
	info := pipe.Info()
	if cfg.Parallel <= 0 {
		cfg.Parallel = 4
	}
	if info.MaxSeqs > 0 {
		cfg.Parallel = min(cfg.Parallel, info.MaxSeqs)
	}
	if cfg.BatchTokens <= 0 {
		cfg.BatchTokens = 512
	}
	if cfg.QueueSize <= 0 {
		cfg.QueueSize = 64
	}
	if cfg.RecoverTimeout <= 0 {
		cfg.RecoverTimeout = 30 * time.Second
	}
	if cfg.MaxRecoveries <= 0 {
		cfg.MaxRecoveries = 3
	}
	if log == nil {
		log = zap.NewNop()
	}
	s := &Scheduler{
		pipe: pipe, tok: tok, cfg: cfg, log: log, info: info,
		incoming: make(chan *seq, cfg.QueueSize),
		done:     make(chan struct{}),
	}
	// Sequence ids are unique across the mesh: stages serve several entry
	// nodes at once.
	s.nextID.Store(rand.Uint64() >> 1)
	return s
}

// seq is one request in flight.
type seq struct {
	id     stage.SeqID
	req    Request
	ctx    context.Context
	events chan Event
	stream text.Stream
	stops  *text.StopMatcher

	tokens    []int32 // prompt then generated
	fed       int     // tokens already through the model
	generated int
	opened    bool

	// A sequence whose pipeline broke is replayed: reopened on the next
	// pipeline with its whole history as the prompt. waitUntil bounds the
	// wait for that pipeline (zero while none is awaited).
	waitUntil  time.Time
	recoveries int
	replayed   int // tokens re-fed by replays, not counted as prompt again

	lane int // micro-batch group when pipelining
	sent int // tokens past fed in batches still in flight

	logprobs []TokenLogprob // accepted tokens not yet listed in an event
}

// busy says whether the sequence is in a batch that is in flight.
func (q *seq) busy() bool { return q.sent > 0 }

// pending is the number of tokens to feed before the next token can be
// sampled: the prompt (or, after a replay, the whole history), then one.
func (q *seq) pending() int { return len(q.tokens) - q.fed }

func (q *seq) prefilling() bool { return q.pending() > 1 }

// Submit queues a request. The returned channel gets text pieces and a final
// event, then closes. Cancelling ctx abandons the request and frees its slot.
func (s *Scheduler) Submit(ctx context.Context, r Request) (<-chan Event, error) {
	if len(r.Prompt) == 0 {
		return nil, errors.New("empty prompt")
	}
	if len(r.Prompt) >= s.info.Context {
		return nil, fmt.Errorf("%w: prompt has %d tokens, context is %d", ErrContextLength, len(r.Prompt), s.info.Context)
	}
	for i, t := range r.Prompt {
		if t < 0 || int(t) >= s.info.Vocab {
			return nil, fmt.Errorf("prompt token %d at %d is outside the vocabulary of %d", t, i, s.info.Vocab)
		}
	}
	if err := r.Sampling.Validate(); err != nil {
		return nil, err
	}
	if r.Sampling.Seed == nil {
		// Fix the seed now: a generation replayed on a new pipeline after a
		// failure must draw the same tokens it would have drawn.
		seed := rand.Int64()
		r.Sampling.Seed = &seed
	}
	stops, err := text.NewStopMatcher(r.Stop)
	if err != nil {
		return nil, err
	}
	if r.MaxTokens <= 0 {
		r.MaxTokens = s.info.Context
	}
	// The channel holds every event the request can produce, so the
	// scheduler never blocks on a slow client.
	room := min(r.MaxTokens, s.info.Context-len(r.Prompt))
	q := &seq{
		id:     stage.SeqID(s.nextID.Add(1)),
		req:    r,
		ctx:    ctx,
		events: make(chan Event, room+4),
		stops:  stops,
		tokens: slices.Clone(r.Prompt),
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	select {
	case s.incoming <- q:
		s.stats.Requests++
		return q.events, nil
	default:
		return nil, fmt.Errorf("%w: %d queued", ErrOverloaded, s.cfg.QueueSize)
	}
}

// Stats returns a snapshot of the counters.
func (s *Scheduler) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats
}

// Run is the scheduling loop. It returns when ctx is cancelled, after failing
// every request still queued or active with ErrClosed.
func (s *Scheduler) Run(ctx context.Context) error {
	defer close(s.done)
	var waiting, active []*seq
	defer func() {
		// Refuse new requests first, so that none can slip in after the
		// drain below and wait forever.
		s.mu.Lock()
		s.closed = true
		s.mu.Unlock()
		for {
			select {
			case q := <-s.incoming:
				waiting = append(waiting, q)
				continue
			default:
			}
			break
		}
		s.drainFlights(ctx)
		for _, q := range append(waiting, active...) {
			s.finish(q, Event{Err: ErrClosed})
		}
	}()
	for {
		if len(waiting) == 0 && len(active) == 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case q := <-s.incoming:
				waiting = append(waiting, q)
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	drain:
		for {
			select {
			case q := <-s.incoming:
				waiting = append(waiting, q)
			default:
				break drain
			}
		}
		// Drop what clients abandoned, then admit into free slots.
		waiting = slices.DeleteFunc(waiting, func(q *seq) bool { return s.dropIfGone(q) })
		active = slices.DeleteFunc(active, func(q *seq) bool { return s.dropIfGone(q) })
		slotsFull := false
		for len(active) < s.cfg.Parallel && len(waiting) > 0 {
			q := waiting[0]
			sp := q.req.Sampling
			if sp.JSON {
				sp.JSONFrom = len(q.req.Prompt) // a replay resumes after what was generated
			}
			if err := s.pipe.Open(q.id, sp, q.tokens); err != nil {
				if errors.Is(err, stage.ErrNoSlot) {
					// Stages are shared by every entry node: wait for a
					// slot rather than fail.
					slotsFull = true
					break
				}
				// No pipeline right now (a replan is under way): wait for
				// one, within the recovery bound.
				now := time.Now()
				if q.waitUntil.IsZero() {
					q.waitUntil = now.Add(s.cfg.RecoverTimeout)
				}
				if now.Before(q.waitUntil) {
					slotsFull = true
					break
				}
				waiting = waiting[1:]
				s.finish(q, Event{Err: fmt.Errorf("no pipeline could be formed within %s: %w", s.cfg.RecoverTimeout, err)})
				continue
			}
			waiting = waiting[1:]
			q.opened = true
			q.waitUntil = time.Time{}
			q.lane = laneFor(active, s.lanes())
			active = append(active, q)
		}
		s.mu.Lock()
		s.stats.Active, s.stats.Waiting = len(active), len(waiting)
		s.mu.Unlock()
		if len(active) == 0 {
			if slotsFull {
				select {
				case <-ctx.Done():
				case <-time.After(20 * time.Millisecond):
				}
			}
			continue
		}
		var replay []*seq
		// Batches still in flight are awaited there, also when the
		// route has since shrunk to one stage.
		if sub, ok := s.pipe.(Submitter); ok && (sub.Lanes() > 1 || len(s.flights) > 0) {
			active, replay = s.stepPipelined(ctx, sub, active)
		} else {
			active, replay = s.step(ctx, active)
		}
		waiting = append(replay, waiting...)
		s.mu.Lock()
		s.stats.Active, s.stats.Waiting = len(active), len(waiting)
		s.mu.Unlock()
	}
}

func (s *Scheduler) dropIfGone(q *seq) bool {
	if q.ctx.Err() == nil || q.busy() {
		return false
	}
	s.finish(q, Event{Err: q.ctx.Err()})
	return true
}

// step runs one forward pass over the active sequences and returns those
// still generating, and those to replay on a new pipeline.
func (s *Scheduler) step(ctx context.Context, active []*seq) (next, replay []*seq) {
	b, take, outs := s.build(active, s.cfg.BatchTokens)
	if b.Rows() == 0 {
		return active, nil
	}
	start := time.Now()
	picked, err := s.pipe.Forward(ctx, b)
	s.count(time.Since(start))
	if err == nil {
		err = checkPicked(picked, len(outs))
	}
	if err != nil {
		return nil, s.replay(active, err)
	}
	return s.apply(active, take, outs, picked), nil
}

// checkPicked checks that a pipeline answered every output row.
func checkPicked(p sample.Picked, rows int) error {
	if len(p.Tokens) != rows {
		return fmt.Errorf("pipeline returned %d tokens for %d output rows", len(p.Tokens), rows)
	}
	if len(p.Logprobs) != 0 && len(p.Logprobs) != rows {
		return fmt.Errorf("pipeline returned %d log-probabilities for %d output rows", len(p.Logprobs), rows)
	}
	return nil
}

// build makes the next batch of a group of sequences: one token for each
// decoding sequence, prompt chunks for the others, within budget tokens.
// Every sequence of the group must have a token not yet sent. The tokens
// taken count as sent until apply.
func (s *Scheduler) build(group []*seq, budget int) (b *stage.Batch, take []int, outs []*seq) {
	ws := make([]want, len(group))
	for i, q := range group {
		if rest := q.unsent(); rest > 1 {
			ws[i] = want{prefill: rest}
		}
	}
	take = planBatch(ws, budget)
	b = &stage.Batch{}
	for i, q := range group {
		from := q.fed + q.sent
		for k := range take[i] {
			pos := from + k
			b.Seqs = append(b.Seqs, q.id)
			b.Pos = append(b.Pos, int32(pos))
			b.Tokens = append(b.Tokens, q.tokens[pos])
		}
		if take[i] > 0 && from+take[i] == len(q.tokens) {
			b.Outputs = append(b.Outputs, len(b.Seqs)-1)
			outs = append(outs, q)
		}
		q.sent += take[i]
	}
	return b, take, outs
}

// unsent is the tokens not yet in any batch.
func (q *seq) unsent() int { return len(q.tokens) - q.fed - q.sent }

func (s *Scheduler) count(elapsed time.Duration) {
	s.mu.Lock()
	s.stats.Forwards++
	s.stats.ForwardSeconds += elapsed.Seconds()
	s.mu.Unlock()
}

// replay handles a broken pipeline: every sequence is reopened on the next
// one with its history, so the client sees neither a gap nor a repeat.
func (s *Scheduler) replay(group []*seq, err error) (replay []*seq) {
	s.log.Warn("forward pass failed; replaying sequences on the next pipeline", zap.Error(err), zap.Int("sequences", len(group)))
	s.mu.Lock()
	s.stats.Replays += uint64(len(group))
	s.mu.Unlock()
	for _, q := range group {
		q.sent = 0
		if q.opened {
			s.pipe.Release(q.id) // best effort: the old pipeline may be gone
			q.opened = false
		}
		q.recoveries++
		if q.recoveries > s.cfg.MaxRecoveries {
			s.finish(q, Event{Err: fmt.Errorf("forward pass failed %d times: %w", q.recoveries, err)})
			continue
		}
		q.replayed += q.fed
		q.fed = 0
		replay = append(replay, q)
	}
	return replay
}

// apply takes a batch's results: positions advance, sampled tokens are
// streamed, finished sequences leave. It returns the group still active.
func (s *Scheduler) apply(group []*seq, take []int, outs []*seq, picked sample.Picked) []*seq {
	var prompt uint64
	for i, q := range group {
		if q.prefilling() {
			prompt += uint64(take[i])
		}
		q.fed += take[i]
		q.sent -= take[i]
	}
	s.mu.Lock()
	s.stats.PromptTokens += prompt
	s.mu.Unlock()
	finished := map[*seq]bool{}
	for r, q := range outs {
		var lp *sample.Logprob
		if len(picked.Logprobs) != 0 {
			lp = &picked.Logprobs[r]
		}
		if reason, done := s.accept(q, picked.Tokens[r], lp); done {
			s.complete(q, reason)
			finished[q] = true
		}
	}
	return slices.DeleteFunc(group, func(q *seq) bool { return finished[q] })
}

// flight is a batch in flight on a pipelined route.
type flight struct {
	lane  int
	group []*seq
	take  []int
	outs  []*seq
	wait  func(context.Context) (sample.Picked, error)
	start time.Time
}

// stepPipelined keeps a batch in flight per stage, each of a different lane
// (group of sequences), so that while one micro-batch is on stage 2 the
// next is on stage 1. It awaits only the oldest batch, and that lane's next
// batch goes in at once while the others are still on their stages: a
// decode step of S lanes through S stages takes S stage-times. (Submitting
// a batch per lane and then awaiting them all took 2S-1: the first lane
// idled while the last one finished.) On a single machine this changes
// little; across machines it is what lets throughput grow with the number
// of stages.
//
// A lane's prompt tokens go in chunks of BatchTokens/lanes, each its own
// batch: a stage may run a prompt's next chunk while the following stage
// runs the one before (the route keeps their order), so even a single long
// prompt keeps every stage busy.
//
// The batches stay in flight across calls, in s.flights; a failure waits
// them out and replays every sequence.
func (s *Scheduler) stepPipelined(ctx context.Context, sub Submitter, active []*seq) (next, replay []*seq) {
	lanes := max(sub.Lanes(), 1)
	chunk := max(s.cfg.BatchTokens/lanes, minPromptChunk)
	for len(s.flights) < lanes {
		lane, group := s.nextGroup(active, lanes)
		if len(group) == 0 {
			break
		}
		decoding := 0
		for _, q := range group {
			if q.unsent() == 1 {
				decoding++
			}
		}
		// Every decoding sequence's token goes in; prompts fill the rest.
		b, take, outs := s.build(group, max(chunk, decoding))
		if b.Rows() == 0 {
			break
		}
		wait, err := sub.Submit(ctx, b)
		if err != nil {
			s.drainFlights(ctx)
			return nil, s.replay(active, err)
		}
		s.flights = append(s.flights, &flight{lane: lane, group: group, take: take, outs: outs, wait: wait, start: time.Now()})
	}
	if len(s.flights) == 0 {
		return active, nil
	}
	f := s.flights[0]
	s.flights = s.flights[1:]
	picked, err := f.wait(ctx)
	s.count(time.Since(f.start))
	if err == nil {
		err = checkPicked(picked, len(f.outs))
	}
	if err != nil {
		s.drainFlights(ctx)
		var all []*seq
		for _, q := range active {
			if q.events != nil {
				all = append(all, q)
			}
		}
		return nil, s.replay(all, err)
	}
	s.apply(f.group, f.take, f.outs, picked)
	return slices.DeleteFunc(active, func(q *seq) bool { return q.events == nil }), nil
}

// lanes is how many lanes the pipeline keeps in flight (1 unpipelined).
func (s *Scheduler) lanes() int {
	if sub, ok := s.pipe.(Submitter); ok {
		return max(sub.Lanes(), 1)
	}
	return 1
}

// laneFor is the lane a new sequence joins: the one with the fewest active
// sequences, the lowest on ties, so that micro-batches stay even as
// sequences of different lengths come and go.
func laneFor(active []*seq, lanes int) int {
	count := make([]int, lanes)
	for _, q := range active {
		count[q.lane%lanes]++
	}
	return slices.Index(count, slices.Min(count))
}

// nextGroup picks the lane whose sequences go in next and returns those
// that have tokens to send. Lanes with nothing in flight come first, in
// turn; then a lane that is in flight but has prompt left to send, whose
// next chunk can follow the one before it down the route. It returns no
// group when no sequence has a token to send.
func (s *Scheduler) nextGroup(active []*seq, lanes int) (lane int, group []*seq) {
	busy := make([]bool, lanes)
	for _, f := range s.flights {
		busy[f.lane%lanes] = true
	}
	for _, wantIdle := range []bool{true, false} {
		for i := range lanes {
			lane = (s.fillLane + i) % lanes
			if busy[lane] == wantIdle {
				continue
			}
			group = nil
			for _, q := range active {
				if q.lane%lanes == lane && q.unsent() > 0 {
					group = append(group, q)
				}
			}
			if len(group) > 0 {
				s.fillLane = lane + 1
				return lane, group
			}
		}
	}
	return 0, nil
}

// drainFlights waits out every batch in flight, discarding the results:
// what they held is about to be replayed.
func (s *Scheduler) drainFlights(ctx context.Context) {
	for _, f := range s.flights {
		f.wait(ctx)
	}
	s.flights = nil
}

// accept appends a sampled token (with its log-probability, when the
// request asked for them), streams its text, and says whether the sequence
// is done and why.
func (s *Scheduler) accept(q *seq, tok int32, lp *sample.Logprob) (string, bool) {
	s.mu.Lock()
	s.stats.GeneratedTokens++
	s.mu.Unlock()
	if s.tok.IsEOG(tok) {
		return "stop", true
	}
	q.tokens = append(q.tokens, tok)
	q.generated++
	q.recoveries = 0 // progress: the next failure is a new one
	piece, err := s.tok.Decode([]int32{tok})
	if err != nil {
		s.finish(q, Event{Err: fmt.Errorf("decoding token %d: %w", tok, err)})
		return "", true
	}
	if q.req.Sampling.Logprobs {
		if lp == nil {
			s.finish(q, Event{Err: fmt.Errorf("the pipeline sent token %d without the log-probability asked for", tok)})
			return "", true
		}
		tl, err := s.tokenLogprob(piece, lp)
		if err != nil {
			s.finish(q, Event{Err: err})
			return "", true
		}
		q.logprobs = append(q.logprobs, tl)
	}
	if s.emit(q, q.stream.Push(piece)) {
		return "stop", true
	}
	switch {
	case q.generated >= q.req.MaxTokens:
		return "length", true
	case len(q.tokens) >= s.info.Context:
		return "length", true
	}
	return "", false
}

// tokenLogprob spells out a token's log-probability and its alternatives.
func (s *Scheduler) tokenLogprob(piece string, lp *sample.Logprob) (TokenLogprob, error) {
	tl := TokenLogprob{Token: piece, Logprob: lp.Logprob, Top: make([]TopLogprob, len(lp.Top))}
	for i, c := range lp.Top {
		text, err := s.tok.Decode([]int32{c.Token})
		if err != nil {
			return tl, fmt.Errorf("decoding alternative token %d: %w", c.Token, err)
		}
		tl.Top[i] = TopLogprob{Token: text, Logprob: c.Logprob}
	}
	return tl, nil
}

// emit passes text through the stop matcher and sends what may be shown,
// with the log-probabilities of the tokens accepted since the last event;
// it reports whether a stop string was hit.
func (s *Scheduler) emit(q *seq, piece string) bool {
	if piece == "" {
		return false
	}
	out, stopped := q.stops.Push(piece)
	if out != "" {
		q.events <- Event{Text: out, Logprobs: q.takeLogprobs()}
	}
	return stopped
}

// takeLogprobs hands over the log-probabilities not yet sent.
func (q *seq) takeLogprobs() []TokenLogprob {
	lps := q.logprobs
	q.logprobs = nil
	return lps
}

func (s *Scheduler) complete(q *seq, reason string) {
	if q.events == nil {
		return // already failed
	}
	if reason != "stop" || !q.stops.Stopped() {
		if s.emit(q, q.stream.Flush()) {
			reason = "stop"
		}
		if rest := q.stops.Flush(); rest != "" {
			q.events <- Event{Text: rest, Logprobs: q.takeLogprobs()}
		}
	}
	done := Event{Done: true, FinishReason: reason}
	if !q.stops.Stopped() {
		// Tokens of no text (or text still held) are listed last; those a
		// stop string cut off are not.
		done.Logprobs = q.takeLogprobs()
	}
	s.finish(q, done)
}

// finish sends the final event, closes the channel and frees the slot.
func (s *Scheduler) finish(q *seq, ev Event) {
	if q.events == nil {
		return
	}
	if q.opened {
		if err := s.pipe.Release(q.id); err != nil {
			s.log.Warn("releasing sequence", zap.Uint64("seq", uint64(q.id)), zap.Error(err))
		}
		q.opened = false
	}
	if ev.Err != nil && !errors.Is(ev.Err, context.Canceled) {
		s.mu.Lock()
		s.stats.Failed++
		s.mu.Unlock()
	}
	ev.PromptTokens = len(q.req.Prompt)
	ev.CompletionTokens = q.generated
	q.events <- ev
	close(q.events)
	q.events = nil
}
