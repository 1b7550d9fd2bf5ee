package openai

import (
	"context"
	"math"
	"sync"
)

// fakeBackend serves scripted models.
type fakeBackend struct {
	models []*fakeModel
}

func newFake(models ...*fakeModel) *fakeBackend { return &fakeBackend{models: models} }

func (b *fakeBackend) Models() []ModelInfo {
	out := make([]ModelInfo, len(b.models))
	for i, m := range b.models {
		out[i] = m.info
	}
	return out
}

func (b *fakeBackend) Model(id string) (Model, bool) {
	for _, m := range b.models {
		if m.info.ID == id {
			return m, true
		}
	}
	return nil, false
}

// fakeModel emits pieces, then a final event (or midErr). Prompts are
// "tokenized" one token per byte so that counts are easy to predict.
type fakeModel struct {
	info      ModelInfo
	pieces    []string
	finish    string // final finish_reason; "" leaves it to the server
	genErr    error  // returned by Generate
	promptErr error  // returned by ChatPrompt and Prompt
	midErr    error  // sent after the pieces instead of the final event
	block     bool   // after the pieces, wait for ctx to end
	endless   bool   // repeat pieces until ctx ends
	panicking bool   // ChatPrompt panics
	noFinal   bool   // close the channel without a final event
	bareFinal bool   // final event without reason or usage

	mu       sync.Mutex
	reqs     []GenerateRequest
	msgs     [][]Message
	texts    []string
	started  chan struct{} // closed when a blocking generation waits
	canceled chan struct{} // closed when a generation saw ctx end
	once     sync.Once
	sonce    sync.Once
}

func newModel(id string, pieces ...string) *fakeModel {
	return &fakeModel{
		info:     ModelInfo{ID: id, Created: 1700000000, OwnedBy: "tester"},
		pieces:   pieces,
		finish:   "stop",
		started:  make(chan struct{}),
		canceled: make(chan struct{}),
	}
}

func (m *fakeModel) Info() ModelInfo { return m.info }

func bytesToTokens(s string) []int32 {
	out := make([]int32, len(s))
	for i := range len(s) {
		out[i] = int32(s[i])
	}
	return out
}

func (m *fakeModel) ChatPrompt(msgs []Message) ([]int32, error) {
	if m.panicking {
		panic("template exploded")
	}
	if m.promptErr != nil {
		return nil, m.promptErr
	}
	m.mu.Lock()
	m.msgs = append(m.msgs, msgs)
	m.mu.Unlock()
	var s string
	for _, msg := range msgs {
		s += msg.Role + ":" + msg.Content + "\n"
	}
	return bytesToTokens(s), nil
}

func (m *fakeModel) Prompt(s string) ([]int32, error) {
	if m.promptErr != nil {
		return nil, m.promptErr
	}
	m.mu.Lock()
	m.texts = append(m.texts, s)
	m.mu.Unlock()
	return append([]int32{1}, bytesToTokens(s)...), nil
}

func (m *fakeModel) lastReq() GenerateRequest {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.reqs) == 0 {
		return GenerateRequest{}
	}
	return m.reqs[len(m.reqs)-1]
}

func (m *fakeModel) lastMsgs() []Message {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.msgs) == 0 {
		return nil
	}
	return m.msgs[len(m.msgs)-1]
}

func (m *fakeModel) Generate(ctx context.Context, req GenerateRequest) (<-chan Event, error) {
	m.mu.Lock()
	m.reqs = append(m.reqs, req)
	m.mu.Unlock()
	if m.genErr != nil {
		return nil, m.genErr
	}
	ch := make(chan Event) // unbuffered: the server must keep reading
	go func() {
		defer close(ch)
		send := func(ev Event) bool {
			select {
			case ch <- ev:
				return true
			case <-ctx.Done():
				m.once.Do(func() { close(m.canceled) })
				return false
			}
		}
		for first := true; first || m.endless; first = false {
			for i, p := range m.pieces {
				ev := Event{Text: p}
				if req.Logprobs {
					ev.Logprobs = fakeLogprobs(i, p, req.TopLogprobs)
				}
				if !send(ev) {
					return
				}
			}
		}
		if m.block {
			m.sonce.Do(func() { close(m.started) })
			<-ctx.Done()
			m.once.Do(func() { close(m.canceled) })
			return
		}
		if m.midErr != nil {
			send(Event{Err: m.midErr})
			return
		}
		if m.noFinal {
			return
		}
		if m.bareFinal {
			send(Event{Done: true})
			return
		}
		send(Event{Done: true, FinishReason: m.finish, Usage: Usage{
			PromptTokens:     len(req.Prompt),
			CompletionTokens: len(m.pieces),
			TotalTokens:      len(req.Prompt) + len(m.pieces),
		}})
	}()
	return ch, nil
}

// fakeLogprobs is piece i's one token: log-probability -(i+1)/4, and the
// piece itself and "?" (impossible) as alternatives, cut to top.
func fakeLogprobs(i int, piece string, top int) []TokenLogprob {
	lp := TokenLogprob{Token: piece, Logprob: -float32(i+1) / 4}
	alts := []TopLogprob{{Token: piece, Logprob: lp.Logprob}, {Token: "?", Logprob: float32(math.Inf(-1))}}
	lp.Top = alts[:min(top, len(alts))]
	return []TokenLogprob{lp}
}
