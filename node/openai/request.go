package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"reflect"
	"strconv"
	"strings"
)

// maxStop is OpenAI's limit on stop sequences.
const maxStop = 4

const noTools = "tool calling is not supported"

// genParams are the request fields shared by both endpoints, validated.
type genParams struct {
	model        string
	n            int // choices, 1..maxChoices
	stream       bool
	includeUsage bool
	maxTokens    int // 0: the client set no limit

	stop             []string
	temperature      float32
	topK             int
	topP             float32
	minP             float32
	seed             *int64
	repeatPenalty    float32
	frequencyPenalty float32
	presencePenalty  float32

	logprobs    bool   // return each token's log-probability
	topLogprobs int    // with this many alternatives
	jsonObject  bool   // response_format json_object or json_schema
	jsonSchema  string // json_schema's schema, compact
}

// maxChoices bounds n: each choice is a sequence of its own.
const maxChoices = 16

// maxSchemaBytes bounds a json_schema's schema (compact), as the mesh's
// wire does.
const maxSchemaBytes = 64 << 10

// maxTopLogprobs is OpenAI's limit on top_logprobs; completions' logprobs
// (5 at OpenAI) takes as many here.
const maxTopLogprobs = 20

type chatRequest struct {
	genParams
	messages []Message
}

type completionRequest struct {
	genParams
	text   string
	tokens []int32 // set when the prompt came as token ids; text is then unused
}

// commonJSON is the wire form of the shared fields. Pointers tell absent
// (or null) from zero; RawMessage holds fields that take several shapes.
// Unknown fields are ignored: clients send many we have no use for.
type commonJSON struct {
	Model         *string `json:"model"`
	Stream        *bool   `json:"stream"`
	StreamOptions *struct {
		IncludeUsage *bool `json:"include_usage"`
	} `json:"stream_options"`
	MaxTokens           *int               `json:"max_tokens"`
	MaxCompletionTokens *int               `json:"max_completion_tokens"`
	Temperature         *float64           `json:"temperature"`
	TopP                *float64           `json:"top_p"`
	TopK                *int               `json:"top_k"`
	MinP                *float64           `json:"min_p"`
	RepeatPenalty       *float64           `json:"repeat_penalty"`
	FrequencyPenalty    *float64           `json:"frequency_penalty"`
	PresencePenalty     *float64           `json:"presence_penalty"`
	Seed                *int64             `json:"seed"`
	N                   *int               `json:"n"`
	Stop                json.RawMessage    `json:"stop"`
	Logprobs            json.RawMessage    `json:"logprobs"`
	TopLogprobs         *int               `json:"top_logprobs"`
	LogitBias           map[string]float64 `json:"logit_bias"`
}

type chatJSON struct {
	commonJSON
	Messages       *[]messageJSON  `json:"messages"`
	Tools          json.RawMessage `json:"tools"`
	ToolChoice     json.RawMessage `json:"tool_choice"`
	Functions      json.RawMessage `json:"functions"`
	FunctionCall   json.RawMessage `json:"function_call"`
	ResponseFormat json.RawMessage `json:"response_format"`
}

type messageJSON struct {
	Role      string          `json:"role"`
	Content   json.RawMessage `json:"content"`
	ToolCalls json.RawMessage `json:"tool_calls"`
}

type completionJSON struct {
	commonJSON
	Prompt json.RawMessage `json:"prompt"`
	Echo   *bool           `json:"echo"`
	BestOf *int            `json:"best_of"`
	Suffix *string         `json:"suffix"`
}

// readBody reads the whole body; r.Body is already size-limited.
func readBody(r *http.Request, limit int64) ([]byte, *apiError) {
	if r.ContentLength > limit {
		return nil, tooLarge(limit)
	}
	data, err := io.ReadAll(r.Body)
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return nil, tooLarge(limit)
		}
		return nil, invalidRequest("", "", "Could not read the request body: %v.", err)
	}
	return data, nil
}

func tooLarge(limit int64) *apiError {
	return &apiError{
		status:  http.StatusRequestEntityTooLarge,
		message: fmt.Sprintf("Request body too large: the limit is %d bytes.", limit),
		typ:     typeInvalidRequest,
		code:    "request_too_large",
	}
}

// decodeJSON decodes one JSON object, with errors that say where and what.
func decodeJSON(data []byte, v any) *apiError {
	if len(bytes.TrimSpace(data)) == 0 {
		return invalidRequest("", "", "The request body is empty; expected a JSON object.")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(v); err != nil {
		return jsonError(err, len(data))
	}
	end := dec.InputOffset()
	if _, err := dec.Token(); err != io.EOF {
		return invalidRequest("", "", "Invalid JSON in the request body: unexpected data after the object at byte offset %d.", end)
	}
	return nil
}

func jsonError(err error, size int) *apiError {
	if e, ok := errors.AsType[*json.SyntaxError](err); ok {
		return invalidRequest("", "", "Invalid JSON in the request body at byte offset %d: %v.", e.Offset, e)
	}
	if e, ok := errors.AsType[*json.UnmarshalTypeError](err); ok {
		if e.Field == "" {
			return invalidRequest("", "", "The request body must be a JSON object, not %s.", e.Value)
		}
		// encoding/json names the embedded struct in the path; clients know
		// only the JSON field.
		field := strings.TrimPrefix(e.Field, "commonJSON.")
		return invalidRequest(field, "invalid_type",
			"Invalid type for '%s' at byte offset %d: expected %s, got %s.", field, e.Offset, jsonTypeName(e.Type), e.Value)
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return invalidRequest("", "", "Invalid JSON in the request body: unexpected end of input at byte offset %d.", size)
	}
	return invalidRequest("", "", "Invalid JSON in the request body: %v.", err)
}

// jsonTypeName names a Go destination type as the JSON the client should send.
func jsonTypeName(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Slice, reflect.Array:
		return "an array"
	default:
		return "an object"
	}
}

func parseChatRequest(data []byte) (*chatRequest, *apiError) {
	var j chatJSON
	if e := decodeJSON(data, &j); e != nil {
		return nil, e
	}
	p, e := j.commonJSON.validate()
	if e != nil {
		return nil, e
	}
	if !isAbsent(j.Tools) && !isEmptyArray(j.Tools) {
		return nil, unsupported("tools", noTools)
	}
	if !isAbsent(j.Functions) && !isEmptyArray(j.Functions) {
		return nil, unsupported("functions", noTools)
	}
	// "none" and "auto" with no tools change nothing; anything else asks for a call.
	if !isAbsent(j.ToolChoice) && !isOneOf(j.ToolChoice, "none", "auto") {
		return nil, unsupported("tool_choice", noTools)
	}
	if !isAbsent(j.FunctionCall) && !isOneOf(j.FunctionCall, "none", "auto") {
		return nil, unsupported("function_call", noTools)
	}
	if p.jsonObject, p.jsonSchema, e = checkResponseFormat(j.ResponseFormat); e != nil {
		return nil, e
	}
	if e := p.chatLogprobs(j.Logprobs, j.TopLogprobs); e != nil {
		return nil, e
	}
	if j.Messages == nil {
		return nil, missingParam("messages")
	}
	if len(*j.Messages) == 0 {
		return nil, invalidValue("messages", "must hold at least one message")
	}
	msgs := make([]Message, len(*j.Messages))
	for i, m := range *j.Messages {
		msg, e := m.toMessage(i)
		if e != nil {
			return nil, e
		}
		msgs[i] = msg
	}
	return &chatRequest{genParams: p, messages: msgs}, nil
}

func (m messageJSON) toMessage(i int) (Message, *apiError) {
	param := fmt.Sprintf("messages[%d]", i)
	role := m.Role
	switch role {
	case "system", "user", "assistant":
	case "developer":
		// Newer OpenAI name for system instructions; templates know "system".
		role = "system"
	case "tool", "function":
		return Message{}, unsupported(param+".role", "role '%s' is not supported; %s", role, noTools)
	case "":
		return Message{}, missingParam(param + ".role")
	default:
		return Message{}, invalidValue(param+".role", "'%s' is not one of 'system', 'developer', 'user', 'assistant'", role)
	}
	if !isAbsent(m.ToolCalls) && !isEmptyArray(m.ToolCalls) {
		return Message{}, unsupported(param+".tool_calls", noTools)
	}
	content, e := parseContent(m.Content, param+".content")
	if e != nil {
		return Message{}, e
	}
	// An assistant turn may be null (it carried only tool calls in OpenAI's
	// world); any other turn without content is a client bug.
	if content == nil {
		if role != "assistant" {
			return Message{}, missingParam(param + ".content")
		}
		content = new("")
	}
	return Message{Role: role, Content: *content}, nil
}

// parseContent takes a string or an array of text parts; nil means absent.
func parseContent(raw json.RawMessage, param string) (*string, *apiError) {
	if isAbsent(raw) {
		return nil, nil
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, invalidValue(param, "%v", err)
		}
		return &s, nil
	case '[':
		var parts []struct {
			Type string  `json:"type"`
			Text *string `json:"text"`
		}
		if err := json.Unmarshal(raw, &parts); err != nil {
			return nil, invalidValue(param, "must be a string or an array of content parts")
		}
		texts := make([]string, 0, len(parts))
		for k, part := range parts {
			pp := fmt.Sprintf("%s[%d]", param, k)
			switch part.Type {
			case "text":
				if part.Text == nil {
					return nil, missingParam(pp + ".text")
				}
				texts = append(texts, *part.Text)
			case "":
				return nil, missingParam(pp + ".type")
			default:
				return nil, unsupported(pp+".type", "content of type '%s' is not supported; this server takes text only", part.Type)
			}
		}
		// Parts are separate blocks of text; a newline keeps words apart.
		s := strings.Join(texts, "\n")
		return &s, nil
	default:
		return nil, invalidRequest(param, "invalid_type", "Invalid type for '%s': expected a string or an array of content parts.", param)
	}
}

// checkResponseFormat reads response_format: text, json_object (the reply
// is one JSON object) or json_schema (one the schema allows; the schema is
// returned as compact JSON, for the backend to check).
func checkResponseFormat(raw json.RawMessage) (jsonObject bool, schema string, e *apiError) {
	if isAbsent(raw) {
		return false, "", nil
	}
	var rf struct {
		Type       string `json:"type"`
		JSONSchema *struct {
			Name   string          `json:"name"`
			Schema json.RawMessage `json:"schema"`
		} `json:"json_schema"`
	}
	if err := json.Unmarshal(raw, &rf); err != nil {
		return false, "", invalidRequest("response_format", "invalid_type", "Invalid type for 'response_format': expected an object with a 'type'.")
	}
	switch rf.Type {
	case "text":
		return false, "", nil
	case "json_object":
		return true, "", nil
	case "json_schema":
		if rf.JSONSchema == nil {
			return false, "", missingParam("response_format.json_schema")
		}
		if isAbsent(rf.JSONSchema.Schema) {
			// OpenAI takes a schema-less json_schema as any object.
			return true, "", nil
		}
		var compact bytes.Buffer
		if err := json.Compact(&compact, rf.JSONSchema.Schema); err != nil {
			return false, "", invalidValue("response_format.json_schema.schema", "%v", err)
		}
		if compact.Len() > maxSchemaBytes {
			return false, "", invalidValue("response_format.json_schema.schema", "%d bytes, over the limit of %d", compact.Len(), maxSchemaBytes)
		}
		return true, compact.String(), nil
	case "":
		return false, "", missingParam("response_format.type")
	default:
		return false, "", invalidValue("response_format.type", "'%s' is not one of 'text', 'json_object', 'json_schema'", rf.Type)
	}
}

func parseCompletionRequest(data []byte) (*completionRequest, *apiError) {
	var j completionJSON
	if e := decodeJSON(data, &j); e != nil {
		return nil, e
	}
	p, e := j.commonJSON.validate()
	if e != nil {
		return nil, e
	}
	if j.Echo != nil && *j.Echo {
		return nil, unsupported("echo", "echoing the prompt is not supported")
	}
	if j.BestOf != nil && *j.BestOf > 1 {
		return nil, unsupported("best_of", "values above 1 are not supported")
	}
	if j.Suffix != nil && *j.Suffix != "" {
		return nil, unsupported("suffix", "insertion with a suffix is not supported")
	}
	if e := p.completionLogprobs(j.Logprobs, j.TopLogprobs); e != nil {
		return nil, e
	}
	req := &completionRequest{genParams: p}
	if e := req.parsePrompt(j.Prompt); e != nil {
		return nil, e
	}
	return req, nil
}

// parsePrompt takes a string, an array of one string, an array of token
// ids, or an array of one array of token ids. Several prompts would need n
// choices per response, which this server does not do.
func (c *completionRequest) parsePrompt(raw json.RawMessage) *apiError {
	if isAbsent(raw) {
		return missingParam("prompt")
	}
	switch raw[0] {
	case '"':
		if err := json.Unmarshal(raw, &c.text); err != nil {
			return invalidValue("prompt", "%v", err)
		}
		return nil
	case '[':
	default:
		return invalidRequest("prompt", "invalid_type", "Invalid type for 'prompt': expected a string, an array of strings or an array of token ids.")
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return invalidValue("prompt", "%v", err)
	}
	if len(items) == 0 {
		return invalidValue("prompt", "must not be an empty array")
	}
	switch items[0][0] {
	case '"', '[':
		if len(items) > 1 {
			return unsupported("prompt", "%d prompts in one request are not supported; send one prompt per request", len(items))
		}
		if items[0][0] == '"' {
			return c.parsePrompt(items[0])
		}
		return c.parseTokens(items[0])
	default:
		return c.parseTokens(raw)
	}
}

func (c *completionRequest) parseTokens(raw json.RawMessage) *apiError {
	var ids []*int64 // pointers, so that a null is caught rather than read as 0
	if err := json.Unmarshal(raw, &ids); err != nil {
		return invalidRequest("prompt", "invalid_type", "Invalid type for 'prompt': token arrays must hold only integers.")
	}
	if len(ids) == 0 {
		return invalidValue("prompt", "must not be an empty array")
	}
	c.tokens = make([]int32, len(ids))
	for i, id := range ids {
		if id == nil {
			return invalidRequest("prompt", "invalid_type", "Invalid type for 'prompt': token arrays must hold only integers.")
		}
		if *id < 0 || *id > math.MaxInt32 {
			return invalidValue("prompt", "token id %d is out of range", *id)
		}
		c.tokens[i] = int32(*id)
	}
	return nil
}

// validate checks the shared fields and fills OpenAI's defaults.
func (j *commonJSON) validate() (genParams, *apiError) {
	p := genParams{n: 1, temperature: 1, topP: 1, repeatPenalty: 1}
	if j.Model == nil || *j.Model == "" {
		return p, missingParam("model")
	}
	p.model = *j.Model
	p.stream = j.Stream != nil && *j.Stream
	if j.StreamOptions != nil && j.StreamOptions.IncludeUsage != nil {
		p.includeUsage = *j.StreamOptions.IncludeUsage
	}
	if j.N != nil {
		if *j.N < 1 {
			return p, invalidValue("n", "must be at least 1, got %d", *j.N)
		}
		if *j.N > maxChoices {
			return p, invalidValue("n", "must be at most %d, got %d", maxChoices, *j.N)
		}
		p.n = *j.N
	}
	for _, mt := range []struct {
		name string
		v    *int
	}{{"max_tokens", j.MaxTokens}, {"max_completion_tokens", j.MaxCompletionTokens}} {
		if mt.v == nil {
			continue
		}
		if *mt.v < 1 {
			return p, invalidValue(mt.name, "must be at least 1, got %d", *mt.v)
		}
		// max_completion_tokens is the newer name and wins when both are sent.
		p.maxTokens = *mt.v
	}

	var e *apiError
	if p.temperature, e = floatIn("temperature", j.Temperature, 0, 2, true, 1); e != nil {
		return p, e
	}
	if p.topP, e = floatIn("top_p", j.TopP, 0, 1, false, 1); e != nil {
		return p, e
	}
	if p.minP, e = floatIn("min_p", j.MinP, 0, 1, true, 0); e != nil {
		return p, e
	}
	if p.frequencyPenalty, e = floatIn("frequency_penalty", j.FrequencyPenalty, -2, 2, true, 0); e != nil {
		return p, e
	}
	if p.presencePenalty, e = floatIn("presence_penalty", j.PresencePenalty, -2, 2, true, 0); e != nil {
		return p, e
	}
	if j.RepeatPenalty != nil {
		if *j.RepeatPenalty <= 0 {
			return p, invalidValue("repeat_penalty", "must be above 0, got %s", fmtFloat(*j.RepeatPenalty))
		}
		p.repeatPenalty = float32(*j.RepeatPenalty)
	}
	if j.TopK != nil {
		if *j.TopK < 0 {
			return p, invalidValue("top_k", "must be at least 0, got %d", *j.TopK)
		}
		p.topK = *j.TopK
	}
	p.seed = j.Seed

	if p.stop, e = parseStop(j.Stop); e != nil {
		return p, e
	}
	if len(j.LogitBias) > 0 {
		return p, unsupported("logit_bias", "logit bias is not supported")
	}
	return p, nil
}

// chatLogprobs reads chat's logprobs (a boolean) and top_logprobs (0 to
// 20, with logprobs true).
func (p *genParams) chatLogprobs(raw json.RawMessage, top *int) *apiError {
	if !isAbsent(raw) {
		if err := json.Unmarshal(raw, &p.logprobs); err != nil {
			return invalidRequest("logprobs", "invalid_type", "Invalid type for 'logprobs': expected a boolean.")
		}
	}
	if top == nil {
		return nil
	}
	if *top < 0 || *top > maxTopLogprobs {
		return invalidValue("top_logprobs", "must be 0 to %d, got %d", maxTopLogprobs, *top)
	}
	if *top > 0 && !p.logprobs {
		return invalidValue("top_logprobs", "needs logprobs set to true")
	}
	p.topLogprobs = *top
	return nil
}

// completionLogprobs reads completions' logprobs: how many alternatives to
// list with each token's log-probability (0 to 20; null or absent: none).
func (p *genParams) completionLogprobs(raw json.RawMessage, top *int) *apiError {
	if top != nil {
		return invalidValue("top_logprobs", "is a chat completions parameter; completions take logprobs: N")
	}
	if isAbsent(raw) || isOneOf(raw, "false") {
		return nil
	}
	var n int
	if err := json.Unmarshal(raw, &n); err != nil {
		return invalidRequest("logprobs", "invalid_type", "Invalid type for 'logprobs': expected an integer (how many alternatives to list).")
	}
	if n < 0 || n > maxTopLogprobs {
		return invalidValue("logprobs", "must be 0 to %d, got %d", maxTopLogprobs, n)
	}
	p.logprobs, p.topLogprobs = true, n
	return nil
}

// floatIn checks an optional number against [lo, hi] (or (lo, hi] when
// !loIncl), giving def when absent.
func floatIn(name string, v *float64, lo, hi float64, loIncl bool, def float32) (float32, *apiError) {
	if v == nil {
		return def, nil
	}
	x := *v
	if x > hi || x < lo || !loIncl && x == lo {
		open := "["
		if !loIncl {
			open = "("
		}
		return 0, invalidValue(name, "%s is outside %s%s, %s]", fmtFloat(x), open, fmtFloat(lo), fmtFloat(hi))
	}
	return float32(x), nil
}

func fmtFloat(f float64) string { return strconv.FormatFloat(f, 'g', -1, 64) }

// parseStop takes a string or an array of up to four strings; empty
// strings are dropped since they would stop before the first token.
func parseStop(raw json.RawMessage) ([]string, *apiError) {
	if isAbsent(raw) {
		return nil, nil
	}
	var list []json.RawMessage
	switch raw[0] {
	case '"':
		list = []json.RawMessage{raw}
	case '[':
		if err := json.Unmarshal(raw, &list); err != nil {
			return nil, invalidValue("stop", "%v", err)
		}
		if len(list) > maxStop {
			return nil, invalidValue("stop", "at most %d sequences are allowed, got %d", maxStop, len(list))
		}
	default:
		return nil, invalidRequest("stop", "invalid_type", "Invalid type for 'stop': expected a string or an array of strings.")
	}
	var stops []string
	for i, item := range list {
		var s string
		if len(item) == 0 || item[0] != '"' || json.Unmarshal(item, &s) != nil {
			return nil, invalidRequest("stop", "invalid_type", "Invalid type for 'stop[%d]': expected a string.", i)
		}
		if s != "" {
			stops = append(stops, s)
		}
	}
	return stops, nil
}

// isAbsent: the field was not sent, or sent as null.
func isAbsent(raw json.RawMessage) bool {
	return len(raw) == 0 || string(raw) == "null"
}

func isEmptyArray(raw json.RawMessage) bool {
	var a []json.RawMessage
	return raw[0] == '[' && json.Unmarshal(raw, &a) == nil && len(a) == 0
}

// isOneOf reports whether raw is one of the given JSON literals or strings.
func isOneOf(raw json.RawMessage, values ...string) bool {
	var s string
	if raw[0] == '"' && json.Unmarshal(raw, &s) == nil {
		for _, v := range values {
			if s == v {
				return true
			}
		}
		return false
	}
	for _, v := range values {
		if string(raw) == v {
			return true
		}
	}
	return false
}
