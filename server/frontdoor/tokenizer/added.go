package tokenizer

import (
	"sort"
	"strings"
	"unicode"
	"unicode/utf8"
)

// addedToken is one of tokenizer.json's added_tokens, as the matcher uses it.
type addedToken struct {
	content    string // as matched: normalized for a normalized token
	id         uint32
	singleWord bool // match only where neither neighbour is a word character
	lstrip     bool // the match takes in the whitespace before it
	rstrip     bool // the match takes in the whitespace after it
}

// split is a piece of text: an added token's (id >= 0) or text still to encode (id < 0).
type split struct {
	start, end int
	id         int64
}

// addedMatcher finds added tokens in text as Hugging Face's AddedVocabulary does: the
// leftmost match, and the longest of those starting there (an Aho-Corasick automaton with
// LeftmostLongest matching in Hugging Face; a byte trie here, since the tokens are few and
// short), then single_word, lstrip and rstrip applied to each match in turn.
type addedMatcher struct {
	tokens []addedToken
	nodes  []trieNode // nodes[0] is the root
	root   [256]int32 // the root's children by byte; 0 for none
	// only is the first byte of every token when they all share it (Llama's and Qwen's all
	// start with '<'), so the scan can use strings.IndexByte; -1 otherwise.
	only int
}

type trieNode struct {
	tok   int32 // index in tokens of the token ending here, or -1
	edges []trieEdge
}

type trieEdge struct {
	b    byte
	node int32
}

func newAddedMatcher(tokens []addedToken) *addedMatcher {
	if len(tokens) == 0 {
		return nil
	}
	m := &addedMatcher{tokens: tokens, nodes: []trieNode{{tok: -1}}, only: -1}
	child := func(n int32, b byte) int32 {
		if n == 0 {
			return m.root[b]
		}
		for _, e := range m.nodes[n].edges {
			if e.b == b {
				return e.node
			}
		}
		return 0
	}
	firsts := map[byte]bool{}
	for i, tok := range tokens {
		n := int32(0)
		for k := 0; k < len(tok.content); k++ {
			b := tok.content[k]
			c := child(n, b)
			if c == 0 {
				c = int32(len(m.nodes))
				m.nodes = append(m.nodes, trieNode{tok: -1})
				if n == 0 {
					m.root[b] = c
				} else {
					m.nodes[n].edges = append(m.nodes[n].edges, trieEdge{b, c})
				}
			}
			n = c
		}
		if m.nodes[n].tok < 0 { // a content listed twice keeps its first entry
			m.nodes[n].tok = int32(i)
		}
		firsts[tok.content[0]] = true
	}
	for i := range m.nodes {
		e := m.nodes[i].edges
		sort.Slice(e, func(a, b int) bool { return e[a].b < e[b].b })
	}
	if len(firsts) == 1 {
		for b := range firsts {
			m.only = int(b)
		}
	}
	return m
}

// longest returns the index of the longest token that s[i:] starts with, and its length.
func (m *addedMatcher) longest(s string, i int) (tok int32, n int) {
	tok = -1
	node := m.root[s[i]]
	for j := i + 1; node != 0; j++ {
		if t := m.nodes[node].tok; t >= 0 {
			tok, n = t, j-i
		}
		if j == len(s) {
			break
		}
		edges := m.nodes[node].edges
		next := int32(0)
		for _, e := range edges {
			if e.b == s[j] {
				next = e.node
				break
			}
		}
		node = next
	}
	return tok, n
}

// nextMatch returns the next match at or after i: leftmost, then longest.
func (m *addedMatcher) nextMatch(s string, i int) (tok int32, start, end int) {
	for i < len(s) {
		if m.only >= 0 {
			j := strings.IndexByte(s[i:], byte(m.only))
			if j < 0 {
				return -1, 0, 0
			}
			i += j
		} else if m.root[s[i]] == 0 {
			i++
			continue
		}
		if tok, n := m.longest(s, i); tok >= 0 {
			return tok, i, i + n
		}
		i++
	}
	return -1, 0, 0
}

// split appends the pieces of s to dst: the added tokens found in it and the text between them.
// A nil matcher returns s whole.
func (m *addedMatcher) split(dst []split, s string) []split {
	if m == nil {
		return append(dst, split{0, len(s), -1})
	}
	offset := 0
	for i := 0; i < len(s); {
		tok, start, stop := m.nextMatch(s, i)
		if tok < 0 {
			break
		}
		i = stop // matches never overlap, whatever single_word discards
		a := &m.tokens[tok]
		if a.singleWord {
			if (start > 0 && endsWithWord(s[:start])) || (stop < len(s) && startsWithWord(s[stop:])) {
				continue
			}
		}
		if a.lstrip {
			start = max(trailingSpaceStart(s[:start]), offset)
		}
		if a.rstrip {
			stop += leadingSpaceLen(s[stop:])
		}
		if offset < start {
			dst = append(dst, split{offset, start, -1})
		}
		dst = append(dst, split{start, stop, int64(a.id)})
		offset = stop
	}
	if offset != len(s) {
		dst = append(dst, split{offset, len(s), -1})
	}
	return dst
}

// isWordChar is \w of Rust's regex crate, which Hugging Face uses for single_word: Alphabetic,
// marks, decimal digits, connector punctuation and the joiners.
func isWordChar(r rune) bool {
	return unicode.IsLetter(r) || unicode.Is(unicode.Nl, r) || unicode.Is(unicode.Other_Alphabetic, r) ||
		unicode.IsMark(r) || unicode.Is(unicode.Nd, r) || unicode.Is(unicode.Pc, r) || unicode.Is(unicode.Join_Control, r)
}

func endsWithWord(s string) bool {
	r, _ := utf8.DecodeLastRuneInString(s)
	return isWordChar(r)
}

func startsWithWord(s string) bool {
	r, _ := utf8.DecodeRuneInString(s)
	return isWordChar(r)
}

// trailingSpaceStart is where the whitespace that s ends with starts (len(s) for none).
func trailingSpaceStart(s string) int {
	i := len(s)
	for i > 0 {
		r, n := utf8.DecodeLastRuneInString(s[:i])
		if !unicode.Is(spaceTable, r) {
			break
		}
		i -= n
	}
	return i
}

// leadingSpaceLen is the length of the whitespace that s starts with.
func leadingSpaceLen(s string) int {
	i := 0
	for i < len(s) {
		r, n := utf8.DecodeRuneInString(s[i:])
		if !unicode.Is(spaceTable, r) {
			break
		}
		i += n
	}
	return i
}
