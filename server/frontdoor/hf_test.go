package frontdoor

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/server/frontdoor/testmodels"
)

var (
	modelsOnce sync.Once
	models     *Models
	modelsErr  error
)

// realModels loads the real models of scripts/models.sh once for the package's tests.
func realModels(t *testing.T) *Models {
	t.Helper()
	dirs := map[string]string{}
	for _, name := range testmodels.Names {
		dirs[name] = testmodels.Dir(t, name)
	}
	modelsOnce.Do(func() { models, modelsErr = LoadModels(dirs) })
	if modelsErr != nil {
		t.Fatal(modelsErr)
	}
	return models
}

// chatGolden is a case of chattemplate/testdata/<model>.golden.json, which
// scripts/goldens/gen-chat-goldens.mjs writes from Hugging Face's apply_chat_template and its
// tokenizers: the request, and the prompt's token ids (the Rust tokenizer's where it differs).
type chatGolden struct {
	Name      string                     `json:"name"`
	Request   map[string]json.RawMessage `json:"request"`
	Synthetic *testmodels.Synth          `json:"synthetic"`

	WantIDs           []uint32              `json:"want_ids"`
	RustWantIDs       []uint32              `json:"rust_want_ids"`
	WantIDsDigest     *testmodels.IDsDigest `json:"want_ids_digest"`
	RustWantIDsDigest *testmodels.IDsDigest `json:"rust_want_ids_digest"`
}

// TestChatGoldens sends every chat golden case through the front door as the picker does, as
// an OpenAI request body (Parse, then Tokens with the model's own tokenizer and chat template),
// and wants Hugging Face's token ids: system prompts, multi-turn, unicode, tools, reasoning,
// chat_template_kwargs, and conversations of 220 KB.
func TestChatGoldens(t *testing.T) {
	m := realModels(t)
	for _, model := range testmodels.Names {
		raw, err := os.ReadFile(filepath.Join("chattemplate", "testdata", model+".golden.json"))
		if err != nil {
			t.Fatal(err)
		}
		var file struct{ Cases []chatGolden }
		if err := json.Unmarshal(raw, &file); err != nil {
			t.Fatal(err)
		}
		for _, c := range file.Cases {
			t.Run(model+"/"+c.Name, func(t *testing.T) {
				r, err := Parse(ChatCompletions, testmodels.ChatBody(t, model, c.Request, c.Synthetic))
				if err != nil {
					t.Fatalf("Parse: %v", err)
				}
				got, err := m.Tokens(r)
				if err != nil {
					t.Fatalf("Tokens: %v", err)
				}
				switch {
				case c.RustWantIDs != nil || c.WantIDs != nil:
					want := c.RustWantIDs
					if want == nil {
						want = c.WantIDs
					}
					if diff := cmp.Diff(want, got); diff != "" {
						t.Errorf("ids (-want +got):\n%s", diff)
					}
				case c.RustWantIDsDigest != nil || c.WantIDsDigest != nil:
					want := c.RustWantIDsDigest
					if want == nil {
						want = c.WantIDsDigest
					}
					if diff := cmp.Diff(*want, testmodels.DigestOf(got)); diff != "" {
						t.Errorf("ids (-want +got):\n%s", diff)
					}
				default:
					t.Fatal("the golden case has no ids: run scripts/goldens/gen-chat-goldens.mjs")
				}
			})
		}
	}
}

// tokenizerGolden is a case of tokenizer/testdata/goldens-<model>.json with its text stored.
type tokenizerGolden struct {
	Name           string   `json:"name"`
	Text           *string  `json:"text"`
	IDs            []uint32 `json:"ids"`
	IDsSpecial     []uint32 `json:"ids_special"`
	RustIDs        []uint32 `json:"rust_ids"`
	RustIDsSpecial []uint32 `json:"rust_ids_special"`
}

// TestCompletionsGoldens sends the tokenizer goldens' texts as completions prompts, with and
// without add_special_tokens, and wants Hugging Face's ids.
func TestCompletionsGoldens(t *testing.T) {
	m := realModels(t)
	for _, model := range testmodels.Names {
		raw, err := os.ReadFile(filepath.Join("tokenizer", "testdata", "goldens-"+model+".json"))
		if err != nil {
			t.Fatal(err)
		}
		var file struct{ Cases []tokenizerGolden }
		if err := json.Unmarshal(raw, &file); err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, c := range file.Cases {
			if c.Text == nil || c.IDs == nil {
				continue
			}
			n++
			for _, special := range []bool{true, false} {
				want := c.IDsSpecial
				if c.RustIDsSpecial != nil {
					want = c.RustIDsSpecial
				}
				if !special {
					want = c.IDs
					if c.RustIDs != nil {
						want = c.RustIDs
					}
				}
				body, err := json.Marshal(map[string]any{"model": model, "prompt": *c.Text, "add_special_tokens": special})
				if err != nil {
					t.Fatal(err)
				}
				r, err := Parse(Completions, body)
				if err != nil {
					t.Fatalf("%s: Parse: %v", c.Name, err)
				}
				got, err := m.Tokens(r)
				if err != nil {
					t.Fatalf("%s: Tokens: %v", c.Name, err)
				}
				if diff := cmp.Diff(want, got); diff != "" {
					t.Errorf("%s/%s add_special_tokens=%v (-want +got):\n%s", model, c.Name, special, diff)
				}
			}
		}
		if n < 40 {
			t.Errorf("%s: only %d cases with text and ids", model, n)
		}
	}
}

// TestLoadModel checks how a model directory loads: a base model without a chat template loads
// (its chat requests are unservable, its completions are not), and a broken file is an error
// naming the model, the directory and the file.
func TestLoadModel(t *testing.T) {
	src := testmodels.Dir(t, "qwen3")
	copyFile := func(t *testing.T, dir, name string, edit func(map[string]json.RawMessage)) {
		t.Helper()
		data, err := os.ReadFile(filepath.Join(src, name))
		if err != nil {
			t.Fatal(err)
		}
		if edit != nil {
			var obj map[string]json.RawMessage
			if err := json.Unmarshal(data, &obj); err != nil {
				t.Fatal(err)
			}
			edit(obj)
			if data, err = json.Marshal(obj); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("base model", func(t *testing.T) {
		dir := t.TempDir()
		copyFile(t, dir, "tokenizer.json", nil)
		copyFile(t, dir, "tokenizer_config.json", func(o map[string]json.RawMessage) { delete(o, "chat_template") })
		m, err := LoadModels(map[string]string{"base": dir})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.Tokens(&Request{Kind: Completions, Model: "base", Prompt: "hello", AddSpecialTokens: true}); err != nil {
			t.Errorf("completions: %v", err)
		}
		_, err = m.Tokens(&Request{Kind: ChatCompletions, Model: "base", Messages: []Message{{Role: "user", Content: "hi"}}})
		var unservable *UnservableError
		if !errors.As(err, &unservable) || unservable.Missing != "chat template" {
			t.Errorf("chat: got %v, want an UnservableError for the chat template", err)
		}
	})
	t.Run("no tokenizer_config.json", func(t *testing.T) {
		dir := t.TempDir()
		copyFile(t, dir, "tokenizer.json", nil)
		if _, err := LoadModel(dir); err != nil {
			t.Errorf("LoadModel: %v", err)
		}
	})
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, dir string)
		want  []string
	}{
		{"no tokenizer.json", func(t *testing.T, dir string) {}, []string{`model "m"`, "tokenizer.json", "no such file"}},
		{"an unsupported model type", func(t *testing.T, dir string) {
			copyFile(t, dir, "tokenizer.json", func(o map[string]json.RawMessage) {
				o["model"] = json.RawMessage(`{"type": "WordPiece", "vocab": {"a": 0}}`)
			})
		}, []string{`model "m"`, "tokenizer.json", "WordPiece", "only BPE"}},
		{"a template that does not compile", func(t *testing.T, dir string) {
			copyFile(t, dir, "tokenizer.json", nil)
			copyFile(t, dir, "tokenizer_config.json", func(o map[string]json.RawMessage) {
				o["chat_template"] = json.RawMessage(`"{% for m in messages %}"`)
			})
		}, []string{`model "m"`, "chattemplate"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			tc.setup(t, dir)
			_, err := LoadModels(map[string]string{"m": dir})
			if err == nil {
				t.Fatal("LoadModels: nil error")
			}
			for _, w := range append(tc.want, dir) {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("LoadModels: %v; want it to say %q", err, w)
				}
			}
		})
	}
}
