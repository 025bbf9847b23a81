package chattemplate

import (
	"strings"
	"unicode/utf8"
)

// filterNames are the filters rewrite redirects to this package's versions (python.go). The names
// this package adds start with "__kvrouter_", which no Hugging Face template uses.
var filterNames = map[string]string{
	"tojson": "__kvrouter_tojson",
	"trim":   "__kvrouter_trim",
	"string": "__kvrouter_string",
}

// printName names the function every {{ expression }} is wrapped in: jinja2 prints str(value),
// the library prints None as "" and floats with %g.
const printName = "__kvrouter_print"

// wsName names the variable holding pyWhitespace.
const wsName = "__kvrouter_whitespace"

var stripMethods = map[string]bool{"strip": true, "lstrip": true, "rstrip": true}

// rewrite turns a chat template's source into one the Jinja library renders as Python's jinja2
// does. It lexes the source as jinja2's lexer does (transformers' environment: trim_blocks,
// lstrip_blocks, keep_trailing_newline false) and writes it back in a form that leaves the library
// no decisions where it differs from jinja2:
//
//   - Whitespace control is applied here, with jinja2's rules (the "-" and "+" markers, trim_blocks,
//     lstrip_blocks, the template's trailing newline, newlines normalised to "\n"), and every piece
//     of text is written as a string literal printed by an expression ({{ '...' }}), so the
//     library, which trims the text next to a tag even when an expression stands between them
//     (`{% for %}{{ x }}\n{% endfor %}` loses the newline), has no text left to trim. Comments
//     are dropped; {% raw %} blocks become text.
//   - String literals are unescaped as Python does (\r, \v, \xhh, \uXXXX, octal, ...): the
//     library knows only \n, \t, \\, \' and \".
//   - `| tojson`, `| trim` and `| string` call this package's versions (python.go), named by
//     filterNames: the library looks its own filters up before the caller's.
//   - Each {{ expression }} prints through printName, Python's str(): the library prints None as
//     "" and floats with Go's %g.
//   - `.strip()`, `.lstrip()` and `.rstrip()` without arguments get Python's whitespace as their
//     argument: the library strips only " \t\n\r" in lstrip and rstrip.
//   - Inside tags, "}}" and "%}" that jinja2 reads as closing braces (a dict literal's) are
//     spaced apart, since the library would take them for the tag's end.
func rewrite(source string) string {
	src := strings.ReplaceAll(source, "\r\n", "\n")
	src = strings.ReplaceAll(src, "\r", "\n")
	src = strings.TrimSuffix(src, "\n") // keep_trailing_newline=False drops one
	var b strings.Builder
	b.Grow(len(src) + len(src)/4)
	pos, lineStarting := 0, true
	for {
		open, kind := nextOpener(src, pos)
		if open < 0 {
			writeText(&b, src[pos:])
			return b.String()
		}
		text := src[pos:open]
		i := open + 2
		var sign byte
		if i < len(src) && (src[i] == '-' || src[i] == '+') {
			sign = src[i]
			i++
		}
		if kind == '%' {
			if bodyStart, closeSign, ok := rawBegin(src, i); ok {
				writeText(&b, leftStrip(text, sign, true, lineStarting))
				lineStarting = false
				if closeSign == '-' {
					j := skipSpace(src, bodyStart)
					lineStarting = j > bodyStart && src[j-1] == '\n'
					bodyStart = j
				}
				end, dataEnd, openSign, endSign := rawEnd(src, bodyStart)
				if end < 0 {
					b.WriteString(src[open:]) // unclosed: the library reports it
					return b.String()
				}
				writeText(&b, leftStrip(src[bodyStart:dataEnd], openSign, true, lineStarting))
				pos, lineStarting = rightStrip(src, end, endSign, true)
				continue
			}
		}
		writeText(&b, leftStrip(text, sign, kind != '{', lineStarting))
		end, closeSign := tagClose(src, i, kind)
		if end < 0 {
			b.WriteString(src[open:]) // unclosed: the library reports it
			return b.String()
		}
		inner := src[i:end]
		closerLen := 2
		if closeSign != 0 {
			closerLen = 3
		}
		switch kind {
		case '{':
			b.WriteString("{{ " + printName + "((")
			rewriteTag(&b, inner)
			b.WriteString(")) }}")
		case '%':
			b.WriteString("{% ")
			rewriteTag(&b, inner)
			b.WriteString(" %}")
		}
		pos, lineStarting = rightStrip(src, end+closerLen, closeSign, kind != '{')
	}
}

// nextOpener returns the first "{{", "{%" or "{#" at or after pos and its second character.
func nextOpener(s string, pos int) (int, byte) {
	for i := pos; i+1 < len(s); i++ {
		if s[i] == '{' {
			switch s[i+1] {
			case '{', '%', '#':
				return i, s[i+1]
			}
		}
	}
	return -1, 0
}

// leftStrip applies the whitespace control of a tag's left side to the text before it: "-" strips
// all whitespace; otherwise lstrip_blocks (block and comment tags, not "+") strips the spaces
// between the line's start and the tag when they are all the line holds.
func leftStrip(text string, sign byte, block, lineStarting bool) string {
	switch {
	case sign == '-':
		return strings.TrimRight(text, pyWhitespace)
	case sign == '+' || !block:
		return text
	}
	lpos := strings.LastIndexByte(text, '\n') + 1
	if (lpos > 0 || lineStarting) && lpos < len(text) && strings.Trim(text[lpos:], pyWhitespace) == "" {
		return text[:lpos]
	}
	return text
}

// rightStrip applies the whitespace control of a tag's right side, whose closer ends at pos: "-"
// skips all whitespace after it, trim_blocks (block and comment tags, not "+") one newline. It
// returns where the text resumes and whether what the closer consumed ended a line.
func rightStrip(s string, pos int, sign byte, block bool) (int, bool) {
	switch {
	case sign == '-':
		j := skipSpace(s, pos)
		return j, j > pos && s[j-1] == '\n'
	case sign == '+' || !block:
		return pos, false
	case pos < len(s) && s[pos] == '\n':
		return pos + 1, true
	}
	return pos, false
}

func skipSpace(s string, i int) int {
	for i < len(s) {
		r, size := utf8.DecodeRuneInString(s[i:])
		if !strings.ContainsRune(pyWhitespace, r) {
			break
		}
		i += size
	}
	return i
}

// rawBegin matches the rest of jinja2's raw opener, `\s*raw\s*(-%}|%})`, at i; it returns where
// the raw text starts and the closer's sign.
func rawBegin(s string, i int) (int, byte, bool) {
	j := skipSpace(s, i)
	if !strings.HasPrefix(s[j:], "raw") {
		return 0, 0, false
	}
	j = skipSpace(s, j+3)
	switch {
	case strings.HasPrefix(s[j:], "-%}"):
		return j + 3, '-', true
	case strings.HasPrefix(s[j:], "%}"):
		return j + 2, 0, true
	}
	return 0, 0, false
}

// rawEnd finds the first `{%[-+]? endraw [-+]?%}` at or after i: it returns the index after its
// "%}", where the raw text ends, and the signs of its opener and closer.
func rawEnd(s string, i int) (end, dataEnd int, openSign, closeSign byte) {
	for {
		k := strings.Index(s[i:], "{%")
		if k < 0 {
			return -1, 0, 0, 0
		}
		k += i
		j := k + 2
		var sg byte
		if j < len(s) && (s[j] == '-' || s[j] == '+') {
			sg = s[j]
			j++
		}
		j = skipSpace(s, j)
		if strings.HasPrefix(s[j:], "endraw") {
			j = skipSpace(s, j+6)
			switch {
			case strings.HasPrefix(s[j:], "+%}"), strings.HasPrefix(s[j:], "-%}"):
				return j + 3, k, sg, s[j]
			case strings.HasPrefix(s[j:], "%}"):
				return j + 2, k, sg, 0
			}
		}
		i = k + 2
	}
}

// tagClose finds the end of a tag whose content starts at i, as jinja2's lexer does: a comment
// ends at the first "#}" (with its sign), an expression or statement at the first closer outside
// string literals and brackets. It returns the index of the closer (of its sign, when it has one)
// and the sign, or -1.
func tagClose(s string, i int, kind byte) (int, byte) {
	if kind == '#' {
		k := strings.Index(s[i:], "#}")
		if k < 0 {
			return -1, 0
		}
		k += i
		if k > i && (s[k-1] == '-' || s[k-1] == '+') {
			return k - 1, s[k-1]
		}
		return k, 0
	}
	closer := byte('}')
	if kind == '%' {
		closer = '%'
	}
	depth := 0
	for i < len(s) {
		c := s[i]
		switch c {
		case '\'', '"':
			i = stringEnd(s, i)
			continue
		case '(', '[', '{':
			depth++
		case ')', ']':
			depth = max(0, depth-1)
		}
		if depth == 0 {
			if (c == '-' || c == '+' && kind == '%') && i+2 < len(s) && s[i+1] == closer && s[i+2] == '}' {
				return i, c
			}
			if c == closer && i+1 < len(s) && s[i+1] == '}' {
				return i, 0
			}
		}
		if c == '}' {
			depth = max(0, depth-1)
		}
		i++
	}
	return -1, 0
}

// stringEnd returns the index after the string literal that starts at i (or len(s)).
func stringEnd(s string, i int) int {
	q := s[i]
	for j := i + 1; j < len(s); j++ {
		switch s[j] {
		case '\\':
			j++
		case q:
			return j + 1
		}
	}
	return len(s)
}

// writeText writes template text as an expression printing it.
func writeText(b *strings.Builder, text string) {
	if text == "" {
		return
	}
	b.WriteString("{{ ")
	quoteString(b, text, '\'')
	b.WriteString(" }}")
}

func isIdent(c byte) bool {
	return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// rewriteTag writes a tag's content with the redirections applied.
func rewriteTag(b *strings.Builder, s string) {
	var prev byte // the last character outside whitespace, strings and identifiers
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == '\'' || c == '"':
			j := i + 1
			for j < len(s) && s[j] != c {
				if s[j] == '\\' && j+1 < len(s) {
					j++
				}
				j++
			}
			if j < len(s) {
				quoteString(b, unescapePython(s[i+1:j]), c)
				j++
			} else {
				b.WriteString(s[i:]) // unclosed: the library reports it
			}
			prev = 'x'
			i = j
		case isIdent(c) && !(c >= '0' && c <= '9'):
			j := i
			for j < len(s) && isIdent(s[j]) {
				j++
			}
			name := s[i:j]
			if renamed, ok := filterNames[name]; ok && prev == '|' {
				b.WriteString(renamed)
			} else if stripMethods[name] && prev == '.' && emptyCall(s[j:]) {
				k := j + strings.IndexByte(s[j:], ')')
				b.WriteString(name + "(" + wsName + ")")
				j = k + 1
			} else {
				b.WriteString(name)
			}
			prev = 'x'
			i = j
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			b.WriteByte(c)
			i++
		default:
			if c == '}' && (prev == '}' || prev == '%') && i > 0 && (s[i-1] == '}' || s[i-1] == '%') {
				b.WriteByte(' ') // not the tag's end: jinja2 closed a bracket
			}
			b.WriteByte(c)
			prev = c
			i++
		}
	}
}

// emptyCall reports whether s starts with "()" (whitespace allowed inside and before).
func emptyCall(s string) bool {
	s = strings.TrimLeft(s, " \t\r\n")
	if !strings.HasPrefix(s, "(") {
		return false
	}
	return strings.HasPrefix(strings.TrimLeft(s[1:], " \t\r\n"), ")")
}

// quoteString writes text as a string literal the library reads back to text: quoted with only
// the escapes the library knows.
func quoteString(b *strings.Builder, text string, quote byte) {
	b.WriteByte(quote)
	for _, r := range text {
		switch r {
		case '\\':
			b.WriteString(`\\`)
		case rune(quote):
			b.WriteByte('\\')
			b.WriteByte(quote)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte(quote)
}

// unescapePython decodes a string literal's body as Jinja does (Python's unicode-escape codec,
// after turning \r\n and \r into \n): an unknown escape stays as written.
func unescapePython(s string) string {
	if !strings.ContainsAny(s, "\\\r") {
		return s
	}
	s = strings.ReplaceAll(s, "\r\n", "\n")
	s = strings.ReplaceAll(s, "\r", "\n")
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '\\' || i+1 == len(s) {
			b.WriteByte(c)
			continue
		}
		i++
		switch e := s[i]; e {
		case '\n':
			// A backslash before a newline continues the line.
		case '\\', '\'', '"':
			b.WriteByte(e)
		case 'a':
			b.WriteByte('\a')
		case 'b':
			b.WriteByte('\b')
		case 'f':
			b.WriteByte('\f')
		case 'n':
			b.WriteByte('\n')
		case 'r':
			b.WriteByte('\r')
		case 't':
			b.WriteByte('\t')
		case 'v':
			b.WriteByte('\v')
		case 'x', 'u', 'U':
			n := map[byte]int{'x': 2, 'u': 4, 'U': 8}[e]
			if r, ok := hexRune(s[i+1:], n); ok {
				b.WriteRune(r)
				i += n
			} else {
				b.WriteByte('\\')
				b.WriteByte(e)
			}
		case '0', '1', '2', '3', '4', '5', '6', '7':
			v, n := 0, 0
			for n < 3 && i+n < len(s) && s[i+n] >= '0' && s[i+n] <= '7' {
				v = v*8 + int(s[i+n]-'0')
				n++
			}
			b.WriteRune(rune(v))
			i += n - 1
		default:
			b.WriteByte('\\')
			b.WriteByte(e)
		}
	}
	return b.String()
}

func hexRune(s string, n int) (rune, bool) {
	if len(s) < n {
		return 0, false
	}
	var r rune
	for i := range n {
		c := s[i]
		switch {
		case c >= '0' && c <= '9':
			r = r*16 + rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r*16 + rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r*16 + rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	return r, r <= 0x10ffff
}
