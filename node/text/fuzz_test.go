package text

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"
)

// decodeConversation turns fuzz input into messages: messages separated by
// NUL, role and content by the first ':'.
func decodeConversation(s string) []Message {
	if s == "" {
		return nil
	}
	var msgs []Message
	for _, part := range strings.Split(s, "\x00") {
		role, content, _ := strings.Cut(part, ":")
		msgs = append(msgs, Message{Role: role, Content: content})
	}
	return msgs
}

// FuzzRender checks that no template text and no conversation make Render
// panic, that it fails exactly for invalid conversations, and that it is
// deterministic. Seeds: testdata/fuzz/FuzzRender (the fixture templates).
func FuzzRender(f *testing.F) {
	f.Add("", "user:hi", byte(0))
	f.Add("<|im_start|>", "system:s\x00user:u\x00assistant:<think>r</think>a", byte(0xff))
	f.Add("[INST] loop.last and system_message [SYSTEM_PROMPT] [TOOL_RESULTS]", "system:s\x00tool:t", byte(1))
	f.Fuzz(func(t *testing.T, tmpl, conv string, flags byte) {
		msgs := decodeConversation(conv)
		think := flags&8 != 0
		opts := RenderOptions{
			BOS:                 "<s>",
			EmitBOS:             flags&1 != 0,
			AddGenerationPrompt: flags&2 != 0,
			HasToken:            func(string) bool { return flags&16 != 0 },
		}
		if flags&4 != 0 {
			opts.EnableThinking = &think
		}
		got, style, err := Render(tmpl, msgs, opts)
		if verr := validateMessages(msgs); (err != nil) != (verr != nil) {
			t.Fatalf("Render error %v, validation error %v", err, verr)
		}
		if err != nil {
			if !errors.Is(err, ErrInvalidMessages) {
				t.Fatalf("error %v does not wrap ErrInvalidMessages", err)
			}
			return
		}
		if detected := DetectStyle(tmpl); style != detected && !(detected == Fallback && style == ChatML) {
			t.Fatalf("rendered as %v, template detected as %v", style, detected)
		}
		again, _, _ := ParseTemplate(tmpl).Render(msgs, opts)
		if again != got {
			t.Fatalf("Render is not deterministic:\n%q\n%q", got, again)
		}
		if utf8.ValidString(tmpl) && utf8.ValidString(conv) && !utf8.ValidString(got) {
			t.Fatalf("valid input rendered to invalid UTF-8: %q", got)
		}
	})
}
