package chattemplate

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/kvrouter/kvrouter/server/frontdoor/testmodels"
)

// loadModel loads a model's real chat template, or skips the test when the files are missing.
func loadModel(t testing.TB, model string) *Template {
	t.Helper()
	dir := testmodels.Dir(t, model)
	tmpl, err := Load(dir)
	if err != nil {
		t.Fatalf("Load(%s): %v", dir, err)
	}
	return tmpl
}

// goldenRequest is the part of an OpenAI chat request a golden case holds.
type goldenRequest struct {
	Messages            []wireMessage     `json:"messages"`
	Tools               []json.RawMessage `json:"tools"`
	ChatTemplateKwargs  json.RawMessage   `json:"chat_template_kwargs"`
	AddGenerationPrompt *bool             `json:"add_generation_prompt"`
}

// wireMessage is a message as the request body carries it.
type wireMessage struct {
	Role             string            `json:"role"`
	Content          json.RawMessage   `json:"content"`
	Name             string            `json:"name"`
	ToolCallID       string            `json:"tool_call_id"`
	ToolCalls        []json.RawMessage `json:"tool_calls"`
	ReasoningContent string            `json:"reasoning_content"`
}

type goldenCase struct {
	Name       string        `json:"name"`
	Model      string        `json:"model"`
	Template   string        `json:"template"`
	Request    goldenRequest `json:"request"`
	Synthetic  *synthSpec    `json:"synthetic"`
	Want       *string       `json:"want"`
	WantSHA256 string        `json:"want_sha256"`
	WantLen    int           `json:"want_len"`
}

type goldenFile struct {
	Model    string       `json:"model"`
	Renderer string       `json:"renderer"`
	Cases    []goldenCase `json:"cases"`
}

func readGoldens(t testing.TB, model string) goldenFile {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", model+".golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g goldenFile
	if err := json.Unmarshal(raw, &g); err != nil {
		t.Fatal(err)
	}
	return g
}

// message converts a request message the way the front door reads it: a string content, null,
// or a list of parts (kept as Parts, and their text joined into Content).
func (w wireMessage) message(t testing.TB) Message {
	m := Message{Role: w.Role, Name: w.Name, ToolCallID: w.ToolCallID, ToolCalls: w.ToolCalls,
		ReasoningContent: w.ReasoningContent}
	raw := bytes.TrimSpace(w.Content)
	switch {
	case len(raw) == 0 || string(raw) == "null":
	case raw[0] == '"':
		if err := json.Unmarshal(raw, &m.Content); err != nil {
			t.Fatal(err)
		}
	default:
		var parts []struct{ Type, Text string }
		if err := json.Unmarshal(raw, &parts); err != nil {
			t.Fatal(err)
		}
		m.Parts = []Part{}
		for i, p := range parts {
			m.Parts = append(m.Parts, Part{Type: p.Type, Text: p.Text})
			if i > 0 {
				m.Content += "\n"
			}
			m.Content += p.Text
		}
	}
	return m
}

// inputs returns a case's messages and options.
func (c goldenCase) inputs(t testing.TB) ([]Message, Options) {
	var msgs []Message
	if c.Synthetic != nil {
		msgs = synthMessages(*c.Synthetic)
	}
	for _, w := range c.Request.Messages {
		msgs = append(msgs, w.message(t))
	}
	opt := Options{AddGenerationPrompt: true, Tools: c.Request.Tools}
	if c.Request.AddGenerationPrompt != nil {
		opt.AddGenerationPrompt = *c.Request.AddGenerationPrompt
	}
	if len(c.Request.ChatTemplateKwargs) > 0 {
		// As json.RawMessage, the values keep their objects' key order, as json.loads does.
		var kw map[string]json.RawMessage
		if err := json.Unmarshal(c.Request.ChatTemplateKwargs, &kw); err != nil {
			t.Fatal(err)
		}
		opt.Extra = map[string]any{}
		for k, v := range kw {
			opt.Extra[k] = v
		}
	}
	return msgs, opt
}

func digest(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// TestGoldens renders every case of testdata/<model>.golden.json, which
// scripts/goldens/gen-chat-goldens.mjs wrote with Hugging Face's apply_chat_template, and wants
// the same prompt, byte for byte.
func TestGoldens(t *testing.T) {
	for _, model := range []string{"llama-3.1", "qwen3"} {
		t.Run(model, func(t *testing.T) {
			tmpl := loadModel(t, model)
			g := readGoldens(t, model)
			if len(g.Cases) == 0 {
				t.Fatal("no golden cases")
			}
			for _, c := range g.Cases {
				t.Run(c.Name, func(t *testing.T) {
					msgs, opt := c.inputs(t)
					got, err := tmpl.Render(msgs, opt)
					if err != nil {
						t.Fatalf("Render: %v", err)
					}
					if c.Want != nil {
						if diff := cmp.Diff(*c.Want, got); diff != "" {
							t.Errorf("prompt differs from %s (-want +got):\n%s", g.Renderer, diff)
						}
						return
					}
					if got := fmt.Sprintf("%s %d", digest(got), len(got)); got != fmt.Sprintf("%s %d", c.WantSHA256, c.WantLen) {
						t.Errorf("prompt's sha256 and length = %s, want %s %d (%s)", got, c.WantSHA256, c.WantLen, g.Renderer)
					}
				})
			}
		})
	}
}

// TestPythonGoldens renders the cases of testdata/python.golden.json, which
// testdata/crosscheck_jinja2.py wrote with Python's jinja2 in transformers' environment (what vLLM
// renders with): the cases where Hugging Face's JavaScript library renders differently (str.strip
// with an argument, Python's whitespace, floats and U+2028 in tojson, tojson's options), so
// the JavaScript goldens cannot hold them.
func TestPythonGoldens(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("testdata", "python.golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g struct {
		Renderer string       `json:"renderer"`
		Now      string       `json:"now"`
		Cases    []goldenCase `json:"cases"`
	}
	if err := json.Unmarshal(raw, &g); err != nil {
		t.Fatal(err)
	}
	now, err := time.Parse("2006-01-02T15:04:05", g.Now)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range g.Cases {
		t.Run(c.Name, func(t *testing.T) {
			var tmpl *Template
			if c.Model != "" {
				tmpl = loadModel(t, c.Model)
			} else if tmpl, err = Parse(c.Template, Specials{}); err != nil {
				t.Fatal(err)
			}
			msgs, opt := c.inputs(t)
			opt.Now = func() time.Time { return now }
			got, err := tmpl.Render(msgs, opt)
			if err != nil {
				t.Fatalf("Render: %v", err)
			}
			if diff := cmp.Diff(*c.Want, got); diff != "" {
				t.Errorf("prompt differs from %s (-want +got):\n%s", g.Renderer, diff)
			}
		})
	}
}
