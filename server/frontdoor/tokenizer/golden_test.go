package tokenizer

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"
	"github.com/kvrouter/kvrouter/server/frontdoor/testmodels"
)

// The goldens are written by scripts/goldens/gen-tokenizer-goldens.mjs from Hugging Face's
// JavaScript tokenizer and, where it is installed, its Rust one; rust_* fields are the Rust
// tokenizer's ids where the two disagree, and the Go tokenizer must match those.
type goldenFile struct {
	Model      string                     `json:"model"`
	Patch      map[string]json.RawMessage `json:"patch"`
	CorpusSize int                        `json:"corpus_size"`
	JavaScript string                     `json:"javascript"`
	Rust       *string                    `json:"rust"`
	Cases      []goldenCase               `json:"cases"`
}

type goldenCase struct {
	Name string  `json:"name"`
	Text *string `json:"text"`
	Chat bool    `json:"chat"`

	IDs            []uint32 `json:"ids"`
	IDsSpecial     []uint32 `json:"ids_special"`
	RustIDs        []uint32 `json:"rust_ids"`
	RustIDsSpecial []uint32 `json:"rust_ids_special"`

	// A long text: generated (by name) or stored, with its ids in brief.
	Generated string `json:"generated"`
	Bytes     int    `json:"bytes"`
	digest
	Rust *digest `json:"rust"`
}

type digest struct {
	Count  int      `json:"count"`
	SHA256 string   `json:"sha256"`
	Head   []uint32 `json:"head"`
	Tail   []uint32 `json:"tail"`
}

func digestOf(ids []uint32, short bool) digest {
	buf := make([]byte, 4*len(ids))
	for i, id := range ids {
		binary.LittleEndian.PutUint32(buf[4*i:], id)
	}
	sum := sha256.Sum256(buf)
	d := digest{Count: len(ids), SHA256: hex.EncodeToString(sum[:])}
	if !short {
		d.Head = ids[:min(100, len(ids))]
		d.Tail = ids[max(0, len(ids)-100):]
	}
	return d
}

var loaded sync.Map // golden name -> *Tokenizer, shared by the tests (Load takes a while)

// loadModel loads a model's tokenizer, or the variant a golden file describes: the model's
// tokenizer.json with the golden's top-level keys replaced, written to a temporary directory.
func loadModel(t testing.TB, name string, g *goldenFile) *Tokenizer {
	t.Helper()
	if tk, ok := loaded.Load(name); ok {
		return tk.(*Tokenizer)
	}
	dir := testmodels.Dir(t, g.Model)
	if g.Patch != nil {
		var f map[string]json.RawMessage
		data, err := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(data, &f); err != nil {
			t.Fatal(err)
		}
		for k, v := range g.Patch {
			f[k] = v
		}
		out, err := json.Marshal(f)
		if err != nil {
			t.Fatal(err)
		}
		dir = filepath.Join(os.TempDir(), fmt.Sprintf("kvrouter-tokenizer-%s-%d", name, os.Getpid()))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(dir)
		if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), out, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tk, err := Load(dir)
	if err != nil {
		t.Fatalf("Load(%s): %v", dir, err)
	}
	actual, _ := loaded.LoadOrStore(name, tk)
	return actual.(*Tokenizer)
}

func readGolden(t testing.TB, name string) *goldenFile {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("testdata", "goldens-"+name+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var g goldenFile
	if err := json.Unmarshal(data, &g); err != nil {
		t.Fatal(err)
	}
	return &g
}

var goldenNames = []string{"llama-3.1", "qwen3", "qwen3-flags", "qwen3-bytelevel-regex", "llama-3.1-prefix-space"}

// xorshift32 is the generator's deterministic randomness.
type xorshift32 uint32

func (s *xorshift32) next() uint32 {
	x := uint32(*s)
	x ^= x << 13
	x ^= x >> 17
	x ^= x << 5
	*s = xorshift32(x)
	return x
}

const size220 = 220 * 1024

func randomText(seed uint32, alphabet string, n int) string {
	cps := []rune(alphabet)
	s := xorshift32(seed)
	var b strings.Builder
	for b.Len() < n {
		b.WriteRune(cps[s.next()%uint32(len(cps))])
	}
	return b.String()
}

// generate builds a generated text as gen-tokenizer-goldens.mjs does.
func generate(name string, corpus []string) (string, bool) {
	switch name {
	case "long":
		return longText(corpus, size220), true
	case "letters-220k":
		return randomText(1, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", size220), true
	case "one-char-220k":
		return strings.Repeat("a", size220), true
	case "digits-220k":
		return randomText(2, "0123456789", size220), true
	case "punct-220k":
		return randomText(3, "!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~", size220), true
	case "spaces-220k":
		return strings.Repeat(" ", size220), true
	case "whitespace-220k":
		return randomText(4, " \t\n\r\u00a0", size220), true
	case "cjk-220k":
		return randomText(5, "的一是不了人我在有他这为之大来以个中上们到说国和地也子时道出而要于就下得可你年生", size220), true
	case "emoji-220k":
		return randomText(6, "😀👍🏽❤️🇺🇸👨‍👩‍👧", size220), true
	}
	var lo rune
	if _, err := fmt.Sscanf(name, "sweep-%x", &lo); err == nil {
		var b strings.Builder
		for cp := lo; cp < lo+0x1000; cp++ {
			if utf8.ValidRune(cp) {
				fmt.Fprintf(&b, "x%c %c1%c%c\n", cp, cp, cp, cp)
			}
		}
		return b.String(), true
	}
	return "", false
}

// longText is the corpus in a deterministic jumble of at least n bytes.
func longText(corpus []string, n int) string {
	seps := []string{" ", "\n", "\r\n", "\t", ""}
	var b strings.Builder
	for k := 0; b.Len() < n; k++ {
		b.WriteString(corpus[(k*7)%len(corpus)])
		b.WriteString(seps[k%5])
		fmt.Fprint(&b, (k*k)%100003)
		b.WriteString(seps[(k+2)%5])
	}
	return b.String()
}

func corpusOf(g *goldenFile) []string {
	var out []string
	for _, c := range g.Cases[:g.CorpusSize] {
		out = append(out, *c.Text)
	}
	return out
}

// TestGoldens compares every golden case's ids with Hugging Face's: the corpus (English, code,
// whitespace, numbers, contractions, scripts, emoji, combining and unnormalized forms, special
// tokens in the text), rendered chat templates, the variants' cases, and the long texts (by
// digest), with add_special_tokens false and true.
func TestGoldens(t *testing.T) {
	for _, name := range goldenNames {
		t.Run(name, func(t *testing.T) {
			g := readGolden(t, name)
			tk := loadModel(t, name, g)
			corpus := corpusOf(g)
			for _, c := range g.Cases {
				t.Run(c.Name, func(t *testing.T) {
					if c.Count == 0 && c.SHA256 == "" {
						want, wantSpecial := c.IDs, c.IDsSpecial
						if c.RustIDs != nil {
							want = c.RustIDs
						}
						if c.RustIDsSpecial != nil {
							wantSpecial = c.RustIDsSpecial
						}
						if diff := cmp.Diff(want, tk.Encode(*c.Text, false)); diff != "" {
							t.Errorf("Encode(%q, false) (-hugging face +go):\n%s", *c.Text, diff)
						}
						if diff := cmp.Diff(wantSpecial, tk.Encode(*c.Text, true)); diff != "" {
							t.Errorf("Encode(%q, true) (-hugging face +go):\n%s", *c.Text, diff)
						}
						return
					}
					var text string
					if c.Text != nil {
						text = *c.Text
					} else {
						var ok bool
						if text, ok = generate(c.Generated, corpus); !ok {
							t.Fatalf("unknown generated text %q", c.Generated)
						}
					}
					if len(text) != c.Bytes {
						t.Fatalf("the text has %d bytes, the golden's %d: the generators disagree", len(text), c.Bytes)
					}
					want := c.digest
					if c.Rust != nil {
						want = *c.Rust
					}
					got := digestOf(tk.Encode(text, false), want.Head == nil)
					if diff := cmp.Diff(want, got); diff != "" {
						t.Errorf("the ids of %s (%d bytes) (-hugging face +go):\n%s", c.Name, len(text), diff)
					}
				})
			}
		})
	}
}
