package chattemplate

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/ardanlabs/jinja"
	"github.com/google/go-cmp/cmp"
)

func mustParse(t *testing.T, src string) *Template {
	t.Helper()
	tmpl, err := Parse(src, Specials{BOS: "<s>", EOS: "</s>"})
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	return tmpl
}

func render(t *testing.T, tmpl *Template, msgs []Message, opt Options) string {
	t.Helper()
	out, err := tmpl.Render(msgs, opt)
	if err != nil {
		t.Fatalf("Render: %v", err)
	}
	return out
}

func TestRaiseException(t *testing.T) {
	tmpl := mustParse(t, `{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}`+
		`{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}`+
		`{{ m.content }}{% endfor %}`)
	if got := render(t, tmpl, []Message{{Role: "user", Content: "a"}, {Role: "assistant", Content: "b"}}, Options{}); got != "ab" {
		t.Errorf("Render = %q, want %q", got, "ab")
	}
	_, err := tmpl.Render([]Message{{Role: "assistant", Content: "a"}}, Options{})
	var exc *Exception
	if !errors.As(err, &exc) {
		t.Fatalf("Render error = %v (%T), want an *Exception", err, err)
	}
	if want := "Conversation roles must alternate user/assistant/user/assistant/..."; exc.Message != want || err.Error() != want {
		t.Errorf("Exception = %q (Error() %q), want %q", exc.Message, err.Error(), want)
	}
}

// TestRecoversPanics renders templates that make the Jinja library panic (strings.Repeat with a
// negative count) and wants an error instead.
func TestRecoversPanics(t *testing.T) {
	const src = `{{ messages[0].content * (0 - messages | length) }}`
	// The library itself panics on this template: the test would prove nothing otherwise.
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("the library did not panic; pick another template for this test")
			}
		}()
		lib, err := jinja.Compile(src)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = lib.Render(map[string]any{"messages": []any{map[string]any{"content": "x"}}})
	}()
	tmpl := mustParse(t, src)
	out, err := tmpl.Render([]Message{{Role: "user", Content: "x"}}, Options{})
	if err == nil || !strings.Contains(err.Error(), "the template failed") {
		t.Fatalf("Render = %q, %v; want the recovered panic as an error", out, err)
	}
}

func TestTemplateErrors(t *testing.T) {
	for _, src := range []string{`{% if messages %}never closed`, `{{ unclosed `, `{% for %}{% endfor %}`} {
		if _, err := Parse(src, Specials{}); err == nil {
			t.Errorf("Parse(%q) succeeded, want an error", src)
		}
	}
	tmpl := mustParse(t, `{{ no_such_function() }}`)
	if _, err := tmpl.Render(nil, Options{}); err == nil {
		t.Error("calling an undefined function rendered, want an error")
	}
}

// TestMessageMapping prints what the template sees of each message: the fields vLLM gives it, in
// its order, with tool call arguments parsed (or {} when they are not JSON).
func TestMessageMapping(t *testing.T) {
	tmpl := mustParse(t, `{% for m in messages %}{{ m | tojson }}
{% endfor %}{{ tools }}|{{ documents }}|{{ add_generation_prompt }}|{{ bos_token }}|{{ eos_token }}|{{ unk_token is defined }}`)
	msgs := []Message{
		{Role: "system", Content: "sys", Name: "ops"},
		{Role: "user", Content: "hi", ToolCalls: []json.RawMessage{[]byte(`{}`)}, ReasoningContent: "ignored", ToolCallID: "ignored"},
		{Role: "assistant", ReasoningContent: "think", ToolCalls: []json.RawMessage{
			[]byte(`{"type":"function","id":"c1","function":{"arguments":"{\"b\": 1, \"a\": [true, null, 2.5]}","name":"f"},"extra":1}`),
			[]byte(`{"id":"c2","function":{"name":"g","arguments":"nope"}}`),
			[]byte(`{"id":"c3","function":{"name":"h","arguments":{"z":1}}}`),
			[]byte(`{"id":"c4","function":{"name":"i"}}`),
		}},
		{Role: "assistant", Content: "no calls", ToolCalls: []json.RawMessage{}},
		{Role: "tool", Content: "42", ToolCallID: "c1"},
	}
	got := render(t, tmpl, msgs, Options{AddGenerationPrompt: true})
	want := `{"role": "system", "content": "sys", "name": "ops"}
{"role": "user", "content": "hi"}
{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": [true, null, 2.5]}}}, {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {}}}, {"id": "c3", "type": "function", "function": {"name": "h", "arguments": {"z": 1}}}, {"id": "c4", "type": "function", "function": {"name": "i", "arguments": {}}}], "reasoning": "think", "reasoning_content": "think"}
{"role": "assistant", "content": "no calls"}
{"role": "tool", "content": "42", "tool_call_id": "c1"}
None|None|True|<s>|</s>|False`
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	if _, err := tmpl.Render([]Message{{Role: "assistant", ToolCalls: []json.RawMessage{[]byte(`[1]`)}}}, Options{}); err == nil {
		t.Error("a tool call that is not an object rendered, want an error")
	}
}

// TestTools prints the tools as the template sees them: vLLM's model_dump order and defaults.
func TestTools(t *testing.T) {
	tmpl := mustParse(t, `{% for t in tools %}{{ t | tojson }}
{% endfor %}`)
	got := render(t, tmpl, nil, Options{Tools: []json.RawMessage{
		[]byte(`{"function":{"parameters":{"type":"object","properties":{"b":{},"a":{}}},"strict":true,"name":"f"},"type":"function","x-extra":[1]}`),
		[]byte(`{"function":{"name":"g"}}`),
		[]byte(`{"type":"custom","custom":{"name":"raw","b":1,"a":2}}`),
	}})
	want := `{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object", "properties": {"b": {}, "a": {}}}, "strict": true}, "x-extra": [1]}
{"type": "function", "function": {"name": "g", "description": null, "parameters": null}}
{"type": "custom", "custom": {"name": "raw", "b": 1, "a": 2}}
`
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	for _, bad := range []string{`[]`, `{"type":"function"}`, `{"function":{"name":3}}`, `{"function":`, strings.Repeat(`[`, maxDepth+2) + strings.Repeat(`]`, maxDepth+2)} {
		if _, err := tmpl.Render(nil, Options{Tools: []json.RawMessage{[]byte(bad)}}); err == nil {
			t.Errorf("tool %.40s rendered, want an error", bad)
		}
	}
	if got := render(t, mustParse(t, `{{ tools is none }}`), nil, Options{Tools: []json.RawMessage{}}); got != "True" {
		t.Errorf("no tools: tools is none = %s, want True", got)
	}
}

func TestContentFormat(t *testing.T) {
	const openai = `{% for message in messages %}{{ message.role }}:{% for part in message['content'] %}[{{ part.type }}{% if part.text is defined %} {{ part.text }}{% endif %}]{% endfor %}
{% endfor %}`
	tmpl := mustParse(t, openai)
	if tmpl.ContentFormat() != ContentOpenAI {
		t.Fatalf("ContentFormat = %q, want %q", tmpl.ContentFormat(), ContentOpenAI)
	}
	msgs := []Message{
		{Role: "user", Content: "plain"},
		{Role: "user", Content: "a\nb", Parts: []Part{{Type: "text", Text: "a"}, {Type: "image_url"}, {Type: "input_text", Text: "b"}}},
	}
	// trim_blocks eats the newline after the inner {% endfor %}.
	want := "user:[text plain]user:[text a][image][text b]"
	if diff := cmp.Diff(want, render(t, tmpl, msgs, Options{})); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	// A tool message whose parts are all text is a string whatever the format.
	if got := render(t, mustParse(t, `{% for m in messages %}{% for p in m.content %}{% endfor %}{{ m.content }}{% endfor %}`),
		[]Message{{Role: "tool", Parts: []Part{{Type: "text", Text: "x"}, {Type: "text", Text: "y"}}}}, Options{}); got != "x\ny" {
		t.Errorf("tool message content = %q, want %q", got, "x\ny")
	}

	plain := mustParse(t, `{% for m in messages %}{{ m['content'] }}|{% endfor %}`)
	if plain.ContentFormat() != ContentString {
		t.Fatalf("ContentFormat = %q, want %q", plain.ContentFormat(), ContentString)
	}
	if got := render(t, plain, msgs[:1], Options{}); got != "plain|" {
		t.Errorf("Render = %q", got)
	}
	parts := []Message{{Role: "user", Parts: []Part{{Type: "text", Text: "a"}, {Type: "refusal", Text: "b"}}}}
	if got := render(t, plain, parts, Options{}); got != "a\nb|" {
		t.Errorf("Render = %q, want the text parts joined by newlines", got)
	}
	if _, err := plain.Render(msgs[1:], Options{}); err == nil || !strings.Contains(err.Error(), "image_url") {
		t.Errorf("an image part in the string format: %v, want an error naming it", err)
	}
	if got := render(t, plain, parts, Options{ContentFormat: ContentOpenAI}); !strings.Contains(got, "'type': 'text'") {
		t.Errorf("ContentFormat override: Render = %q, want the parts", got)
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("tokenizer_config.json", `{
		"bos_token": {"__type": "AddedToken", "content": "<bos>", "lstrip": false},
		"eos_token": "<eos>", "pad_token": null,
		"chat_template": [
			{"name": "default", "template": "default {{ bos_token }}{{ eos_token }}{{ pad_token is defined }}"},
			{"name": "tool_use", "template": "tool_use {{ tools | length }}"}
		]}`)
	tmpl, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got := render(t, tmpl, nil, Options{}); got != "default <bos><eos>False" {
		t.Errorf("without tools: %q", got)
	}
	if got := render(t, tmpl, nil, Options{Tools: []json.RawMessage{[]byte(`{"type":"function","function":{"name":"f"}}`)}}); got != "tool_use 1" {
		t.Errorf("with tools: %q", got)
	}
	write("chat_template.jinja", "from the jinja file")
	if tmpl, err = Load(dir); err != nil {
		t.Fatal(err)
	}
	if got := render(t, tmpl, nil, Options{}); got != "from the jinja file" {
		t.Errorf("with chat_template.jinja: %q", got)
	}

	for name, cfg := range map[string]string{
		"no template":    `{"eos_token": "x"}`,
		"no default":     `{"chat_template": [{"name": "rag", "template": "x"}]}`,
		"bad token":      `{"chat_template": "x", "bos_token": 7}`,
		"bad template":   `{"chat_template": "{% if %}"}`,
		"not json":       `{`,
		"template typed": `{"chat_template": 3}`,
	} {
		d := t.TempDir()
		if err := os.WriteFile(filepath.Join(d, "tokenizer_config.json"), []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := Load(d); err == nil {
			t.Errorf("%s: Load succeeded, want an error", name)
		}
	}
	if _, err := Load(filepath.Join(dir, "missing")); err == nil {
		t.Error("Load of a missing directory succeeded")
	}
}

func TestExtra(t *testing.T) {
	tmpl := mustParse(t, `{{ enable_thinking }}|{{ obj | tojson }}|{{ m | tojson }}|{{ n + 1 }}|{{ bos_token }}`)
	got := render(t, tmpl, nil, Options{Extra: map[string]any{
		"enable_thinking": false,
		"obj":             json.RawMessage(`{"z": 1, "a": [1.0, "x"]}`),
		"m":               map[string]any{"z": 1, "a": json.Number("2")},
		"n":               json.Number("41"),
		"bos_token":       "<override>",
	}})
	if want := `False|{"z": 1, "a": [1.0, "x"]}|{"a": 2, "z": 1}|42|<override>`; got != want {
		t.Errorf("Render = %q, want %q", got, want)
	}
	for _, k := range []string{"messages", "tools", "documents", "add_generation_prompt", "chat_template", "tokenize"} {
		if _, err := tmpl.Render(nil, Options{Extra: map[string]any{k: true}}); err == nil {
			t.Errorf("Extra[%q] rendered, want an error", k)
		}
	}
	if _, err := tmpl.Render(nil, Options{Extra: map[string]any{"x": struct{}{}}}); err == nil {
		t.Error("an unsupported Extra value rendered, want an error")
	}
}

func TestRangeIsBounded(t *testing.T) {
	tmpl := mustParse(t, `{% for i in range(1000000000) %}x{% endfor %}`)
	if _, err := tmpl.Render(nil, Options{}); err == nil || !strings.Contains(err.Error(), "limit") {
		t.Errorf("range(10**9): %v, want the limit's error", err)
	}
}

// TestRewriteLeavesLiteralsAlone checks that the source redirections touch only expressions:
// text, comments, string literals and raw blocks keep "| tojson" and ".strip()".
func TestRewriteLeavesLiteralsAlone(t *testing.T) {
	src := `a | tojson .strip() {{ '| tojson .strip()' }}{# x | tojson #}{% raw %}{{ y | tojson }}{{ s.strip() }}{% endraw %}{{ "x" | trim }}`
	got := render(t, mustParse(t, src), nil, Options{})
	if want := `a | tojson .strip() | tojson .strip(){{ y | tojson }}{{ s.strip() }}x`; got != want {
		t.Errorf("Render = %q, want %q", got, want)
	}
	if got := rewrite(src); !strings.Contains(got, `"x" | __kvrouter_trim`) || strings.Contains(got, "__kvrouter_tojson") || strings.Contains(got, wsName) {
		t.Errorf("rewrite = %q, want only the trim filter redirected", got)
	}
}

// concurrencyTemplate mutates what each render owns (a namespace, a list, a dict) so that the race
// detector sees any state shared between renders.
const concurrencyTemplate = `{%- set ns = namespace(count=0, last='') -%}
{%- set seen = [] -%}{%- set d = {} -%}
{%- for m in messages[::-1] -%}{%- set ns.count = ns.count + 1 -%}{%- set ns.last = m.role -%}{%- do seen.append(m.content) if false -%}{%- endfor -%}
{%- for m in messages -%}{{ bos_token }}{{ m.role }}: {{ m.content | trim }}{{ m | tojson }}
{% endfor -%}{{ ns.count }} {{ ns.last }}{%- if add_generation_prompt %} assistant:{% endif -%}`

func TestConcurrentRender(t *testing.T) {
	templates := map[string]*Template{}
	src := strings.ReplaceAll(concurrencyTemplate, `{%- do seen.append(m.content) if false -%}`, "")
	templates["inline"] = mustParse(t, src)
	for _, model := range []string{"llama-3.1", "qwen3"} {
		templates[model] = loadModel(t, model)
	}
	convs := make([][]Message, 16)
	for i := range convs {
		convs[i] = synthMessages(synthSpec{Turns: 1 + i%5, Lines: 2 + i, System: i%2 == 0})
	}
	for name, tmpl := range templates {
		t.Run(name, func(t *testing.T) {
			want := make([]string, len(convs))
			for i, c := range convs {
				want[i] = render(t, tmpl, c, Options{AddGenerationPrompt: i%3 != 0})
			}
			var wg sync.WaitGroup
			errs := make(chan error, 8)
			for g := range 8 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for r := range 40 {
						i := (g*7 + r) % len(convs)
						got, err := tmpl.Render(convs[i], Options{AddGenerationPrompt: i%3 != 0})
						if err == nil && got != want[i] {
							err = fmt.Errorf("conversation %d rendered differently under concurrency", i)
						}
						if err != nil {
							errs <- err
							return
						}
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
		})
	}
}
