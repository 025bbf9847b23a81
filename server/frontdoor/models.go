package frontdoor

import (
	"fmt"
)

// Tokenizer encodes text into the model's token ids exactly as the engine's tokenizer does
// (server/frontdoor/tokenizer reads a Hugging Face tokenizer.json). It must be safe for concurrent
// use.
type Tokenizer interface {
	Encode(text string, addSpecialTokens bool) []uint32
}

// ChatTemplate renders a chat request into the prompt text the engine tokenizes, as Hugging
// Face's apply_chat_template does with tokenize=False. It must be safe for concurrent use.
type ChatTemplate interface {
	Render(r *Request) (string, error)
}

// Model is how the front door tokenizes one model's prompts; either part may be nil, and a
// request that needs the missing part is refused (*UnservableError).
type Model struct {
	Tokenizer Tokenizer
	Template  ChatTemplate
}

// Models tokenizes prompts for the models it holds. The zero value holds none: it routes
// completions that carry token ids and refuses the rest.
type Models struct {
	byName map[string]Model
}

// NewModels returns the front door's models by name.
func NewModels(byName map[string]Model) *Models {
	return &Models{byName: byName}
}

// Lookup returns the model named name, and whether the front door holds it.
func (m *Models) Lookup(name string) (Model, bool) {
	if m == nil {
		return Model{}, false
	}
	mod, ok := m.byName[name]
	return mod, ok
}

// UnservableError is a request the front door reads but cannot tokenize: its model has no
// tokenizer or chat template configured. The picker answers it with HTTP 503: the request is
// fine, the router is not set up for it.
type UnservableError struct {
	Model, Missing string
}

func (e *UnservableError) Error() string {
	return fmt.Sprintf("model %q has no %s configured in the endpoint picker (picker_models)", e.Model, e.Missing)
}

// TemplateError is a chat template that refused the messages (raise_exception in the template:
// roles out of order, say); the picker answers it with HTTP 400 and the template's message.
type TemplateError struct{ Err error }

func (e *TemplateError) Error() string {
	return "the chat template refused the messages: " + e.Err.Error()
}
func (e *TemplateError) Unwrap() error { return e.Err }

// Tokens returns the prompt's token ids as the engine serving r.Model sees them: a completions
// prompt of token ids as given; a completions text tokenized, with the tokenizer's special tokens
// unless the body's add_special_tokens is false (vLLM's default is true); chat messages rendered
// by the chat template and tokenized without adding special tokens again (the template writes
// them) unless add_special_tokens is true.
func (m *Models) Tokens(r *Request) ([]uint32, error) {
	if r.Kind == Completions && r.TokenIDs != nil {
		return r.TokenIDs, nil
	}
	mod, _ := m.Lookup(r.Model)
	if mod.Tokenizer == nil {
		return nil, &UnservableError{Model: r.Model, Missing: "tokenizer"}
	}
	if r.Kind == Completions {
		return mod.Tokenizer.Encode(r.Prompt, r.AddSpecialTokens), nil
	}
	if mod.Template == nil {
		return nil, &UnservableError{Model: r.Model, Missing: "chat template"}
	}
	text, err := mod.Template.Render(r)
	if err != nil {
		return nil, &TemplateError{Err: err}
	}
	return mod.Tokenizer.Encode(text, r.AddSpecialTokens), nil
}
