package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server"
)

// cdConfigKeys are the keys --conditional-disagg-config accepts (Dynamo §1.9).
var cdConfigKeys = []string{"policy", "eff_isl_threshold", "eff_isl_ratio_threshold", "prefill_busy_threshold", "decode_busy_threshold"}

const cdFlag = "--conditional-disagg-config"

// parseCDConfig checks the JSON of --conditional-disagg-config the way Dynamo's command line does,
// with the same messages (naming our flags), and applies it to cd.
func parseCDConfig(raw string, cd *policy.CDConfig) error {
	var doc map[string]json.RawMessage
	dec := json.NewDecoder(strings.NewReader(raw))
	if err := dec.Decode(&doc); err != nil || doc == nil || dec.More() {
		return fmt.Errorf("%s must be a JSON object", cdFlag)
	}
	var unknown []string
	for k := range doc {
		if !slices.Contains(cdConfigKeys, k) {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		return fmt.Errorf("%s has unknown field(s): %s", cdFlag, strings.Join(unknown, ", "))
	}
	if v, ok := doc["policy"]; ok {
		var s string
		if err := json.Unmarshal(v, &s); err != nil || isNull(v) {
			return fmt.Errorf("%s policy must be a string", cdFlag)
		}
		p, err := policy.ParseCDPolicy(s)
		if err != nil {
			return fmt.Errorf("%s policy must be one of %s", cdFlag, strings.Join(policy.CDPolicyNames(), ", "))
		}
		cd.Policy = p
	}
	if v, ok := doc["eff_isl_threshold"]; ok {
		n, err := jsonInteger(v)
		if err != nil {
			return fmt.Errorf("%s eff_isl_threshold must be an integer", cdFlag)
		}
		if n < 0 {
			return fmt.Errorf("%s eff_isl_threshold must be >= 0", cdFlag)
		}
		cd.EffISLThreshold = uint64(n)
	}
	if v, ok := doc["eff_isl_ratio_threshold"]; ok {
		f, err := jsonNumber(v)
		if err != nil || isNull(v) {
			return fmt.Errorf("%s eff_isl_ratio_threshold must be a number", cdFlag)
		}
		if f < 0 || f > 1 {
			return fmt.Errorf("%s eff_isl_ratio_threshold must be in [0.0, 1.0]", cdFlag)
		}
		cd.EffISLRatioThreshold = f
	}
	for _, t := range []struct {
		key string
		dst **float64
	}{{"prefill_busy_threshold", &cd.PrefillBusyThreshold}, {"decode_busy_threshold", &cd.DecodeBusyThreshold}} {
		v, ok := doc[t.key]
		if !ok || isNull(v) { // null means unset
			continue
		}
		f, err := jsonNumber(v)
		if err != nil {
			return fmt.Errorf("%s %s must be a number", cdFlag, t.key)
		}
		if f < 0 {
			return fmt.Errorf("%s %s must be >= 0", cdFlag, t.key)
		}
		*t.dst = &f
	}
	return nil
}

func isNull(v json.RawMessage) bool { return string(bytes.TrimSpace(v)) == "null" }

// jsonNumber accepts a JSON number, and rejects booleans, strings and null. (encoding/json would
// also take a quoted number into a json.Number, so the first byte is checked.)
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
	return n.Float64()
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

// resolveConditionalDisagg builds the conditional-disaggregation configuration from
// --conditional-disagg, --conditional-disagg-config and --router-queue-threshold, with Dynamo's rules
// and messages (§1.9), in Dynamo's order.
func (c *loadedConfig) resolveConditionalDisagg(logger *slog.Logger) error {
	cd := policy.DefaultCDConfig()
	cd.Enabled = c.ConditionalDisagg
	if c.ConditionalDisaggConfig != "" {
		// The JSON is checked as it is read, before the rules that relate it to other settings.
		if err := parseCDConfig(c.ConditionalDisaggConfig, &cd); err != nil {
			return err
		}
		if !cd.Enabled {
			return fmt.Errorf("%s requires --conditional-disagg", cdFlag)
		}
	}
	if cd.Enabled && cd.Policy.NeedsPrefillBusy() && cd.PrefillBusyThreshold == nil {
		if c.Router.QueueThreshold == nil {
			return fmt.Errorf("conditional_disagg policy='%s' needs prefill_busy_threshold, but neither prefill_busy_threshold nor --router-queue-threshold is set", cd.Policy)
		}
		t := *c.Router.QueueThreshold
		cd.PrefillBusyThreshold = &t
		logger.Info(fmt.Sprintf("conditional_disagg prefill_busy_threshold defaults to --router-queue-threshold=%v", t))
	}
	if cd.Enabled && !c.Router.UseKVEvents {
		return fmt.Errorf("--conditional-disagg requires --use-kv-events")
	}
	if cd.Enabled && cd.DecodeBusyThreshold != nil {
		logger.Info("conditional_disagg decode busy guard enabled", "decode_busy_threshold", *cd.DecodeBusyThreshold)
	}
	c.Router.ConditionalDisagg = cd
	return nil
}

// cdEntries reports the effective conditional-disaggregation values for GetConfig, each with the
// source it came from: the JSON's source for keys it sets, router_queue_threshold's for an inherited
// prefill busy threshold, and the default otherwise.
func (c *loadedConfig) cdEntries() []server.ConfigEntry {
	var doc map[string]json.RawMessage
	_ = json.Unmarshal([]byte(c.ConditionalDisaggConfig), &doc)
	source := func(key string) server.ConfigSource {
		if _, ok := doc[key]; ok {
			return c.sources["conditional_disagg_config"]
		}
		return server.SourceDefault
	}
	cd := c.Router.ConditionalDisagg
	optional := func(v *float64) string {
		if v == nil {
			return ""
		}
		return strconv.FormatFloat(*v, 'g', -1, 64)
	}
	prefillSource := source("prefill_busy_threshold")
	if _, set := doc["prefill_busy_threshold"]; !set && cd.PrefillBusyThreshold != nil {
		prefillSource = c.sources["router_queue_threshold"]
	}
	return []server.ConfigEntry{
		{Key: "conditional_disagg.policy", Value: cd.Policy.String(), Source: source("policy")},
		{Key: "conditional_disagg.eff_isl_threshold", Value: strconv.FormatUint(cd.EffISLThreshold, 10), Source: source("eff_isl_threshold")},
		{Key: "conditional_disagg.eff_isl_ratio_threshold", Value: strconv.FormatFloat(cd.EffISLRatioThreshold, 'g', -1, 64), Source: source("eff_isl_ratio_threshold")},
		{Key: "conditional_disagg.prefill_busy_threshold", Value: optional(cd.PrefillBusyThreshold), Source: prefillSource},
		{Key: "conditional_disagg.decode_busy_threshold", Value: optional(cd.DecodeBusyThreshold), Source: source("decode_busy_threshold")},
	}
}
