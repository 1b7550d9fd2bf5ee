package openai

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// TestLogprobs checks the two shapes OpenAI gives log-probabilities: chat's
// per-token objects and the completions arrays, whole and streamed. The
// fake model lists one token per piece (fakeLogprobs).
func TestLogprobs(t *testing.T) {
	const chatMsgs = `"messages":[{"role":"user","content":"hi"}]`
	chatToken := func(tok string, lp float64, top string) string {
		b, _ := json.Marshal(bytesJSON(tok))
		return `{"token":"` + tok + `","logprob":` + fmtFloat(lp) + `,"bytes":` + string(b) + `,"top_logprobs":[` + top + `]}`
	}
	tests := []struct {
		name   string
		path   string
		body   string
		stream bool
		// want is the logprobs of each choice that carries text, in order.
		want []string
	}{
		{"chat, no logprobs", "/v1/chat/completions", `{"model":"m",` + chatMsgs + `}`, false,
			[]string{`null`}},
		{"chat, logprobs only", "/v1/chat/completions", `{"model":"m","logprobs":true,` + chatMsgs + `}`, false,
			[]string{`{"content":[` + chatToken("Hé", -0.25, "") + `,` + chatToken(" yo", -0.5, "") + `],"refusal":null}`}},
		{"chat, two alternatives, -Inf as -9999", "/v1/chat/completions", `{"model":"m","logprobs":true,"top_logprobs":2,` + chatMsgs + `}`, false,
			[]string{`{"content":[` +
				chatToken("Hé", -0.25, `{"token":"Hé","logprob":-0.25,"bytes":[72,195,169]},{"token":"?","logprob":-9999,"bytes":[63]}`) + `,` +
				chatToken(" yo", -0.5, `{"token":" yo","logprob":-0.5,"bytes":[32,121,111]},{"token":"?","logprob":-9999,"bytes":[63]}`) +
				`],"refusal":null}`}},
		{"chat stream", "/v1/chat/completions", `{"model":"m","stream":true,"logprobs":true,"top_logprobs":1,` + chatMsgs + `}`, true,
			[]string{
				`{"content":[` + chatToken("Hé", -0.25, `{"token":"Hé","logprob":-0.25,"bytes":[72,195,169]}`) + `],"refusal":null}`,
				`{"content":[` + chatToken(" yo", -0.5, `{"token":" yo","logprob":-0.5,"bytes":[32,121,111]}`) + `],"refusal":null}`,
			}},
		{"completion, no logprobs", "/v1/completions", `{"model":"m","prompt":"p"}`, false,
			[]string{`null`}},
		{"completion, logprobs 0", "/v1/completions", `{"model":"m","prompt":"p","logprobs":0}`, false,
			[]string{`{"tokens":["Hé"," yo"],"token_logprobs":[-0.25,-0.5],"top_logprobs":[{},{}],"text_offset":[0,2]}`}},
		{"completion, logprobs 2", "/v1/completions", `{"model":"m","prompt":"p","logprobs":2}`, false,
			[]string{`{"tokens":["Hé"," yo"],"token_logprobs":[-0.25,-0.5],"top_logprobs":[{"?":-9999,"Hé":-0.25},{" yo":-0.5,"?":-9999}],"text_offset":[0,2]}`}},
		{"completion stream: offsets run on", "/v1/completions", `{"model":"m","prompt":"p","stream":true,"logprobs":1}`, true,
			[]string{
				`{"tokens":["Hé"],"token_logprobs":[-0.25],"top_logprobs":[{"Hé":-0.25}],"text_offset":[0]}`,
				`{"tokens":[" yo"],"token_logprobs":[-0.5],"top_logprobs":[{" yo":-0.5}],"text_offset":[2]}`,
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := newModel("m", "Hé", " yo")
			h := NewHandler(newFake(m), Config{})
			rec := serve(t, h, "POST", tt.path, tt.body)
			if rec.Code != 200 {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
			bodies := []string{rec.Body.String()}
			if tt.stream {
				bodies = sseEvents(t, rec.Body.String())
			}
			var got []string
			for _, b := range bodies {
				if b == "[DONE]" {
					continue
				}
				var v struct {
					Choices []struct {
						Text  *string `json:"text"`
						Delta *struct {
							Content *string `json:"content"`
						} `json:"delta"`
						Message  *struct{}       `json:"message"`
						Logprobs json.RawMessage `json:"logprobs"`
					} `json:"choices"`
				}
				if err := json.Unmarshal([]byte(b), &v); err != nil {
					t.Fatalf("%v: %s", err, b)
				}
				for _, c := range v.Choices {
					text := c.Message != nil || c.Text != nil && *c.Text != "" || c.Delta != nil && c.Delta.Content != nil && *c.Delta.Content != ""
					if text {
						got = append(got, normJSON(t, c.Logprobs))
					} else if string(c.Logprobs) != "null" {
						t.Errorf("a choice without text carries logprobs %s", c.Logprobs)
					}
				}
			}
			var want []string
			for _, w := range tt.want {
				want = append(want, normJSON(t, json.RawMessage(w)))
			}
			if strings.Join(got, "\n") != strings.Join(want, "\n") {
				t.Errorf("logprobs\n got %s\nwant %s", strings.Join(got, "\n     "), strings.Join(want, "\n     "))
			}
			if r := m.lastReq(); r.Logprobs != (tt.want[0] != "null") {
				t.Errorf("backend asked for logprobs %v", r.Logprobs)
			}
		})
	}
}

// normJSON re-encodes JSON with sorted object keys.
func normJSON(t *testing.T, raw json.RawMessage) string {
	t.Helper()
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		t.Fatalf("%v: %s", err, raw)
	}
	b, _ := json.Marshal(v)
	return string(b)
}

// TestResponseFormat: json_object and json_schema reach the backend as
// JSON (with the schema, compact); text and no format do not.
func TestResponseFormat(t *testing.T) {
	m := newModel("m", "{}")
	h := NewHandler(newFake(m), Config{})
	for _, tt := range []struct {
		format string
		json   bool
		schema string
	}{
		{`,"response_format":{"type":"json_object"}`, true, ""},
		{`,"response_format":{"type":"json_schema","json_schema":{"name":"p","strict":true,"schema":{"type": "object",
			"properties": {"a": {"type": "string"}}}}}`, true, `{"type":"object","properties":{"a":{"type":"string"}}}`},
		{`,"response_format":{"type":"json_schema","json_schema":{"name":"any"}}`, true, ""},
		{`,"response_format":{"type":"text"}`, false, ""},
		{``, false, ""},
	} {
		rec := serve(t, h, "POST", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]`+tt.format+`}`)
		if r := m.lastReq(); rec.Code != 200 || r.JSON != tt.json || r.JSONSchema != tt.schema {
			t.Errorf("%s: %d, JSON %v schema %q, want %v %q", tt.format, rec.Code, r.JSON, r.JSONSchema, tt.json, tt.schema)
		}
	}
}

// TestChoicesStream: with n, a chat stream opens every choice, carries each
// chunk under its index, closes each, and a failure of any choice ends the
// stream with the error and no [DONE].
func TestChoicesStream(t *testing.T) {
	m := newModel("m", "x", "y")
	h := NewHandler(newFake(m), Config{})
	evs := sseEvents(t, serve(t, h, "POST", "/v1/chat/completions", `{"model":"m","stream":true,"n":2,"messages":[{"role":"user","content":"hi"}]}`).Body.String())
	if len(evs) == 0 || evs[len(evs)-1] != "[DONE]" {
		t.Fatalf("events %q", evs)
	}
	text := map[float64]string{}
	finished := map[float64]int{}
	for k, ev := range evs[:len(evs)-1] {
		var v struct {
			Choices []struct {
				Index float64 `json:"index"`
				Delta struct {
					Role    string  `json:"role"`
					Content *string `json:"content"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(ev), &v); err != nil || len(v.Choices) != 1 {
			t.Fatalf("event %d: %s", k, ev)
		}
		c := v.Choices[0]
		if k < 2 && (c.Delta.Role != "assistant" || c.Index != float64(k)) {
			t.Errorf("event %d is not choice %d's opener: %s", k, k, ev)
		}
		if c.Delta.Content != nil {
			text[c.Index] += *c.Delta.Content
		}
		if c.FinishReason != nil {
			finished[c.Index]++
		}
	}
	if text[0] != "xy" || text[1] != "xy" || finished[0] != 1 || finished[1] != 1 {
		t.Errorf("texts %v, finishes %v", text, finished)
	}

	m.midErr = errors.New("device lost")
	evs = sseEvents(t, serve(t, h, "POST", "/v1/chat/completions", `{"model":"m","stream":true,"n":2,"messages":[{"role":"user","content":"hi"}]}`).Body.String())
	if last := evs[len(evs)-1]; last == "[DONE]" || !strings.Contains(last, "device lost") {
		t.Errorf("a failed choice ended the stream with %q", last)
	}
}
