package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"
)

// chatServer is an OpenAI API that answers each chat turn with "you said:
// <the last message> (turn N)" in two streamed chunks, and records what it
// was sent.
type chatServer struct {
	t    *testing.T
	key  string
	mu   sync.Mutex
	reqs []map[string]any
	// hold, when set, sends the first chunk and then waits for the client
	// to go away (a long reply interrupted).
	hold bool
	// failTurn fails that turn (1-based) with an error event mid-stream.
	failTurn int
}

func (s *chatServer) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		if !s.authorized(w, r) {
			return
		}
		fmt.Fprint(w, `{"object":"list","data":[{"id":"tiny","object":"model"},{"id":"other","object":"model"}]}`)
	})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		if !s.authorized(w, r) {
			return
		}
		var req map[string]any
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		s.mu.Lock()
		s.reqs = append(s.reqs, req)
		turn := len(s.reqs)
		s.mu.Unlock()
		msgs := req["messages"].([]any)
		last := msgs[len(msgs)-1].(map[string]any)["content"].(string)
		w.Header().Set("Content-Type", "text/event-stream")
		send := func(v string) {
			fmt.Fprintf(w, "data: %s\n\n", v)
			w.(http.Flusher).Flush()
		}
		chunk := func(text string) string {
			b, _ := json.Marshal(map[string]any{"choices": []any{map[string]any{"index": 0, "delta": map[string]string{"content": text}}}})
			return string(b)
		}
		send(chunk("you said: "))
		s.mu.Lock()
		hold := s.hold
		s.mu.Unlock()
		if hold {
			<-r.Context().Done()
			return
		}
		if turn == s.failTurn {
			send(`{"error":{"message":"a stage left the mesh","type":"server_error"}}`)
			return
		}
		send(chunk(fmt.Sprintf("%s (turn %d)", last, turn)))
		send(`{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}`)
		send("[DONE]")
	})
	return mux
}

func (s *chatServer) authorized(w http.ResponseWriter, r *http.Request) bool {
	if s.key != "" && r.Header.Get("Authorization") != "Bearer "+s.key {
		w.WriteHeader(http.StatusUnauthorized)
		fmt.Fprint(w, `{"error":{"message":"missing API key"}}`)
		return false
	}
	return true
}

// awaitRequests waits, for 10 s at most, until n requests came.
func (s *chatServer) awaitRequests(n int) {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		s.mu.Lock()
		got := len(s.reqs)
		s.mu.Unlock()
		if got >= n {
			return
		}
	}
}

// messages are the conversation of request i, as "role: content" lines.
func (s *chatServer) messages(i int) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if i >= len(s.reqs) {
		return "<no request>"
	}
	var lines []string
	for _, m := range s.reqs[i]["messages"].([]any) {
		m := m.(map[string]any)
		lines = append(lines, fmt.Sprintf("%s: %s", m["role"], m["content"]))
	}
	return strings.Join(lines, "\n")
}

func startChatServer(t *testing.T, s *chatServer) string {
	s.t = t
	srv := httptest.NewServer(s.handler())
	t.Cleanup(srv.Close)
	return srv.URL
}

func TestChatOneShot(t *testing.T) {
	tests := []struct {
		name  string
		args  []string
		stdin string
		want  string // the conversation sent
		sent  map[string]any
	}{
		{"prompt words", []string{"hello", "there"}, "", "user: hello there", nil},
		{"flags after the prompt", []string{"hi", "--temperature", "0", "--max-tokens=9", "--seed", "7", "--system", "be brief"}, "",
			"system: be brief\nuser: hi", map[string]any{"temperature": 0.0, "max_tokens": 9.0, "seed": 7.0, "model": "tiny"}},
		{"piped text after the prompt", []string{"Summarize:"}, "line 1\nline 2\n", "user: Summarize:\n\nline 1\nline 2", nil},
		{"piped text alone", nil, "just this\n", "user: just this", nil},
		{"another model", []string{"--model", "other", "x"}, "", "user: x", map[string]any{"model": "other"}},
		{"JSON replies", []string{"--json", "x"}, "", "user: x", map[string]any{"response_format": "map[type:json_object]"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := &chatServer{key: "k1"}
			url := startChatServer(t, s)
			var out bytes.Buffer
			args := append([]string{"--node", url, "--api-key", "k1"}, tt.args...)
			if err := chatCommand(context.Background(), strings.NewReader(tt.stdin), &out, args); err != nil {
				t.Fatal(err)
			}
			last := strings.TrimPrefix(tt.want[strings.LastIndex(tt.want, "user: "):], "user: ")
			if want := "you said: " + last + " (turn 1)\n"; out.String() != want {
				t.Errorf("output %q, want %q", out.String(), want)
			}
			if got := s.messages(0); got != tt.want {
				t.Errorf("sent\n%s\nwant\n%s", got, tt.want)
			}
			for k, v := range tt.sent {
				got := s.reqs[0][k]
				if m, ok := got.(map[string]any); ok {
					got = fmt.Sprint(m)
				}
				if got != v {
					t.Errorf("%s = %v, want %v", k, got, v)
				}
			}
			if s.reqs[0]["stream"] != true {
				t.Errorf("not streamed: %v", s.reqs[0])
			}
		})
	}
}

func TestChatErrors(t *testing.T) {
	s := &chatServer{key: "k1"}
	url := startChatServer(t, s)
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"no API key", []string{"--node", url, "hi"}, "wants its API key"},
		{"nobody there", []string{"--node", "127.0.0.1:1", "hi"}, "no meshnode answers at http://127.0.0.1:1"},
		{"nothing to say", []string{"--node", url, "--api-key", "k1"}, "nothing to say"},
		{"bad temperature", []string{"--node", url, "--temperature", "3", "hi"}, "--temperature"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := chatCommand(context.Background(), strings.NewReader(""), io.Discard, tt.args)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("got %v, want an error saying %q", err, tt.want)
			}
		})
	}
}

// runREPL holds a conversation with script as the terminal's lines and
// returns what it printed.
func runREPL(t *testing.T, s *chatServer, in io.Reader, sigs <-chan os.Signal) string {
	t.Helper()
	url := startChatServer(t, s)
	var out lockedBuffer
	c := &chatClient{opts: chatOptions{url: url, key: s.key, model: "tiny", system: "be kind"}, http: &http.Client{}}
	done := make(chan error, 1)
	go func() { done <- c.repl(context.Background(), in, &out, sigs) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("the chat did not end; it printed:\n%s", out.String())
	}
	return out.String()
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func TestChatConversation(t *testing.T) {
	s := &chatServer{failTurn: 3}
	script := strings.Join([]string{
		"hello",
		`"""`, "line one", "line two", `"""`,
		"", "/foo",
		"this one fails", // turn 3: the node fails mid-reply
		"/clear",
		"again",
		"/bye",
		"never sent",
	}, "\n") + "\n"
	out := runREPL(t, s, strings.NewReader(script), make(chan os.Signal))
	wants := []string{
		"system: be kind\nuser: hello",
		"system: be kind\nuser: hello\nassistant: you said: hello (turn 1)\nuser: line one\nline two",
		"system: be kind\nuser: hello\nassistant: you said: hello (turn 1)\nuser: line one\nline two\nassistant: you said: line one\nline two (turn 2)\nuser: this one fails",
		// The failed turn is not kept, and /clear keeps only the system message.
		"system: be kind\nuser: again",
	}
	if len(s.reqs) != len(wants) {
		t.Fatalf("%d requests, want %d; printed:\n%s", len(s.reqs), len(wants), out)
	}
	for i, want := range wants {
		if got := s.messages(i); got != want {
			t.Errorf("turn %d sent\n%s\nwant\n%s", i+1, got, want)
		}
	}
	for _, want := range []string{
		"Talking to tiny at",
		">>> you said: hello (turn 1)\n",
		">>> ... ... ... you said: line one\nline two (turn 2)\n",
		"Unknown command /foo; /help lists them.",
		">>> you said: \nerror: the node failed mid-reply: a stage left the mesh\n",
		"Cleared the conversation.",
		"you said: again (turn 4)\n>>> ",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the chat did not print %q; it printed:\n%s", want, out)
		}
	}
}

// TestChatInterrupt: Ctrl-C stops a reply but not the chat, and what came
// of the reply stays in the conversation.
func TestChatInterrupt(t *testing.T) {
	s := &chatServer{hold: true}
	in, feed := io.Pipe()
	sigs := make(chan os.Signal, 1)
	go func() {
		defer feed.Close()
		fmt.Fprintln(feed, "tell me everything")
		// Interrupt once the reply has begun (the server holds it open).
		s.awaitRequests(1)
		time.Sleep(50 * time.Millisecond)
		sigs <- os.Interrupt
		s.mu.Lock()
		s.hold = false
		s.mu.Unlock()
		fmt.Fprintln(feed, "go on")
		s.awaitRequests(2)
		time.Sleep(100 * time.Millisecond)
	}()
	out := runREPL(t, s, in, sigs)
	if !strings.Contains(out, "you said: \n(stopped)\n") {
		t.Errorf("no sign of the stopped reply; printed:\n%s", out)
	}
	want := "system: be kind\nuser: tell me everything\nassistant: you said: \nuser: go on"
	if got := s.messages(1); got != want {
		t.Errorf("after the interrupt sent\n%s\nwant\n%s", got, want)
	}
}

// TestChatWithNode: a one-shot chat with a node serving stories260K prints
// what the API gives for the same greedy request.
func TestChatWithNode(t *testing.T) {
	cfg := nodeConfig(t)
	cfg.Model = needModel(t)
	cfg.APIKey = "sk-chat-test"
	ready := make(chan string, 1)
	cfg.Ready = func(addr string) { ready <- addr }
	n := startInProcess(t, cfg)
	var addr string
	select {
	case addr = <-ready:
	case err := <-n.done:
		t.Fatalf("node: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("the node did not come up")
	}
	const user = "Tell me a story about a cat."
	body, _ := json.Marshal(map[string]any{
		"model": "stories260K", "temperature": 0, "max_tokens": 32,
		"messages": []map[string]string{{"role": "user", "content": user}},
	})
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/v1/chat/completions", bytes.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+cfg.APIKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var whole struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&whole); err != nil || len(whole.Choices) != 1 {
		t.Fatalf("%v %+v", err, whole)
	}
	t.Setenv("MESHNODE_API_KEY", cfg.APIKey)
	var out bytes.Buffer
	err = chatCommand(context.Background(), strings.NewReader(""), &out,
		[]string{"--node", addr, "--temperature", "0", "--max-tokens", "32", "--verbose", user})
	if err != nil {
		t.Fatal(err)
	}
	got, stats, _ := strings.Cut(out.String(), "\n(")
	if want := whole.Choices[0].Message.Content; got != want || want == "" {
		t.Errorf("chat printed %q, the API says %q", got, want)
	}
	if !strings.HasPrefix(stats, "32 tokens in ") {
		t.Errorf("--verbose printed %q", stats)
	}
	var ee *exitError
	if errors.As(chatCommand(context.Background(), strings.NewReader(""), io.Discard, []string{"--node", addr, "--api-key", "wrong", "hi"}), &ee) == false || ee.code != exitUnreachable {
		t.Errorf("a wrong key: %v", ee)
	}
}
