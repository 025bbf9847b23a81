// Package policy makes routing decisions over a read-only view of kvstate: the cost of each worker
// (Dynamo's KV-router formula, §3.3), selection with temperature and tie-breaks (§3.4), the flow of
// disaggregated and aggregated routing (§5), and validation of the configuration that drives them.
//
// A "§N.M" in this package's comments names a section of docs/dynamo-behaviour.md, the Dynamo
// behaviour the router matches.
package policy

import (
	"fmt"
	"math"
	"strings"
	"time"
)

// Queue policies of router-side queueing.
const (
	QueuePolicyFCFS = "fcfs"
	QueuePolicyWSPT = "wspt"
)

// DefaultPrefillTokenCapacity is assumed for a worker that advertises no max_num_batched_tokens; it
// effectively makes such a worker never count as busy (Dynamo §1.6).
const DefaultPrefillTokenCapacity = 10_000_000

// Config is the router's selection configuration (Dynamo's KvRouterConfig, §3.1). Field comments give
// the YAML key; defaults are those of DefaultConfig.
type Config struct {
	OverlapScoreCredit        float64       // overlap_score_credit: weight of device-tier overlap (1.0)
	OverlapScoreCreditDecay   float64       // overlap_score_credit_decay: shrinks credit on prefill-loaded workers (0)
	PrefillLoadScale          float64       // prefill_load_scale: weight of the prefill term (1.0)
	OverlapScoreWeight        *float64      // overlap_score_weight: deprecated single weight (unset)
	DecodeActiveRequestWeight float64       // decode_active_request_weight: cost per active request (0)
	HostCacheHitWeight        float64       // host_cache_hit_weight: credit per host-tier block (0.75)
	DiskCacheHitWeight        float64       // disk_cache_hit_weight: credit per disk-tier block (0.25)
	SharedCacheMultiplier     float64       // shared_cache_multiplier: credit per external-tier block (0)
	RouterTemperature         float64       // router_temperature: softmax temperature, 0 = argmin (0)
	UseKVEvents               bool          // use_kv_events: index workers' KV events (true)
	AssumeKVReuse             bool          // router_assume_kv_reuse: dedupe shared active blocks (true)
	TrackPrefillTokens        bool          // router_track_prefill_tokens: charge prefill load (true)
	QueueThreshold            *float64      // router_queue_threshold: busy when prefill load > t x capacity (unset)
	QueuePolicy               string        // router_queue_policy: fcfs or wspt (fcfs)
	QueueMaxDepth             int           // router_queue_max_depth: requests the queue holds (1024)
	EnforceDisagg             bool          // enforce_disagg: fail instead of routing aggregated (false)
	ConditionalDisagg         CDConfig      // conditional_disagg, conditional_disagg_config
	SessionAffinityTTL        time.Duration // session_affinity_ttl: how long a session keeps its decode worker (0 = off)
	Scorer                    Scorer        // scorer: costs each hop's candidates (dynamo)
}

// DefaultConfig returns Dynamo's defaults.
func DefaultConfig() Config {
	return Config{
		OverlapScoreCredit: 1.0,
		PrefillLoadScale:   1.0,
		HostCacheHitWeight: 0.75,
		DiskCacheHitWeight: 0.25,
		UseKVEvents:        true,
		AssumeKVReuse:      true,
		TrackPrefillTokens: true,
		QueuePolicy:        QueuePolicyFCFS,
		QueueMaxDepth:      1024,
		ConditionalDisagg:  DefaultCDConfig(),
		Scorer:             DynamoCost,
	}
}

// FieldError is an invalid configuration value: the field (YAML key) and the rule it broke.
type FieldError struct {
	Field string
	Rule  string
}

func (e *FieldError) Error() string { return e.Field + " " + e.Rule }

func fieldErr(field, format string, args ...any) error {
	return &FieldError{Field: field, Rule: fmt.Sprintf(format, args...)}
}

// nonNegative checks a finite number >= 0, as Dynamo's validation does for most weights.
func nonNegative(field string, v float64) error {
	if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
		return fieldErr(field, "must be a finite, non-negative number (got %v)", v)
	}
	return nil
}

// unitInterval checks a number in [0, 1].
func unitInterval(field string, v float64) error {
	if math.IsNaN(v) || v < 0 || v > 1 {
		return fieldErr(field, "must be in [0, 1] (got %v)", v)
	}
	return nil
}

// Validate checks every rule of Dynamo §3.1 and returns the first broken one as a *FieldError.
func (c Config) Validate() error {
	checks := []error{
		nonNegative("overlap_score_credit", c.OverlapScoreCredit),
		nonNegative("overlap_score_credit_decay", c.OverlapScoreCreditDecay),
		nonNegative("prefill_load_scale", c.PrefillLoadScale),
		nonNegative("decode_active_request_weight", c.DecodeActiveRequestWeight),
		unitInterval("host_cache_hit_weight", c.HostCacheHitWeight),
		unitInterval("disk_cache_hit_weight", c.DiskCacheHitWeight),
		unitInterval("shared_cache_multiplier", c.SharedCacheMultiplier),
		nonNegative("router_temperature", c.RouterTemperature),
	}
	if c.OverlapScoreWeight != nil {
		checks = append(checks, nonNegative("overlap_score_weight", *c.OverlapScoreWeight))
	}
	if c.QueueThreshold != nil {
		checks = append(checks, nonNegative("router_queue_threshold", *c.QueueThreshold))
	}
	if c.QueuePolicy != QueuePolicyFCFS && c.QueuePolicy != QueuePolicyWSPT {
		checks = append(checks, fieldErr("router_queue_policy", "must be one of %q, %q (got %q)", QueuePolicyFCFS, QueuePolicyWSPT, c.QueuePolicy))
	}
	if c.SessionAffinityTTL < 0 {
		checks = append(checks, fieldErr("session_affinity_ttl", "must not be negative (got %v)", c.SessionAffinityTTL))
	}
	if c.QueueMaxDepth < 1 {
		checks = append(checks, fieldErr("router_queue_max_depth", "must be at least 1 (got %d)", c.QueueMaxDepth))
	}
	for _, err := range checks {
		if err != nil {
			return err
		}
	}
	_, err := c.EffectiveCD(CDOverride{})
	return err
}

// Override changes selection parameters for one request (Dynamo's router_config_override). Nil
// fields keep the configured value.
type Override struct {
	OverlapScoreCredit    *float64
	PrefillLoadScale      *float64
	OverlapScoreWeight    *float64
	RouterTemperature     *float64
	SharedCacheMultiplier *float64
	AssumeKVReuse         *bool
	TrackPrefillTokens    *bool
}

// Validate checks the override with the same rules as the configuration.
func (o Override) Validate() error {
	for _, f := range []struct {
		name string
		v    *float64
		unit bool
	}{
		{"overlap_score_credit", o.OverlapScoreCredit, false},
		{"prefill_load_scale", o.PrefillLoadScale, false},
		{"overlap_score_weight", o.OverlapScoreWeight, false},
		{"router_temperature", o.RouterTemperature, false},
		{"shared_cache_multiplier", o.SharedCacheMultiplier, true},
	} {
		if f.v == nil {
			continue
		}
		check := nonNegative
		if f.unit {
			check = unitInterval
		}
		if err := check(f.name, *f.v); err != nil {
			return err
		}
	}
	return nil
}

// Weights are the effective numbers the cost formula uses for one hop of one request: the
// configuration with the request's override and the deprecated-weight mapping applied.
type Weights struct {
	Credit, Decay, PrefillLoadScale, DecodeActiveRequestWeight float64
	HostWeight, DiskWeight, SharedMultiplier                   float64
	Temperature                                                float64
	AssumeKVReuse, TrackPrefillTokens                          bool
}

// Weights returns the effective weights for a request with override o. The deprecated
// overlap_score_weight w, when present, sets prefill_load_scale to w, and w == 0 also sets the
// credit to 0; a request's own weight wins over the configured one (§3.1).
func (c Config) Weights(o Override) Weights { return c.weights(o) }

// weights is Weights without copying the configuration (see effectiveCD).
func (c *Config) weights(o Override) Weights {
	w := Weights{
		Credit: c.OverlapScoreCredit, Decay: c.OverlapScoreCreditDecay, PrefillLoadScale: c.PrefillLoadScale,
		DecodeActiveRequestWeight: c.DecodeActiveRequestWeight,
		HostWeight:                c.HostCacheHitWeight, DiskWeight: c.DiskCacheHitWeight, SharedMultiplier: c.SharedCacheMultiplier,
		Temperature:   c.RouterTemperature,
		AssumeKVReuse: c.AssumeKVReuse, TrackPrefillTokens: c.TrackPrefillTokens,
	}
	applyLegacyWeight(&w, c.OverlapScoreWeight)
	if o.OverlapScoreCredit != nil {
		w.Credit = *o.OverlapScoreCredit
	}
	if o.PrefillLoadScale != nil {
		w.PrefillLoadScale = *o.PrefillLoadScale
	}
	applyLegacyWeight(&w, o.OverlapScoreWeight)
	if o.RouterTemperature != nil {
		w.Temperature = *o.RouterTemperature
	}
	if o.SharedCacheMultiplier != nil {
		w.SharedMultiplier = *o.SharedCacheMultiplier
	}
	if o.AssumeKVReuse != nil {
		w.AssumeKVReuse = *o.AssumeKVReuse
	}
	if o.TrackPrefillTokens != nil {
		w.TrackPrefillTokens = *o.TrackPrefillTokens
	}
	return w
}

func applyLegacyWeight(w *Weights, weight *float64) {
	if weight == nil {
		return
	}
	w.PrefillLoadScale = *weight
	if *weight == 0 {
		w.Credit = 0
	}
}

// String formats the override's set fields, for logs.
func (o Override) String() string {
	var parts []string
	add := func(name string, v *float64) {
		if v != nil {
			parts = append(parts, fmt.Sprintf("%s=%v", name, *v))
		}
	}
	add("overlap_score_credit", o.OverlapScoreCredit)
	add("prefill_load_scale", o.PrefillLoadScale)
	add("overlap_score_weight", o.OverlapScoreWeight)
	add("router_temperature", o.RouterTemperature)
	add("shared_cache_multiplier", o.SharedCacheMultiplier)
	if o.AssumeKVReuse != nil {
		parts = append(parts, fmt.Sprintf("assume_kv_reuse=%v", *o.AssumeKVReuse))
	}
	if o.TrackPrefillTokens != nil {
		parts = append(parts, fmt.Sprintf("track_prefill_tokens=%v", *o.TrackPrefillTokens))
	}
	return strings.Join(parts, " ")
}
