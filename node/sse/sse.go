// Package sse reads a server-sent event stream as the OpenAI API writes
// it: "data: <json>" lines separated by blank lines, ended by
// "data: [DONE]". meshnode chat, the tests, the load test and the mesh
// benchmark read meshnode's streams through it, each with checks of its
// own.
package sse

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
)

// ErrNoDone is returned when the stream ends without "data: [DONE]".
var ErrNoDone = errors.New("the stream ended without [DONE]")

// maxEvent bounds one event line.
const maxEvent = 4 << 20

// Each calls fn with the data of every event up to [DONE] and returns nil
// once [DONE] came. Blank lines and comments (":...") are skipped; any
// other line is an error, as is fn's, which stops the reading. A stream
// that ends early gives the read error, else ErrNoDone.
func Each(r io.Reader, fn func(data []byte) error) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxEvent)
	for sc.Scan() {
		line := sc.Bytes()
		if len(line) == 0 || line[0] == ':' {
			continue
		}
		data, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			return fmt.Errorf("stream line %q is not an event", line)
		}
		data = bytes.TrimPrefix(data, []byte(" "))
		if string(data) == "[DONE]" {
			return nil
		}
		if err := fn(data); err != nil {
			return err
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return ErrNoDone
}

// Chunk is what one event of an OpenAI stream may hold: per choice, a
// completion's text or a chat's delta and the finish reason; the usage
// (with include_usage); or the error that ends a failed stream.
type Chunk struct {
	Choices []struct {
		Index int    `json:"index"`
		Text  string `json:"text"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}
