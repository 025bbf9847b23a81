package policy

import "math"

// CDPolicy is a conditional-disaggregation policy: whether a request may skip remote prefill and
// run whole on the decode worker that already caches most of its prompt (Dynamo §1.2). Policies
// are values registered by name (RegisterCDPolicy, cdpolicies.go): a new one is a file with its
// type and its registration.
type CDPolicy interface {
	// String returns the policy's configuration name.
	String() string
	// NeedsPrefillBusy reports whether the policy reads the prefill-busy signal: the router then
	// computes it, and the configuration must give a prefill-busy threshold.
	NeedsPrefillBusy() bool
	// Bypass decides from the signals of one request (§1.4), before the decode gate.
	Bypass(s CDSignals) bool
}

// CDSignals is what a policy decides from.
type CDSignals struct {
	// ISLBounded: the effective ISL is under eff_isl_threshold and its share of the prompt under
	// eff_isl_ratio_threshold (both strict).
	ISLBounded bool
	// PrefillBusy is the busy signal of the prefill worker the router would pick; Unknown unless the
	// policy NeedsPrefillBusy, or when no signal is available (a missing signal counts as calm).
	PrefillBusy Signal
	// EffectiveISL and Ratio are the numbers behind ISLBounded (EffectiveISL).
	EffectiveISL, Ratio float64
}

// CDConfig configures conditional disaggregation (Dynamo §1.9). Defaults are those of
// DefaultCDConfig.
type CDConfig struct {
	Enabled bool
	Policy  CDPolicy
	// EffISLThreshold bounds the tokens a decode worker may prefill locally (2048).
	EffISLThreshold uint64
	// EffISLRatioThreshold bounds the uncached share of the prompt, in [0, 1] (0.7).
	EffISLRatioThreshold float64
	// PrefillBusyThreshold: a prefill worker is busy when its active prefill tokens exceed this times
	// its max_num_batched_tokens. Unset, router_queue_threshold applies; the load-aware policies need one.
	PrefillBusyThreshold *float64
	// DecodeBusyThreshold enables the decode gate: a bypass is vetoed when the decode worker's projected
	// blocks exceed this times its total_kv_blocks, or when its capacity is unknown. Unset = gate off.
	DecodeBusyThreshold *float64
}

// DefaultCDConfig returns Dynamo's defaults (feature off).
func DefaultCDConfig() CDConfig {
	return CDConfig{Policy: ISLBounding, EffISLThreshold: 2048, EffISLRatioThreshold: 0.7}
}

// Signal is a yes-or-no signal that may be unavailable (a worker's busy state when its threshold or
// its selection is missing): Dynamo logs it as true, false or unknown.
type Signal uint8

// The values of a Signal.
const (
	SignalUnknown Signal = iota
	SignalNo
	SignalYes
)

// String returns unknown, false or true.
func (t Signal) String() string {
	switch t {
	case SignalNo:
		return "false"
	case SignalYes:
		return "true"
	}
	return "unknown"
}

// CDInput is what the policy decides from (Dynamo §1.3).
type CDInput struct {
	// PromptTokens is P.
	PromptTokens uint64
	// DecodeCachedTokens is C: the tier-weighted cached tokens, unrounded, on the decode worker the
	// router would pick.
	DecodeCachedTokens float64
	// PrefillBusy is the busy signal of the prefill worker the router would pick.
	PrefillBusy Signal
}

// EffectiveISL returns the tokens the decode worker would have to prefill, P - min(C, P), and their
// share of the prompt, eff / max(P, 1). Cached tokens are weighted and unrounded (§8 item 1): rounding
// to whole blocks can flip the strict thresholds.
func (in CDInput) EffectiveISL() (eff, ratio float64) {
	p := float64(in.PromptTokens)
	eff = p - math.Min(in.DecodeCachedTokens, p)
	return eff, eff / math.Max(p, 1)
}

// SaysBypass reports whether the policy would bypass remote prefill, before the decode gate (§1.4).
// A disabled configuration never bypasses.
func (c CDConfig) SaysBypass(in CDInput) bool {
	if !c.Enabled {
		return false
	}
	eff, ratio := in.EffectiveISL()
	return c.Policy.Bypass(CDSignals{
		ISLBounded:  eff < float64(c.EffISLThreshold) && ratio < c.EffISLRatioThreshold,
		PrefillBusy: in.PrefillBusy, EffectiveISL: eff, Ratio: ratio,
	})
}

// GateDecision is the decode gate's label, logged and counted for every decision (§1.7).
type GateDecision string

// Decode gate labels.
const (
	GateDeclinedByPolicy    GateDecision = "bypass_declined_by_policy"
	GateAllowedGateDisabled GateDecision = "bypass_allowed_decode_gate_disabled"
	GateDeniedBusyUnknown   GateDecision = "bypass_denied_decode_busy_unknown"
	GateDeniedBusy          GateDecision = "bypass_denied_decode_busy"
	GateAllowedNotBusy      GateDecision = "bypass_allowed_decode_not_busy"
)

// Gate applies the decode-busy gate as a veto on the policy's answer: with the gate configured, only
// a decode worker known not to be busy may take the bypass; an unknown signal fails closed.
func Gate(policySaysBypass, gateConfigured bool, decodeBusy Signal) (bool, GateDecision) {
	switch {
	case !policySaysBypass:
		return false, GateDeclinedByPolicy
	case !gateConfigured:
		return true, GateAllowedGateDisabled
	case decodeBusy == SignalUnknown:
		return false, GateDeniedBusyUnknown
	case decodeBusy == SignalYes:
		return false, GateDeniedBusy
	}
	return true, GateAllowedNotBusy
}

// DecodeBusy reports whether a decode worker's projected blocks (including the request's new ones)
// exceed threshold x its total KV blocks; Unknown when it advertised no capacity (§1.7).
func DecodeBusy(potentialBlocks, totalKVBlocks uint64, threshold float64) Signal {
	if totalKVBlocks == 0 {
		return SignalUnknown
	}
	return signalOf(float64(potentialBlocks) > threshold*float64(totalKVBlocks))
}

// PrefillBusy reports whether a prefill worker's active prefill tokens exceed threshold x its
// prefill capacity (§1.6).
func PrefillBusy(activePrefillTokens, capacity uint64, threshold float64) Signal {
	return signalOf(float64(activePrefillTokens) > threshold*float64(capacity))
}

func signalOf(b bool) Signal {
	if b {
		return SignalYes
	}
	return SignalNo
}

// Reason says why a request was routed the way it was: the outcome of conditional disaggregation,
// or why it was not consulted. Metric label values are the String forms.
type Reason uint8

// Decision reasons.
const (
	ReasonUnspecified Reason = iota
	// ReasonNoPrefillWorkers: the model has no prefill pool; the request runs aggregated.
	ReasonNoPrefillWorkers
	// ReasonConditionalDisaggOff: conditional disaggregation is not enabled.
	ReasonConditionalDisaggOff
	// ReasonPrefillWorkerPinned: the request pins a prefill worker.
	ReasonPrefillWorkerPinned
	// ReasonEmptyPrompt: no routing tokens.
	ReasonEmptyPrompt
	// ReasonDecodePinUnresolved: the decode pin names no rank and the worker has no unique rank.
	ReasonDecodePinUnresolved
	// ReasonDecodeSelectionFailed: the advisory decode selection found no worker (all overloaded,
	// or none eligible).
	ReasonDecodeSelectionFailed
	// ReasonPolicyDeclined: the policy said remote prefill.
	ReasonPolicyDeclined
	// ReasonDecodeCannotBypass: the chosen decode worker did not register bypass support.
	ReasonDecodeCannotBypass
	// ReasonDecodeBusy: the decode gate vetoed: the worker is busy.
	ReasonDecodeBusy
	// ReasonDecodeBusyUnknown: the decode gate vetoed: the worker's capacity is unknown.
	ReasonDecodeBusyUnknown
	// ReasonBypass: the request bypasses remote prefill.
	ReasonBypass
	// ReasonDecodeAffinityUnresolved: the session is bound to a decode worker that is gone.
	ReasonDecodeAffinityUnresolved
)

var reasonNames = [...]string{
	ReasonUnspecified:              "unspecified",
	ReasonNoPrefillWorkers:         "no_prefill_workers",
	ReasonConditionalDisaggOff:     "conditional_disagg_off",
	ReasonPrefillWorkerPinned:      "prefill_worker_pinned",
	ReasonEmptyPrompt:              "empty_prompt",
	ReasonDecodePinUnresolved:      "decode_pin_unresolved",
	ReasonDecodeSelectionFailed:    "decode_selection_failed",
	ReasonPolicyDeclined:           "policy_declined",
	ReasonDecodeCannotBypass:       "decode_cannot_bypass",
	ReasonDecodeBusy:               "decode_busy",
	ReasonDecodeBusyUnknown:        "decode_busy_unknown",
	ReasonBypass:                   "bypass",
	ReasonDecodeAffinityUnresolved: "decode_affinity_unresolved",
}

// String returns the reason's metric label.
func (r Reason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return "unspecified"
}
