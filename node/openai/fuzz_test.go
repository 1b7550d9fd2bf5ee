package openai

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// FuzzRequest sends arbitrary bodies to both generation endpoints: the
// server must answer every one with 200 or an OpenAI error object with a
// 4xx status, never panic or 5xx, and keep serving.
func FuzzRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","prompt":"hi","max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"m","prompt":[1,2,3],"stop":["a","b"],"temperature":0.5,"top_p":0.9,"seed":7}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"n":2}`,
		`{"model":"m","messages":[],"max_tokens":-1}`,
		`{"model":"nope","prompt":"x"}`,
		`{"model":"m","prompt":[[1,2]],"logprobs":true}`,
		`{`, `null`, `[]`, `"x"`, ``,
	} {
		f.Add(s, false)
		f.Add(s, true)
	}
	h := NewHandler(newFake(newModel("m", "a", "b")), Config{MaxTokensCap: 16})
	f.Fuzz(func(t *testing.T, body string, chat bool) {
		path := "/v1/completions"
		if chat {
			path = "/v1/chat/completions"
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, path, strings.NewReader(body)))
		switch {
		case rec.Code == http.StatusOK:
		case rec.Code >= 400 && rec.Code < 500:
			var e struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
				} `json:"error"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Error.Message == "" || e.Error.Type == "" {
				t.Fatalf("%d without an OpenAI error object: %q", rec.Code, rec.Body.String())
			}
		default:
			t.Fatalf("status %d for %q: %s", rec.Code, body, rec.Body.String())
		}
	})
}
