package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

// ErrUsage means the command line itself was malformed; the flag set has printed why.
var ErrUsage = errors.New("usage")

// Load builds the configuration of the command named name from its arguments and environment:
// New, AddFlags, parse, Complete and Validate. Errors name the setting as the user gave it; a
// malformed command line is ErrUsage, after the flag set printed why to stderr.
func Load(name string, args []string, getenv func(string) string, stderr io.Writer) (*Options, error) {
	o := New()
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	o.AddFlags(fs)
	if err := fs.Parse(args); err != nil {
		return nil, ErrUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "%s: unexpected argument %q\n", name, fs.Arg(0))
		fs.Usage()
		return nil, ErrUsage
	}
	if err := o.Complete(getenv); err != nil {
		return nil, err
	}
	if err := o.Validate(); err != nil {
		return nil, err
	}
	return o, nil
}

// flagValue is a flag as parsed, kept until Complete applies it over the file and the environment.
type flagValue struct {
	s setting
	v string
}

// AddFlags registers --config and a flag for every setting on fs. Parsing only records the values:
// Complete applies them, last, so that a flag wins over the environment and the file wherever it
// stands on the command line.
func (o *Options) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.ConfigFile, "config", o.ConfigFile, "YAML configuration file (keys as the flags, with underscores; env KVROUTER_CONFIG)")
	for _, s := range settings {
		def := s.get(o)
		record := func(v string) error {
			o.fromFlags = append(o.fromFlags, flagValue{s, v})
			return nil
		}
		if s.isBool {
			fs.BoolFunc(s.flagName(), fmt.Sprintf("%s (default %s, env %s)", s.help, def, s.envName()), record)
			continue
		}
		fs.Func(s.flagName(), fmt.Sprintf("%s (default %q, env %s)", s.help, def, s.envName()), record)
	}
}

// Complete applies the layers over the defaults, lowest first: the YAML file (--config, else
// KVROUTER_CONFIG), the KVROUTER_* environment, then the flags AddFlags recorded. An empty variable
// counts as unset, so KVROUTER_X= does not override the file.
func (o *Options) Complete(getenv func(string) string) error {
	if o.ConfigFile == "" {
		o.ConfigFile = getenv("KVROUTER_CONFIG")
	}
	if o.ConfigFile != "" {
		if err := o.applyFile(o.ConfigFile); err != nil {
			return err
		}
	}
	for _, s := range settings {
		v := getenv(s.envName())
		if v == "" {
			continue
		}
		if err := s.set(o, v); err != nil {
			return fmt.Errorf("%s: %w", s.envName(), err)
		}
		o.sources[s.key] = SourceEnv
	}
	for _, f := range o.fromFlags {
		if err := f.s.set(o, f.v); err != nil {
			return fmt.Errorf("--%s: %w", f.s.flagName(), err)
		}
		o.sources[f.s.key] = SourceFlag
	}
	o.fromFlags = nil
	return nil
}

// applyFile reads a YAML file of settings. Unknown keys are errors, so a typo never goes unnoticed.
func (o *Options) applyFile(path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("--config: %w", err)
	}
	var doc map[string]yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	var unknown []string
	for key := range doc {
		if !slices.ContainsFunc(settings, func(s setting) bool { return s.key == key }) {
			unknown = append(unknown, key)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		return fmt.Errorf("config file %s has unknown key(s): %s", path, strings.Join(unknown, ", "))
	}
	for _, s := range settings {
		node, ok := doc[s.key]
		if !ok {
			continue
		}
		v := node.Value
		switch {
		case s.key == "conditional_disagg_config" && node.Kind == yaml.MappingNode:
			// The same keys as the flag's JSON, written as a YAML mapping: each scalar keeps its
			// written form, so 2048.0 is a float here as in the JSON, and is refused where an
			// integer is required.
			js, err := yamlMappingToJSON(&node)
			if err != nil {
				return fmt.Errorf("config file %s: %s: %w", path, s.key, err)
			}
			v = js
		case node.Kind != yaml.ScalarNode:
			return fmt.Errorf("config file %s: %s must be a single value", path, s.key)
		}
		if node.Tag == "!!null" {
			v = ""
		}
		if err := s.set(o, v); err != nil {
			return fmt.Errorf("config file %s: %s %w", path, s.key, err)
		}
		o.sources[s.key] = SourceFile
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
			if _, err := strconv.ParseFloat(v.Value, 64); err != nil {
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
