package tokenizer

import (
	"sync"
	"unicode"
	"unicode/utf8"
)

// A stage is one splitting step of the pre-tokenizer: given s and a position i < len(s), it
// returns the end of the piece that starts at i. The stages below are hand-written matchers of
// the known Split patterns, with the regular expressions' semantics spelled out: alternatives
// tried in order, the first that matches wins, quantifiers greedy with backtracking. Each
// pattern matches at every position, so the pieces cover the text with no gaps.
type stage func(s string, i int) int

// Character classes of the patterns: \p{L}, \p{N}, \r or \n, other \s, and the rest.
const (
	clsOther uint8 = iota
	clsLetter
	clsNumber
	clsNewline
	clsSpace
)

var (
	classOnce sync.Once
	bmpClass  []uint8 // the class of every code point below U+10000
)

func initClasses() {
	classOnce.Do(func() {
		bmpClass = make([]uint8, 0x10000)
		for r := rune(0); r < 0x10000; r++ {
			bmpClass[r] = classifySlow(r)
		}
	})
}

func classifySlow(r rune) uint8 {
	switch {
	case r == '\r' || r == '\n':
		return clsNewline
	case unicode.Is(letterTable, r):
		return clsLetter
	case unicode.Is(numberTable, r):
		return clsNumber
	case unicode.Is(spaceTable, r):
		return clsSpace
	}
	return clsOther
}

// classAt returns the class of the character at s[i] and its length in bytes. s is valid UTF-8.
func classAt(s string, i int) (uint8, int) {
	if c := s[i]; c < utf8.RuneSelf {
		return bmpClass[c], 1
	}
	r, n := utf8.DecodeRuneInString(s[i:])
	if r < 0x10000 {
		return bmpClass[r], n
	}
	return classifySlow(r), n
}

// scan returns the end of the run of class cls that starts at i.
func scan(s string, i int, cls uint8) int {
	for i < len(s) {
		c, n := classAt(s, i)
		if c != cls {
			break
		}
		i += n
	}
	return i
}

// scanOther returns the end of the run of [^\s\p{L}\p{N}] that starts at i.
func scanOther(s string, i int) int { return scan(s, i, clsOther) }

// isSpaceClass reports whether a class is \s.
func isSpaceClass(c uint8) bool { return c == clsNewline || c == clsSpace }

// contraction returns the length after an apostrophe of the contraction s[i:] starts with:
// 's, 't, 're, 've, 'm, 'll or 'd. With fold, letters match case-insensitively as Oniguruma's
// (?i:...) matches them, so s also matches U+017F (ſ, LATIN SMALL LETTER LONG S), whose case
// folding is s; no other character folds to one of these letters.
func contraction(s string, i int, fold bool) int {
	if i >= len(s) {
		return 0
	}
	lower := func(c byte) byte {
		if fold && 'A' <= c && c <= 'Z' {
			return c + 'a' - 'A'
		}
		return c
	}
	at := func(k int) byte {
		if i+k < len(s) {
			return lower(s[i+k])
		}
		return 0
	}
	switch at(0) {
	case 's', 't', 'm', 'd':
		return 1
	case 'r', 'v':
		if at(1) == 'e' {
			return 2
		}
	case 'l':
		if at(1) == 'l' {
			return 2
		}
	case 0xC5: // U+017F is C5 BF
		if fold && at(1) == 0xBF {
			return 2
		}
	}
	return 0
}

// llama3Digits is
//
//	(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,maxDigits}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
func llama3Digits(s string, i, maxDigits int) int {
	if s[i] == '\'' {
		if n := contraction(s, i+1, true); n > 0 {
			return i + 1 + n
		}
	}
	cls, n := classAt(s, i)
	switch cls {
	case clsLetter: // \p{L}+ (the optional first character matched nothing)
		return scan(s, i+n, clsLetter)
	case clsNumber: // \p{N}{1,maxDigits}
		j := i + n
		for k := 1; k < maxDigits && j < len(s); k++ {
			c, m := classAt(s, j)
			if c != clsNumber {
				break
			}
			j += m
		}
		return j
	case clsNewline: // only \s*[\r\n]+ can start with \r or \n
		return spaceRun(s, i, true)
	}
	// A space or other character: [^\r\n\p{L}\p{N}]\p{L}+ when a letter follows.
	if j := i + n; j < len(s) {
		if c, m := classAt(s, j); c == clsLetter {
			return scan(s, j+m, clsLetter)
		}
	}
	// ' ?[^\s\p{L}\p{N}]+[\r\n]*'
	start := -1
	if cls == clsOther {
		start = i
	} else if s[i] == ' ' && i+1 < len(s) {
		if c, _ := classAt(s, i+1); c == clsOther {
			start = i + 1
		}
	}
	if start >= 0 {
		j := scanOther(s, start)
		for j < len(s) && (s[j] == '\r' || s[j] == '\n') {
			j++
		}
		return j
	}
	return spaceRun(s, i, true)
}

// spaceRun matches at i, the start of a run of whitespace: \s*[\r\n]+ when newlines counts
// and the run holds \r or \n (the run up to its last one), else \s+(?!\S) (the run, less its
// last character when something follows it, so that character goes with the next word), else
// \s+ (a lone whitespace character before a word).
func spaceRun(s string, i int, newlines bool) int {
	j, lastNL, last := i, -1, i
	for j < len(s) {
		c, n := classAt(s, j)
		if !isSpaceClass(c) {
			break
		}
		if c == clsNewline {
			lastNL = j + n
		}
		last = j
		j += n
	}
	if newlines && lastNL >= 0 {
		return lastNL
	}
	if j == len(s) || last == i {
		return j
	}
	return last
}

// stageLlama3 is Llama 3's Split pattern (numbers in threes).
func stageLlama3(s string, i int) int { return llama3Digits(s, i, 3) }

// stageQwen2 is Qwen 2's Split pattern (single digits).
func stageQwen2(s string, i int) int { return llama3Digits(s, i, 1) }

// stageGPT2 is the ByteLevel pre-tokenizer's pattern (GPT-2):
//
//	's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
func stageGPT2(s string, i int) int {
	if s[i] == '\'' {
		if n := contraction(s, i+1, false); n > 0 {
			return i + 1 + n
		}
	}
	j := i
	if s[i] == ' ' && i+1 < len(s) {
		j = i + 1
	}
	cls, n := classAt(s, j)
	if !isSpaceClass(cls) {
		return scan(s, j+n, cls)
	}
	return spaceRun(s, i, false)
}
