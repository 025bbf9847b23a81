package config

import (
	"flag"
	"io"

	"github.com/kvrouter/kvrouter/server/config/layered"
)

// ErrUsage means the command line itself was malformed; the flag set has printed why.
var ErrUsage = layered.ErrUsage

// Load builds the configuration of the command named name from its arguments and environment:
// New, AddFlags, parse, Complete and Validate. Errors name the setting as the user gave it; a
// malformed command line is ErrUsage, after the flag set printed why to stderr.
func Load(name string, args []string, getenv func(string) string, stderr io.Writer) (*Options, error) {
	o := New()
	if err := o.layers.Parse(o, name, args, getenv, stderr); err != nil {
		return nil, err
	}
	o.ConfigFile = o.layers.ConfigFile
	if err := o.Validate(); err != nil {
		return nil, err
	}
	return o, nil
}

// AddFlags registers --config and a flag for every setting on fs. Parsing only records the values:
// Complete applies them, last, so that a flag wins over the environment and the file wherever it
// stands on the command line.
func (o *Options) AddFlags(fs *flag.FlagSet) {
	o.layers.ConfigFile = o.ConfigFile
	o.layers.AddFlags(o, fs)
}

// Complete applies the layers over the defaults, lowest first: the YAML file (--config, else
// KVROUTER_CONFIG), the KVROUTER_* environment, then the flags AddFlags recorded. An empty variable
// counts as unset, so KVROUTER_X= does not override the file.
func (o *Options) Complete(getenv func(string) string) error {
	if o.ConfigFile != "" && o.layers.ConfigFile == "" {
		o.layers.ConfigFile = o.ConfigFile
	}
	err := o.layers.Complete(o, getenv)
	o.ConfigFile = o.layers.ConfigFile
	return err
}
