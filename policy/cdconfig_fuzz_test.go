package policy

import (
	"encoding/json"
	"errors"
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// FuzzConditionalDisaggJSON feeds any text to ParseCDConfigJSON, as --conditional-disagg-config
// (from a flag, the environment or the YAML file) gives it, over the defaults, and checks:
//
//   - it never panics;
//   - a refusal is a *FieldError with a rule, naming either the object itself (no field) or a key of
//     the object that the object sets;
//   - an accepted object reports the keys it set (sorted, each a known key, exactly the object's),
//     leaves every other value at its default, and passes CDConfig.Validate: a registered policy,
//     a ratio in [0, 1], finite thresholds >= 0;
//   - printing the result as a complete JSON object (printCDJSON) parses back to the same
//     configuration, and prints the same again;
//   - the rules relating it to the rest of the configuration (Config.ResolveCD, with use_kv_events
//     and router_queue_threshold fuzzed) accept it resolved (valid again, with a prefill-busy
//     threshold whenever an enabled policy needs one, inherited from router_queue_threshold when it
//     set none) or refuse it with a *RuleError naming the setting; and the same values given as a
//     per-request override (Config.EffectiveCD) meet the same rules with the same answer.
func FuzzConditionalDisaggJSON(f *testing.F) {
	for _, raw := range []string{
		// TestConditionalDisaggConfig (server/config), good and bad.
		`{"policy":"isl_or_load","eff_isl_threshold":4096,"eff_isl_ratio_threshold":0.8,"prefill_busy_threshold":16,"decode_busy_threshold":0.9}`,
		`{"policy":"isl_bounding"}`, `{"foo":1}`, `{"zz":1,"foo":2,"policy":"isl_bounding"}`, `[1]`, `{policy:`,
		`{"eff_isl_threshold":1.5}`, `{"eff_isl_threshold":true}`, `{"eff_isl_threshold":null}`, `{"eff_isl_threshold":-1}`,
		`{"eff_isl_ratio_threshold":null}`, `{"eff_isl_ratio_threshold":"0.5"}`, `{"eff_isl_ratio_threshold":1.5}`,
		`{"eff_isl_ratio_threshold":1.0000001}`, `{"prefill_busy_threshold":null}`, `{"decode_busy_threshold":false}`,
		`{"prefill_busy_threshold":-0.1}`, `{"decode_busy_threshold":-0.1}`, `{"policy":1}`, `{"policy":"bogus"}`,
		`{"policy":"prefill_load"}`, `{"eff_isl_threshold":1024}`, `{"eff_isl_ratio_threshold":1.5}`,
		// As the YAML file's mapping becomes JSON (keys sorted, numbers as written).
		`{"eff_isl_threshold":512,"policy":"isl_or_load","prefill_busy_threshold":2.5}`,
		`{"eff_isl_threshold":2048.0}`, `{"decode_busy_threshold":null,"policy":"isl_bounding"}`,
		// Edges of the number rules.
		`{"eff_isl_threshold":2e3}`, `{"eff_isl_threshold":-0}`, `{"eff_isl_threshold":9223372036854775808}`,
		`{"eff_isl_ratio_threshold":-0}`, `{"eff_isl_ratio_threshold":1e-400}`, `{"prefill_busy_threshold":1e999}`,
		`{"decode_busy_threshold":" 1"}`, `{"policy":"isl_bounding","policy":"prefill_load"}`, `{} {}`, `{}`, `null`, ``, ` {"policy" : "isl_or_load" } `,
		// A stray closing bracket after the object (a known bug: see below).
		`{}}`, `{"policy":""}}`, `{"eff_isl_threshold":1}] trailing`,
	} {
		f.Add(raw, true, true, -1.0)
		f.Add(raw, false, true, 4.0)
	}
	f.Add(`{"policy":"prefill_load"}`, true, false, 0.5)
	f.Add(`{"policy":"isl_bounding"}} junk`, true, true, 0.0) // once accepted as the object alone
	f.Fuzz(func(t *testing.T, raw string, enabled, useKVEvents bool, queueThreshold float64) {
		if len(raw) > 256 {
			return // five keys fit; longer inputs only cost the fuzzer time (minimizing them)
		}
		cd := DefaultCDConfig()
		cd.Enabled = enabled
		set, err := ParseCDConfigJSON(raw, &cd)
		var object map[string]json.RawMessage
		_ = json.Unmarshal([]byte(raw), &object) // nil unless raw is exactly one JSON object
		if err != nil {
			var fe *FieldError
			if !errors.As(err, &fe) || fe.Rule == "" {
				t.Fatalf("ParseCDConfigJSON(%q) = %#v, want a *FieldError with a rule", raw, err)
			}
			if _, ok := object[fe.Field]; fe.Field != "" && !ok {
				t.Fatalf("ParseCDConfigJSON(%q) = %v: names %q, which the object does not set", raw, err, fe.Field)
			}
			return
		}
		if object == nil {
			t.Fatalf("ParseCDConfigJSON(%q) accepted what encoding/json does not read as an object", raw)
		}
		keys := make([]string, 0, len(object))
		for k := range object {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		if diff := cmp.Diff(keys, set, cmpopts.EquateEmpty()); diff != "" {
			t.Fatalf("ParseCDConfigJSON(%q) set mismatch (-object's keys +reported):\n%s", raw, diff)
		}
		for _, k := range set {
			if !slices.Contains(CDConfigKeys, k) {
				t.Fatalf("ParseCDConfigJSON(%q) accepted the unknown key %q", raw, k)
			}
		}
		if err := cd.Validate(); err != nil {
			t.Fatalf("ParseCDConfigJSON(%q) accepted %+v, which Validate refuses: %v", raw, cd, err)
		}
		inRange := func(v *float64) bool { return v == nil || *v >= 0 && !math.IsInf(*v, 1) }
		if _, err := LookupCDPolicy(cd.Policy.String()); err != nil || !(cd.EffISLRatioThreshold >= 0 && cd.EffISLRatioThreshold <= 1) ||
			!inRange(cd.PrefillBusyThreshold) || !inRange(cd.DecodeBusyThreshold) {
			t.Fatalf("ParseCDConfigJSON(%q) accepted %+v: want a registered policy, a ratio in [0, 1] and finite thresholds >= 0", raw, cd)
		}
		def := DefaultCDConfig()
		def.Enabled = enabled
		if changed := changedUnset(cd, def, set); len(changed) > 0 {
			t.Fatalf("ParseCDConfigJSON(%q) changed %v, which the object does not set", raw, changed)
		}

		printed := printCDJSON(cd)
		again := DefaultCDConfig()
		again.Enabled = enabled
		if _, err := ParseCDConfigJSON(printed, &again); err != nil {
			t.Fatalf("ParseCDConfigJSON(%q), the print of ParseCDConfigJSON(%q), = %v", printed, raw, err)
		}
		if diff := cmp.Diff(cd, again, cmpCD); diff != "" || printCDJSON(again) != printed {
			t.Fatalf("%q parsed, printed as %q and parsed again differs (-first +again):\n%s", raw, printed, diff)
		}

		cfg := DefaultConfig()
		cfg.UseKVEvents = useKVEvents
		if queueThreshold >= 0 && !math.IsInf(queueThreshold, 0) {
			cfg.QueueThreshold = &queueThreshold
		}
		if err := cfg.Validate(); err != nil {
			t.Fatalf("the fuzzed configuration is invalid: %v", err)
		}
		resolved, err := cfg.ResolveCD(cd, flagName)
		var re *RuleError
		switch {
		case err == nil:
			if err := resolved.Validate(); err != nil {
				t.Fatalf("ResolveCD(%+v) = %+v, which Validate refuses: %v", cd, resolved, err)
			}
			want := cd.PrefillBusyThreshold
			if want == nil {
				want = cfg.QueueThreshold
			}
			if !cmp.Equal(resolved.PrefillBusyThreshold, want, cmpCD) {
				t.Fatalf("ResolveCD(%+v) prefill busy threshold = %v, want %v", cd, resolved.PrefillBusyThreshold, want)
			}
			if resolved.Enabled && resolved.Policy.NeedsPrefillBusy() && resolved.PrefillBusyThreshold == nil {
				t.Fatalf("ResolveCD(%+v) = %+v: %s without a prefill busy threshold", cd, resolved, resolved.Policy)
			}
		case !errors.As(err, &re) || (re.Field != "policy" && re.Field != "enabled") || !strings.Contains(re.Msg, "--"):
			t.Fatalf("ResolveCD(%+v) = %#v, want a *RuleError naming policy or enabled, and the settings as flags", cd, err)
		}
		o := CDOverride{Enabled: &cd.Enabled, Policy: &cd.Policy, EffISLThreshold: &cd.EffISLThreshold,
			EffISLRatioThreshold: &cd.EffISLRatioThreshold, PrefillBusyThreshold: cd.PrefillBusyThreshold, DecodeBusyThreshold: cd.DecodeBusyThreshold}
		byOverride, overrideErr := cfg.EffectiveCD(o)
		byConfig, configErr := cfg.ResolveCD(cd, func(key string) string { return key })
		if errText(overrideErr) != errText(configErr) || !cmp.Equal(byOverride, byConfig, cmpCD) {
			t.Fatalf("%+v as an override = %+v, %v; as the configuration = %+v, %v", cd, byOverride, overrideErr, byConfig, configErr)
		}
	})
}

// cmpCD compares configurations: policies by name, numbers by their bits (so -0 is not 0), and
// pointers by what they point to.
var cmpCD = cmp.Options{
	cmp.Comparer(func(a, b CDPolicy) bool {
		return a == nil && b == nil || a != nil && b != nil && a.String() == b.String()
	}),
	cmp.Comparer(func(a, b float64) bool { return math.Float64bits(a) == math.Float64bits(b) }),
}

// flagName names a key as its flag, as kvrouter serve's messages do.
func flagName(key string) string { return "--" + strings.ReplaceAll(key, "_", "-") }

// changedUnset returns the keys the object did not set whose value in cd differs from def's.
func changedUnset(cd, def CDConfig, set []string) []string {
	var changed []string
	for _, k := range CDConfigKeys {
		if slices.Contains(set, k) {
			continue
		}
		var same bool
		switch k {
		case "policy":
			same = cmp.Equal(cd.Policy, def.Policy, cmpCD)
		case "eff_isl_threshold":
			same = cd.EffISLThreshold == def.EffISLThreshold
		case "eff_isl_ratio_threshold":
			same = cmp.Equal(cd.EffISLRatioThreshold, def.EffISLRatioThreshold, cmpCD)
		case "prefill_busy_threshold":
			same = cmp.Equal(cd.PrefillBusyThreshold, def.PrefillBusyThreshold, cmpCD)
		case "decode_busy_threshold":
			same = cmp.Equal(cd.DecodeBusyThreshold, def.DecodeBusyThreshold, cmpCD)
		}
		if !same {
			changed = append(changed, k)
		}
	}
	if cd.Enabled != def.Enabled {
		changed = append(changed, "(enabled)")
	}
	return changed
}

// printCDJSON writes a configuration as the complete JSON object ParseCDConfigJSON reads, every key
// present (an unset threshold as null), numbers as short as they read back.
func printCDJSON(cd CDConfig) string {
	optional := func(v *float64) string {
		if v == nil {
			return "null"
		}
		return strconv.FormatFloat(*v, 'g', -1, 64)
	}
	name, _ := json.Marshal(cd.Policy.String())
	return `{"policy":` + string(name) +
		`,"eff_isl_threshold":` + strconv.FormatUint(cd.EffISLThreshold, 10) +
		`,"eff_isl_ratio_threshold":` + strconv.FormatFloat(cd.EffISLRatioThreshold, 'g', -1, 64) +
		`,"prefill_busy_threshold":` + optional(cd.PrefillBusyThreshold) +
		`,"decode_busy_threshold":` + optional(cd.DecodeBusyThreshold) + `}`
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
