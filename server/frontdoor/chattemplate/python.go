package chattemplate

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ardanlabs/jinja"
)

// This file holds the Python behaviour that vLLM's renderer (transformers' apply_chat_template on
// jinja2) shows and the Jinja library does not: the tojson filter of transformers, Python's set
// of whitespace for trim and str.strip(), strftime_now and range.

// pyWhitespace is every character Python's str.isspace() accepts, which str.strip() and Jinja's
// trim filter remove: Go's unicode.IsSpace lacks U+001C..U+001F, JavaScript's trim() lacks those
// and U+0085 but adds U+FEFF.
const pyWhitespace = "\t\n\v\f\r\x1c\x1d\x1e\x1f \u0085\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"

// pyTrim is Jinja's trim filter: str.strip(chars), whitespace when chars is absent or None.
func pyTrim(args []jinja.Value, kwargs map[string]jinja.Value) (jinja.Value, error) {
	if len(args) == 0 {
		return jinja.Undefined(), errors.New("trim: missing value")
	}
	s := printString(args[0])
	chars := pyWhitespace
	if c, ok := argAt(args, kwargs, 1, "chars"); ok && !c.IsNone() && !c.IsUndefined() {
		if !c.IsString() {
			return jinja.Undefined(), errors.New("trim: chars must be a string")
		}
		chars = c.AsString()
	}
	return jinja.NewString(strings.Trim(s, chars)), nil
}

// printString is Python's str(v), which jinja2 prints for {{ v }}: None is "None", a float its
// repr (1.0), a list or dict its repr ({'a': [1, None]}). An undefined value prints "".
func printString(v jinja.Value) string {
	switch {
	case v.IsString():
		return v.AsString()
	case v.IsUndefined():
		return ""
	}
	var b strings.Builder
	pyRepr(&b, v, 0)
	return b.String()
}

// pyPrint is printString as a template function: the rewrite wraps every {{ expression }} in it.
func pyPrint(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
	if len(args) != 1 {
		return jinja.Undefined(), errors.New("print: one value expected")
	}
	if args[0].IsString() {
		return args[0], nil
	}
	return jinja.NewString(printString(args[0])), nil
}

// pyStringFilter is Jinja's string filter: str(v).
func pyStringFilter(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
	if len(args) == 0 {
		return jinja.Undefined(), errors.New("string: missing value")
	}
	return pyPrint(args[:1], nil)
}

// pyRepr writes Python's repr(v).
func pyRepr(b *strings.Builder, v jinja.Value, depth int) {
	if depth > maxDepth {
		b.WriteString("...")
		return
	}
	switch {
	case v.IsUndefined():
		b.WriteString("Undefined")
	case v.IsNone():
		b.WriteString("None")
	case v.IsBool():
		if v.AsBool() {
			b.WriteString("True")
		} else {
			b.WriteString("False")
		}
	case v.IsInt():
		b.WriteString(strconv.FormatInt(v.AsInt(), 10))
	case v.IsFloat():
		b.WriteString(pyFloatRepr(v.AsFloat()))
	case v.IsString():
		pyStrRepr(b, v.AsString())
	case v.IsList():
		b.WriteByte('[')
		for i, it := range v.AsList().Items {
			if i > 0 {
				b.WriteString(", ")
			}
			pyRepr(b, it, depth+1)
		}
		b.WriteByte(']')
	case v.IsDict():
		d := v.AsDict()
		b.WriteByte('{')
		for i, k := range d.Keys {
			if i > 0 {
				b.WriteString(", ")
			}
			pyStrRepr(b, k)
			b.WriteString(": ")
			pyRepr(b, d.Data[k], depth+1)
		}
		b.WriteByte('}')
	default:
		b.WriteString(v.String())
	}
}

// pyStrRepr writes Python's repr of a string: in single quotes unless it holds a single quote and
// no double quote, with backslash escapes for the quote, backslashes and unprintable characters.
func pyStrRepr(b *strings.Builder, s string) {
	quote := byte('\'')
	if strings.IndexByte(s, '\'') >= 0 && strings.IndexByte(s, '"') < 0 {
		quote = '"'
	}
	b.WriteByte(quote)
	for _, r := range s {
		switch {
		case r == rune(quote) || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case unicode.IsPrint(r):
			b.WriteRune(r)
		case r < 0x100:
			fmt.Fprintf(b, `\x%02x`, r)
		case r < 0x10000:
			fmt.Fprintf(b, `\u%04x`, r)
		default:
			fmt.Fprintf(b, `\U%08x`, r)
		}
	}
	b.WriteByte(quote)
}

// argAt returns the argument at position i, or the keyword argument name.
func argAt(args []jinja.Value, kwargs map[string]jinja.Value, i int, name string) (jinja.Value, bool) {
	if i < len(args) {
		return args[i], true
	}
	v, ok := kwargs[name]
	return v, ok
}

// pyToJSON is the tojson filter transformers installs for chat templates:
// json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False), each
// overridable by position or keyword. Unlike Jinja's own tojson it does not HTML-escape, and
// unlike Go's encoding/json it separates with ", " and ": ", leaves non-ASCII (U+2028 included)
// unescaped, and writes floats as Python's repr does (1.0, 1e+16).
func pyToJSON(args []jinja.Value, kwargs map[string]jinja.Value) (jinja.Value, error) {
	if len(args) == 0 {
		return jinja.Undefined(), errors.New("tojson: missing value")
	}
	var e jsonEncoder
	if v, ok := argAt(args, kwargs, 1, "ensure_ascii"); ok {
		e.ensureASCII = v.IsTruthy()
	}
	indented := false
	if v, ok := argAt(args, kwargs, 2, "indent"); ok && !v.IsNone() && !v.IsUndefined() {
		indented = true
		switch {
		case v.IsString():
			e.indent = v.AsString()
		case v.IsInt():
			e.indent = strings.Repeat(" ", int(max(0, min(v.AsInt(), 64))))
		default:
			return jinja.Undefined(), errors.New("tojson: indent must be an integer or a string")
		}
	}
	e.itemSep, e.keySep = ", ", ": "
	if indented {
		e.itemSep = ","
	}
	if v, ok := argAt(args, kwargs, 3, "separators"); ok && !v.IsNone() && !v.IsUndefined() {
		if !v.IsList() || v.AsList().Len() != 2 || !v.AsList().Get(0).IsString() || !v.AsList().Get(1).IsString() {
			return jinja.Undefined(), errors.New("tojson: separators must be two strings")
		}
		e.itemSep, e.keySep = v.AsList().Get(0).AsString(), v.AsList().Get(1).AsString()
	}
	if v, ok := argAt(args, kwargs, 4, "sort_keys"); ok {
		e.sortKeys = v.IsTruthy()
	}
	e.indented = indented
	if err := e.encode(args[0], 0); err != nil {
		return jinja.Undefined(), fmt.Errorf("tojson: %w", err)
	}
	return jinja.NewString(e.b.String()), nil
}

type jsonEncoder struct {
	b               strings.Builder
	ensureASCII     bool
	indented        bool
	indent          string
	itemSep, keySep string
	sortKeys        bool
}

func (e *jsonEncoder) newline(depth int) {
	if !e.indented {
		return
	}
	e.b.WriteByte('\n')
	for range depth {
		e.b.WriteString(e.indent)
	}
}

func (e *jsonEncoder) encode(v jinja.Value, depth int) error {
	if depth > maxDepth {
		return errTooDeep
	}
	switch {
	case v.IsNone():
		e.b.WriteString("null")
	case v.IsBool():
		if v.AsBool() {
			e.b.WriteString("true")
		} else {
			e.b.WriteString("false")
		}
	case v.IsInt():
		e.b.WriteString(strconv.FormatInt(v.AsInt(), 10))
	case v.IsFloat():
		f := v.AsFloat()
		switch {
		case math.IsNaN(f):
			e.b.WriteString("NaN")
		case math.IsInf(f, 1):
			e.b.WriteString("Infinity")
		case math.IsInf(f, -1):
			e.b.WriteString("-Infinity")
		default:
			e.b.WriteString(pyFloatRepr(f))
		}
	case v.IsString():
		e.str(v.AsString())
	case v.IsList():
		items := v.AsList().Items
		if len(items) == 0 {
			e.b.WriteString("[]")
			return nil
		}
		e.b.WriteByte('[')
		for i, it := range items {
			if i > 0 {
				e.b.WriteString(e.itemSep)
			}
			e.newline(depth + 1)
			if err := e.encode(it, depth+1); err != nil {
				return err
			}
		}
		e.newline(depth)
		e.b.WriteByte(']')
	case v.IsDict():
		d := v.AsDict()
		if d.Len() == 0 {
			e.b.WriteString("{}")
			return nil
		}
		keys := d.Keys
		if e.sortKeys {
			keys = append([]string(nil), keys...)
			sort.Strings(keys)
		}
		e.b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				e.b.WriteString(e.itemSep)
			}
			e.newline(depth + 1)
			e.str(k)
			e.b.WriteString(e.keySep)
			if err := e.encode(d.Data[k], depth+1); err != nil {
				return err
			}
		}
		e.newline(depth)
		e.b.WriteByte('}')
	case v.IsUndefined():
		return errors.New("an undefined value is not JSON serializable")
	default:
		return errors.New("a function is not JSON serializable")
	}
	return nil
}

const hexDigits = "0123456789abcdef"

// str writes s as a JSON string the way Python's json module does.
func (e *jsonEncoder) str(s string) {
	b := &e.b
	b.WriteByte('"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < 0x7f {
			i++
			continue
		}
		if c >= 0x7f && !e.ensureASCII {
			i++
			continue
		}
		b.WriteString(s[start:i])
		if c < utf8.RuneSelf {
			switch c {
			case '"':
				b.WriteString(`\"`)
			case '\\':
				b.WriteString(`\\`)
			case '\n':
				b.WriteString(`\n`)
			case '\r':
				b.WriteString(`\r`)
			case '\t':
				b.WriteString(`\t`)
			case '\b':
				b.WriteString(`\b`)
			case '\f':
				b.WriteString(`\f`)
			default:
				u16(b, rune(c))
			}
			i++
		} else {
			r, size := utf8.DecodeRuneInString(s[i:])
			if r >= 0x10000 {
				r -= 0x10000
				u16(b, 0xd800+(r>>10))
				u16(b, 0xdc00+(r&0x3ff))
			} else {
				u16(b, r)
			}
			i += size
		}
		start = i
	}
	b.WriteString(s[start:])
	b.WriteByte('"')
}

func u16(b *strings.Builder, r rune) {
	b.WriteString(`\u`)
	b.WriteByte(hexDigits[r>>12&0xf])
	b.WriteByte(hexDigits[r>>8&0xf])
	b.WriteByte(hexDigits[r>>4&0xf])
	b.WriteByte(hexDigits[r&0xf])
}

// pyFloatRepr formats a finite float as Python's repr() does: the shortest digits that read back
// to the same float, in positional notation when the decimal exponent is in [-4, 16) and with
// ".0" when there is no fraction, else in exponent notation with a signed exponent of at least
// two digits (1e-05, 1.5e+16).
func pyFloatRepr(f float64) string {
	switch {
	case math.IsNaN(f):
		return "nan"
	case math.IsInf(f, 1):
		return "inf"
	case math.IsInf(f, -1):
		return "-inf"
	}
	e := strconv.FormatFloat(f, 'e', -1, 64) // [-]d[.ddd]e±XX
	neg := e[0] == '-'
	if neg {
		e = e[1:]
	}
	mant, exps, _ := strings.Cut(e, "e")
	exp, _ := strconv.Atoi(exps)
	digits := strings.Replace(mant, ".", "", 1)
	var out string
	if exp < -4 || exp >= 16 {
		out = mant
		if exp < 0 {
			out += fmt.Sprintf("e-%02d", -exp)
		} else {
			out += fmt.Sprintf("e+%02d", exp)
		}
	} else {
		point := exp + 1 // digits before the decimal point
		switch {
		case point <= 0:
			out = "0." + strings.Repeat("0", -point) + digits
		case point >= len(digits):
			out = digits + strings.Repeat("0", point-len(digits)) + ".0"
		default:
			out = digits[:point] + "." + digits[point:]
		}
	}
	if neg {
		out = "-" + out
	}
	return out
}

// maxRange bounds range(): Python builds a lazy range, the library a list, so a template
// range(10**9) would allocate gigabytes.
const maxRange = 1 << 20

// pyRange is Python's range(stop) / range(start, stop[, step]) as a list of at most maxRange
// integers.
func pyRange(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
	for _, a := range args {
		if !a.IsInt() && !a.IsBool() {
			return jinja.Undefined(), errors.New("range: arguments must be integers")
		}
	}
	n := func(i int) int64 {
		if args[i].IsBool() {
			if args[i].AsBool() {
				return 1
			}
			return 0
		}
		return args[i].AsInt()
	}
	var start, stop, step int64 = 0, 0, 1
	switch len(args) {
	case 1:
		stop = n(0)
	case 2:
		start, stop = n(0), n(1)
	case 3:
		start, stop, step = n(0), n(1), n(2)
	default:
		return jinja.Undefined(), fmt.Errorf("range expected 1 to 3 arguments, got %d", len(args))
	}
	if step == 0 {
		return jinja.Undefined(), errors.New("range() arg 3 must not be zero")
	}
	var count int64
	if step > 0 && stop > start {
		count = (stop - start + step - 1) / step
	} else if step < 0 && stop < start {
		count = (start - stop - step - 1) / -step
	}
	if count > maxRange {
		return jinja.Undefined(), fmt.Errorf("range of %d items is over this renderer's limit of %d", count, maxRange)
	}
	items := make([]jinja.Value, count)
	for i := range items {
		items[i] = jinja.NewInt(start + int64(i)*step)
	}
	return jinja.NewList(items), nil
}

// strftime formats t as Python's time.strftime does for the directives chat templates use (the
// C library's; %-d and the like, glibc's no-padding flag, included). An unknown directive is
// written as is.
func strftime(format string, t time.Time) string {
	var b strings.Builder
	for i := 0; i < len(format); i++ {
		c := format[i]
		if c != '%' || i+1 == len(format) {
			b.WriteByte(c)
			continue
		}
		i++
		pad := true
		if format[i] == '-' && i+1 < len(format) {
			pad = false
			i++
		}
		num := func(v, width int) {
			s := strconv.Itoa(v)
			if pad {
				for len(s) < width {
					s = "0" + s
				}
			}
			b.WriteString(s)
		}
		switch format[i] {
		case 'Y':
			num(t.Year(), 4)
		case 'y':
			num(t.Year()%100, 2)
		case 'm':
			num(int(t.Month()), 2)
		case 'd':
			num(t.Day(), 2)
		case 'e':
			s := strconv.Itoa(t.Day())
			if pad && len(s) < 2 {
				s = " " + s
			}
			b.WriteString(s)
		case 'H':
			num(t.Hour(), 2)
		case 'I':
			h := t.Hour() % 12
			if h == 0 {
				h = 12
			}
			num(h, 2)
		case 'M':
			num(t.Minute(), 2)
		case 'S':
			num(t.Second(), 2)
		case 'j':
			num(t.YearDay(), 3)
		case 'p':
			if t.Hour() < 12 {
				b.WriteString("AM")
			} else {
				b.WriteString("PM")
			}
		case 'B':
			b.WriteString(t.Month().String())
		case 'b', 'h':
			b.WriteString(t.Month().String()[:3])
		case 'A':
			b.WriteString(t.Weekday().String())
		case 'a':
			b.WriteString(t.Weekday().String()[:3])
		case 'w':
			num(int(t.Weekday()), 1)
		case 'Z':
			name, _ := t.Zone()
			b.WriteString(name)
		case 'z':
			b.WriteString(t.Format("-0700"))
		case 'F':
			b.WriteString(t.Format("2006-01-02"))
		case 'T':
			b.WriteString(t.Format("15:04:05"))
		case '%':
			b.WriteByte('%')
		default:
			b.WriteByte('%')
			if !pad {
				b.WriteByte('-')
			}
			b.WriteByte(format[i])
		}
	}
	return b.String()
}
