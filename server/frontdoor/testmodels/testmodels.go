// Package testmodels finds the real model files (tokenizer.json, tokenizer_config.json) that the
// front door's tests tokenize and render with. scripts/models.sh puts them in .tmp/models; a test
// run without them skips those tests, except where KVROUTER_REQUIRE_MODELS=1 (scripts/test.sh
// sets it after fetching them), where a missing model fails the test, so that CI never passes
// by skipping the goldens.
package testmodels

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// Names are the models scripts/models.sh fetches.
var Names = []string{"llama-3.1", "qwen3"}

// Root is the directory holding one directory per model: $KVROUTER_MODELS, or the repository's
// .tmp/models.
func Root() string {
	if d := os.Getenv("KVROUTER_MODELS"); d != "" {
		return d
	}
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..", ".tmp", "models")
}

// Dir returns the directory of model, skipping the test (or failing it, under
// KVROUTER_REQUIRE_MODELS=1) when its tokenizer.json or tokenizer_config.json is missing.
func Dir(tb testing.TB, model string) string {
	tb.Helper()
	dir := filepath.Join(Root(), model)
	for _, f := range []string{"tokenizer.json", "tokenizer_config.json"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			if os.Getenv("KVROUTER_REQUIRE_MODELS") == "1" {
				tb.Fatalf("no %s (KVROUTER_REQUIRE_MODELS=1): %v; run scripts/models.sh", filepath.Join(dir, f), err)
			}
			tb.Skipf("no %s (%v): run scripts/models.sh, or set KVROUTER_MODELS", filepath.Join(dir, f), err)
		}
	}
	return dir
}

// synthWords are the filler of the synthetic golden conversations, as
// scripts/goldens/gen-chat-goldens.mjs has them: accents, CJK, emoji sequences, a combining mark,
// and text that looks like Jinja, JSON escapes and HTML.
var synthWords = []string{
	"alpha", "héllo", "wörld", "世界", "你好", "🙂", "👩\u200d👩\u200d👧", "e\u0301", "naïve", "Ω",
	"{{ x }}", "{% if y %}", "quote\"d", "back\\slash", "tab\there", "<b>&amp;</b>",
}

// SynthText is the text of one synthetic message, built exactly as gen-chat-goldens.mjs's
// synthText builds it.
func SynthText(seed, lines int) string {
	var b strings.Builder
	for i := range lines {
		a := synthWords[(i*7+seed)%len(synthWords)]
		c := synthWords[(i*3+seed*5)%len(synthWords)]
		fmt.Fprintf(&b, "%d.%d %s lorem ipsum dolor sit amet %s consectetur\n", seed, i, a, c)
	}
	return b.String()
}

// Synth is a golden case's recipe for a large conversation (its "synthetic" field).
type Synth struct {
	Turns  int  `json:"turns"`
	Lines  int  `json:"lines"`
	System bool `json:"system"`
}

// Turn is one message of a synthetic conversation.
type Turn struct{ Role, Content string }

// Conversation builds the recipe's conversation: an optional system message, then Turns
// messages alternating user and assistant, each of Lines lines.
func (s Synth) Conversation() []Turn {
	var turns []Turn
	if s.System {
		turns = append(turns, Turn{"system", SynthText(0, s.Lines)})
	}
	for t := range s.Turns {
		role := "user"
		if t%2 == 1 {
			role = "assistant"
		}
		turns = append(turns, Turn{role, SynthText(t+1, s.Lines)})
	}
	return turns
}

// ChatBody is the OpenAI chat request of a chat golden case (frontdoor/chattemplate/testdata) as a
// client sends it for model: the case's request fields, with the recipe's conversation as its
// messages when synth is not nil.
func ChatBody(tb testing.TB, model string, request map[string]json.RawMessage, synth *Synth) []byte {
	tb.Helper()
	body := map[string]any{"model": model, "max_tokens": 16}
	for k, v := range request {
		body[k] = v
	}
	if synth != nil {
		var msgs []map[string]string
		for _, turn := range synth.Conversation() {
			msgs = append(msgs, map[string]string{"role": turn.Role, "content": turn.Content})
		}
		body["messages"] = msgs
	}
	data, err := json.Marshal(body)
	if err != nil {
		tb.Fatal(err)
	}
	return data
}

// IDsDigest is how the goldens write a long prompt's ids: their count and the sha256 of their
// little-endian uint32 bytes.
type IDsDigest struct {
	Count  int    `json:"count"`
	SHA256 string `json:"sha256"`
}

// DigestOf returns the ids' digest.
func DigestOf(ids []uint32) IDsDigest {
	buf := make([]byte, 4*len(ids))
	for i, id := range ids {
		binary.LittleEndian.PutUint32(buf[4*i:], id)
	}
	sum := sha256.Sum256(buf)
	return IDsDigest{Count: len(ids), SHA256: hex.EncodeToString(sum[:])}
}
