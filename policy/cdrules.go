package policy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// Every conditional-disaggregation rule (Dynamo §1.9) is written once, here, with the Python
// layer's message, and used wherever a value comes from: the --conditional-disagg-config JSON
// (from a flag, the environment or the YAML file, through ParseCDConfigJSON), and the per-request
// override (through Config.EffectiveCD). A field rule is a *FieldError naming the JSON key; the
// caller says where the key was written (--conditional-disagg-config, or
// config_override.conditional_disagg.). A rule relating settings is a *RuleError whose message
// names the settings as the caller writes them.

// CDConfigKeys are the keys of the conditional-disaggregation JSON object, in Dynamo's order.
var CDConfigKeys = []string{"policy", "eff_isl_threshold", "eff_isl_ratio_threshold", "prefill_busy_threshold", "decode_busy_threshold"}

// RuleError is a broken rule that relates several settings. Field is the setting of the override
// it concerns; the message is whole.
type RuleError struct {
	Field string
	Msg   string
}

func (e *RuleError) Error() string { return e.Msg }

// LookupCDPolicy returns the policy registered under name, or the policy field's rule.
func LookupCDPolicy(name string) (CDPolicy, error) {
	if p, ok := cdPolicies.lookup(name); ok {
		return p, nil
	}
	return nil, errUnknownCDPolicy()
}

// errUnknownCDPolicy is the policy field's rule (§1.9), listing the registered policies.
func errUnknownCDPolicy() error {
	return fieldErr("policy", "must be one of %s", strings.Join(CDPolicyNames(), ", "))
}

// Validate checks the value rules of §1.9, in Dynamo's order.
func (c CDConfig) Validate() error {
	if c.Policy == nil {
		return errUnknownCDPolicy()
	}
	if r := c.EffISLRatioThreshold; !(r >= 0 && r <= 1) { // NaN fails too
		return fieldErr("eff_isl_ratio_threshold", "must be in [0.0, 1.0]")
	}
	if t := c.PrefillBusyThreshold; t != nil {
		if err := busyThreshold("prefill_busy_threshold", *t); err != nil {
			return err
		}
	}
	if t := c.DecodeBusyThreshold; t != nil {
		if err := busyThreshold("decode_busy_threshold", *t); err != nil {
			return err
		}
	}
	return nil
}

// busyThreshold checks a busy threshold. A negative one breaks Dynamo's rule (§1.9) and gets its
// message. An infinite or NaN one would make a worker never busy, a gate that is set but can never
// trip, so kvrouter refuses it too, with a message of its own that names the value: "must be >= 0"
// would not say what is wrong with +Inf.
func busyThreshold(field string, v float64) error {
	switch {
	case math.IsNaN(v) || math.IsInf(v, 0):
		return fieldErr(field, "must be a finite number >= 0 (got %v)", v)
	case v < 0:
		return fieldErr(field, "must be >= 0")
	}
	return nil
}

// ResolveCD checks cd against the rest of the configuration (§1.9, after the value rules): a
// load-aware policy needs a prefill-busy threshold, inheriting router_queue_threshold when it has
// none, and the feature needs KV events. name says how a message refers to a configuration key
// (its flag at startup; the key itself in an override).
func (c *Config) ResolveCD(cd CDConfig, name func(key string) string) (CDConfig, error) {
	if err := cd.Validate(); err != nil {
		return CDConfig{}, err
	}
	if cd.PrefillBusyThreshold == nil {
		cd.PrefillBusyThreshold = c.QueueThreshold // shared, never written through
	}
	if cd.Enabled && cd.Policy.NeedsPrefillBusy() && cd.PrefillBusyThreshold == nil {
		return CDConfig{}, &RuleError{Field: "policy", Msg: fmt.Sprintf(
			"conditional_disagg policy='%s' needs prefill_busy_threshold, but neither prefill_busy_threshold nor %s is set",
			cd.Policy, name("router_queue_threshold"))}
	}
	if cd.Enabled && !c.UseKVEvents {
		return CDConfig{}, &RuleError{Field: "enabled", Msg: fmt.Sprintf("%s requires %s", name("conditional_disagg"), name("use_kv_events"))}
	}
	return cd, nil
}

// ParseCDConfigJSON applies a conditional-disaggregation JSON object to cd, checking how each value
// is written (Dynamo's argparse rules) and then the value rules (Validate). It returns the keys the
// object set, for provenance. Errors are *FieldError, with an empty Field for the object itself.
func ParseCDConfigJSON(raw string, cd *CDConfig) (set []string, err error) {
	var doc map[string]json.RawMessage
	dec := json.NewDecoder(strings.NewReader(raw))
	if err := dec.Decode(&doc); err != nil || doc == nil {
		return nil, fieldErr("", "must be a JSON object")
	}
	// Nothing may follow the object. (dec.More is false before a stray '}' or ']', so it cannot say.)
	if _, err := dec.Token(); err != io.EOF {
		return nil, fieldErr("", "must be a JSON object")
	}
	var unknown []string
	for k := range doc {
		if !slices.Contains(CDConfigKeys, k) {
			unknown = append(unknown, k)
		}
		set = append(set, k)
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		return nil, fieldErr("", "has unknown field(s): %s", strings.Join(unknown, ", "))
	}
	slices.Sort(set)
	if v, ok := doc["policy"]; ok {
		var s string
		if err := json.Unmarshal(v, &s); err != nil || isJSONNull(v) {
			return nil, fieldErr("policy", "must be a string")
		}
		p, err := LookupCDPolicy(s)
		if err != nil {
			return nil, err
		}
		cd.Policy = p
	}
	if v, ok := doc["eff_isl_threshold"]; ok {
		n, err := jsonInteger(v)
		if err != nil {
			return nil, fieldErr("eff_isl_threshold", "must be an integer")
		}
		if n < 0 {
			return nil, fieldErr("eff_isl_threshold", "must be >= 0")
		}
		cd.EffISLThreshold = uint64(n)
	}
	if v, ok := doc["eff_isl_ratio_threshold"]; ok {
		f, err := jsonNumber(v)
		if err != nil {
			return nil, fieldErr("eff_isl_ratio_threshold", "must be a number")
		}
		cd.EffISLRatioThreshold = f
	}
	for _, t := range []struct {
		key string
		dst **float64
	}{{"prefill_busy_threshold", &cd.PrefillBusyThreshold}, {"decode_busy_threshold", &cd.DecodeBusyThreshold}} {
		v, ok := doc[t.key]
		if !ok || isJSONNull(v) { // null means unset
			continue
		}
		f, err := jsonNumber(v)
		if err != nil {
			return nil, fieldErr(t.key, "must be a number")
		}
		*t.dst = &f
	}
	return set, cd.Validate()
}

func isJSONNull(v json.RawMessage) bool { return string(bytes.TrimSpace(v)) == "null" }

// jsonNumber accepts a JSON number, and rejects booleans, strings and null. (encoding/json would
// also take a quoted number into a json.Number, so the first byte is checked.) A number too large
// for a float64 (1e999) is a number: it comes back as ±Inf, for the value rules to refuse with the
// message they give an infinite value from any other source.
func jsonNumber(v json.RawMessage) (float64, error) {
	s := bytes.TrimSpace(v)
	if len(s) == 0 || (s[0] != '-' && (s[0] < '0' || s[0] > '9')) {
		return 0, fmt.Errorf("not a number: %s", s)
	}
	var n json.Number
	d := json.NewDecoder(bytes.NewReader(v))
	d.UseNumber()
	if err := d.Decode(&n); err != nil {
		return 0, err
	}
	f, err := n.Float64()
	if errors.Is(err, strconv.ErrRange) && math.IsInf(f, 0) {
		return f, nil
	}
	return f, err
}

// jsonInteger accepts a JSON number written as an integer: 1.5, 2e3, true and null are not.
func jsonInteger(v json.RawMessage) (int64, error) {
	s := string(bytes.TrimSpace(v))
	if strings.ContainsAny(s, ".eE") {
		return 0, fmt.Errorf("not an integer: %s", s)
	}
	if _, err := jsonNumber(v); err != nil {
		return 0, err
	}
	return strconv.ParseInt(s, 10, 64)
}
