package frontdoor

import (
	"encoding/json"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name string
		kind Kind
		body string
		want *Request
	}{
		{"completions text", Completions, `{"model": "m", "prompt": "hi", "max_tokens": 4}`,
			&Request{Kind: Completions, Model: "m", Prompt: "hi", AddSpecialTokens: true, AddGenerationPrompt: true}},
		{"completions token ids", Completions, `{"model": "m", "prompt": [1, 2, 4294967295]}`,
			&Request{Kind: Completions, Model: "m", TokenIDs: []uint32{1, 2, 4294967295}, AddSpecialTokens: true, AddGenerationPrompt: true}},
		{"completions token ids with spaces", Completions, `{"model": "m", "prompt": [ 1 ,2,
 3 ]}`,
			&Request{Kind: Completions, Model: "m", TokenIDs: []uint32{1, 2, 3}, AddSpecialTokens: true, AddGenerationPrompt: true}},
		{"completions list of one text", Completions, `{"model": "m", "prompt": ["hi"]}`,
			&Request{Kind: Completions, Model: "m", Prompt: "hi", AddSpecialTokens: true, AddGenerationPrompt: true}},
		{"completions list of one list of ids", Completions, `{"model": "m", "prompt": [[5, 6]]}`,
			&Request{Kind: Completions, Model: "m", TokenIDs: []uint32{5, 6}, AddSpecialTokens: true, AddGenerationPrompt: true}},
		{"chat", ChatCompletions, `{"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]}], "chat_template_kwargs": {"enable_thinking": false}}`,
			&Request{Kind: ChatCompletions, Model: "m", AddGenerationPrompt: true, TemplateKwargs: map[string]json.RawMessage{"enable_thinking": json.RawMessage("false")},
				Messages: []Message{{Role: "system", Content: "be brief"}, {Role: "user", Content: "a\nb", Parts: []string{"a", "b"}}, {Role: "assistant", ToolCalls: []json.RawMessage{json.RawMessage(`{"id": "1"}`)}}}}},
		{"chat continuing the last message", ChatCompletions, `{"model": "m", "messages": [{"role": "user", "content": "x"}], "continue_final_message": true}`,
			&Request{Kind: ChatCompletions, Model: "m", Messages: []Message{{Role: "user", Content: "x"}}}},
		{"completions without special tokens", Completions, `{"model": "m", "prompt": "hi", "add_special_tokens": false}`,
			&Request{Kind: Completions, Model: "m", Prompt: "hi", AddGenerationPrompt: true}},
		{"chat with special tokens", ChatCompletions, `{"model": "m", "messages": [{"role": "user", "content": "x"}], "add_special_tokens": true}`,
			&Request{Kind: ChatCompletions, Model: "m", Messages: []Message{{Role: "user", Content: "x"}}, AddSpecialTokens: true, AddGenerationPrompt: true}},
		{"no model: the header may name it", Completions, `{"prompt": [1]}`,
			&Request{Kind: Completions, TokenIDs: []uint32{1}, AddSpecialTokens: true, AddGenerationPrompt: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Parse(tc.kind, []byte(tc.body))
			if err != nil {
				t.Fatalf("Parse() = %v", err)
			}
			if diff := cmp.Diff(tc.want, got, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("Parse() (-want +got):\n%s", diff)
			}
		})
	}
}

func TestParseRefuses(t *testing.T) {
	for _, tc := range []struct {
		name, body, field, rule string
		kind                    Kind
	}{
		{"not JSON", `{"prompt": `, "", "not a JSON object", Completions},
		{"two values", `{"prompt": "a"} {}`, "", "after top-level value", Completions},
		{"a string among ids", `{"prompt": [1, "a"]}`, "prompt[1]", "not a token id", Completions},
		{"an exponent", `{"prompt": [1e3]}`, "prompt[0]", "not a token id", Completions},
		{"no prompt", `{"model": "m"}`, "prompt", "must be set", Completions},
		{"empty prompt list", `{"prompt": []}`, "prompt", "must not be empty", Completions},
		{"several prompts", `{"prompt": ["a", "b"]}`, "prompt", "holds 2 prompts", Completions},
		{"a number", `{"prompt": 5}`, "prompt", "must be a string", Completions},
		{"negative id", `{"prompt": [1, -1]}`, "prompt[1]", "not a token id", Completions},
		{"fractional id", `{"prompt": [1.5]}`, "prompt[0]", "not a token id", Completions},
		{"huge id", `{"prompt": [4294967296]}`, "prompt[0]", "not a token id", Completions},
		{"no messages", `{"model": "m", "messages": []}`, "messages", "at least one", ChatCompletions},
		{"no role", `{"messages": [{"content": "x"}]}`, "messages[0].role", "must not be empty", ChatCompletions},
		{"image part", `{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}`, "messages[0].content", "text parts only", ChatCompletions},
		{"model not a string", `{"model": 5, "prompt": "x"}`, "", "model must be a JSON string", Completions},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse(tc.kind, []byte(tc.body))
			var bad *BadRequestError
			if !errors.As(err, &bad) || bad.Field != tc.field || !strings.Contains(bad.Rule, tc.rule) {
				t.Fatalf("Parse() = %v, want a bad request of field %q saying %q", err, tc.field, tc.rule)
			}
		})
	}
}

func TestKindOf(t *testing.T) {
	for path, want := range map[string]Kind{"/v1/completions": Completions, "/v1/chat/completions?x=1": ChatCompletions, "/v1/chat/completions/": ChatCompletions, "/v1/embeddings": 0} {
		if got, ok := KindOf(path); got != want || ok != (want != 0) {
			t.Errorf("KindOf(%q) = %v, %v; want %v", path, got, ok, want)
		}
	}
}

// FuzzTokenIDs: whatever list of numbers a body holds, the fast reader of token ids agrees with
// encoding/json (and the rules of a token id) on what it is.
func FuzzTokenIDs(f *testing.F) {
	for _, s := range []string{`[1, 2, 3]`, `[]`, `[4294967295]`, `[4294967296]`, `[-1]`, `[1.0]`, `[ 7 ]`, `[1,]`, `[01]`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, list string) {
		if !strings.HasPrefix(strings.TrimSpace(list), "[") {
			return // a text prompt, or no list: TestParseRefuses covers those
		}
		got, err := Parse(Completions, []byte(`{"prompt": `+list+`}`))
		var items []any
		if json.Unmarshal([]byte(list), &items) != nil {
			if err == nil {
				t.Fatalf("Parse(%q) = %v, but it is no JSON list", list, got)
			}
			return
		}
		if slices.ContainsFunc(items, func(v any) bool { _, num := v.(float64); return !num }) {
			return // texts or lists: TestParse and TestParseRefuses cover those
		}
		var want []json.Number
		if err := json.Unmarshal([]byte(list), &want); err != nil {
			t.Fatal(err)
		}
		valid := len(want) > 0
		ids := make([]uint32, 0, len(want))
		for _, n := range want {
			v, err := strconv.ParseUint(n.String(), 10, 32)
			if err != nil {
				valid = false
				break
			}
			ids = append(ids, uint32(v))
		}
		if !valid {
			if err == nil {
				t.Fatalf("Parse(%q) = %v, want a refusal", list, got.TokenIDs)
			}
			return
		}
		if err != nil {
			t.Fatalf("Parse(%q) = %v, want %v", list, err, ids)
		}
		if diff := cmp.Diff(ids, got.TokenIDs); diff != "" {
			t.Fatalf("Parse(%q) (-want +got):\n%s", list, diff)
		}
	})
}
