package policy

import (
	"strings"
	"testing"
)

// smallPrompts is a test-only conditional-disaggregation policy, to show what adding one takes:
// a type with a name, whether it reads the prefill-busy signal, and its decision; then its
// registration. It bypasses whenever the effective ISL is at most 4096 tokens, however much of the
// prompt that is.
type smallPrompts struct{}

func (smallPrompts) String() string          { return "small_prompts" }
func (smallPrompts) NeedsPrefillBusy() bool  { return false }
func (smallPrompts) Bypass(s CDSignals) bool { return s.EffectiveISL <= 4096 }

// TestAddingACDPolicy registers smallPrompts and routes with it, from the configuration and from a
// per-request override: a cold 256-token prompt, which isl_bounding sends to remote prefill (its
// whole prompt is uncached: ratio 1), bypasses under the new policy.
func TestAddingACDPolicy(t *testing.T) {
	t.Cleanup(RegisterCDPolicy(smallPrompts{}))
	p, err := LookupCDPolicy("small_prompts")
	if err != nil {
		t.Fatalf("LookupCDPolicy(small_prompts) = %v", err)
	}
	if _, err := LookupCDPolicy("nope"); err == nil || !strings.HasSuffix(err.Error(), "'isl_or_load', 'small_prompts'") {
		t.Errorf("LookupCDPolicy(nope) = %v, want the registered names listed, small_prompts last", err)
	}

	f, _ := cdFleet(t)
	cold := Request{ID: "cold", Tokens: coldPrompt(16 * testBlockSize)}
	if o, _ := route(t, f, cdOn(), cold); o.Mode == ModeBypass {
		t.Fatalf("isl_bounding bypassed a cold prompt: %+v", o)
	}
	cfg := cdOn()
	cfg.ConditionalDisagg.Policy = p
	byConfig := cold
	byConfig.ID = "by-config"
	if o, _ := route(t, f, cfg, byConfig); o.Mode != ModeBypass {
		t.Errorf("with small_prompts configured: mode %v (reason %v), want bypass", o.Mode, o.Reason)
	}
	byRequest := cold
	byRequest.ID, byRequest.CDOverride = "by-request", CDOverride{Policy: &p}
	if o, dec := route(t, f, cdOn(), byRequest); o.Mode != ModeBypass || dec.CD.Policy.String() != "small_prompts" {
		t.Errorf("with small_prompts as the request's override: mode %v (reason %v), want bypass by small_prompts", o.Mode, o.Reason)
	}
}
