package tokenizer

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/server/frontdoor/testmodels"
)

// The figures (go test -run '^$' -bench . ./server/frontdoor/tokenizer) are in
// docs/BENCHMARKS.md, "Tokenizing in the picker".

// benchText is English and code (the corpus's prose, code, JSON, HTML and Markdown cases) with a
// counter between the pieces, cut to n bytes at a character boundary.
func benchText(tb testing.TB, g *goldenFile, n int) string {
	tb.Helper()
	pick := map[string]bool{"english": true, "paragraph": true, "contractions": true, "code-go": true,
		"code-python": true, "code-js": true, "json": true, "html": true, "markdown": true, "crlf": true,
		"numbers": true, "trailing-spaces": true, "urls": true}
	var pieces []string
	for _, c := range g.Cases[:g.CorpusSize] {
		if pick[c.Name] {
			pieces = append(pieces, *c.Text)
		}
	}
	var b strings.Builder
	for k := 0; b.Len() < n; k++ {
		fmt.Fprintf(&b, "%s\n%d ", pieces[k%len(pieces)], k)
	}
	return cut(b.String(), n)
}

// proseText is pseudo-English of made-up words (mostly distinct, so the word cache rarely
// helps): the BPE's uncached speed.
func proseText(n int) string {
	syll := []string{"ka", "ro", "mi", "ten", "sul", "bra", "ve", "quo", "nix", "pe", "lam", "dor", "ith", "e", "a", "us"}
	s := xorshift32(7)
	var b strings.Builder
	for b.Len() < n {
		k := 1 + s.next()%4
		if s.next()%8 == 0 {
			b.WriteString("Th")
		}
		for range k {
			b.WriteString(syll[s.next()%uint32(len(syll))])
		}
		switch s.next() % 12 {
		case 0:
			b.WriteString(". ")
		case 1:
			b.WriteString(", ")
		case 2:
			b.WriteString("\n")
		default:
			b.WriteString(" ")
		}
	}
	return cut(b.String(), n)
}

func cut(s string, n int) string {
	for n < len(s) && n > 0 && s[n]&0xC0 == 0x80 {
		n--
	}
	return s[:min(n, len(s))]
}

var benchSizes = []struct {
	name string
	n    int
}{{"1KB", 1 << 10}, {"16KB", 16 << 10}, {"220KB", 220 << 10}}

func benchModel(b *testing.B, name string) (*Tokenizer, *goldenFile) {
	g := readGolden(b, name)
	return loadModel(b, name, g), g
}

// BenchmarkEncode is English and code with the word cache warm, as it is in a running picker.
func BenchmarkEncode(b *testing.B) {
	for _, model := range []string{"llama-3.1", "qwen3"} {
		tk, g := benchModel(b, model)
		for _, sz := range benchSizes {
			text := benchText(b, g, sz.n)
			b.Run(model+"/"+sz.name, func(b *testing.B) {
				dst := make([]uint32, 0, len(text))
				b.SetBytes(int64(len(text)))
				for b.Loop() {
					dst = tk.AppendEncode(dst[:0], text, true)
				}
			})
		}
	}
}

// BenchmarkEncodeCold is the same 220 KB with every cache emptied before each encode, and
// pseudo-English whose words are mostly new: the speed on text never seen before.
func BenchmarkEncodeCold(b *testing.B) {
	for _, model := range []string{"llama-3.1", "qwen3"} {
		tk, g := benchModel(b, model)
		for _, in := range []struct{ name, text string }{
			{"code-220KB", benchText(b, g, 220<<10)},
			{"prose-220KB", proseText(220 << 10)},
		} {
			b.Run(model+"/"+in.name, func(b *testing.B) {
				dst := make([]uint32, 0, len(in.text))
				b.SetBytes(int64(len(in.text)))
				for b.Loop() {
					tk.resetCaches()
					dst = tk.AppendEncode(dst[:0], in.text, true)
				}
			})
		}
	}
}

// BenchmarkEncodePathological is 220 KB that is one word: random letters, one letter repeated,
// spaces; and the corpus jumble ("long") and random CJK.
func BenchmarkEncodePathological(b *testing.B) {
	for _, model := range []string{"llama-3.1", "qwen3"} {
		tk, g := benchModel(b, model)
		for _, name := range []string{"letters-220k", "one-char-220k", "spaces-220k", "punct-220k", "cjk-220k", "long"} {
			text, _ := generate(name, corpusOf(g))
			b.Run(model+"/"+name, func(b *testing.B) {
				dst := make([]uint32, 0, len(text))
				b.SetBytes(int64(len(text)))
				for b.Loop() {
					dst = tk.AppendEncode(dst[:0], text, false)
				}
			})
		}
	}
}

// BenchmarkLoad is reading and indexing a model's tokenizer.json.
func BenchmarkLoad(b *testing.B) {
	for _, model := range []string{"llama-3.1", "qwen3"} {
		dir := testmodels.Dir(b, model)
		b.Run(model, func(b *testing.B) {
			for b.Loop() {
				if _, err := Load(dir); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
