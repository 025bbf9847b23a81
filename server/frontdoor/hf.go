package frontdoor

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"slices"
	"sync"

	"github.com/kvrouter/kvrouter/server/frontdoor/chattemplate"
	"github.com/kvrouter/kvrouter/server/frontdoor/tokenizer"
)

// LoadModel reads a Hugging Face model directory as the engine's tokenizer reads it: the
// tokenizer from tokenizer.json (and tokenizer_config.json's split_special_tokens), the chat
// template from chat_template.jinja or tokenizer_config.json. A model without a chat template (a
// base model) loads with none, and the picker answers its chat requests 503 saying so; any other
// problem in either file is an error naming the file.
func LoadModel(dir string) (Model, error) {
	tk, err := tokenizer.Load(dir)
	if err != nil {
		return Model{}, err
	}
	m := Model{Tokenizer: tk}
	tmpl, err := chattemplate.Load(dir)
	switch {
	case err == nil:
		m.Template = hfTemplate{tmpl}
	case errors.Is(err, chattemplate.ErrNoTemplate), errors.Is(err, fs.ErrNotExist):
	default:
		return Model{}, err
	}
	return m, nil
}

// LoadModels loads each model's directory (LoadModel), all at once: a tokenizer.json takes a
// few hundred milliseconds to index. The error names the first model, in name order, that failed.
func LoadModels(dirs map[string]string) (*Models, error) {
	byName := make(map[string]Model, len(dirs))
	errs := make(map[string]error, len(dirs))
	var mu sync.Mutex
	var wg sync.WaitGroup
	for name, dir := range dirs {
		wg.Go(func() {
			m, err := LoadModel(dir)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs[name] = err
				return
			}
			byName[name] = m
		})
	}
	wg.Wait()
	if len(errs) > 0 {
		name := slices.Sorted(maps.Keys(errs))[0]
		return nil, fmt.Errorf("model %q (%s): %w", name, dirs[name], errs[name])
	}
	return NewModels(byName), nil
}

// hfTemplate renders a request through a Hugging Face chat template, giving the template what
// vLLM gives it: the messages, the tools, add_generation_prompt and chat_template_kwargs.
type hfTemplate struct{ t *chattemplate.Template }

func (h hfTemplate) Render(r *Request) (string, error) {
	msgs := make([]chattemplate.Message, len(r.Messages))
	for i, m := range r.Messages {
		msgs[i] = chattemplate.Message{Role: m.Role, Content: m.Content, Name: m.Name, ToolCallID: m.ToolCallID,
			ToolCalls: m.ToolCalls, ReasoningContent: m.ReasoningContent}
		if m.Parts != nil {
			msgs[i].Parts = make([]chattemplate.Part, len(m.Parts))
			for k, text := range m.Parts {
				msgs[i].Parts[k] = chattemplate.Part{Type: "text", Text: text}
			}
		}
	}
	opt := chattemplate.Options{AddGenerationPrompt: r.AddGenerationPrompt, Tools: r.Tools}
	if len(r.TemplateKwargs) > 0 {
		opt.Extra = make(map[string]any, len(r.TemplateKwargs))
		for k, v := range r.TemplateKwargs {
			opt.Extra[k] = v
		}
	}
	return h.t.Render(msgs, opt)
}
