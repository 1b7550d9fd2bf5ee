package text

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"
)

// Style is a chat template family.
type Style int

const (
	Fallback Style = iota // no template, or one we do not recognise
	Llama3
	ChatML
	Mistral
	Gemma
)

func (s Style) String() string {
	switch s {
	case Fallback:
		return "fallback"
	case Llama3:
		return "llama3"
	case ChatML:
		return "chatml"
	case Mistral:
		return "mistral"
	case Gemma:
		return "gemma"
	}
	return fmt.Sprintf("Style(%d)", int(s))
}

// Message roles accepted by Render.
const (
	RoleSystem    = "system"
	RoleUser      = "user"
	RoleAssistant = "assistant"
	RoleTool      = "tool"
)

// Message is one chat message with plain text content.
type Message struct {
	Role    string
	Content string
}

// ErrInvalidMessages is wrapped by every error Render returns for a
// conversation it cannot render; the HTTP layer maps it to 400.
var ErrInvalidMessages = errors.New("invalid chat messages")

// RenderOptions controls the parts of a prompt that do not come from the
// messages.
type RenderOptions struct {
	// BOS and EOS are the vocabulary's texts for its begin and end of sequence
	// tokens. Empty means the family's usual text (<|begin_of_text|>, <s>,
	// <bos>; </s>).
	BOS, EOS string
	// EmitBOS writes the BOS text where the template has bos_token. Leave it
	// false when the tokenizer adds the BOS token itself, or the prompt would
	// start with two.
	EmitBOS bool
	// AddGenerationPrompt ends the prompt with the opening of an assistant
	// turn (no effect for Mistral, whose [/INST] is the prompt).
	AddGenerationPrompt bool
	// EnableThinking, when false, turns thinking off in templates that have
	// the switch (Qwen3). Nil means the template's default: on.
	EnableThinking *bool
	// HasToken reports whether the vocabulary has a token; the fallback uses
	// it to choose ChatML. Nil means no.
	HasToken func(string) bool
	// Now is the date templates print (Llama 3.2's "Today Date"). Zero means
	// time.Now().
	Now time.Time
}

func (o RenderOptions) bos(def string) string {
	if !o.EmitBOS {
		return ""
	}
	if o.BOS != "" {
		return o.BOS
	}
	return def
}

func (o RenderOptions) eos(def string) string {
	if o.EOS != "" {
		return o.EOS
	}
	return def
}

// DetectStyle names the family of a Jinja chat template from its marker
// strings; Fallback when it has none we know.
func DetectStyle(tmpl string) Style {
	switch {
	case strings.Contains(tmpl, "<|start_header_id|>") && strings.Contains(tmpl, "<|eot_id|>"):
		return Llama3
	// Phi-4 uses <|im_start|> with a different separator; not ChatML.
	case strings.Contains(tmpl, "<|im_start|>") && !strings.Contains(tmpl, "<|im_sep|>"):
		return ChatML
	case strings.Contains(tmpl, "<start_of_turn>"):
		return Gemma
	// Llama 2 also uses [INST], but wraps the system message in <<SYS>>.
	case strings.Contains(tmpl, "[INST]") && !strings.Contains(tmpl, "<<SYS>>"):
		return Mistral
	}
	return Fallback
}

// Template is a chat template read once, so that each request only renders.
// The zero value renders the fallback format.
type Template struct {
	style Style
	bos   bool // the template writes bos_token (ChatML; the others always do)

	// Llama 3.1+
	dated      bool
	knowledge  string // "December 2023"
	dateFixed  string // date literal used when the template has no strftime_now
	dateFormat string // strftime format passed to strftime_now
	ipython    bool   // tool results go in an ipython turn
	toolJSON   bool   // ... JSON-quoted

	// ChatML
	defaultSystem string
	toolResponse  bool   // tool results as <tool_response> blocks in a user turn
	thinkStrip    bool   // Qwen3: reasoning of earlier assistant turns is dropped
	genPrompt     string // "<|im_start|>assistant\n", possibly with more
	thinkOff      string // appended to genPrompt when thinking is disabled
	thinkOn       string // appended to genPrompt when thinking is enabled

	// Mistral
	instOpen, instClose    string
	asstPrefix, asstSuffix string
	asstTrim               bool
	sysLast                bool   // system goes into the last message (v3)
	sysBlock               string // "[SYSTEM_PROMPT]" opener (v7), or ""
	toolResults            string // "[TOOL_RESULTS]" opener, or ""
}

// Jinja string literals in GGUF metadata carry newlines either raw or as the
// escape \n, depending on how the template was written.
const nl = `(?:\\n|\n)`

var (
	reKnowledge    = regexp.MustCompile(`Cutting Knowledge Date: ([^"'\\\n]*)`)
	reDateLiteral  = regexp.MustCompile(`set date_string = ["']([^"']*)["']`)
	reStrftime     = regexp.MustCompile(`strftime_now\(\s*["']([^"']*)["']\s*\)`)
	reChatMLSystem = regexp.MustCompile(`<\|im_start\|>system` + nl + `([^'"{}<\\]+)<\|im_end\|>`)
	reSystemVar    = regexp.MustCompile(`set system_message = '([^'\\{}]+)'`)
	reChatMLGen    = regexp.MustCompile(`\{\{-?\s*['"](<\|im_start\|>assistant` + nl + `(?:[^'"\\]|\\.)*)['"]\s*-?\}\}`)
	reLiteral      = regexp.MustCompile(`'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)"`)
	reAsstPrefix   = regexp.MustCompile(`['"] ['"]\s*\+\s*message(?:\[['"]content['"]\]|\.content)`)
	reAsstTrim     = regexp.MustCompile(`message(?:\[['"]content['"]\]|\.content)\s*\|\s*trim\s*\+\s*eos_token`)
	reAsstSuffix   = regexp.MustCompile(`eos_token\s*\+\s*['"] ['"]`)
)

// ParseTemplate reads a Jinja chat template. It never fails: a template it
// does not recognise renders in the fallback format.
func ParseTemplate(tmpl string) *Template {
	t := &Template{style: DetectStyle(tmpl), bos: strings.Contains(tmpl, "bos_token")}
	switch t.style {
	case Llama3:
		t.dated = strings.Contains(tmpl, "Cutting Knowledge Date:")
		t.knowledge = "December 2023"
		if m := reKnowledge.FindStringSubmatch(tmpl); m != nil {
			t.knowledge = m[1]
		}
		t.dateFixed = "26 Jul 2024"
		if m := reDateLiteral.FindStringSubmatch(tmpl); m != nil {
			t.dateFixed = m[1]
		}
		// Hugging Face and llama.cpp both define strftime_now, so a template
		// that calls it prints the current date rather than its literal.
		if m := reStrftime.FindStringSubmatch(tmpl); m != nil {
			t.dateFormat = m[1]
		}
		t.ipython = strings.Contains(tmpl, "ipython")
		t.toolJSON = strings.Contains(tmpl, "message.content | tojson")
	case ChatML:
		t.parseChatML(tmpl)
	case Mistral:
		t.parseMistral(tmpl)
	}
	return t
}

func (t *Template) parseChatML(tmpl string) {
	if m := reChatMLSystem.FindStringSubmatch(tmpl); m != nil {
		t.defaultSystem = unescapeJinja(m[1])
	} else if m := reSystemVar.FindStringSubmatch(tmpl); m != nil {
		t.defaultSystem = unescapeJinja(m[1])
	}
	t.toolResponse = strings.Contains(tmpl, "<tool_response>")
	t.thinkStrip = strings.Contains(tmpl, "</think>") && strings.Contains(tmpl, "last_query_index")
	t.genPrompt = "<|im_start|>assistant\n"
	// The generation prompt is the last assistant opener written as a whole
	// expression; some templates append <think> to it.
	if all := reChatMLGen.FindAllStringSubmatch(tmpl, -1); all != nil {
		t.genPrompt = unescapeJinja(all[len(all)-1][1])
	}
	// Qwen3: {% if enable_thinking is defined and enable_thinking is false %}
	// {{ OFF }}{% else %}{{ ON }}{% endif %}, the else branch optional.
	if i := strings.Index(tmpl, "enable_thinking is false"); i >= 0 {
		block := tmpl[i:]
		if j := strings.Index(block, "endif"); j >= 0 {
			block = block[:j]
		}
		off, on := block, ""
		if j := strings.Index(block, "else"); j >= 0 {
			off, on = block[:j], block[j:]
		}
		t.thinkOff = firstLiteral(off)
		t.thinkOn = firstLiteral(on)
	}
}

func (t *Template) parseMistral(tmpl string) {
	switch {
	case strings.Contains(tmpl, `' [INST] '`) || strings.Contains(tmpl, `" [INST] "`):
		t.instOpen = " [INST] "
	case strings.Contains(tmpl, "[INST] "):
		t.instOpen = "[INST] "
	default:
		t.instOpen = "[INST]"
	}
	t.instClose = "[/INST]"
	if strings.Contains(tmpl, " [/INST]") {
		t.instClose = " [/INST]"
	}
	if reAsstPrefix.MatchString(tmpl) {
		t.asstPrefix = " "
	}
	if reAsstSuffix.MatchString(tmpl) {
		t.asstSuffix = " "
	}
	t.asstTrim = reAsstTrim.MatchString(tmpl)
	t.sysLast = strings.Contains(tmpl, "loop.last and system_message")
	if strings.Contains(tmpl, "[SYSTEM_PROMPT]") {
		t.sysBlock = "[SYSTEM_PROMPT]"
		if strings.Contains(tmpl, "[SYSTEM_PROMPT] ") {
			t.sysBlock += " "
		}
	}
	if strings.Contains(tmpl, "[TOOL_RESULTS]") {
		t.toolResults = "[TOOL_RESULTS]"
		if strings.Contains(tmpl, "[TOOL_RESULTS] ") {
			t.toolResults += " "
		}
	}
}

// firstLiteral returns the first Jinja string literal in s, unescaped.
func firstLiteral(s string) string {
	m := reLiteral.FindStringSubmatch(s)
	if m == nil {
		return ""
	}
	if m[1] != "" {
		return unescapeJinja(m[1])
	}
	return unescapeJinja(m[2])
}

// unescapeJinja undoes the escapes a Jinja (Python) string literal may hold.
func unescapeJinja(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '\\' || i+1 == len(s) {
			b.WriteByte(c)
			continue
		}
		i++
		switch s[i] {
		case 'n':
			b.WriteByte('\n')
		case 't':
			b.WriteByte('\t')
		case 'r':
			b.WriteByte('\r')
		default: // \\, \', \" and anything else: the character itself
			b.WriteByte(s[i])
		}
	}
	return b.String()
}

// Style is the template family; Fallback for the zero Template.
func (t *Template) Style() Style { return t.style }

// Render renders tmpl (see ParseTemplate) for msgs. It returns the style it
// rendered in: the template's, or for an unknown template ChatML or Fallback.
func Render(tmpl string, msgs []Message, opts RenderOptions) (string, Style, error) {
	return ParseTemplate(tmpl).Render(msgs, opts)
}

// Render renders msgs in t's format; see the package documentation.
func (t *Template) Render(msgs []Message, opts RenderOptions) (string, Style, error) {
	if err := validateMessages(msgs); err != nil {
		return "", t.style, fmt.Errorf("rendering %s chat prompt: %w", t.style, err)
	}
	var b strings.Builder
	style := t.style
	switch t.style {
	case Llama3:
		t.renderLlama3(&b, msgs, opts)
	case ChatML:
		t.renderChatML(&b, msgs, opts)
	case Mistral:
		t.renderMistral(&b, msgs, opts)
	case Gemma:
		renderGemma(&b, msgs, opts)
	default:
		if opts.HasToken != nil && opts.HasToken("<|im_start|>") {
			style = ChatML
			fallbackChatML.renderChatML(&b, msgs, opts)
		} else {
			renderPlain(&b, msgs, opts)
		}
	}
	return b.String(), style, nil
}

var fallbackChatML = &Template{style: ChatML, genPrompt: "<|im_start|>assistant\n"}

func validateMessages(msgs []Message) error {
	if len(msgs) == 0 {
		return fmt.Errorf("no messages: %w", ErrInvalidMessages)
	}
	for i, m := range msgs {
		switch m.Role {
		case RoleSystem:
			if i != 0 {
				return fmt.Errorf("message %d: a system message is only allowed first: %w", i, ErrInvalidMessages)
			}
		case RoleUser, RoleAssistant, RoleTool:
		default:
			return fmt.Errorf("message %d: unknown role %q (want system, user, assistant or tool): %w", i, m.Role, ErrInvalidMessages)
		}
	}
	return nil
}

func (t *Template) renderLlama3(b *strings.Builder, msgs []Message, o RenderOptions) {
	b.WriteString(o.bos("<|begin_of_text|>"))
	header := func(role string) {
		b.WriteString("<|start_header_id|>")
		b.WriteString(role)
		b.WriteString("<|end_header_id|>\n\n")
	}
	if t.dated {
		sys := ""
		if msgs[0].Role == RoleSystem {
			sys = pyStrip(msgs[0].Content)
			msgs = msgs[1:]
		}
		date := t.dateFixed
		if t.dateFormat != "" {
			now := o.Now
			if now.IsZero() {
				now = time.Now()
			}
			date = strftime(now, t.dateFormat)
		}
		header("system")
		b.WriteString("Cutting Knowledge Date: " + t.knowledge + "\n")
		b.WriteString("Today Date: " + date + "\n\n")
		b.WriteString(sys)
		b.WriteString("<|eot_id|>")
	}
	for _, m := range msgs {
		if m.Role == RoleTool && t.ipython {
			header("ipython")
			if t.toolJSON {
				// A string is "iterable" to Jinja, so the template JSON-quotes it.
				b.WriteString(pyJSONString(m.Content))
			} else {
				b.WriteString(m.Content)
			}
			b.WriteString("<|eot_id|>")
			continue
		}
		header(m.Role)
		b.WriteString(pyStrip(m.Content))
		b.WriteString("<|eot_id|>")
	}
	if o.AddGenerationPrompt {
		header(RoleAssistant)
	}
}

func (t *Template) renderChatML(b *strings.Builder, msgs []Message, o RenderOptions) {
	if t.bos {
		b.WriteString(o.bos(""))
	}
	if t.defaultSystem != "" && msgs[0].Role != RoleSystem {
		b.WriteString("<|im_start|>system\n" + t.defaultSystem + "<|im_end|>\n")
	}
	// Qwen3 keeps reasoning only in assistant turns after the last real user
	// query (a user message that is not just a tool response).
	lastQuery := len(msgs) - 1
	if t.thinkStrip {
		for i := len(msgs) - 1; i >= 0; i-- {
			c := msgs[i].Content
			if msgs[i].Role == RoleUser && !(strings.HasPrefix(c, "<tool_response>") && strings.HasSuffix(c, "</tool_response>")) {
				lastQuery = i
				break
			}
		}
	}
	for i, m := range msgs {
		switch {
		case m.Role == RoleTool && t.toolResponse:
			if i == 0 || msgs[i-1].Role != RoleTool {
				b.WriteString("<|im_start|>user")
			}
			b.WriteString("\n<tool_response>\n" + m.Content + "\n</tool_response>")
			if i == len(msgs)-1 || msgs[i+1].Role != RoleTool {
				b.WriteString("<|im_end|>\n")
			}
			continue
		case m.Role == RoleAssistant && t.thinkStrip:
			content, reasoning := splitThink(m.Content)
			b.WriteString("<|im_start|>assistant\n")
			if i > lastQuery && (i == len(msgs)-1 || reasoning != "") {
				b.WriteString("<think>\n" + strings.Trim(reasoning, "\n") + "\n</think>\n\n" + strings.TrimLeft(content, "\n"))
			} else {
				b.WriteString(content)
			}
			b.WriteString("<|im_end|>\n")
			continue
		}
		b.WriteString("<|im_start|>" + m.Role + "\n" + m.Content + "<|im_end|>\n")
	}
	if o.AddGenerationPrompt {
		b.WriteString(t.genPrompt)
		if o.EnableThinking != nil && !*o.EnableThinking {
			b.WriteString(t.thinkOff)
		} else {
			b.WriteString(t.thinkOn)
		}
	}
}

// splitThink separates "<think>reasoning</think>answer" the way Qwen3's
// template does: reasoning is what precedes the first </think> after the last
// <think>, the content what follows the last </think>.
func splitThink(s string) (content, reasoning string) {
	i := strings.Index(s, "</think>")
	if i < 0 {
		return s, ""
	}
	r := strings.TrimRight(s[:i], "\n")
	if j := strings.LastIndex(r, "<think>"); j >= 0 {
		r = r[j+len("<think>"):]
	}
	reasoning = strings.TrimLeft(r, "\n")
	content = strings.TrimLeft(s[strings.LastIndex(s, "</think>")+len("</think>"):], "\n")
	return content, reasoning
}

func (t *Template) renderMistral(b *strings.Builder, msgs []Message, o RenderOptions) {
	b.WriteString(o.bos("<s>"))
	eos := o.eos("</s>")
	sys, hasSys := "", false
	if msgs[0].Role == RoleSystem {
		sys, hasSys = msgs[0].Content, true
		msgs = msgs[1:]
	}
	if hasSys && t.sysBlock != "" {
		b.WriteString(t.sysBlock + sys + "[/SYSTEM_PROMPT]")
		hasSys = false
	}
	for i, m := range msgs {
		switch m.Role {
		case RoleAssistant:
			c := m.Content
			if t.asstTrim {
				c = pyStrip(c)
			}
			b.WriteString(t.asstPrefix + c + eos + t.asstSuffix)
		case RoleTool:
			if t.toolResults != "" {
				b.WriteString(t.toolResults + `{"content": ` + m.Content + `}[/TOOL_RESULTS]`)
				break
			}
			// No tool support in the template: the result is a user turn.
			fallthrough
		default:
			c := m.Content
			if hasSys && ((t.sysLast && i == len(msgs)-1) || (!t.sysLast && i == 0)) {
				c = sys + "\n\n" + c
			}
			b.WriteString(t.instOpen + c + t.instClose)
		}
	}
}

func renderGemma(b *strings.Builder, msgs []Message, o RenderOptions) {
	b.WriteString(o.bos("<bos>"))
	prefix := ""
	if msgs[0].Role == RoleSystem {
		prefix = msgs[0].Content + "\n\n"
		msgs = msgs[1:]
	}
	for i, m := range msgs {
		role := m.Role
		if role == RoleAssistant {
			role = "model"
		}
		b.WriteString("<start_of_turn>" + role + "\n")
		if i == 0 {
			b.WriteString(prefix)
		}
		b.WriteString(pyStrip(m.Content))
		b.WriteString("<end_of_turn>\n")
	}
	if o.AddGenerationPrompt {
		b.WriteString("<start_of_turn>model\n")
	}
}

func renderPlain(b *strings.Builder, msgs []Message, o RenderOptions) {
	b.WriteString(o.bos(""))
	for _, m := range msgs {
		switch m.Role {
		case RoleSystem:
			b.WriteString("System: ")
		case RoleUser:
			b.WriteString("User: ")
		case RoleAssistant:
			b.WriteString("Assistant: ")
		case RoleTool:
			b.WriteString("Tool: ")
		}
		b.WriteString(m.Content)
		b.WriteString("\n")
	}
	if o.AddGenerationPrompt {
		b.WriteString("Assistant:")
	}
}
