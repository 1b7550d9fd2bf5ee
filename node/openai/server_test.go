package openai

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

func serve(t *testing.T, h http.Handler, method, path, body string, hdr ...string) *httptest.ResponseRecorder {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req := httptest.NewRequest(method, path, rd)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

func decode(t *testing.T, data []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatalf("response is not a JSON object: %v\n%s", err, data)
	}
	return m
}

// wantError checks an OpenAI error response; param and code "" mean null.
func wantError(t *testing.T, rec *httptest.ResponseRecorder, status int, typ, param, code, msgPart string) {
	t.Helper()
	if rec.Code != status {
		t.Fatalf("status = %d, want %d; body %s", rec.Code, status, rec.Body)
	}
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type = %q", ct)
	}
	body := decode(t, rec.Body.Bytes())
	e, ok := body["error"].(map[string]any)
	if !ok || len(body) != 1 {
		t.Fatalf("body is not {\"error\":{...}}: %s", rec.Body)
	}
	if len(e) != 4 {
		t.Errorf("error has fields %v, want message, type, param, code", e)
	}
	nullable := func(s string) any {
		if s == "" {
			return nil
		}
		return s
	}
	if e["type"] != typ {
		t.Errorf("type = %v, want %q", e["type"], typ)
	}
	if e["param"] != nullable(param) {
		t.Errorf("param = %v, want %q", e["param"], param)
	}
	if e["code"] != nullable(code) {
		t.Errorf("code = %v, want %q", e["code"], code)
	}
	msg, _ := e["message"].(string)
	if msg == "" || !strings.Contains(msg, msgPart) {
		t.Errorf("message = %q, want it to contain %q", msg, msgPart)
	}
}

func TestModels(t *testing.T) {
	a := newModel("alpha")
	a.info.ContextLength = 4096
	b := newModel("org/beta")
	b.info.OwnedBy = ""
	h := NewHandler(newFake(a, b), Config{})

	rec := serve(t, h, "GET", "/v1/models", "")
	if rec.Code != 200 {
		t.Fatalf("status %d", rec.Code)
	}
	want := `{"object":"list","data":[` +
		`{"id":"alpha","object":"model","created":1700000000,"owned_by":"tester","context_length":4096},` +
		`{"id":"org/beta","object":"model","created":1700000000,"owned_by":"meshnode"}]}` + "\n"
	if rec.Body.String() != want {
		t.Errorf("body\n%s\nwant\n%s", rec.Body, want)
	}

	rec = serve(t, h, "GET", "/v1/models/org/beta", "")
	if got := decode(t, rec.Body.Bytes()); rec.Code != 200 || got["id"] != "org/beta" || got["object"] != "model" {
		t.Errorf("get model: %d %s", rec.Code, rec.Body)
	}
	wantError(t, serve(t, h, "GET", "/v1/models/nope", ""), 404, "invalid_request_error", "model", "model_not_found", "nope")
	wantError(t, serve(t, h, "GET", "/v1/models/", ""), 404, "invalid_request_error", "", "unknown_url", "/v1/models/")

	empty := serve(t, NewHandler(newFake(), Config{}), "GET", "/v1/models", "")
	if empty.Body.String() != `{"object":"list","data":[]}`+"\n" {
		t.Errorf("empty list: %s", empty.Body)
	}
}

func TestHealth(t *testing.T) {
	var mu sync.Mutex
	var healthErr error
	h := NewHandler(newFake(), Config{APIKey: "secret", Health: func() error {
		mu.Lock()
		defer mu.Unlock()
		return healthErr
	}})
	rec := serve(t, h, "GET", "/health", "")
	if rec.Code != 200 || rec.Body.String() != `{"status":"ok"}`+"\n" {
		t.Errorf("health: %d %s", rec.Code, rec.Body)
	}
	if rec := serve(t, h, "HEAD", "/health", ""); rec.Code != 200 {
		t.Errorf("HEAD health: %d", rec.Code)
	}
	mu.Lock()
	healthErr = errors.New("model loading")
	mu.Unlock()
	rec = serve(t, h, "GET", "/health", "")
	wantError(t, rec, 503, "server_error", "", "service_unavailable", "model loading")
	if rec.Header().Get("Retry-After") != "1" {
		t.Errorf("no Retry-After on 503")
	}
}

func TestRoutes(t *testing.T) {
	h := NewHandler(newFake(newModel("m")), Config{})
	wantError(t, serve(t, h, "GET", "/v1/nothing", ""), 404, "invalid_request_error", "", "unknown_url", "GET /v1/nothing")
	wantError(t, serve(t, h, "GET", "/", ""), 404, "invalid_request_error", "", "unknown_url", "")

	rec := serve(t, h, "GET", "/v1/chat/completions", "")
	wantError(t, rec, 405, "invalid_request_error", "", "method_not_allowed", "POST")
	if rec.Header().Get("Allow") != "POST" {
		t.Errorf("Allow = %q", rec.Header().Get("Allow"))
	}
	rec = serve(t, h, "DELETE", "/v1/models", "")
	wantError(t, rec, 405, "invalid_request_error", "", "method_not_allowed", "GET")
	if rec.Header().Get("Allow") != "GET, HEAD" {
		t.Errorf("Allow = %q", rec.Header().Get("Allow"))
	}
	wantError(t, serve(t, h, "POST", "/v1/completions/", "{}"), 404, "invalid_request_error", "", "unknown_url", "")
}

func TestChatCompletion(t *testing.T) {
	m := newModel("m", "Hel", "lo", " wörld")
	h := NewHandler(newFake(m), Config{})
	body := `{"model":"m","messages":[
		{"role":"developer","content":"be brief"},
		{"role":"user","content":[{"type":"text","text":"hi"},{"type":"text","text":"there"}]},
		{"role":"assistant","content":null},
		{"role":"user","content":"again","name":"bob"}],
		"user":"ignored-field","stop":"END","seed":7,"temperature":0}`
	before := time.Now().Unix()
	rec := serve(t, h, "POST", "/v1/chat/completions", body, "X-Request-Id", "req-123")
	if rec.Code != 200 {
		t.Fatalf("status %d: %s", rec.Code, rec.Body)
	}
	if rec.Header().Get("X-Request-Id") != "req-123" {
		t.Errorf("X-Request-Id = %q", rec.Header().Get("X-Request-Id"))
	}
	var got map[string]any
	_ = json.Unmarshal(rec.Body.Bytes(), &got)
	id, _ := got["id"].(string)
	if !strings.HasPrefix(id, "chatcmpl-") || len(id) < len("chatcmpl-")+16 {
		t.Errorf("id = %q", id)
	}
	created, _ := got["created"].(float64)
	if int64(created) < before || int64(created) > time.Now().Unix() {
		t.Errorf("created = %v", got["created"])
	}
	delete(got, "id")
	delete(got, "created")
	prompt := "system:be brief\nuser:hi\nthere\nassistant:\nuser:again\n"
	want := map[string]any{
		"object": "chat.completion",
		"model":  "m",
		"choices": []any{map[string]any{
			"index":         0.0,
			"message":       map[string]any{"role": "assistant", "content": "Hello wörld"},
			"logprobs":      nil,
			"finish_reason": "stop",
		}},
		"usage": map[string]any{"prompt_tokens": float64(len(prompt)), "completion_tokens": 3.0, "total_tokens": float64(len(prompt) + 3)},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("body\n%v\nwant\n%v", got, want)
	}

	wantMsgs := []Message{{"system", "be brief"}, {"user", "hi\nthere"}, {"assistant", ""}, {"user", "again"}}
	if msgs := m.lastMsgs(); !reflect.DeepEqual(msgs, wantMsgs) {
		t.Errorf("messages = %q", msgs)
	}
	seed := int64(7)
	wantReq := GenerateRequest{
		RequestID: "req-123", Prompt: bytesToTokens(prompt), MaxTokens: 4096, Stop: []string{"END"},
		Temperature: 0, TopP: 1, RepeatPenalty: 1, Seed: &seed,
	}
	if req := m.lastReq(); !reflect.DeepEqual(req, wantReq) {
		t.Errorf("request\n%+v\nwant\n%+v", req, wantReq)
	}
}

func TestSamplingParams(t *testing.T) {
	m := newModel("m", "x")
	h := NewHandler(newFake(m), Config{MaxTokensCap: 100})
	body := `{"model":"m","prompt":"p","temperature":1.5,"top_p":0.9,"top_k":40,"min_p":0.05,
		"repeat_penalty":1.1,"frequency_penalty":-1,"presence_penalty":2,"stop":["a","","b"],
		"max_tokens":10,"max_completion_tokens":20,"n":1,"logprobs":null,"tools":[],"response_format":{"type":"text"}}`
	rec := serve(t, h, "POST", "/v1/completions", body)
	if rec.Code != 200 {
		t.Fatalf("status %d: %s", rec.Code, rec.Body)
	}
	want := GenerateRequest{
		RequestID: m.lastReq().RequestID, Prompt: []int32{1, 'p'}, MaxTokens: 20, Stop: []string{"a", "b"},
		Temperature: 1.5, TopK: 40, TopP: 0.9, MinP: 0.05, RepeatPenalty: 1.1, FrequencyPenalty: -1, PresencePenalty: 2,
	}
	if got := m.lastReq(); !reflect.DeepEqual(got, want) {
		t.Errorf("request\n%+v\nwant\n%+v", got, want)
	}
	if len(want.RequestID) < 16 {
		t.Errorf("generated request id %q", want.RequestID)
	}
}

func TestMaxTokens(t *testing.T) {
	m := newModel("m", "x")
	h := NewHandler(newFake(m), Config{MaxTokensCap: 50})
	cases := []struct {
		ctxLen int
		body   string
		want   int
	}{
		{0, `{"model":"m","prompt":"abc"}`, 50},                   // no limit: the cap
		{0, `{"model":"m","prompt":"abc","max_tokens":500}`, 50},  // capped
		{0, `{"model":"m","prompt":"abc","max_tokens":5}`, 5},     // as asked
		{20, `{"model":"m","prompt":"abc"}`, 16},                  // room left: 20 - 4
		{100, `{"model":"m","prompt":"abc"}`, 50},                 // cap below room
		{20, `{"model":"m","prompt":"abc","max_tokens":30}`, 30},  // explicit: the backend decides
		{20, `{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10]}`, 10}, // token prompt, as is
	}
	for _, c := range cases {
		m.info.ContextLength = c.ctxLen
		rec := serve(t, h, "POST", "/v1/completions", c.body)
		if rec.Code != 200 {
			t.Fatalf("%s: status %d %s", c.body, rec.Code, rec.Body)
		}
		if got := m.lastReq().MaxTokens; got != c.want {
			t.Errorf("ctx %d %s: MaxTokens = %d, want %d", c.ctxLen, c.body, got, c.want)
		}
	}
	m.info.ContextLength = 4
	wantError(t, serve(t, h, "POST", "/v1/completions", `{"model":"m","prompt":"abc"}`),
		400, "invalid_request_error", "prompt", "context_length_exceeded", "maximum context length is 4")
	wantError(t, serve(t, h, "POST", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"abc"}]}`),
		400, "invalid_request_error", "messages", "context_length_exceeded", "context length")
}

func TestCompletionPrompts(t *testing.T) {
	m := newModel("m", "a", "b")
	h := NewHandler(newFake(m), Config{})
	cases := []struct {
		prompt string
		tokens []int32
	}{
		{`"hi"`, []int32{1, 'h', 'i'}},
		{`["hi"]`, []int32{1, 'h', 'i'}},
		{`""`, []int32{1}},
		{`[5, 6, 7]`, []int32{5, 6, 7}},
		{`[[8, 9]]`, []int32{8, 9}},
	}
	for _, c := range cases {
		rec := serve(t, h, "POST", "/v1/completions", `{"model":"m","prompt":`+c.prompt+`}`)
		if rec.Code != 200 {
			t.Fatalf("%s: %d %s", c.prompt, rec.Code, rec.Body)
		}
		if got := m.lastReq().Prompt; !reflect.DeepEqual(got, c.tokens) {
			t.Errorf("%s: tokens %v, want %v", c.prompt, got, c.tokens)
		}
	}

	rec := serve(t, h, "POST", "/v1/completions", `{"model":"m","prompt":"hi","max_tokens":2}`)
	var got map[string]any
	_ = json.Unmarshal(rec.Body.Bytes(), &got)
	if id, _ := got["id"].(string); !strings.HasPrefix(id, "cmpl-") {
		t.Errorf("id = %q", id)
	}
	delete(got, "id")
	delete(got, "created")
	want := map[string]any{
		"object": "text_completion",
		"model":  "m",
		"choices": []any{map[string]any{
			"text": "ab", "index": 0.0, "logprobs": nil, "finish_reason": "stop",
		}},
		"usage": map[string]any{"prompt_tokens": 3.0, "completion_tokens": 2.0, "total_tokens": 5.0},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("body\n%v\nwant\n%v", got, want)
	}
}

// A backend may leave the finish reason and usage out; the server fills
// what it knows.
func TestBareFinalEvent(t *testing.T) {
	m := newModel("m", "a")
	m.bareFinal = true
	h := NewHandler(newFake(m), Config{})
	rec := serve(t, h, "POST", "/v1/completions", `{"model":"m","prompt":"abc"}`)
	if !strings.Contains(rec.Body.String(), `"finish_reason":"stop"}],"usage":{"prompt_tokens":4,"completion_tokens":0,"total_tokens":4}}`) {
		t.Errorf("body %s", rec.Body)
	}
}

func TestFinishLength(t *testing.T) {
	m := newModel("m", "a")
	m.finish = "length"
	h := NewHandler(newFake(m), Config{})
	rec := serve(t, h, "POST", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	if !strings.Contains(rec.Body.String(), `"finish_reason":"length"`) {
		t.Errorf("body %s", rec.Body)
	}
}

func TestBadRequests(t *testing.T) {
	h := NewHandler(newFake(newModel("m", "x")), Config{})
	const msgs = `"messages":[{"role":"user","content":"hi"}]`
	chat := func(fields string) string { return `{"model":"m",` + msgs + `,` + fields + `}` }
	const ir = "invalid_request_error"
	cases := []struct {
		name, path, body     string
		status               int
		typ, param, code, in string
	}{
		{"empty body", "chat", ``, 400, ir, "", "", "empty"},
		{"syntax", "chat", `{"model": "m",}`, 400, ir, "", "", "byte offset 15"},
		{"truncated", "chat", `{"model": "m"`, 400, ir, "", "", "unexpected end"},
		{"trailing", "chat", `{"model":"m",` + msgs + `} {}`, 400, ir, "", "", "after the object at byte offset"},
		{"not object", "chat", `[1]`, 400, ir, "", "", "must be a JSON object"},
		{"wrong type", "chat", `{"model":5,` + msgs + `}`, 400, ir, "model", "invalid_type", "expected a string, got number"},
		{"wrong type nested", "chat", `{"model":"m","messages":[{"role":1,"content":"x"}]}`, 400, ir, "messages.role", "invalid_type", "expected a string"},
		{"top_k float", "chat", chat(`"top_k":1.5`), 400, ir, "top_k", "invalid_type", "expected an integer"},
		{"missing model", "chat", `{` + msgs + `}`, 400, ir, "model", "missing_required_parameter", "'model'"},
		{"empty model", "chat", `{"model":"",` + msgs + `}`, 400, ir, "model", "missing_required_parameter", "'model'"},
		{"missing messages", "chat", `{"model":"m"}`, 400, ir, "messages", "missing_required_parameter", "'messages'"},
		{"empty messages", "chat", `{"model":"m","messages":[]}`, 400, ir, "messages", "invalid_value", "at least one"},
		{"missing role", "chat", `{"model":"m","messages":[{"content":"x"}]}`, 400, ir, "messages[0].role", "missing_required_parameter", ""},
		{"bad role", "chat", `{"model":"m","messages":[{"role":"robot","content":"x"}]}`, 400, ir, "messages[0].role", "invalid_value", "robot"},
		{"tool role", "chat", `{"model":"m","messages":[{"role":"tool","content":"x","tool_call_id":"a"}]}`, 400, ir, "messages[0].role", "unsupported_parameter", "not supported"},
		{"missing content", "chat", `{"model":"m","messages":[{"role":"user"}]}`, 400, ir, "messages[0].content", "missing_required_parameter", ""},
		{"content number", "chat", `{"model":"m","messages":[{"role":"user","content":3}]}`, 400, ir, "messages[0].content", "invalid_type", ""},
		{"image part", "chat", `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`, 400, ir, "messages[0].content[0].type", "unsupported_parameter", "image_url"},
		{"part without text", "chat", `{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}`, 400, ir, "messages[0].content[0].text", "missing_required_parameter", ""},
		{"tool calls", "chat", `{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"x"}]}]}`, 400, ir, "messages[0].tool_calls", "unsupported_parameter", ""},
		{"unknown model", "chat", `{"model":"zzz",` + msgs + `}`, 404, ir, "model", "model_not_found", "zzz"},
		{"n=17", "chat", chat(`"n":17`), 400, ir, "n", "invalid_value", "at most 16"},
		{"n=0", "chat", chat(`"n":0`), 400, ir, "n", "invalid_value", "at least 1"},
		{"temperature high", "chat", chat(`"temperature":2.5`), 400, ir, "temperature", "invalid_value", "2.5 is outside [0, 2]"},
		{"temperature negative", "chat", chat(`"temperature":-0.1`), 400, ir, "temperature", "invalid_value", ""},
		{"top_p zero", "chat", chat(`"top_p":0`), 400, ir, "top_p", "invalid_value", "outside (0, 1]"},
		{"top_p high", "chat", chat(`"top_p":1.01`), 400, ir, "top_p", "invalid_value", ""},
		{"min_p", "chat", chat(`"min_p":2`), 400, ir, "min_p", "invalid_value", ""},
		{"top_k negative", "chat", chat(`"top_k":-1`), 400, ir, "top_k", "invalid_value", ""},
		{"repeat_penalty", "chat", chat(`"repeat_penalty":0`), 400, ir, "repeat_penalty", "invalid_value", ""},
		{"max_tokens negative", "chat", chat(`"max_tokens":-1`), 400, ir, "max_tokens", "invalid_value", "at least 1"},
		{"max_tokens zero", "chat", chat(`"max_tokens":0`), 400, ir, "max_tokens", "invalid_value", ""},
		{"max_completion_tokens", "chat", chat(`"max_completion_tokens":-5`), 400, ir, "max_completion_tokens", "invalid_value", ""},
		{"presence_penalty", "chat", chat(`"presence_penalty":2.1`), 400, ir, "presence_penalty", "invalid_value", ""},
		{"frequency_penalty", "chat", chat(`"frequency_penalty":-3`), 400, ir, "frequency_penalty", "invalid_value", ""},
		{"stop 5", "chat", chat(`"stop":["a","b","c","d","e"]`), 400, ir, "stop", "invalid_value", "at most 4"},
		{"stop number", "chat", chat(`"stop":["a",1]`), 400, ir, "stop", "invalid_type", "stop[1]"},
		{"stop object", "chat", chat(`"stop":{}`), 400, ir, "stop", "invalid_type", ""},
		{"tools", "chat", chat(`"tools":[{"type":"function","function":{"name":"f"}}]`), 400, ir, "tools", "unsupported_parameter", "not supported"},
		{"tool_choice", "chat", chat(`"tool_choice":"required"`), 400, ir, "tool_choice", "unsupported_parameter", ""},
		{"functions", "chat", chat(`"functions":[{"name":"f"}]`), 400, ir, "functions", "unsupported_parameter", ""},
		{"logprobs not a boolean", "chat", chat(`"logprobs":2`), 400, ir, "logprobs", "invalid_type", ""},
		{"top_logprobs without logprobs", "chat", chat(`"top_logprobs":2`), 400, ir, "top_logprobs", "invalid_value", "needs logprobs"},
		{"top_logprobs over 20", "chat", chat(`"logprobs":true,"top_logprobs":21`), 400, ir, "top_logprobs", "invalid_value", "0 to 20"},
		{"top_logprobs negative", "chat", chat(`"logprobs":true,"top_logprobs":-1`), 400, ir, "top_logprobs", "invalid_value", "0 to 20"},
		{"logit_bias", "chat", chat(`"logit_bias":{"5":1}`), 400, ir, "logit_bias", "unsupported_parameter", ""},
		{"json_schema without its object", "chat", chat(`"response_format":{"type":"json_schema"}`), 400, ir, "response_format.json_schema", "missing_required_parameter", ""},
		{"json_schema too large", "chat", chat(`"response_format":{"type":"json_schema","json_schema":{"schema":{"description":"` + strings.Repeat("x", 70000) + `"}}}`), 400, ir, "response_format.json_schema.schema", "invalid_value", "over the limit"},
		{"response_format string", "chat", chat(`"response_format":"json"`), 400, ir, "response_format", "invalid_type", ""},
		{"response_format no type", "chat", chat(`"response_format":{}`), 400, ir, "response_format.type", "missing_required_parameter", ""},
		{"response_format bad", "chat", chat(`"response_format":{"type":"xml"}`), 400, ir, "response_format.type", "invalid_value", ""},
		{"missing prompt", "cmpl", `{"model":"m"}`, 400, ir, "prompt", "missing_required_parameter", "'prompt'"},
		{"null prompt", "cmpl", `{"model":"m","prompt":null}`, 400, ir, "prompt", "missing_required_parameter", ""},
		{"empty prompt array", "cmpl", `{"model":"m","prompt":[]}`, 400, ir, "prompt", "invalid_value", "empty"},
		{"two prompts", "cmpl", `{"model":"m","prompt":["a","b"]}`, 400, ir, "prompt", "unsupported_parameter", "2 prompts"},
		{"prompt number", "cmpl", `{"model":"m","prompt":5}`, 400, ir, "prompt", "invalid_type", ""},
		{"mixed tokens", "cmpl", `{"model":"m","prompt":[1,"a"]}`, 400, ir, "prompt", "invalid_type", ""},
		{"null token", "cmpl", `{"model":"m","prompt":[1,null]}`, 400, ir, "prompt", "invalid_type", ""},
		{"null first token", "cmpl", `{"model":"m","prompt":[null]}`, 400, ir, "prompt", "invalid_type", ""},
		{"two token arrays", "cmpl", `{"model":"m","prompt":[[1],[2]]}`, 400, ir, "prompt", "unsupported_parameter", ""},
		{"empty token array", "cmpl", `{"model":"m","prompt":[[]]}`, 400, ir, "prompt", "invalid_value", "empty"},
		{"negative token", "cmpl", `{"model":"m","prompt":[1,-2]}`, 400, ir, "prompt", "invalid_value", "-2"},
		{"completion logprobs over 20", "cmpl", `{"model":"m","prompt":"a","logprobs":21}`, 400, ir, "logprobs", "invalid_value", "0 to 20"},
		{"completion logprobs not a number", "cmpl", `{"model":"m","prompt":"a","logprobs":"2"}`, 400, ir, "logprobs", "invalid_type", ""},
		{"completion top_logprobs", "cmpl", `{"model":"m","prompt":"a","logprobs":2,"top_logprobs":2}`, 400, ir, "top_logprobs", "invalid_value", "chat completions parameter"},
		{"echo", "cmpl", `{"model":"m","prompt":"a","echo":true}`, 400, ir, "echo", "unsupported_parameter", ""},
		{"best_of", "cmpl", `{"model":"m","prompt":"a","best_of":3}`, 400, ir, "best_of", "unsupported_parameter", ""},
		{"cmpl n", "cmpl", `{"model":"m","prompt":"a","n":100}`, 400, ir, "n", "invalid_value", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			path := "/v1/chat/completions"
			if c.path == "cmpl" {
				path = "/v1/completions"
			}
			wantError(t, serve(t, h, "POST", path, c.body), c.status, c.typ, c.param, c.code, c.in)
		})
	}
}

func TestAcceptedVariants(t *testing.T) {
	h := NewHandler(newFake(newModel("m", "x")), Config{})
	const msgs = `"messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"}]`
	for _, fields := range []string{
		`"stop":null`, `"stop":"x"`, `"stop":["a","b","c","d"]`, `"tools":null`, `"tool_choice":"none"`,
		`"logprobs":false`, `"top_logprobs":0`, `"response_format":null`, `"stream":false`,
		`"stream_options":{"include_usage":true}`, `"n":null`, `"seed":-1`, `"temperature":2`, `"top_p":1`,
		`"metadata":{"a":"b"}`, `"store":false`, `"parallel_tool_calls":true`, `"logit_bias":{}`,
	} {
		rec := serve(t, h, "POST", "/v1/chat/completions", `{"model":"m",`+msgs+`,`+fields+`}`)
		if rec.Code != 200 {
			t.Errorf("%s: %d %s", fields, rec.Code, rec.Body)
		}
	}
}

func TestBackendErrors(t *testing.T) {
	chatBody := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	cmplBody := `{"model":"m","prompt":"hi"}`
	cases := []struct {
		name          string
		setup         func(m *fakeModel)
		status        int
		typ, param, c string
		retry         bool
	}{
		{"overloaded", func(m *fakeModel) { m.genErr = fmt.Errorf("queue full (8): %w", ErrOverloaded) }, 429, "requests", "", "rate_limit_exceeded", true},
		{"unavailable", func(m *fakeModel) { m.genErr = fmt.Errorf("loading: %w", ErrUnavailable) }, 503, "server_error", "", "service_unavailable", true},
		{"context", func(m *fakeModel) { m.genErr = fmt.Errorf("9000 > 8192: %w", ErrContextLength) }, 400, "invalid_request_error", "PARAM", "context_length_exceeded", false},
		{"invalid", func(m *fakeModel) { m.genErr = fmt.Errorf("seed unsupported: %w", ErrInvalidParam) }, 400, "invalid_request_error", "", "invalid_value", false},
		{"other", func(m *fakeModel) { m.genErr = errors.New("gpu on fire") }, 500, "server_error", "", "", false},
		{"prompt context", func(m *fakeModel) { m.promptErr = fmt.Errorf("too long: %w", ErrContextLength) }, 400, "invalid_request_error", "PARAM", "context_length_exceeded", false},
		{"prompt invalid", func(m *fakeModel) { m.promptErr = fmt.Errorf("roles must alternate: %w", ErrInvalidParam) }, 400, "invalid_request_error", "", "invalid_value", false},
		{"prompt other", func(m *fakeModel) { m.promptErr = errors.New("template broken") }, 500, "server_error", "", "", false},
		{"mid-stream", func(m *fakeModel) { m.midErr = errors.New("decode failed") }, 500, "server_error", "", "", false},
		{"no final event", func(m *fakeModel) { m.noFinal = true }, 500, "server_error", "", "", false},
		{"panic", func(m *fakeModel) { m.panicking = true }, 500, "server_error", "", "", false},
	}
	for _, c := range cases {
		for _, ep := range []struct{ path, body, param string }{
			{"/v1/chat/completions", chatBody, "messages"},
			{"/v1/completions", cmplBody, "prompt"},
		} {
			if c.name == "panic" && ep.param == "prompt" {
				continue // the fake panics in ChatPrompt only
			}
			t.Run(c.name+ep.path, func(t *testing.T) {
				m := newModel("m", "a", "b")
				c.setup(m)
				h := NewHandler(newFake(m), Config{})
				rec := serve(t, h, "POST", ep.path, ep.body)
				param := strings.ReplaceAll(c.param, "PARAM", ep.param)
				wantError(t, rec, c.status, c.typ, param, c.c, "")
				if got := rec.Header().Get("Retry-After"); (got == "1") != c.retry {
					t.Errorf("Retry-After = %q", got)
				}
				if rec.Header().Get("X-Request-Id") == "" {
					t.Errorf("no X-Request-Id")
				}
			})
		}
	}
	// The backend's wrapped message reaches the client.
	m := newModel("m")
	m.genErr = fmt.Errorf("queue full (8 waiting): %w", ErrOverloaded)
	rec := serve(t, NewHandler(newFake(m), Config{}), "POST", "/v1/completions", cmplBody)
	wantError(t, rec, 429, "requests", "", "rate_limit_exceeded", "queue full (8 waiting)")
}

// sseEvents splits an SSE body into its data payloads, checking framing.
func sseEvents(t *testing.T, body string) []string {
	t.Helper()
	if !strings.HasSuffix(body, "\n\n") {
		t.Fatalf("stream does not end with a blank line: %q", body)
	}
	var out []string
	for ev := range strings.SplitSeq(strings.TrimSuffix(body, "\n\n"), "\n\n") {
		data, ok := strings.CutPrefix(ev, "data: ")
		if !ok || strings.Contains(data, "\n") {
			t.Fatalf("malformed event %q", ev)
		}
		out = append(out, data)
	}
	return out
}

func TestStreamChat(t *testing.T) {
	m := newModel("m", "Hi", " there")
	m.finish = "length"
	h := NewHandler(newFake(m), Config{})
	rec := serve(t, h, "POST", "/v1/chat/completions",
		`{"model":"m","stream":true,"max_tokens":2,"messages":[{"role":"user","content":"yo"}]}`)
	if rec.Code != 200 || rec.Header().Get("Content-Type") != "text/event-stream" {
		t.Fatalf("%d %q", rec.Code, rec.Header().Get("Content-Type"))
	}
	if !rec.Flushed {
		t.Errorf("not flushed")
	}
	evs := sseEvents(t, rec.Body.String())
	if len(evs) != 5 || evs[4] != "[DONE]" {
		t.Fatalf("events %q", evs)
	}
	first := decode(t, []byte(evs[0]))
	id := first["id"].(string)
	if !strings.HasPrefix(id, "chatcmpl-") {
		t.Errorf("id %q", id)
	}
	wantChoices := []string{
		`[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]`,
		`[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]`,
		`[{"index":0,"delta":{"content":" there"},"logprobs":null,"finish_reason":null}]`,
		`[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]`,
	}
	for i, want := range wantChoices {
		var ev struct {
			ID      string          `json:"id"`
			Object  string          `json:"object"`
			Created int64           `json:"created"`
			Model   string          `json:"model"`
			Choices json.RawMessage `json:"choices"`
		}
		if err := json.Unmarshal([]byte(evs[i]), &ev); err != nil {
			t.Fatal(err)
		}
		if ev.ID != id || ev.Object != "chat.completion.chunk" || ev.Model != "m" || ev.Created == 0 {
			t.Errorf("event %d header: %s", i, evs[i])
		}
		if string(ev.Choices) != want {
			t.Errorf("event %d choices %s, want %s", i, ev.Choices, want)
		}
		if strings.Contains(evs[i], "usage") {
			t.Errorf("usage sent without include_usage: %s", evs[i])
		}
	}
}

func TestStreamIncludeUsage(t *testing.T) {
	for _, path := range []string{"/v1/chat/completions", "/v1/completions"} {
		m := newModel("m", "a", "b")
		h := NewHandler(newFake(m), Config{})
		body := `{"model":"m","stream":true,"stream_options":{"include_usage":true},"prompt":"xy","messages":[{"role":"user","content":"xy"}]}`
		evs := sseEvents(t, serve(t, h, "POST", path, body).Body.String())
		n := len(evs)
		if evs[n-1] != "[DONE]" {
			t.Fatalf("%s: %q", path, evs)
		}
		for _, ev := range evs[:n-2] {
			if !strings.HasSuffix(ev, `,"usage":null}`) {
				t.Errorf("%s: chunk without usage null: %s", path, ev)
			}
		}
		last := decode(t, []byte(evs[n-2]))
		promptLen := len(m.lastReq().Prompt)
		wantUsage := map[string]any{"prompt_tokens": float64(promptLen), "completion_tokens": 2.0, "total_tokens": float64(promptLen + 2)}
		if ch, ok := last["choices"].([]any); !ok || len(ch) != 0 || !reflect.DeepEqual(last["usage"], wantUsage) {
			t.Errorf("%s: usage chunk %s", path, evs[n-2])
		}
	}
}

func TestStreamCompletion(t *testing.T) {
	m := newModel("m", "one", "two")
	h := NewHandler(newFake(m), Config{})
	rec := serve(t, h, "POST", "/v1/completions", `{"model":"m","stream":true,"prompt":"p"}`)
	evs := sseEvents(t, rec.Body.String())
	if len(evs) != 4 || evs[3] != "[DONE]" {
		t.Fatalf("events %q", evs)
	}
	wantChoices := []string{
		`[{"text":"one","index":0,"logprobs":null,"finish_reason":null}]`,
		`[{"text":"two","index":0,"logprobs":null,"finish_reason":null}]`,
		`[{"text":"","index":0,"logprobs":null,"finish_reason":"stop"}]`,
	}
	for i, want := range wantChoices {
		ev := decode(t, []byte(evs[i]))
		if ev["object"] != "text_completion" || !strings.HasPrefix(ev["id"].(string), "cmpl-") {
			t.Errorf("event %d: %s", i, evs[i])
		}
		choices, _ := json.Marshal(ev["choices"])
		// Marshal of a map sorts keys; compare against the same treatment.
		var w any
		_ = json.Unmarshal([]byte(want), &w)
		wantNorm, _ := json.Marshal(w)
		if string(choices) != string(wantNorm) {
			t.Errorf("event %d choices %s, want %s", i, choices, want)
		}
	}
	if !strings.Contains(evs[0], `"choices":[{"text":"one","index":0,"logprobs":null,"finish_reason":null}]`) {
		t.Errorf("field order: %s", evs[0])
	}
}

func TestStreamMidError(t *testing.T) {
	m := newModel("m", "partial")
	m.midErr = errors.New("kv cache corrupted")
	h := NewHandler(newFake(m), Config{})
	rec := serve(t, h, "POST", "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`)
	evs := sseEvents(t, rec.Body.String())
	if len(evs) != 3 {
		t.Fatalf("events %q", evs)
	}
	want := `{"error":{"message":"internal error: generate: kv cache corrupted","type":"server_error","param":null,"code":null}}`
	if evs[2] != want {
		t.Errorf("error event %s, want %s", evs[2], want)
	}
}

func TestStreamSetupError(t *testing.T) {
	// Errors known before the first token still get a real status.
	m := newModel("m")
	m.genErr = fmt.Errorf("full: %w", ErrOverloaded)
	h := NewHandler(newFake(m), Config{})
	rec := serve(t, h, "POST", "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`)
	wantError(t, rec, 429, "requests", "", "rate_limit_exceeded", "full")
}

func TestBodyLimit(t *testing.T) {
	h := NewHandler(newFake(newModel("m", "x")), Config{MaxBodyBytes: 100})
	big := `{"model":"m","prompt":"` + strings.Repeat("a", 200) + `"}`
	wantError(t, serve(t, h, "POST", "/v1/completions", big), 413, "invalid_request_error", "", "request_too_large", "100 bytes")

	// Without Content-Length the limit is hit while reading.
	req := httptest.NewRequest("POST", "/v1/chat/completions", io.MultiReader(strings.NewReader(big)))
	req.ContentLength = -1
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	wantError(t, rec, 413, "invalid_request_error", "", "request_too_large", "")

	if rec := serve(t, h, "POST", "/v1/completions", `{"model":"m","prompt":"ok"}`); rec.Code != 200 {
		t.Errorf("small body: %d %s", rec.Code, rec.Body)
	}
}

func TestAPIKey(t *testing.T) {
	h := NewHandler(newFake(newModel("m", "x")), Config{APIKey: "sk-test"})
	body := `{"model":"m","prompt":"p"}`
	wantError(t, serve(t, h, "POST", "/v1/completions", body), 401, "invalid_request_error", "", "invalid_api_key", "Missing API key")
	for _, auth := range []string{"Bearer wrong", "Bearer sk-tes", "Bearer sk-test2", "Basic sk-test", "sk-test", "Bearer"} {
		rec := serve(t, h, "POST", "/v1/completions", body, "Authorization", auth)
		wantError(t, rec, 401, "invalid_request_error", "", "invalid_api_key", "Incorrect API key")
		if strings.Contains(rec.Body.String(), "sk-tes") {
			t.Errorf("key echoed: %s", rec.Body)
		}
	}
	for _, auth := range []string{"Bearer sk-test", "bearer sk-test"} {
		if rec := serve(t, h, "POST", "/v1/completions", body, "Authorization", auth); rec.Code != 200 {
			t.Errorf("%q: %d %s", auth, rec.Code, rec.Body)
		}
	}
	wantError(t, serve(t, h, "GET", "/v1/models", ""), 401, "invalid_request_error", "", "invalid_api_key", "")
	wantError(t, serve(t, h, "GET", "/v1/unknown", ""), 401, "invalid_request_error", "", "invalid_api_key", "")
	if rec := serve(t, h, "GET", "/health", ""); rec.Code != 200 {
		t.Errorf("health needs no key: %d", rec.Code)
	}
}

func TestRequestID(t *testing.T) {
	h := NewHandler(newFake(), Config{})
	if got := serve(t, h, "GET", "/health", "", "X-Request-Id", "abc-123_x.y:z").Header().Get("X-Request-Id"); got != "abc-123_x.y:z" {
		t.Errorf("kept id = %q", got)
	}
	seen := map[string]bool{}
	for _, in := range []string{"", "has space", "new\x7fline", strings.Repeat("a", 129), "ünïcode"} {
		got := serve(t, h, "GET", "/health", "", "X-Request-Id", in).Header().Get("X-Request-Id")
		if got == in || len(got) < 16 || seen[got] {
			t.Errorf("id for %q = %q", in, got)
		}
		seen[got] = true
	}
	if got := serve(t, h, "GET", "/nowhere", "").Header().Get("X-Request-Id"); got == "" {
		t.Errorf("404 without request id")
	}
}

func TestLogging(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	m := newModel("m", "answer")
	h := NewHandler(newFake(m), Config{APIKey: "sk-secret", Logger: zap.New(core)})
	serve(t, h, "POST", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"my secret prompt"}]}`,
		"Authorization", "Bearer sk-secret", "X-Request-Id", "log-1")
	serve(t, h, "GET", "/v1/models", "", "Authorization", "Bearer sk-wrong", "X-Request-Id", "log-2")

	entries := logs.All()
	if len(entries) != 2 {
		t.Fatalf("%d log lines, want 2", len(entries))
	}
	first := entries[0].ContextMap()
	if first["request_id"] != "log-1" || first["status"] != int64(200) || first["model"] != "m" ||
		first["prompt_tokens"] != int64(len("user:my secret prompt\n")) || first["completion_tokens"] != int64(1) {
		t.Errorf("first line %v", first)
	}
	second := entries[1].ContextMap()
	if second["request_id"] != "log-2" || second["status"] != int64(401) {
		t.Errorf("second line %v", second)
	}
	for _, e := range entries {
		all := fmt.Sprint(e.Message, e.ContextMap())
		if strings.Contains(all, "secret") {
			t.Errorf("log leaks key or prompt: %s", all)
		}
	}
}

// startBlocking starts a request against a real server whose generation
// blocks, and returns once the backend is waiting.
func startBlocking(t *testing.T, srv *httptest.Server, m *fakeModel, body string) (cancel func(), done <-chan struct{}) {
	t.Helper()
	ctx, cancelReq := context.WithCancel(context.Background())
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/v1/chat/completions", strings.NewReader(body))
		resp, err := srv.Client().Do(req)
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
		}
	}()
	select {
	case <-m.started:
	case <-time.After(5 * time.Second):
		t.Fatal("generation never started")
	}
	return cancelReq, finished
}

func TestClientDisconnectCancelsGeneration(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprint("stream=", stream), func(t *testing.T) {
			m := newModel("m", "some", "text")
			m.block = true
			srv := httptest.NewServer(NewHandler(newFake(m), Config{}))
			defer srv.Close()
			body := fmt.Sprintf(`{"model":"m","stream":%v,"messages":[{"role":"user","content":"x"}]}`, stream)
			cancel, done := startBlocking(t, srv, m, body)
			cancel()
			select {
			case <-m.canceled:
			case <-time.After(5 * time.Second):
				t.Fatal("backend never saw the client leave")
			}
			<-done
		})
	}
}

// A client that stops reading must not hold a generation forever.
func TestSlowClientWriteTimeout(t *testing.T) {
	m := newModel("m", strings.Repeat("x", 64<<10))
	m.endless = true
	srv := httptest.NewServer(NewHandler(newFake(m), Config{WriteTimeout: 100 * time.Millisecond}))
	defer srv.Close()
	resp, err := http.Post(srv.URL+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"m","stream":true,"prompt":"p"}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	// Read nothing: socket buffers fill, a write misses its deadline.
	select {
	case <-m.canceled:
	case <-time.After(20 * time.Second):
		t.Fatal("generation not stopped for a client that stopped reading")
	}
}

func TestConcurrentRequests(t *testing.T) {
	m := newModel("m", "a", "b", "c")
	srv := httptest.NewServer(NewHandler(newFake(m), Config{}))
	defer srv.Close()
	const n = 8
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			stream := i%2 == 0
			body := fmt.Sprintf(`{"model":"m","stream":%v,"messages":[{"role":"user","content":"req %d"}]}`, stream, i)
			resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			data, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != 200 {
				errs <- fmt.Errorf("request %d: %d %s", i, resp.StatusCode, data)
				return
			}
			var text string
			if stream {
				sc := bufio.NewScanner(strings.NewReader(string(data)))
				for sc.Scan() {
					payload, ok := strings.CutPrefix(sc.Text(), "data: ")
					if !ok || payload == "[DONE]" {
						continue
					}
					var ch struct {
						Choices []struct {
							Delta struct{ Content string } `json:"delta"`
						} `json:"choices"`
					}
					_ = json.Unmarshal([]byte(payload), &ch)
					for _, c := range ch.Choices {
						text += c.Delta.Content
					}
				}
			} else {
				var cc struct {
					Choices []struct {
						Message struct{ Content string } `json:"message"`
					} `json:"choices"`
				}
				_ = json.Unmarshal(data, &cc)
				if len(cc.Choices) == 1 {
					text = cc.Choices[0].Message.Content
				}
			}
			if text != "abc" {
				errs <- fmt.Errorf("request %d: text %q", i, text)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.reqs) != n {
		t.Errorf("%d generations, want %d", len(m.reqs), n)
	}
}
