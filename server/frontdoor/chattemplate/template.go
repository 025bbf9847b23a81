package chattemplate

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/ardanlabs/jinja"
)

// Specials are the tokenizer's special tokens, which transformers hands every chat template as
// variables (bos_token, eos_token, ...): Llama's template writes bos_token itself. An empty one is
// not set, so the template sees it undefined, as transformers leaves out tokens the tokenizer
// does not have.
type Specials struct {
	BOS, EOS, UNK, SEP, PAD, CLS, Mask string
}

func (s Specials) each(f func(name, token string)) {
	for _, p := range [...]struct{ name, token string }{
		{"bos_token", s.BOS}, {"eos_token", s.EOS}, {"unk_token", s.UNK}, {"sep_token", s.SEP},
		{"pad_token", s.PAD}, {"cls_token", s.CLS}, {"mask_token", s.Mask},
	} {
		if p.token != "" {
			f(p.name, p.token)
		}
	}
}

// ContentFormat is how a template expects a message's content: vLLM detects it per template
// ("auto") and converts every message's content to it before rendering.
type ContentFormat string

const (
	// ContentString gives the template each content as one string: a list of parts becomes its
	// text parts joined by newlines. Templates that print message.content (Llama 3.1, Qwen 3) get
	// this.
	ContentString ContentFormat = "string"
	// ContentOpenAI gives the template each content as a list of parts: {"type": "text", "text":
	// ...} for text and {"type": "image"} (or audio, video) for media, as vLLM does for templates
	// that loop over message.content.
	ContentOpenAI ContentFormat = "openai"
)

// Message is one chat message as the OpenAI API carries it. The template sees it as a mapping,
// so message.role, message['content'] and `'tool_calls' in message` all work; fields that are
// empty are left out of the mapping, as vLLM leaves them out.
type Message struct {
	Role string
	// Content is the message's text. When the client sent a list of parts, Content is their text
	// parts joined by newlines (vLLM's "string" content format) and Parts may hold the parts for
	// templates that loop over them; a null content is "".
	Content string
	// Parts are the content's parts as sent, or nil when the content was a string or null. When
	// set, they take precedence over Content.
	Parts []Part
	// Name is the participant's name (the template sees it as message.name).
	Name string
	// ToolCallID is a tool message's tool_call_id.
	ToolCallID string
	// ToolCalls are an assistant message's tool_calls as sent: {"id", "type", "function": {"name",
	// "arguments"}} with arguments a JSON string, which the template sees parsed, as vLLM parses it
	// before rendering.
	ToolCalls []json.RawMessage
	// ReasoningContent is an assistant message's reasoning (sent as reasoning_content, or
	// reasoning in newer vLLM). The template sees it as both message.reasoning_content and
	// message.reasoning, as vLLM sets both; empty means none.
	ReasoningContent string
}

// Part is one part of a message's content.
type Part struct {
	// Type is the part's type: "text" (or "input_text", "output_text", "refusal", "thinking",
	// which render as text), or a media type ("image_url", "input_audio", "video_url", ...).
	Type string
	// Text is a text part's text.
	Text string
}

// Options are what a request gives the template besides its messages.
type Options struct {
	// AddGenerationPrompt ends the prompt with the header of the assistant's reply; vLLM's default
	// for chat completions.
	AddGenerationPrompt bool
	// Tools are the request's tool definitions as sent ({"type": "function", "function": {...}}).
	// The template sees them as vLLM passes them (see toolValue); none is None, and a template
	// with a "tool_use" variant renders with it when there are some.
	Tools []json.RawMessage
	// Extra are further template variables: the request's chat_template_kwargs (enable_thinking,
	// say). Values are what encoding/json decodes into (json.Number, map[string]any, ...) or a
	// json.RawMessage, whose object keys keep their order; map keys are sorted. They may not name
	// the variables the renderer sets itself (messages, tools, documents,
	// add_generation_prompt) nor chat_template or tokenize, which vLLM refuses too.
	Extra map[string]any
	// ContentFormat overrides the template's detected content format; empty keeps it.
	ContentFormat ContentFormat
	// Now is strftime_now's clock, time.Now when nil. A template that prints the date renders the
	// engine's day only if both clocks agree.
	Now func() time.Time
}

// Template is a compiled chat template: compile it once per model (Parse or Load) and render it
// for every request. It is safe for concurrent use: each render gets its own variables, and
// nothing in the compiled template changes.
type Template struct {
	def, toolUse *jinja.Template
	specials     map[string]jinja.Value
	format       ContentFormat
}

// Parse compiles a chat template's Jinja source once, so that each request only renders it.
// specials are the tokenizer's special tokens, which the template sees as bos_token and the like
// (Load reads them from tokenizer_config.json).
func Parse(source string, specials Specials) (*Template, error) {
	return parseNamed(map[string]string{"default": source}, specials)
}

func parseNamed(sources map[string]string, specials Specials) (*Template, error) {
	t := &Template{specials: map[string]jinja.Value{}}
	def, ok := sources["default"]
	if !ok {
		return nil, fmt.Errorf("chattemplate: the tokenizer has several chat templates and none named \"default\"")
	}
	var err error
	if t.def, err = compile(def); err != nil {
		return nil, err
	}
	if src, ok := sources["tool_use"]; ok {
		if t.toolUse, err = compile(src); err != nil {
			return nil, fmt.Errorf("%w (the \"tool_use\" template)", err)
		}
	}
	t.format = detectContentFormat(def)
	specials.each(func(name, token string) { t.specials[name] = jinja.NewString(token) })
	return t, nil
}

func compile(source string) (tmpl *jinja.Template, err error) {
	defer func() {
		if r := recover(); r != nil {
			tmpl, err = nil, fmt.Errorf("chattemplate: compiling the template failed: %v", r)
		}
	}()
	tmpl, err = jinja.Compile(rewrite(source))
	if err != nil {
		return nil, fmt.Errorf("chattemplate: %w", err)
	}
	return tmpl, nil
}

// ContentFormat returns the content format detected for the template, which Render converts
// every message's content to unless Options.ContentFormat says otherwise.
func (t *Template) ContentFormat() ContentFormat { return t.format }

// contentLoop finds a loop over a message's content: `for x in message['content']` or
// `for x in message.content`, vLLM's test for the "openai" content format (its test walks the
// template's syntax tree; this one reads the source, and also misses a loop over a variable that
// was set from the content).
var contentLoop = regexp.MustCompile(`\bfor\s+[\w\s,]+\s+in\s+\w+\s*(\.\s*content\b|\[\s*['"]content['"]\s*\])`)

func detectContentFormat(source string) ContentFormat {
	if contentLoop.MatchString(source) {
		return ContentOpenAI
	}
	return ContentString
}

// Load reads the chat template of the Hugging Face model directory dir as transformers does:
// dir/chat_template.jinja when present, else tokenizer_config.json's chat_template (a string, or
// a list of {"name", "template"} of which "default" is used, and "tool_use" when the request has
// tools), with tokenizer_config.json's special tokens (a string or an AddedToken object).
func Load(dir string) (*Template, error) {
	raw, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
	if err != nil {
		return nil, fmt.Errorf("chattemplate: %w", err)
	}
	var cfg map[string]json.RawMessage
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return nil, fmt.Errorf("chattemplate: %s: %w", filepath.Join(dir, "tokenizer_config.json"), err)
	}
	var sp Specials
	for _, f := range []struct {
		key string
		dst *string
	}{
		{"bos_token", &sp.BOS}, {"eos_token", &sp.EOS}, {"unk_token", &sp.UNK}, {"sep_token", &sp.SEP},
		{"pad_token", &sp.PAD}, {"cls_token", &sp.CLS}, {"mask_token", &sp.Mask},
	} {
		if *f.dst, err = specialToken(cfg[f.key]); err != nil {
			return nil, fmt.Errorf("chattemplate: tokenizer_config.json: %s: %w", f.key, err)
		}
	}
	sources := map[string]string{}
	if b, err := os.ReadFile(filepath.Join(dir, "chat_template.jinja")); err == nil {
		sources["default"] = string(b)
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("chattemplate: %w", err)
	} else if err := readTemplates(cfg["chat_template"], sources); err != nil {
		return nil, fmt.Errorf("chattemplate: tokenizer_config.json: chat_template: %w", err)
	}
	return parseNamed(sources, sp)
}

func specialToken(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var obj struct {
		Content *string `json:"content"`
	}
	if err := json.Unmarshal(raw, &obj); err != nil || obj.Content == nil {
		return "", errors.New("must be a string or an object with a content string")
	}
	return *obj.Content, nil
}

// ErrNoTemplate is Load's error for a model without a chat template (a base model): its
// tokenizer_config.json has no chat_template and there is no chat_template.jinja.
var ErrNoTemplate = errors.New("the tokenizer has no chat template")

func readTemplates(raw json.RawMessage, into map[string]string) error {
	if len(raw) == 0 || string(raw) == "null" {
		return ErrNoTemplate
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		into["default"] = s
		return nil
	}
	var list []struct {
		Name     string `json:"name"`
		Template string `json:"template"`
	}
	if err := json.Unmarshal(raw, &list); err != nil {
		return errors.New("must be a string or a list of {\"name\", \"template\"}")
	}
	for _, e := range list {
		into[e.Name] = e.Template
	}
	return nil
}

// Exception is the error of a template that refused the conversation with raise_exception
// (roles out of order, say): the request is at fault, as vLLM's HTTP 400 says.
type Exception struct {
	// Message is the template's message.
	Message string
}

func (e *Exception) Error() string { return e.Message }

// reserved are the variables Extra may not set.
var reserved = map[string]bool{
	"messages": true, "tools": true, "documents": true, "add_generation_prompt": true,
	"chat_template": true, "tokenize": true,
}

// Render renders the conversation into the prompt text, as
// apply_chat_template(messages, tools=..., tokenize=False, add_generation_prompt=..., **extra)
// does after vLLM's conversion of the request. The template's own refusals are *Exception; other
// errors (a message the renderer cannot represent, a template that fails) are plain errors. A
// panic in the Jinja library is recovered into an error.
func (t *Template) Render(msgs []Message, opt Options) (out string, err error) {
	defer func() {
		if r := recover(); r != nil {
			out, err = "", fmt.Errorf("chattemplate: the template failed: %v", r)
		}
	}()
	format := t.format
	if opt.ContentFormat != "" {
		format = opt.ContentFormat
	}
	vars := make(map[string]jinja.Value, 12+len(t.specials)+len(opt.Extra))
	for k, v := range t.specials {
		vars[k] = v
	}
	for k, v := range opt.Extra {
		if reserved[k] {
			return "", fmt.Errorf("chattemplate: chat_template_kwargs may not set %q", k)
		}
		if vars[k], err = goValue(v, 0); err != nil {
			return "", fmt.Errorf("chattemplate: chat_template_kwargs.%s: %w", k, err)
		}
	}
	list := make([]jinja.Value, len(msgs))
	for i, m := range msgs {
		if list[i], err = messageValue(m, format); err != nil {
			return "", fmt.Errorf("chattemplate: messages[%d].%w", i, err)
		}
	}
	vars["messages"] = jinja.NewList(list)
	vars["tools"] = jinja.None()
	tmpl := t.def
	if len(opt.Tools) > 0 {
		tools := make([]jinja.Value, len(opt.Tools))
		for i, raw := range opt.Tools {
			if tools[i], err = toolValue(raw); err != nil {
				return "", fmt.Errorf("chattemplate: tools[%d]: %w", i, err)
			}
		}
		vars["tools"] = jinja.NewList(tools)
		if t.toolUse != nil {
			tmpl = t.toolUse
		}
	}
	vars["documents"] = jinja.None()
	vars["add_generation_prompt"] = jinja.NewBool(opt.AddGenerationPrompt)
	now := opt.Now
	if now == nil {
		now = time.Now
	}
	vars["raise_exception"] = raiseException
	vars["strftime_now"] = jinja.NewCallable("strftime_now", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
		if len(args) != 1 || !args[0].IsString() {
			return jinja.Undefined(), errors.New("strftime_now takes one format string")
		}
		return jinja.NewString(strftime(args[0].AsString(), now())), nil
	})
	vars["range"] = rangeFn
	vars[filterNames["tojson"]] = tojsonFn
	vars[filterNames["trim"]] = trimFn
	vars[filterNames["string"]] = stringFn
	vars[printName] = printFn
	vars[wsName] = whitespace
	s, err := tmpl.RenderValues(vars)
	if err != nil {
		var exc *Exception
		if errors.As(err, &exc) {
			return "", exc
		}
		return "", fmt.Errorf("chattemplate: %w", err)
	}
	return s, nil
}

// The variables every render shares: functions without state, and a string.
var (
	raiseException = jinja.NewCallable("raise_exception", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
		msg := "raise_exception called"
		if len(args) > 0 {
			msg = printString(args[0])
		}
		return jinja.Undefined(), &Exception{Message: msg}
	})
	rangeFn    = jinja.NewCallable("range", pyRange)
	tojsonFn   = jinja.NewCallable("tojson", pyToJSON)
	trimFn     = jinja.NewCallable("trim", pyTrim)
	stringFn   = jinja.NewCallable("string", pyStringFilter)
	printFn    = jinja.NewCallable("print", pyPrint)
	whitespace = jinja.NewString(pyWhitespace)
)

// messageValue converts a message to the mapping the template sees, as vLLM's parse_chat_messages
// builds it: role and content always; an assistant's tool_calls (when there are some) and
// reasoning; a tool message's tool_call_id; the name.
func messageValue(m Message, format ContentFormat) (jinja.Value, error) {
	d := jinja.NewDict()
	o := d.AsDict()
	o.Set("role", jinja.NewString(m.Role))
	content, err := contentValue(m, format)
	if err != nil {
		return d, fmt.Errorf("content: %w", err)
	}
	o.Set("content", content)
	if m.Role == "assistant" {
		if len(m.ToolCalls) > 0 {
			calls := make([]jinja.Value, len(m.ToolCalls))
			for i, raw := range m.ToolCalls {
				if calls[i], err = toolCallValue(raw); err != nil {
					return d, fmt.Errorf("tool_calls[%d]: %w", i, err)
				}
			}
			o.Set("tool_calls", jinja.NewList(calls))
		}
		if m.ReasoningContent != "" {
			o.Set("reasoning", jinja.NewString(m.ReasoningContent))
			o.Set("reasoning_content", jinja.NewString(m.ReasoningContent))
		}
	}
	if m.Role == "tool" && m.ToolCallID != "" {
		o.Set("tool_call_id", jinja.NewString(m.ToolCallID))
	}
	if m.Name != "" {
		o.Set("name", jinja.NewString(m.Name))
	}
	return d, nil
}

// mediaModality maps the media part types vLLM accepts to the placeholder type it gives an
// "openai" format template.
var mediaModality = map[string]string{
	"image_url": "image", "input_image": "image", "image_pil": "image", "image_embeds": "image",
	"audio_url": "audio", "input_audio": "audio", "audio_embeds": "audio",
	"video_url": "video",
}

func isTextPart(typ string) bool {
	switch typ {
	case "text", "input_text", "output_text", "refusal", "thinking":
		return true
	}
	return false
}

func contentValue(m Message, format ContentFormat) (jinja.Value, error) {
	if m.Parts == nil {
		if format == ContentOpenAI && m.Role != "tool" {
			return jinja.NewList([]jinja.Value{textPart(m.Content)}), nil
		}
		return jinja.NewString(m.Content), nil
	}
	allText := true
	for _, p := range m.Parts {
		allText = allText && isTextPart(p.Type)
	}
	// vLLM gives a tool message's content as a string whatever the format, when all its parts are
	// text.
	if format == ContentString || m.Role == "tool" && allText {
		texts := make([]string, len(m.Parts))
		for i, p := range m.Parts {
			if !isTextPart(p.Type) {
				return jinja.Undefined(), fmt.Errorf("part %d is of type %q: the template takes text (vLLM would insert the model's placeholder, which this renderer does not know)", i, p.Type)
			}
			texts[i] = p.Text
		}
		return jinja.NewString(strings.Join(texts, "\n")), nil
	}
	list := make([]jinja.Value, len(m.Parts))
	for i, p := range m.Parts {
		switch {
		case isTextPart(p.Type):
			list[i] = textPart(p.Text)
		case mediaModality[p.Type] != "":
			list[i] = dictOf("type", jinja.NewString(mediaModality[p.Type]))
		default:
			return jinja.Undefined(), fmt.Errorf("part %d is of unknown type %q", i, p.Type)
		}
	}
	return jinja.NewList(list), nil
}

func textPart(s string) jinja.Value {
	return dictOf("type", jinja.NewString("text"), "text", jinja.NewString(s))
}
