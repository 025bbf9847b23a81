package tokenizer

import (
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// Tokenizer encodes text into a model's token ids as Hugging Face's tokenizer does for the
// tokenizer.json it was loaded from. It is safe for concurrent use: the loaded tables are read
// only, and each call borrows its own scratch space and word cache.
type Tokenizer struct {
	vocab     map[string]uint32 // the model's tokens as tokenizer.json spells them
	vocabSize int
	rawVocab  map[string]uint32 // the same tokens by their bytes, for ignore_merges
	byteID    [256]int64        // each byte's one-character token, -1 when the vocab lacks it
	merges    mergeTable
	unkID     int64 // -1 when the model has no unknown token
	fuseUnk   bool
	// ignoreMerges makes a pre-token that is itself a token that one token, without merging.
	ignoreMerges bool

	norms []norm.Form // applied in order; none for no normalizer

	stages      []stage // the pre-tokenizer's splitting stages, in order
	prefixSpace bool    // ByteLevel's add_prefix_space ...
	prefixStage int     // ... applied to the pieces that enter stages[prefixStage:]

	added     map[string]uint32 // every added token's content, for TokenID
	rawAdded  *addedMatcher     // added tokens matched in the text as given
	normAdded *addedMatcher     // added tokens matched in the normalized text

	templated      bool
	prefix, suffix []uint32 // what the post-processor adds around the text's ids

	slots []slot
	next  atomic.Uint32
	spare sync.Pool // *state for calls that find every slot busy
}

// slot holds one state that survives garbage collections (a sync.Pool's would not), so the word
// cache it carries stays warm. The padding keeps two slots' mutexes off one cache line.
type slot struct {
	mu sync.Mutex
	st *state
	_  [48]byte
}

// state is one call's scratch space: the word cache and the BPE's buffers.
type state struct {
	cache  wordCache
	bpe    bpeScratch
	outer  []split
	inner  []split
	pieces []string
	next   []string
	buf    []byte
}

func (t *Tokenizer) initStates() {
	n := 2 * runtime.GOMAXPROCS(0)
	t.slots = make([]slot, n)
	t.spare.New = func() any { return newState() }
}

func newState() *state {
	return &state{cache: newWordCache()}
}

func (t *Tokenizer) getState() (*state, *slot) {
	start := t.next.Add(1)
	for i := range t.slots {
		s := &t.slots[(int(start)+i)%len(t.slots)]
		if s.mu.TryLock() {
			if s.st == nil {
				s.st = newState()
			}
			return s.st, s
		}
	}
	return t.spare.Get().(*state), nil
}

func (t *Tokenizer) putState(st *state, s *slot) {
	if s != nil {
		s.mu.Unlock()
		return
	}
	t.spare.Put(st)
}

// resetCaches empties every slot's word cache (for cold-cache benchmarks and tests).
func (t *Tokenizer) resetCaches() {
	for i := range t.slots {
		s := &t.slots[i]
		s.mu.Lock()
		if s.st != nil {
			s.st.cache.reset()
		}
		s.mu.Unlock()
	}
}

// TokenID returns the id of a token as tokenizer.json spells it: an added token's content
// (<|im_start|>, <|begin_of_text|>) or a vocab entry in its byte-level spelling (Ġthe). It
// reports false for a string that is not one token, so a caller can check that the special
// tokens it relies on exist.
func (t *Tokenizer) TokenID(token string) (uint32, bool) {
	if id, ok := t.added[token]; ok {
		return id, true
	}
	id, ok := t.vocab[token]
	return id, ok
}

// Encode returns the token ids of text, as Hugging Face's tokenizer.encode(text,
// add_special_tokens=addSpecialTokens) does: added and special tokens written in the text are
// one token each, and addSpecialTokens adds what the post-processor adds (Llama's
// <|begin_of_text|>; nothing for Qwen). Text that is not valid UTF-8 is encoded as if each
// invalid byte were U+FFFD, as Go's JSON decoder would have turned it.
func (t *Tokenizer) Encode(text string, addSpecialTokens bool) []uint32 {
	return t.AppendEncode(make([]uint32, 0, len(text)/4+len(t.prefix)+len(t.suffix)+1), text, addSpecialTokens)
}

// AppendEncode appends the token ids of text to dst and returns the extended slice, like Encode
// but without allocating when dst has room: a caller that encodes many texts reuses one buffer.
func (t *Tokenizer) AppendEncode(dst []uint32, text string, addSpecialTokens bool) []uint32 {
	if !utf8.ValidString(text) {
		text = replaceInvalid(text)
	}
	if addSpecialTokens {
		dst = append(dst, t.prefix...)
	}
	st, s := t.getState()
	dst = t.encodeText(st, dst, text)
	t.putState(st, s)
	if addSpecialTokens {
		dst = append(dst, t.suffix...)
	}
	return dst
}

// replaceInvalid replaces each byte of s that is not part of valid UTF-8 with U+FFFD.
func replaceInvalid(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 16)
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			b.WriteRune(utf8.RuneError)
		} else {
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// encodeText is Hugging Face's pipeline without the post-processor: added tokens are split out
// of the text as given; the rest is normalized, then split on the added tokens that match
// normalized text, then pre-tokenized, and each pre-token is encoded by the BPE.
func (t *Tokenizer) encodeText(st *state, dst []uint32, text string) []uint32 {
	if text == "" {
		return dst
	}
	st.outer = t.rawAdded.split(st.outer[:0], text)
	outer := st.outer
	for _, sp := range outer {
		if sp.id >= 0 {
			dst = append(dst, uint32(sp.id))
			continue
		}
		seg := text[sp.start:sp.end]
		if seg == "" {
			continue
		}
		seg = t.normalize(seg)
		if seg == "" {
			continue
		}
		st.inner = t.normAdded.split(st.inner[:0], seg)
		for _, in := range st.inner {
			if in.id >= 0 {
				dst = append(dst, uint32(in.id))
				continue
			}
			if in.start < in.end {
				dst = t.encodeSegment(st, dst, seg[in.start:in.end])
			}
		}
	}
	return dst
}

// normalize applies the normalizer; it returns s itself when s is already normalized.
func (t *Tokenizer) normalize(s string) string {
	for _, f := range t.norms {
		if f.IsNormalString(s) {
			continue
		}
		if (f == norm.NFC || f == norm.NFKC) && strings.Contains(s, divesAkuruO) {
			s = composeExceptDivesAkuru(f, s)
			continue
		}
		s = f.String(s)
	}
	return s
}

// divesAkuruO is U+11935 U+11930, the one canonical composition (to U+11938, DIVES AKURU VOWEL
// SIGN O, Unicode 13) that Hugging Face's Rust tokenizer does not make: its NFC leaves the pair
// as it is, while Go's (and JavaScript's) composes it.
const divesAkuruO = "𑤸"

// composeExceptDivesAkuru normalizes s with f, leaving each U+11935 U+11930 uncomposed as the
// Rust tokenizer does: the pieces between the two are normalized apart, which changes nothing
// else, since U+11930 is a starter that composes with nothing but U+11935.
func composeExceptDivesAkuru(f norm.Form, s string) string {
	var b strings.Builder
	for {
		i := strings.Index(s, divesAkuruO)
		if i < 0 {
			b.WriteString(f.String(s))
			return b.String()
		}
		b.WriteString(f.String(s[:i+4])) // up to and with U+11935
		s = s[i+4:]
	}
}

// encodeSegment pre-tokenizes a piece of normalized text and encodes each pre-token.
func (t *Tokenizer) encodeSegment(st *state, dst []uint32, seg string) []uint32 {
	if !t.prefixSpace && len(t.stages) == 1 {
		// The common case (Llama 3, Qwen): one Split stage straight into the BPE.
		split := t.stages[0]
		for i := 0; i < len(seg); {
			j := split(seg, i)
			dst = t.encodeWord(st, dst, seg[i:j])
			i = j
		}
		return dst
	}
	pieces, next := append(st.pieces[:0], seg), st.next[:0]
	for k, split := range t.stages {
		if t.prefixSpace && k == t.prefixStage {
			pieces = t.addPrefixSpace(pieces)
		}
		for _, p := range pieces {
			for i := 0; i < len(p); {
				j := split(p, i)
				next = append(next, p[i:j])
				i = j
			}
		}
		clear(pieces)
		pieces, next = next, pieces[:0]
	}
	if t.prefixSpace && t.prefixStage == len(t.stages) {
		pieces = t.addPrefixSpace(pieces)
	}
	for _, p := range pieces {
		dst = t.encodeWord(st, dst, p)
	}
	clear(pieces) // drop the references into the caller's text
	st.pieces, st.next = pieces[:0], next
	return dst
}

// addPrefixSpace is ByteLevel's add_prefix_space: a space before each piece that does not
// start with one.
func (t *Tokenizer) addPrefixSpace(pieces []string) []string {
	for i, p := range pieces {
		if !strings.HasPrefix(p, " ") {
			pieces[i] = " " + p
		}
	}
	return pieces
}
