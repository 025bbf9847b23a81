package policy

import (
	"errors"

	"github.com/kvrouter/kvrouter/kvstate"
)

// CDOverride changes conditional disaggregation for one request; nil fields keep the configuration.
type CDOverride struct {
	Enabled              *bool
	Policy               *CDPolicy
	EffISLThreshold      *uint64
	EffISLRatioThreshold *float64
	PrefillBusyThreshold *float64
	DecodeBusyThreshold  *float64
}

// EffectiveCD returns the conditional-disaggregation configuration for a request with override o,
// checked by the rules of the startup configuration (ResolveCD), whose messages name the router's
// configuration keys.
func (c Config) EffectiveCD(o CDOverride) (CDConfig, error) { return c.effectiveCD(o) }

// effectiveCD is EffectiveCD without copying the configuration: the routing path calls it, where
// stack frame size matters (see noEligibleWorker).
func (c *Config) effectiveCD(o CDOverride) (CDConfig, error) {
	cd := c.ConditionalDisagg
	if o.Enabled != nil {
		cd.Enabled = *o.Enabled
	}
	if o.Policy != nil {
		cd.Policy = *o.Policy
	}
	if o.EffISLThreshold != nil {
		cd.EffISLThreshold = *o.EffISLThreshold
	}
	if o.EffISLRatioThreshold != nil {
		cd.EffISLRatioThreshold = *o.EffISLRatioThreshold
	}
	if o.PrefillBusyThreshold != nil {
		cd.PrefillBusyThreshold = o.PrefillBusyThreshold
	}
	if o.DecodeBusyThreshold != nil {
		cd.DecodeBusyThreshold = o.DecodeBusyThreshold
	}
	return c.ResolveCD(cd, overrideKey)
}

// overrideKey names a configuration key in a per-request override's messages: as the key itself.
func overrideKey(key string) string { return key }

// CDDiagnostics are the numbers behind a bypass decision, reported to the caller and the metrics.
type CDDiagnostics struct {
	Policy           CDPolicy
	Decode           *kvstate.Worker // the advisory decode pick
	CachedTokens     float64
	EffectiveISL     float64
	Ratio            float64
	PrefillBusy      Signal
	DecodeBusy       Signal
	PrefillEvaluated bool // the policy needed the prefill-busy signal
	GateEvaluated    bool // the decode gate computed its signal
	PolicySaysBypass bool
	Gate             GateDecision // empty when the gate was not consulted
	PotentialBlocks  uint64
	EffISLThreshold  uint64
	RatioThreshold   float64
}

// conditionalDisagg decides whether the request bypasses remote prefill (Dynamo §1.5), recording the
// reason and numbers in the decision. It returns the decode worker to bypass to, or nil for remote
// prefill. Nothing is booked here: both pools are only previewed.
func (r *Kernel) conditionalDisagg(rc *routeCtx, cd CDConfig, w Weights, prefillPool, decodePool []*kvstate.Worker, affinity *Pin, affinityStale bool) *Choice {
	dec, req := rc.dec, rc.req
	switch {
	case !cd.Enabled:
		dec.Reason = ReasonConditionalDisaggOff
		return nil
	case req.PrefillPin != nil:
		dec.Reason = ReasonPrefillWorkerPinned
		return nil
	case rc.prompt.Tokens == 0:
		dec.Reason = ReasonEmptyPrompt
		return nil
	}
	// An explicit decode pin is resolved first (§8 item 4): to its rank, or to the worker's only rank.
	// Only without one does session affinity apply, so a stale session cannot abort a valid pin.
	var pin *Pin
	switch {
	case req.DecodePin != nil:
		key, ok := resolvePin(req.DecodePin, decodePool)
		if !ok {
			dec.Reason = ReasonDecodePinUnresolved
			return nil
		}
		pin = &Pin{Worker: key.ID, Rank: &key.Rank}
	case affinityStale:
		dec.Reason = ReasonDecodeAffinityUnresolved
		return nil
	default:
		pin = affinity
	}
	// The advisory decode selection uses the request's own weights, prefill term included: it asks
	// which decode worker would serve the request if it ran there whole (§1.5 step 10).
	choice, err := r.choose(rc, HopDecodePreview, decodePool, w, pin)
	if err != nil {
		dec.Reason = ReasonDecodeSelectionFailed
		return nil
	}
	d := &CDDiagnostics{
		Policy: cd.Policy, Decode: choice.Worker, CachedTokens: choice.CachedTokens,
		PotentialBlocks: choice.PotentialDecodeBlocks, EffISLThreshold: cd.EffISLThreshold, RatioThreshold: cd.EffISLRatioThreshold,
	}
	dec.CD = d
	in := CDInput{PromptTokens: rc.prompt.Tokens, DecodeCachedTokens: choice.CachedTokens}
	if cd.Policy.NeedsPrefillBusy() {
		in.PrefillBusy = r.prefillBusy(rc, cd, w, prefillPool)
		d.PrefillBusy, d.PrefillEvaluated = in.PrefillBusy, true
	}
	d.EffectiveISL, d.Ratio = in.EffectiveISL()
	d.PolicySaysBypass = cd.SaysBypass(in)
	if d.PolicySaysBypass && !choice.Worker.Info.SupportsBypass {
		// A worker that never said it honours the annotation would wait for a KV transfer that never
		// comes. The gate is not consulted (its label stays empty, and uncounted).
		dec.Reason = ReasonDecodeCannotBypass
		return nil
	}
	gateOn := cd.DecodeBusyThreshold != nil
	if d.PolicySaysBypass && gateOn {
		d.DecodeBusy = DecodeBusy(choice.PotentialDecodeBlocks, choice.Worker.Info.TotalKVBlocks, *cd.DecodeBusyThreshold)
		d.GateEvaluated = true
	}
	var bypass bool
	bypass, d.Gate = Gate(d.PolicySaysBypass, gateOn, d.DecodeBusy)
	switch {
	case d.Gate == GateDeclinedByPolicy:
		dec.Reason = ReasonPolicyDeclined
	case d.Gate == GateDeniedBusy:
		dec.Reason = ReasonDecodeBusy
	case d.Gate == GateDeniedBusyUnknown:
		dec.Reason = ReasonDecodeBusyUnknown
	default:
		dec.Reason = ReasonBypass
	}
	if !bypass {
		return nil
	}
	return &choice
}

// prefillBusy is the busy signal of the prefill worker an advisory selection would pick (§1.6):
// SignalUnknown without a threshold or when the selection fails; SignalYes when every prefill worker
// is overloaded.
func (r *Kernel) prefillBusy(rc *routeCtx, cd CDConfig, w Weights, pool []*kvstate.Worker) Signal {
	if cd.PrefillBusyThreshold == nil {
		return SignalUnknown
	}
	choice, err := r.choose(rc, HopPrefillPreview, pool, w, nil)
	switch {
	case errors.Is(err, ErrAllWorkersOverloaded):
		return SignalYes
	case err != nil:
		return SignalUnknown
	}
	return PrefillBusy(choice.Load.ActivePrefillTokens, PrefillTokenCapacity(choice.Worker), *cd.PrefillBusyThreshold)
}

// resolvePin resolves a decode pin to one worker rank (§10.6): the pinned rank, or the worker's only
// rank in the pool. A worker with several ranks, or none, leaves the pin unresolved.
func resolvePin(p *Pin, pool []*kvstate.Worker) (kvstate.WorkerKey, bool) {
	if p.Rank != nil {
		return kvstate.WorkerKey{ID: p.Worker, Rank: *p.Rank}, true
	}
	var found kvstate.WorkerKey
	n := 0
	for _, w := range pool {
		if w.Info.Key.ID == p.Worker {
			found = w.Info.Key
			n++
		}
	}
	return found, n == 1
}
