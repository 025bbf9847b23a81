// Package frontdoor turns the OpenAI requests a gateway forwards (/v1/completions and
// /v1/chat/completions) into what routing needs: the model and the prompt's token ids, tokenized
// as the model's engine tokenizes them. It knows nothing of gRPC or Envoy: the endpoint picker
// (server) reads the body off the proxy's stream and hands it here.
package frontdoor

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// Kind is the OpenAI API a request calls.
type Kind uint8

// The APIs the front door routes.
const (
	Completions Kind = iota + 1
	ChatCompletions
)

// String returns the API's path.
func (k Kind) String() string {
	switch k {
	case Completions:
		return CompletionsPath
	case ChatCompletions:
		return ChatCompletionsPath
	}
	return "unknown"
}

// The paths of the routed APIs.
const (
	CompletionsPath     = "/v1/completions"
	ChatCompletionsPath = "/v1/chat/completions"
)

// KindOf returns the API a request path calls; the query string is ignored. ok is false for a path
// the front door does not route.
func KindOf(path string) (k Kind, ok bool) {
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	switch strings.TrimSuffix(path, "/") {
	case CompletionsPath:
		return Completions, true
	case ChatCompletionsPath:
		return ChatCompletions, true
	}
	return 0, false
}

// Request is what the front door reads of an OpenAI request body; the rest of the body (sampling
// parameters, stream) is the engine's business and passes through untouched.
type Request struct {
	Kind  Kind
	Model string
	// Completions: the prompt as text, or as token ids (TokenIDs non-nil).
	Prompt   string
	TokenIDs []uint32
	// Chat completions: the messages and what the chat template is given beside them.
	Messages []Message
	Tools    []json.RawMessage
	// TemplateKwargs are the body's chat_template_kwargs (vLLM's extension, e.g. enable_thinking),
	// each value as sent, so that numbers and the order of object keys reach the template as
	// Python's json.loads gives them.
	TemplateKwargs map[string]json.RawMessage
	// AddSpecialTokens has the tokenizer add its special tokens (Llama's <|begin_of_text|>) around
	// the prompt: the body's add_special_tokens (vLLM's extension), by default true for completions
	// and false for chat, whose template writes them.
	AddSpecialTokens bool
	// AddGenerationPrompt is true unless the body continues the last assistant message
	// (continue_final_message, or add_generation_prompt false: vLLM's extensions).
	AddGenerationPrompt bool
}

// Message is one chat message as the OpenAI API carries it. Content is the text, with the text
// parts of a list of parts joined by newlines, as vLLM's "string" content format renders them;
// Parts keeps the list for templates that loop over a message's parts (vLLM's "openai" format).
type Message struct {
	Role             string            `json:"role"`
	Content          string            `json:"content"`
	Parts            []string          `json:"parts,omitempty"` // the text parts; nil for a string or null content
	Name             string            `json:"name,omitempty"`
	ToolCallID       string            `json:"tool_call_id,omitempty"`
	ToolCalls        []json.RawMessage `json:"tool_calls,omitempty"`
	ReasoningContent string            `json:"reasoning_content,omitempty"`
}

// BadRequestError is a body the front door cannot read, naming the field and the rule; the picker
// answers it with HTTP 400.
type BadRequestError struct {
	Field, Rule string
}

func (e *BadRequestError) Error() string {
	if e.Field == "" {
		return e.Rule
	}
	return e.Field + ": " + e.Rule
}

func badRequest(field, format string, args ...any) error {
	return &BadRequestError{Field: field, Rule: fmt.Sprintf(format, args...)}
}

// wireRequest is the part of both APIs' bodies the front door reads.
type wireRequest struct {
	Model                *string                    `json:"model"`
	Prompt               json.RawMessage            `json:"prompt"`
	Messages             []wireMessage              `json:"messages"`
	Tools                []json.RawMessage          `json:"tools"`
	ChatTemplateKwargs   map[string]json.RawMessage `json:"chat_template_kwargs"`
	AddGenerationPrompt  *bool                      `json:"add_generation_prompt"`
	AddSpecialTokens     *bool                      `json:"add_special_tokens"`
	ContinueFinalMessage bool                       `json:"continue_final_message"`
}

type wireMessage struct {
	Role             string            `json:"role"`
	Content          json.RawMessage   `json:"content"`
	Name             string            `json:"name"`
	ToolCallID       string            `json:"tool_call_id"`
	ToolCalls        []json.RawMessage `json:"tool_calls"`
	ReasoningContent string            `json:"reasoning_content"`
}

// Parse reads the body of a request to the API kind. A body that is not a JSON object of that API,
// or whose prompt the router cannot route (several prompts in one completions request), is a
// *BadRequestError.
func Parse(kind Kind, body []byte) (*Request, error) {
	var w wireRequest
	// One pass over the body: json.Unmarshal checks it whole (one value, nothing after it) and
	// decodes it, where a Decoder would copy it into a buffer of its own first.
	if err := json.Unmarshal(body, &w); err != nil {
		return nil, badRequest("", "the body is not a JSON object of %s: %v", kind, jsonError(err))
	}
	r := &Request{Kind: kind, AddGenerationPrompt: true}
	if w.Model != nil {
		r.Model = *w.Model
	}
	switch kind {
	case Completions:
		if err := r.readPrompt(w.Prompt); err != nil {
			return nil, err
		}
	case ChatCompletions:
		if len(w.Messages) == 0 {
			return nil, badRequest("messages", "must hold at least one message")
		}
		r.Messages = make([]Message, len(w.Messages))
		for i, m := range w.Messages {
			text, parts, err := content(m.Content)
			if err != nil {
				return nil, badRequest(fmt.Sprintf("messages[%d].content", i), "%v", err)
			}
			if m.Role == "" {
				return nil, badRequest(fmt.Sprintf("messages[%d].role", i), "must not be empty")
			}
			r.Messages[i] = Message{Role: m.Role, Content: text, Parts: parts, Name: m.Name, ToolCallID: m.ToolCallID,
				ToolCalls: m.ToolCalls, ReasoningContent: m.ReasoningContent}
		}
		r.Tools = w.Tools
		r.TemplateKwargs = w.ChatTemplateKwargs
		if w.AddGenerationPrompt != nil {
			r.AddGenerationPrompt = *w.AddGenerationPrompt
		}
		if w.ContinueFinalMessage {
			r.AddGenerationPrompt = false
		}
	default:
		return nil, badRequest("", "unknown API")
	}
	r.AddSpecialTokens = kind == Completions
	if w.AddSpecialTokens != nil {
		r.AddSpecialTokens = *w.AddSpecialTokens
	}
	return r, nil
}

// readPrompt reads a completions prompt: a string, a list of token ids, or a list of one of
// either. vLLM answers a list of several prompts with one completion each; they would need one
// routing decision each, so the front door refuses them rather than route all by the first.
func (r *Request) readPrompt(raw json.RawMessage) error {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return badRequest("prompt", "must be set")
	}
	switch raw[0] {
	case '"':
		return json.Unmarshal(raw, &r.Prompt)
	case '[':
	default:
		return badRequest("prompt", "must be a string, a list of token ids, or a list of one of either")
	}
	if inner := bytes.TrimSpace(raw[1:]); len(inner) > 0 && (inner[0] == '"' || inner[0] == '[') {
		var items []json.RawMessage
		if err := json.Unmarshal(raw, &items); err != nil {
			return badRequest("prompt", "is not a JSON list: %v", jsonError(err))
		}
		if len(items) > 1 {
			return badRequest("prompt", "holds %d prompts; the router routes one prompt per request", len(items))
		}
		return r.readPrompt(items[0])
	}
	ids, err := tokenIDs(raw)
	if err != nil {
		return err
	}
	if len(ids) == 0 {
		return badRequest("prompt", "must not be empty")
	}
	r.TokenIDs = ids
	return nil
}

// tokenIDs reads a JSON list of token ids. It is the hot part of a completions body of token ids
// (a 220 KB body holds 40,000 of them): decoding each through encoding/json took 40 ms there, this
// loop well under one. The body is already valid JSON (Parse decoded it), so only the numbers'
// own rules are checked: whole, not negative, at most 2^32-1.
func tokenIDs(raw []byte) ([]uint32, error) {
	ids := make([]uint32, 0, len(raw)/6)
	i := 1 // after '['
	for n := 0; ; n++ {
		for i < len(raw) && isSpace(raw[i]) {
			i++
		}
		if i < len(raw) && raw[i] == ']' && n == 0 {
			return ids, nil
		}
		start := i
		var v uint64
		for i < len(raw) && raw[i] >= '0' && raw[i] <= '9' {
			v = v*10 + uint64(raw[i]-'0')
			if v > 1<<32-1 {
				return nil, badRequest(fmt.Sprintf("prompt[%d]", n), "%s is not a token id (0 to 4294967295)", numberAt(raw, start))
			}
			i++
		}
		if i == start || i < len(raw) && (raw[i] == '.' || raw[i] == 'e' || raw[i] == 'E') {
			return nil, badRequest(fmt.Sprintf("prompt[%d]", n), "%s is not a token id (0 to 4294967295)", numberAt(raw, start))
		}
		ids = append(ids, uint32(v))
		for i < len(raw) && isSpace(raw[i]) {
			i++
		}
		if i >= len(raw) {
			return nil, badRequest("prompt", "is not a JSON list")
		}
		switch raw[i] {
		case ',':
			i++
		case ']':
			return ids, nil
		default:
			return nil, badRequest(fmt.Sprintf("prompt[%d]", n+1), "must be a token id (a whole number)")
		}
	}
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// numberAt returns the JSON value that starts at raw[i], for a message (at most 32 bytes).
func numberAt(raw []byte, i int) string {
	end := i
	for end < len(raw) && end-i < 32 && raw[end] != ',' && raw[end] != ']' && !isSpace(raw[end]) {
		end++
	}
	return string(raw[i:end])
}

// content returns a message's content as text: a string, null (no content: an assistant turn
// of tool calls), or a list of parts whose text parts are joined by newlines, which it also
// returns one by one. A part that is not text (an image) is refused: the front door cannot key it
// as the engine would.
func content(raw json.RawMessage) (string, []string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil, nil
	}
	if raw[0] == '"' {
		var s string
		err := json.Unmarshal(raw, &s)
		return s, nil, err
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", nil, fmt.Errorf("must be a string or a list of content parts")
	}
	texts := make([]string, 0, len(parts))
	for i, p := range parts {
		if p.Type != "text" || p.Text == nil {
			return "", nil, fmt.Errorf("part %d is of type %q; the front door routes text parts only", i, p.Type)
		}
		texts = append(texts, *p.Text)
	}
	return strings.Join(texts, "\n"), texts, nil
}

// jsonError shortens encoding/json's errors to what a caller can act on.
func jsonError(err error) string {
	var syn *json.SyntaxError
	if errors.As(err, &syn) {
		return fmt.Sprintf("%v (at byte %d)", syn, syn.Offset)
	}
	var typ *json.UnmarshalTypeError
	if errors.As(err, &typ) {
		return fmt.Sprintf("%s must be a JSON %s", typ.Field, jsonKind(typ.Type.Kind().String()))
	}
	return err.Error()
}

func jsonKind(k string) string {
	switch k {
	case "slice":
		return "list"
	case "map", "struct":
		return "object"
	case "ptr":
		return "value"
	}
	return k
}
