package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/meshnode/meshnode/node/sse"
)

func runChat(ctx context.Context, args []string) error {
	return chatCommand(ctx, os.Stdin, os.Stdout, args)
}

// chatOptions are what a chat sends with every request.
type chatOptions struct {
	url, key    string
	model       string
	system      string
	temperature *float64
	maxTokens   int
	seed        *int64
	json        bool
	verbose     bool
}

func chatCommand(ctx context.Context, in io.Reader, out io.Writer, args []string) error {
	fs := newFlags("chat [flags] [PROMPT...]", `Talks to the model a node serves, through its OpenAI API, in the terminal.

With a PROMPT (or text piped in, or both: the PROMPT first, then the piped
text), it streams one answer and exits. Without, in a terminal, it holds a
conversation: each reply streams as it is generated and the whole
conversation goes with every turn. There, Ctrl-C stops a reply (what came
so far stays in the conversation), and these commands work:

  /clear   forget the conversation (the --system message stays)
  /help    list the commands
  /bye     leave (also /exit, or Ctrl-D)
  """      begin or end a message of several lines

The node is the local one unless --node says otherwise; its API key comes
from --api-key, --api-key-file, MESHNODE_API_KEY or the node's --config
file, as for 'meshnode status'.`, `  meshnode chat
  meshnode chat "Once upon a time"
  meshnode chat --system "Answer in one sentence." --temperature 0
  git diff | meshnode chat "Write a commit message for this change:"
  meshnode chat --json "List three colors as JSON."
  meshnode chat --node http://10.0.0.7:9337 --api-key-file ~/.meshnode-key --verbose`)
	nodeURL := fs.String("node", "http://127.0.0.1:9337", "the node's HTTP address (URL or HOST:PORT)")
	key := fs.String("api-key", "", "the node's API key, if it has one")
	keyFile := fs.String("api-key-file", "", "read the API key from this file")
	fs.String("config", "", "the node's configuration file: take the address (http) and API key from it")
	model := fs.String("model", "", "the model to talk to (default: the first the node serves)")
	system := fs.String("system", "", "a system message that opens the conversation")
	temperature := fs.String("temperature", "", "sampling temperature, 0 (greedy) to 2 (default: the server's, 1)")
	maxTokens := fs.Int("max-tokens", 0, "most tokens in one reply (0: as many as the context allows)")
	seed := fs.String("seed", "", "random seed, for replies that repeat (default: a new one each time)")
	asJSON := fs.Bool("json", false, "make every reply one JSON object (response_format json_object)")
	verbose := fs.Bool("verbose", false, "after each reply, print its token count and speed")
	words, err := parseWithArgs(fs, args)
	if err != nil {
		return err
	}
	base, apiKey, err := nodeEndpoint(fs, *nodeURL, *key, *keyFile)
	if err != nil {
		return err
	}
	opts := chatOptions{url: base, key: apiKey, model: *model, system: *system, maxTokens: *maxTokens, json: *asJSON, verbose: *verbose}
	if *temperature != "" {
		t, err := strconv.ParseFloat(*temperature, 64)
		if err != nil || t < 0 || t > 2 {
			return fmt.Errorf("--temperature %q: want a number from 0 to 2", *temperature)
		}
		opts.temperature = &t
	}
	if *seed != "" {
		s, err := strconv.ParseInt(*seed, 10, 64)
		if err != nil {
			return fmt.Errorf("--seed %q: want an integer", *seed)
		}
		opts.seed = &s
	}
	if *maxTokens < 0 {
		return fmt.Errorf("--max-tokens %d: want 0 (no limit) or more", *maxTokens)
	}

	prompt := strings.Join(words, " ")
	interactive := prompt == "" && isTerminal(in)
	if !isTerminal(in) {
		piped, err := io.ReadAll(in)
		if err != nil {
			return fmt.Errorf("reading standard input: %w", err)
		}
		if p := strings.TrimSpace(string(piped)); p != "" {
			prompt = strings.TrimSpace(prompt + "\n\n" + p)
		}
	}
	if !interactive && prompt == "" {
		return &exitError{code: 2, msg: "nothing to say: give a PROMPT, pipe text in, or run 'meshnode chat' in a terminal for a conversation"}
	}
	c := &chatClient{opts: opts, http: &http.Client{}}
	if c.opts.model == "" {
		if c.opts.model, err = c.firstModel(ctx); err != nil {
			return err
		}
	}
	if !interactive {
		_, err := c.reply(ctx, out, c.conversation(prompt))
		return err
	}
	// Ctrl-C stops a reply, not the chat: the conversation runs on a
	// context of its own, and the signals come here.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	return c.repl(context.WithoutCancel(ctx), in, out, sigs)
}

// chatMessage is one turn of the conversation, as the API takes it.
type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chatClient struct {
	opts chatOptions
	http *http.Client
}

// conversation opens a conversation: the system message, if any, and
// the user's first message, if any.
func (c *chatClient) conversation(user string) []chatMessage {
	var msgs []chatMessage
	if c.opts.system != "" {
		msgs = append(msgs, chatMessage{Role: "system", Content: c.opts.system})
	}
	if user != "" {
		msgs = append(msgs, chatMessage{Role: "user", Content: user})
	}
	return msgs
}

const chatHelp = `Commands:
  /clear   forget the conversation
  /help    this list
  /bye     leave (also /exit, or Ctrl-D)
  """      begin or end a message of several lines
Ctrl-C stops a reply.
`

// repl holds a conversation: lines from in, replies to out. A SIGINT on
// sigs stops the reply in progress (or, at the prompt, says how to
// leave); SIGTERM ends the chat.
func (c *chatClient) repl(ctx context.Context, in io.Reader, out io.Writer, sigs <-chan os.Signal) error {
	fmt.Fprintf(out, "Talking to %s at %s. Type /help for commands, /bye or Ctrl-D to leave.\n", c.opts.model, c.opts.url)
	// The reader owns stdin until EOF: a blocked terminal read cannot be
	// interrupted, and the process ends with the chat.
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(in)
		sc.Buffer(make([]byte, 64<<10), 16<<20)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	msgs := c.conversation("")
	keep := len(msgs) // what /clear keeps
	var multi *strings.Builder
	prompt := func() {
		if multi != nil {
			fmt.Fprint(out, "... ")
		} else {
			fmt.Fprint(out, ">>> ")
		}
	}
	prompt()
	for {
		var line string
		select {
		case s := <-sigs:
			if s == syscall.SIGTERM {
				fmt.Fprintln(out)
				return nil
			}
			fmt.Fprint(out, "\nUse Ctrl-D or /bye to leave.\n")
			prompt()
			continue
		case l, ok := <-lines:
			if !ok {
				fmt.Fprintln(out)
				return nil
			}
			line = l
		}
		text := strings.TrimSpace(line)
		switch {
		case multi != nil:
			if before, done := strings.CutSuffix(text, `"""`); done {
				multi.WriteString(before)
				text, multi = strings.TrimSpace(multi.String()), nil
				break
			}
			multi.WriteString(line + "\n")
			prompt()
			continue
		case strings.HasPrefix(text, `"""`):
			rest := strings.TrimPrefix(text, `"""`)
			if body, done := strings.CutSuffix(rest, `"""`); done && rest != "" {
				text = strings.TrimSpace(body)
				break
			}
			multi = &strings.Builder{}
			if rest != "" {
				multi.WriteString(rest + "\n")
			}
			prompt()
			continue
		}
		switch strings.ToLower(text) {
		case "":
			prompt()
			continue
		case "/bye", "/exit", "/quit":
			return nil
		case "/clear":
			msgs = msgs[:keep]
			fmt.Fprintln(out, "Cleared the conversation.")
			prompt()
			continue
		case "/help", "/?":
			fmt.Fprint(out, chatHelp)
			prompt()
			continue
		}
		if strings.HasPrefix(text, "/") && !strings.Contains(text, " ") {
			fmt.Fprintf(out, "Unknown command %s; /help lists them.\n", text)
			prompt()
			continue
		}
		msgs = append(msgs, chatMessage{Role: "user", Content: text})
		answer, sig, err := c.replyInterruptible(ctx, out, msgs, sigs)
		switch {
		case sig == syscall.SIGTERM:
			fmt.Fprintln(out)
			return nil
		case sig != nil:
			fmt.Fprint(out, "(stopped)\n")
			msgs = append(msgs, chatMessage{Role: "assistant", Content: answer})
		case err != nil:
			fmt.Fprintf(out, "error: %v\n", err)
			msgs = msgs[:len(msgs)-1] // the message can be sent again
		default:
			msgs = append(msgs, chatMessage{Role: "assistant", Content: answer})
		}
		prompt()
	}
}

// replyInterruptible is reply, stopped by a signal on sigs, which it
// returns (nil when none came).
func (c *chatClient) replyInterruptible(ctx context.Context, out io.Writer, msgs []chatMessage, sigs <-chan os.Signal) (string, os.Signal, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	got := make(chan os.Signal, 1)
	done := make(chan struct{})
	go func() {
		defer close(got)
		select {
		case s := <-sigs:
			got <- s
			cancel()
		case <-done:
		}
	}()
	answer, err := c.reply(ctx, out, msgs)
	close(done)
	if s, ok := <-got; ok {
		return answer, s, nil
	}
	return answer, nil, err
}

// firstModel asks the node which models it serves and takes the first.
func (c *chatClient) firstModel(ctx context.Context) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.opts.url+"/v1/models", nil)
	if err != nil {
		return "", fmt.Errorf("bad --node %q: %w", c.opts.url, err)
	}
	resp, err := c.do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&list); err != nil {
		return "", fmt.Errorf("%s/v1/models: %w", c.opts.url, err)
	}
	if len(list.Data) == 0 {
		return "", fmt.Errorf("the node at %s serves no model yet (is it still loading? 'meshnode status' shows it)", c.opts.url)
	}
	return list.Data[0].ID, nil
}

// do sends a request with the API key and turns what goes wrong into
// errors that say what to do.
func (c *chatClient) do(req *http.Request) (*http.Response, error) {
	if c.opts.key != "" {
		req.Header.Set("Authorization", "Bearer "+c.opts.key)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		if req.Context().Err() != nil {
			return nil, context.Cause(req.Context())
		}
		return nil, &exitError{code: exitUnreachable, msg: fmt.Sprintf(`no meshnode answers at %s (%s).
  Is the node running? Start one with 'meshnode serve', or point --node at it.`, c.opts.url, shortNetErr(err))}
	}
	if resp.StatusCode == http.StatusOK {
		return resp, nil
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	var apiErr struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	msg := firstLine(body)
	if json.Unmarshal(body, &apiErr) == nil && apiErr.Error.Message != "" {
		msg = apiErr.Error.Message
	}
	if resp.StatusCode == http.StatusUnauthorized {
		return nil, &exitError{code: exitUnreachable, msg: fmt.Sprintf(
			"the node at %s wants its API key: pass --api-key or --api-key-file, or set MESHNODE_API_KEY", c.opts.url)}
	}
	return nil, fmt.Errorf("the node answered %s: %s", resp.Status, msg)
}

// reply sends the conversation, streams the answer's text to out as it
// comes, and returns the answer (what came of it, on an error).
func (c *chatClient) reply(ctx context.Context, out io.Writer, msgs []chatMessage) (string, error) {
	body := map[string]any{
		"model": c.opts.model, "messages": msgs, "stream": true,
		"stream_options": map[string]bool{"include_usage": true},
	}
	if c.opts.temperature != nil {
		body["temperature"] = *c.opts.temperature
	}
	if c.opts.maxTokens > 0 {
		body["max_tokens"] = c.opts.maxTokens
	}
	if c.opts.seed != nil {
		body["seed"] = *c.opts.seed
	}
	if c.opts.json {
		body["response_format"] = map[string]string{"type": "json_object"}
	}
	data, err := json.Marshal(body)
	if err != nil {
		return "", err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.opts.url+"/v1/chat/completions", bytes.NewReader(data))
	if err != nil {
		return "", fmt.Errorf("bad --node %q: %w", c.opts.url, err)
	}
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := c.do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var answer strings.Builder
	var first time.Duration
	var completion int
	var failed error // the node's own error event, as opposed to a broken stream
	err = sse.Each(resp.Body, func(data []byte) error {
		var chunk sse.Chunk
		if err := json.Unmarshal(data, &chunk); err != nil {
			return fmt.Errorf("a reply chunk that is not JSON: %w", err)
		}
		if chunk.Error != nil {
			failed = fmt.Errorf("the node failed mid-reply: %s", chunk.Error.Message)
			return failed
		}
		if chunk.Usage != nil {
			completion = chunk.Usage.CompletionTokens
		}
		for _, ch := range chunk.Choices {
			if ch.Delta.Content == "" {
				continue
			}
			if answer.Len() == 0 {
				first = time.Since(start)
			}
			answer.WriteString(ch.Delta.Content)
			fmt.Fprint(out, ch.Delta.Content)
		}
		return nil
	})
	endLine(out, answer.String())
	switch {
	case failed != nil:
		return answer.String(), failed
	case err != nil && ctx.Err() != nil:
		return answer.String(), context.Cause(ctx)
	case err != nil:
		return answer.String(), fmt.Errorf("the reply broke off: %w", err)
	}
	if c.opts.verbose {
		elapsed := time.Since(start)
		rate := ""
		if completion > 1 && elapsed > first {
			rate = fmt.Sprintf(", %.1f tokens/s", float64(completion-1)/(elapsed-first).Seconds())
		}
		fmt.Fprintf(out, "(%d tokens in %.2f s%s; first token after %d ms)\n", completion, elapsed.Seconds(), rate, first.Milliseconds())
	}
	return answer.String(), nil
}

// endLine ends the reply's last line.
func endLine(out io.Writer, answer string) {
	if answer != "" && !strings.HasSuffix(answer, "\n") {
		fmt.Fprintln(out)
	}
}
