// Package layered loads a command's settings in layers: the built-in defaults, a YAML file, the
// KVROUTER_* environment, then the flags, each setting named once (its YAML key; its flag is the
// key with dashes, its variable KVROUTER_ and the key in capitals) and parsed by one function that
// states its own rule. It remembers where each value came from, for error messages and for
// reporting the effective configuration. kvrouter serve (server/config) and kvrouter bridge use it.
package layered

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// Source says where a setting's value came from.
type Source int

// Configuration sources, lowest precedence first.
const (
	SourceDefault Source = iota + 1
	SourceFile
	SourceEnv
	SourceFlag
)

func (s Source) String() string {
	switch s {
	case SourceDefault:
		return "default"
	case SourceFile:
		return "file"
	case SourceEnv:
		return "env"
	case SourceFlag:
		return "flag"
	}
	return "unknown"
}

// Entry is one effective setting, as a command reports it.
type Entry struct {
	Key    string
	Value  string
	Source Source
}

// Setting is one configuration key of the options T: its YAML key, help, and how to parse and
// print it. Set checks how a value is written and its own range; rules that relate settings are the
// command's Validate's. A Mapping setting may be written in the YAML file as a flat mapping, which
// it receives as a JSON object (numbers kept as written). A Secret setting has no flag (a command
// line is visible to every user of the machine, in ps and /proc) and is reported redacted.
type Setting[T any] struct {
	Key     string
	Help    string
	IsBool  bool
	Mapping bool
	Secret  bool
	Set     func(o *T, v string) error
	Get     func(o *T) string
}

// Redacted is how a secret setting that is set is reported.
const Redacted = "(redacted)"

// Secret is a setting read only from the environment or the file, never a flag, and reported as
// Redacted when set: a password or a key.
func Secret[T any](key, help string, p func(*T) *string) Setting[T] {
	s := String(key, help, p)
	s.Secret = true
	return s
}

// FlagName is the key as a flag name, without the dashes in front.
func (s Setting[T]) FlagName() string { return strings.ReplaceAll(s.Key, "_", "-") }

// EnvName is the key's environment variable.
func (s Setting[T]) EnvName() string { return "KVROUTER_" + strings.ToUpper(s.Key) }

// FlagOf names a key as its flag, the way Dynamo's messages name settings.
func FlagOf(key string) string { return "--" + strings.ReplaceAll(key, "_", "-") }

// String is a setting of any text.
func String[T any](key, help string, p func(*T) *string) Setting[T] {
	return Setting[T]{Key: key, Help: help,
		Set: func(o *T, v string) error { *p(o) = v; return nil },
		Get: func(o *T) string { return *p(o) }}
}

// Int is an integer of at least min.
func Int[T any](key, help string, p func(*T) *int, min int) Setting[T] {
	return Setting[T]{Key: key, Help: help,
		Set: func(o *T, v string) error {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil {
				return fmt.Errorf("must be an integer (got %q)", v)
			}
			if n < min {
				return fmt.Errorf("must be >= %d (got %d)", min, n)
			}
			*p(o) = n
			return nil
		},
		Get: func(o *T) string { return strconv.Itoa(*p(o)) }}
}

// Uint64 is an unsigned 64-bit integer of at least min.
func Uint64[T any](key, help string, p func(*T) *uint64, min uint64) Setting[T] {
	return Setting[T]{Key: key, Help: help,
		Set: func(o *T, v string) error {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
			if err != nil {
				return fmt.Errorf("must be an unsigned integer (got %q)", v)
			}
			if n < min {
				return fmt.Errorf("must be >= %d (got %d)", min, n)
			}
			*p(o) = n
			return nil
		},
		Get: func(o *T) string { return strconv.FormatUint(*p(o), 10) }}
}

// Duration is a non-negative duration such as 30s.
func Duration[T any](key, help string, p func(*T) *time.Duration) Setting[T] {
	return Setting[T]{Key: key, Help: help,
		Set: func(o *T, v string) error {
			d, err := time.ParseDuration(strings.TrimSpace(v))
			if err != nil || d < 0 {
				return fmt.Errorf("must be a non-negative duration such as 30s or 5m (got %q)", v)
			}
			*p(o) = d
			return nil
		},
		Get: func(o *T) string { return p(o).String() }}
}

// Float is a finite number.
func Float[T any](key, help string, p func(*T) *float64) Setting[T] {
	return Setting[T]{Key: key, Help: help,
		Set: func(o *T, v string) error {
			f, err := ParseFloat(v)
			if err != nil {
				return err
			}
			*p(o) = f
			return nil
		},
		Get: func(o *T) string { return FormatFloat(*p(o)) }}
}

// OptionalFloat is a number that may be unset ("" or "null" unsets it).
func OptionalFloat[T any](key, help string, p func(*T) **float64) Setting[T] {
	return Setting[T]{Key: key, Help: help,
		Set: func(o *T, v string) error {
			if s := strings.TrimSpace(v); s == "" || s == "null" {
				*p(o) = nil
				return nil
			}
			f, err := ParseFloat(v)
			if err != nil {
				return err
			}
			*p(o) = &f
			return nil
		},
		Get: func(o *T) string { return FormatOptional(*p(o)) }}
}

// Bool is true or false; as a flag, --key alone means true.
func Bool[T any](key, help string, p func(*T) *bool) Setting[T] {
	return Setting[T]{Key: key, Help: help, IsBool: true,
		Set: func(o *T, v string) error {
			b, err := strconv.ParseBool(strings.TrimSpace(v))
			if err != nil {
				return fmt.Errorf("must be true or false (got %q)", v)
			}
			*p(o) = b
			return nil
		},
		Get: func(o *T) string { return strconv.FormatBool(*p(o)) }}
}

// ParseFloat reads a finite number.
func ParseFloat(v string) (float64, error) {
	f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, fmt.Errorf("must be a finite number (got %q)", v)
	}
	return f, nil
}

// FormatFloat writes a number as short as it reads back.
func FormatFloat(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) }

// FormatOptional writes an optional number ("" when unset).
func FormatOptional(v *float64) string {
	if v == nil {
		return ""
	}
	return FormatFloat(*v)
}

// ErrUsage means the command line itself was malformed; the flag set has printed why.
var ErrUsage = errors.New("usage")

// Layers applies the layers to options of type T and remembers where each value came from.
type Layers[T any] struct {
	settings []Setting[T]
	// ConfigFile is the YAML file of settings (--config, or KVROUTER_CONFIG); "" reads none.
	ConfigFile string
	sources    map[string]Source
	fromFlags  []flagValue[T]
}

// flagValue is a flag as parsed, kept until Complete applies it over the file and the environment.
type flagValue[T any] struct {
	s Setting[T]
	v string
}

// New returns the layers of the settings, every one from its default.
func New[T any](settings []Setting[T]) *Layers[T] {
	l := &Layers[T]{settings: settings, sources: make(map[string]Source, len(settings))}
	for _, s := range settings {
		l.sources[s.Key] = SourceDefault
	}
	return l
}

// Parse registers the flags on a new flag set named name, parses args and applies the layers to o.
// A malformed command line is ErrUsage, after the flag set printed why to stderr.
func (l *Layers[T]) Parse(o *T, name string, args []string, getenv func(string) string, stderr io.Writer) error {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	l.AddFlags(o, fs)
	if err := fs.Parse(args); err != nil {
		return ErrUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "%s: unexpected argument %q\n", name, fs.Arg(0))
		fs.Usage()
		return ErrUsage
	}
	return l.Complete(o, getenv)
}

// AddFlags registers --config and a flag for every setting on fs. Parsing only records the values:
// Complete applies them, last, so that a flag wins over the environment and the file wherever it
// stands on the command line.
func (l *Layers[T]) AddFlags(o *T, fs *flag.FlagSet) {
	fs.StringVar(&l.ConfigFile, "config", l.ConfigFile, "YAML configuration file (keys as the flags, with underscores; env KVROUTER_CONFIG)")
	for _, s := range l.settings {
		if s.Secret {
			continue
		}
		def := s.Get(o)
		record := func(v string) error {
			l.fromFlags = append(l.fromFlags, flagValue[T]{s, v})
			return nil
		}
		if s.IsBool {
			fs.BoolFunc(s.FlagName(), fmt.Sprintf("%s (default %s, env %s)", s.Help, def, s.EnvName()), record)
			continue
		}
		fs.Func(s.FlagName(), fmt.Sprintf("%s (default %q, env %s)", s.Help, def, s.EnvName()), record)
	}
}

// Complete applies the layers over the defaults, lowest first: the YAML file (--config, else
// KVROUTER_CONFIG), the KVROUTER_* environment, then the flags AddFlags recorded. An empty variable
// counts as unset, so KVROUTER_X= does not override the file.
func (l *Layers[T]) Complete(o *T, getenv func(string) string) error {
	if l.ConfigFile == "" {
		l.ConfigFile = getenv("KVROUTER_CONFIG")
	}
	if l.ConfigFile != "" {
		if err := l.applyFile(o, l.ConfigFile); err != nil {
			return err
		}
	}
	for _, s := range l.settings {
		v := getenv(s.EnvName())
		if v == "" {
			continue
		}
		if err := s.Set(o, v); err != nil {
			return fmt.Errorf("%s: %w", s.EnvName(), err)
		}
		l.sources[s.Key] = SourceEnv
	}
	for _, f := range l.fromFlags {
		if err := f.s.Set(o, f.v); err != nil {
			return fmt.Errorf("--%s: %w", f.s.FlagName(), err)
		}
		l.sources[f.s.Key] = SourceFlag
	}
	l.fromFlags = nil
	return nil
}

// Source returns where the setting key's value came from (SourceDefault for a key it does not know).
func (l *Layers[T]) Source(key string) Source {
	if s, ok := l.sources[key]; ok {
		return s
	}
	return SourceDefault
}

// Describe names a key as the user set it, for error messages: its flag, its environment variable,
// or its key in the file.
func (l *Layers[T]) Describe(key string) string {
	switch l.Source(key) {
	case SourceFlag:
		return FlagOf(key)
	case SourceEnv:
		return "KVROUTER_" + strings.ToUpper(key)
	case SourceFile:
		return key + " (config file)"
	}
	return key + " (default)"
}

// Entries lists every setting's value in o and its source, in the order of the settings.
func (l *Layers[T]) Entries(o *T) []Entry {
	out := make([]Entry, 0, len(l.settings))
	for _, s := range l.settings {
		v := s.Get(o)
		if s.Secret && v != "" {
			v = Redacted
		}
		out = append(out, Entry{Key: s.Key, Value: v, Source: l.Source(s.Key)})
	}
	return out
}

// applyFile reads a YAML file of settings. Unknown keys are errors, so a typo never goes unnoticed.
func (l *Layers[T]) applyFile(o *T, path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("--config: %w", err)
	}
	// The document is read as a node first, so that one that is not a mapping is named as such
	// rather than as yaml's multi-line "cannot unmarshal !!seq into map[string]yaml.Node".
	var root yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&root); err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	var doc map[string]yaml.Node
	if len(root.Content) == 1 && (root.Content[0].Kind != yaml.ScalarNode || root.Content[0].Tag != "!!null") { // else empty
		if top := root.Content[0]; top.Kind != yaml.MappingNode {
			return fmt.Errorf("config file %s: line %d: must be a mapping of settings (key: value), not %s", path, top.Line, yamlKind(top))
		}
		if err := root.Decode(&doc); err != nil {
			var te *yaml.TypeError
			if errors.As(err, &te) { // a key that is no name, or a key given twice: one line each
				return fmt.Errorf("config file %s: %s", path, strings.Join(te.Errors, "; "))
			}
			return fmt.Errorf("config file %s: %w", path, err)
		}
	}
	// One document: the keys of a second one would be ignored, typos and all. Empty ones (a
	// trailing ---) set nothing.
	for {
		var next yaml.Node
		if err := dec.Decode(&next); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return fmt.Errorf("config file %s: %w", path, err)
		}
		if len(next.Content) == 1 && (next.Content[0].Kind != yaml.ScalarNode || next.Content[0].Tag != "!!null") {
			return fmt.Errorf("config file %s: line %d: a second YAML document; write every setting in one mapping", path, next.Content[0].Line)
		}
	}
	var unknown []string
	for key := range doc {
		if !slices.ContainsFunc(l.settings, func(s Setting[T]) bool { return s.Key == key }) {
			unknown = append(unknown, key)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		return fmt.Errorf("config file %s has unknown key(s): %s", path, strings.Join(unknown, ", "))
	}
	for _, s := range l.settings {
		node, ok := doc[s.Key]
		if !ok {
			continue
		}
		v := node.Value
		switch {
		case s.Mapping && node.Kind == yaml.MappingNode:
			// The same keys as the flag's JSON, written as a YAML mapping: each scalar keeps its
			// written form, so 2048.0 is a float here as in the JSON, and is refused where an
			// integer is required.
			js, err := yamlMappingToJSON(&node)
			if err != nil {
				return fmt.Errorf("config file %s: %s: %w", path, s.Key, err)
			}
			v = js
		case node.Kind != yaml.ScalarNode:
			return fmt.Errorf("config file %s: %s must be a single value", path, s.Key)
		}
		if node.Tag == "!!null" {
			v = ""
		}
		if err := s.Set(o, v); err != nil {
			return fmt.Errorf("config file %s: %s %w", path, s.Key, err)
		}
		l.sources[s.Key] = SourceFile
	}
	return nil
}

// yamlMappingToJSON converts a flat YAML mapping of scalars to a JSON object, keeping each number as
// written.
func yamlMappingToJSON(node *yaml.Node) (string, error) {
	obj := make(map[string]json.RawMessage, len(node.Content)/2)
	for i := 0; i+1 < len(node.Content); i += 2 {
		k, v := node.Content[i], node.Content[i+1]
		if v.Kind != yaml.ScalarNode {
			return "", fmt.Errorf("%s must be a single value", k.Value)
		}
		switch v.Tag {
		case "!!int", "!!float":
			// YAML writes numbers JSON does not (.5, +1, 1_000): refused here, as in the JSON.
			if _, err := strconv.ParseFloat(v.Value, 64); err != nil || !json.Valid([]byte(v.Value)) {
				return "", fmt.Errorf("%s: %q is not a number", k.Value, v.Value)
			}
			obj[k.Value] = json.RawMessage(v.Value)
		case "!!bool", "!!null":
			var x any
			if err := v.Decode(&x); err != nil {
				return "", err
			}
			b, _ := json.Marshal(x)
			obj[k.Value] = b
		default:
			b, _ := json.Marshal(v.Value)
			obj[k.Value] = b
		}
	}
	out, err := json.Marshal(obj)
	return string(out), err
}

// yamlKind names the kind of a YAML node for messages.
func yamlKind(n *yaml.Node) string {
	switch n.Kind {
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		return "a single value"
	case yaml.AliasNode:
		return "an alias"
	}
	return "a document"
}
