package policy

import (
	"math"
	"testing"
)

func cdConfig(enabled bool, policy CDPolicy, threshold uint64, ratio float64) CDConfig {
	c := DefaultCDConfig()
	c.Enabled, c.Policy, c.EffISLThreshold, c.EffISLRatioThreshold = enabled, policy, threshold, ratio
	return c
}

// TestISLBounding restates §10.1 (B = 64).
func TestISLBounding(t *testing.T) {
	tests := []struct {
		name      string
		enabled   bool
		p         uint64
		cached    float64
		threshold uint64
		ratio     float64
		wantEff   float64
		want      bool
	}{
		{"1: disabled", false, 100, 0, 2048, 0.7, 100, false},
		{"2: 14 of ~15.6 blocks cached", true, 1000, 896, 2048, 0.7, 104, true},
		{"3: eff 36000 over the absolute threshold", true, 100000, 64000, 2048, 0.99, 36000, false},
		{"4: nothing cached, ratio 1.0", true, 200, 0, 2048, 0.7, 200, false},
		{"5: eff equals the threshold (strict)", true, 2048, 0, 2048, 0.99, 2048, false},
		{"6: empty prompt, no panic", true, 0, 0, 2048, 0.7, 0, true},
		{"7: cached beyond the prompt clamps eff to 0", true, 500, 640, 2048, 0.7, 0, true},
		// §8 item 1: one 0.75-weight host block of 64 tokens is 48 cached tokens. Rounding it to a
		// whole block (64) would give eff 2036 < 2048 and bypass; the weighted 48 gives 2052: no.
		{"8: weighted, not rounded", true, 2100, 48, 2048, 0.99, 2052, false},
		{"ratio threshold 0 never bypasses", true, 1000, 999, 2048, 0, 1, false},
		{"ratio threshold 1 bypasses any partially cached prompt", true, 1000, 1, 2048, 1, 999, true},
		{"absolute threshold 0 never bypasses", true, 1000, 1000, 0, 1, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := CDInput{PromptTokens: tt.p, DecodeCachedTokens: tt.cached}
			if eff, _ := in.EffectiveISL(); eff != tt.wantEff {
				t.Errorf("EffectiveISL() = %v, want %v", eff, tt.wantEff)
			}
			if got := cdConfig(tt.enabled, ISLBounding, tt.threshold, tt.ratio).SaysBypass(in); got != tt.want {
				t.Errorf("SaysBypass() = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestWeightedCachedTokensFeedTheDecision: §8 item 1 through the real conversion from overlap blocks:
// 32 device blocks and 1 host block of 64 tokens give 2048 + 48 cached tokens, not 2048 + 64.
func TestWeightedCachedTokensFeedTheDecision(t *testing.T) {
	w := DefaultConfig().Weights(Override{})
	cached := w.CachedTokens(tierCounts(0, 1), 64)
	if cached != 48 {
		t.Fatalf("CachedTokens(1 host block, B=64) = %v, want 48", cached)
	}
	in := CDInput{PromptTokens: 2100, DecodeCachedTokens: cached}
	if cdConfig(true, ISLBounding, 2048, 0.99).SaysBypass(in) {
		t.Error("SaysBypass() = true, want false: the host block is worth 48 tokens, so eff is 2052")
	}
}

// TestPrefillLoad restates §10.2.
func TestPrefillLoad(t *testing.T) {
	tests := []struct {
		name    string
		enabled bool
		busy    Signal
		p       uint64
		want    bool
	}{
		{"disabled", false, SignalYes, 1000, false},
		{"no signal counts as calm", true, SignalUnknown, 1000, false},
		{"not busy", true, SignalNo, 1000, false},
		{"busy", true, SignalYes, 1000, true},
		{"busy, huge uncached prompt: ISL ignored", true, SignalYes, 100000, true},
		{"not busy, huge prompt", true, SignalNo, 100000, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := CDInput{PromptTokens: tt.p, PrefillBusy: tt.busy}
			if got := cdConfig(tt.enabled, PrefillLoad, 2048, 0.7).SaysBypass(in); got != tt.want {
				t.Errorf("SaysBypass() = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestISLOrLoad restates §10.3 (small = P 1000 / 896 cached; large = P 100000 / 0 cached).
func TestISLOrLoad(t *testing.T) {
	small := CDInput{PromptTokens: 1000, DecodeCachedTokens: 896}
	large := CDInput{PromptTokens: 100000}
	with := func(in CDInput, busy Signal) CDInput { in.PrefillBusy = busy; return in }
	tests := []struct {
		name    string
		enabled bool
		in      CDInput
		want    bool
	}{
		{"small, calm: bypass via ISL", true, with(small, SignalNo), true},
		{"small, busy", true, with(small, SignalYes), true},
		{"large, calm", true, with(large, SignalNo), false},
		{"large, busy: bypass via load", true, with(large, SignalYes), true},
		{"small, disabled", false, with(small, SignalYes), false},
		{"large, disabled", false, with(large, SignalYes), false},
		{"small, no signal", true, with(small, SignalUnknown), true},
		{"large, no signal degrades to isl_bounding", true, with(large, SignalUnknown), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := cdConfig(tt.enabled, ISLOrLoad, 2048, 0.7).SaysBypass(tt.in); got != tt.want {
				t.Errorf("SaysBypass() = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestGate restates §10.4 and §8 item 10: the decode gate is a veto, and with the gate configured a
// missing signal vetoes.
func TestGate(t *testing.T) {
	tests := []struct {
		says, configured bool
		busy             Signal
		want             bool
		label            GateDecision
	}{
		{true, true, SignalNo, true, GateAllowedNotBusy},
		{true, true, SignalYes, false, GateDeniedBusy},
		{false, true, SignalNo, false, GateDeclinedByPolicy},
		{false, true, SignalYes, false, GateDeclinedByPolicy},
		{false, true, SignalUnknown, false, GateDeclinedByPolicy},
		{true, false, SignalUnknown, true, GateAllowedGateDisabled},
		{true, false, SignalYes, true, GateAllowedGateDisabled},
		{true, true, SignalUnknown, false, GateDeniedBusyUnknown},
	}
	for _, tt := range tests {
		got, label := Gate(tt.says, tt.configured, tt.busy)
		if got != tt.want || label != tt.label {
			t.Errorf("Gate(%v, %v, %v) = %v, %s; want %v, %s", tt.says, tt.configured, tt.busy, got, label, tt.want, tt.label)
		}
	}
}

func TestDecodeBusy(t *testing.T) {
	tests := []struct {
		potential, total uint64
		want             Signal
	}{
		{90, 100, SignalNo},
		{91, 100, SignalYes},
		{91, 0, SignalUnknown},
	}
	for _, tt := range tests {
		if got := DecodeBusy(tt.potential, tt.total, 0.9); got != tt.want {
			t.Errorf("DecodeBusy(%d, %d, 0.9) = %v, want %v", tt.potential, tt.total, got, tt.want)
		}
	}
}

// TestPrefillBusy restates §10.5.
func TestPrefillBusy(t *testing.T) {
	tests := []struct {
		active, capacity uint64
		want             Signal
	}{
		{16384, 8192, SignalNo},
		{16385, 8192, SignalYes},
		{1_000_000, DefaultPrefillTokenCapacity, SignalNo},
	}
	for _, tt := range tests {
		if got := PrefillBusy(tt.active, tt.capacity, 2.0); got != tt.want {
			t.Errorf("PrefillBusy(%d, %d, 2.0) = %v, want %v", tt.active, tt.capacity, got, tt.want)
		}
	}
}

func TestCDConfigValidate(t *testing.T) {
	nan, over, neg, inf, negInf := math.NaN(), 1.0000001, -0.1, math.Inf(1), math.Inf(-1)
	tests := []struct {
		name   string
		mutate func(*CDConfig)
		want   string
	}{
		{"defaults", func(*CDConfig) {}, ""},
		{"no policy", func(c *CDConfig) { c.Policy = nil }, "policy must be one of 'isl_bounding', 'prefill_load', 'isl_or_load'"},
		{"ratio NaN", func(c *CDConfig) { c.EffISLRatioThreshold = nan }, "eff_isl_ratio_threshold must be in [0.0, 1.0]"},
		{"ratio 1.0000001", func(c *CDConfig) { c.EffISLRatioThreshold = over }, "eff_isl_ratio_threshold must be in [0.0, 1.0]"},
		{"prefill busy -0.1", func(c *CDConfig) { c.PrefillBusyThreshold = &neg }, "prefill_busy_threshold must be >= 0"},
		{"decode busy -0.1", func(c *CDConfig) { c.DecodeBusyThreshold = &neg }, "decode_busy_threshold must be >= 0"},
		{"ratio +Inf", func(c *CDConfig) { c.EffISLRatioThreshold = inf }, "eff_isl_ratio_threshold must be in [0.0, 1.0]"},
		// Not finite: a message that says so and names the value, for either threshold.
		{"decode busy +Inf", func(c *CDConfig) { c.DecodeBusyThreshold = &inf }, "decode_busy_threshold must be a finite number >= 0 (got +Inf)"},
		{"decode busy -Inf", func(c *CDConfig) { c.DecodeBusyThreshold = &negInf }, "decode_busy_threshold must be a finite number >= 0 (got -Inf)"},
		{"decode busy NaN", func(c *CDConfig) { c.DecodeBusyThreshold = &nan }, "decode_busy_threshold must be a finite number >= 0 (got NaN)"},
		{"prefill busy +Inf", func(c *CDConfig) { c.PrefillBusyThreshold = &inf }, "prefill_busy_threshold must be a finite number >= 0 (got +Inf)"},
		{"prefill busy NaN", func(c *CDConfig) { c.PrefillBusyThreshold = &nan }, "prefill_busy_threshold must be a finite number >= 0 (got NaN)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := DefaultCDConfig()
			tt.mutate(&c)
			got := ""
			if err := c.Validate(); err != nil {
				got = err.Error()
			}
			if got != tt.want {
				t.Errorf("Validate() = %q, want %q", got, tt.want)
			}
		})
	}
}

func tierCounts(device, host uint64) [4]uint64 { return [4]uint64{device, host, 0, 0} }
