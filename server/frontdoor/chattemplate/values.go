package chattemplate

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"

	"github.com/ardanlabs/jinja"
)

// maxDepth bounds how deeply the JSON a request carries (tool definitions, tool call arguments,
// chat_template_kwargs) may nest. Python's json module stops near 1,000 levels (its recursion
// limit); the bound keeps a hostile request from making the decoder, tojson or a recursive macro
// walk an arbitrarily deep value.
const maxDepth = 512

var errTooDeep = fmt.Errorf("JSON nests deeper than %d levels", maxDepth)

// decodeJSON decodes one JSON value into a template value, keeping the order of object keys as
// Python's json.loads (and so vLLM) does: tojson and dict.items() in a template show the keys in
// the order the client sent them. Numbers written without a fraction or exponent that fit in an
// int64 become integers, the rest floats, as json.loads makes int and float.
func decodeJSON(raw []byte) (jinja.Value, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	v, err := decodeValue(dec, 0)
	if err != nil {
		return jinja.Undefined(), err
	}
	if _, err := dec.Token(); err != io.EOF {
		return jinja.Undefined(), errors.New("more than one JSON value")
	}
	return v, nil
}

func decodeValue(dec *json.Decoder, depth int) (jinja.Value, error) {
	if depth > maxDepth {
		return jinja.Undefined(), errTooDeep
	}
	t, err := dec.Token()
	if err != nil {
		return jinja.Undefined(), err
	}
	switch t := t.(type) {
	case nil:
		return jinja.None(), nil
	case bool:
		return jinja.NewBool(t), nil
	case string:
		return jinja.NewString(t), nil
	case json.Number:
		return numberValue(t), nil
	case json.Delim:
		switch t {
		case '[':
			var items []jinja.Value
			for dec.More() {
				item, err := decodeValue(dec, depth+1)
				if err != nil {
					return jinja.Undefined(), err
				}
				items = append(items, item)
			}
			if _, err := dec.Token(); err != nil {
				return jinja.Undefined(), err
			}
			return jinja.NewList(items), nil
		case '{':
			d := jinja.NewDict()
			dict := d.AsDict()
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return jinja.Undefined(), err
				}
				key, _ := kt.(string)
				val, err := decodeValue(dec, depth+1)
				if err != nil {
					return jinja.Undefined(), err
				}
				dict.Set(key, val)
			}
			if _, err := dec.Token(); err != nil {
				return jinja.Undefined(), err
			}
			return d, nil
		}
	}
	return jinja.Undefined(), fmt.Errorf("unexpected JSON token %v", t)
}

func numberValue(n json.Number) jinja.Value {
	s := string(n)
	if !strings.ContainsAny(s, ".eE") {
		if i, err := strconv.ParseInt(s, 10, 64); err == nil {
			return jinja.NewInt(i)
		}
	}
	// ParseFloat answers ±Inf for a literal out of range, as float() does in Python.
	f, _ := strconv.ParseFloat(s, 64)
	return jinja.NewFloat(f)
}

// goValue converts a Go value of the kind encoding/json decodes into (and json.RawMessage, kept
// in order) to a template value. Go maps have no order: their keys are sorted.
func goValue(v any, depth int) (jinja.Value, error) {
	if depth > maxDepth {
		return jinja.Undefined(), errTooDeep
	}
	switch v := v.(type) {
	case nil:
		return jinja.None(), nil
	case jinja.Value:
		return v, nil
	case json.RawMessage:
		return decodeJSON(v)
	case bool:
		return jinja.NewBool(v), nil
	case string:
		return jinja.NewString(v), nil
	case json.Number:
		return numberValue(v), nil
	case int:
		return jinja.NewInt(int64(v)), nil
	case int64:
		return jinja.NewInt(v), nil
	case float64:
		return jinja.NewFloat(v), nil
	case []any:
		items := make([]jinja.Value, len(v))
		for i, it := range v {
			x, err := goValue(it, depth+1)
			if err != nil {
				return jinja.Undefined(), err
			}
			items[i] = x
		}
		return jinja.NewList(items), nil
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		d := jinja.NewDict()
		for _, k := range keys {
			x, err := goValue(v[k], depth+1)
			if err != nil {
				return jinja.Undefined(), err
			}
			d.AsDict().Set(k, x)
		}
		return d, nil
	}
	return jinja.Undefined(), fmt.Errorf("unsupported value of type %T", v)
}

// dictOf builds a dict from key/value pairs in order.
func dictOf(kv ...any) jinja.Value {
	d := jinja.NewDict()
	for i := 0; i+1 < len(kv); i += 2 {
		d.AsDict().Set(kv[i].(string), kv[i+1].(jinja.Value))
	}
	return d
}

// toolValue converts one entry of the request's tools as vLLM hands it to the template: vLLM
// validates it as its ChatCompletionToolsParam model and passes model_dump(), which lists the
// declared fields first, in declaration order and with their defaults (type "function"; the
// function's name, description and parameters, null when absent), then the fields it does not
// declare (strict, say) in the order the client sent them. A tool of another type is passed as
// sent.
func toolValue(raw json.RawMessage) (jinja.Value, error) {
	v, err := decodeJSON(raw)
	if err != nil {
		return v, err
	}
	if !v.IsDict() {
		return v, errors.New("is not a JSON object")
	}
	tool := v.AsDict()
	typ, hasType := tool.Get("type")
	if hasType && !(typ.IsString() && typ.AsString() == "function") {
		return v, nil
	}
	fnv, ok := tool.Get("function")
	if !ok || !fnv.IsDict() {
		return v, errors.New("function: must be an object")
	}
	fn := fnv.AsDict()
	if name, ok := fn.Get("name"); !ok || !name.IsString() {
		return v, errors.New("function.name: must be a string")
	}
	outFn := reorder(fn, "name", "description", "parameters")
	out := jinja.NewDict()
	out.AsDict().Set("type", jinja.NewString("function"))
	out.AsDict().Set("function", outFn)
	for _, k := range tool.Keys {
		if k != "type" && k != "function" {
			out.AsDict().Set(k, tool.Data[k])
		}
	}
	return out, nil
}

// reorder returns d's entries with the named keys first (None when absent), then the others in
// their order.
func reorder(d *jinja.Dict, first ...string) jinja.Value {
	out := jinja.NewDict()
	o := out.AsDict()
	for _, k := range first {
		if v, ok := d.Get(k); ok {
			o.Set(k, v)
		} else {
			o.Set(k, jinja.None())
		}
	}
	for _, k := range d.Keys {
		if !o.Has(k) {
			o.Set(k, d.Data[k])
		}
	}
	return out
}

// toolCallValue converts one of an assistant message's tool_calls: id, type and function (name
// and arguments) in that order, with the arguments' JSON string parsed into a value, as vLLM
// does before rendering (tool-use templates expect a mapping and print it with tojson). Arguments
// that are not valid JSON, or are neither a string, an object nor a list, become {}, as in vLLM.
func toolCallValue(raw json.RawMessage) (jinja.Value, error) {
	v, err := decodeJSON(raw)
	if err != nil {
		return v, err
	}
	if !v.IsDict() {
		return v, errors.New("is not a JSON object")
	}
	call := v.AsDict()
	fnv, ok := call.Get("function")
	if !ok || !fnv.IsDict() {
		return v, errors.New("function: must be an object")
	}
	fn := fnv.AsDict()
	args := jinja.NewDict()
	if a, ok := fn.Get("arguments"); ok {
		switch {
		case a.IsString():
			if parsed, err := decodeJSON([]byte(a.AsString())); err == nil {
				args = parsed
			}
		case a.IsDict(), a.IsList():
			args = a
		}
	}
	outFn := jinja.NewDict()
	name, _ := fn.Get("name")
	outFn.AsDict().Set("name", name)
	outFn.AsDict().Set("arguments", args)
	out := jinja.NewDict()
	o := out.AsDict()
	if id, ok := call.Get("id"); ok {
		o.Set("id", id)
	}
	if typ, ok := call.Get("type"); ok {
		o.Set("type", typ)
	} else {
		o.Set("type", jinja.NewString("function"))
	}
	o.Set("function", outFn)
	return out, nil
}
