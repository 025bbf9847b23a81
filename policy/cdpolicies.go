package policy

import (
	"fmt"
	"strings"
	"sync"
)

// Dynamo's conditional-disaggregation policies (§1.2), registered in this order.
var (
	// ISLBounding bypasses when the effective ISL is bounded (CDSignals.ISLBounded).
	ISLBounding CDPolicy = islBounding{}
	// PrefillLoad bypasses when the prefill worker the router would pick is busy.
	PrefillLoad CDPolicy = prefillLoad{}
	// ISLOrLoad bypasses when either holds.
	ISLOrLoad CDPolicy = islOrLoad{}
)

func init() {
	RegisterCDPolicy(ISLBounding)
	RegisterCDPolicy(PrefillLoad)
	RegisterCDPolicy(ISLOrLoad)
}

type islBounding struct{}

func (islBounding) String() string          { return "isl_bounding" }
func (islBounding) NeedsPrefillBusy() bool  { return false }
func (islBounding) Bypass(s CDSignals) bool { return s.ISLBounded }

type prefillLoad struct{}

func (prefillLoad) String() string          { return "prefill_load" }
func (prefillLoad) NeedsPrefillBusy() bool  { return true }
func (prefillLoad) Bypass(s CDSignals) bool { return s.PrefillBusy == Yes }

type islOrLoad struct{}

func (islOrLoad) String() string          { return "isl_or_load" }
func (islOrLoad) NeedsPrefillBusy() bool  { return true }
func (islOrLoad) Bypass(s CDSignals) bool { return s.ISLBounded || s.PrefillBusy == Yes }

// cdPolicies is the registry: every name a configuration or a request may give.
var cdPolicies struct {
	mu     sync.RWMutex
	byName map[string]CDPolicy
	order  []string
}

// RegisterCDPolicy makes p available under its name, to the configuration and to per-request
// overrides, and returns what removes it again (for tests). A policy registers once, from an
// init function in its own file; a name registered twice is a programming error and panics.
func RegisterCDPolicy(p CDPolicy) (unregister func()) {
	name := p.String()
	cdPolicies.mu.Lock()
	defer cdPolicies.mu.Unlock()
	if _, dup := cdPolicies.byName[name]; dup || name == "" {
		panic(fmt.Sprintf("policy: conditional-disaggregation policy %q registered twice (or unnamed)", name))
	}
	if cdPolicies.byName == nil {
		cdPolicies.byName = make(map[string]CDPolicy)
	}
	cdPolicies.byName[name] = p
	cdPolicies.order = append(cdPolicies.order, name)
	return func() {
		cdPolicies.mu.Lock()
		defer cdPolicies.mu.Unlock()
		delete(cdPolicies.byName, name)
		for i, n := range cdPolicies.order {
			if n == name {
				cdPolicies.order = append(cdPolicies.order[:i:i], cdPolicies.order[i+1:]...)
				break
			}
		}
	}
}

// CDPolicyNames returns the registered policy names, quoted, in registration order: the list the
// validation messages give.
func CDPolicyNames() []string {
	cdPolicies.mu.RLock()
	defer cdPolicies.mu.RUnlock()
	out := make([]string, len(cdPolicies.order))
	for i, n := range cdPolicies.order {
		out[i] = "'" + n + "'"
	}
	return out
}

// ParseCDPolicy returns the policy registered under s, exactly (case-sensitive), with Dynamo's
// error text: unknown conditional_disagg_policy: "x", expected 'isl_bounding', 'prefill_load', or
// 'isl_or_load'.
func ParseCDPolicy(s string) (CDPolicy, error) {
	cdPolicies.mu.RLock()
	p, ok := cdPolicies.byName[s]
	cdPolicies.mu.RUnlock()
	if ok {
		return p, nil
	}
	return nil, fmt.Errorf("unknown conditional_disagg_policy: %q, expected %s", s, orList(CDPolicyNames()))
}

// orList joins names as "a, b, or c" ("a or b", "a").
func orList(names []string) string {
	switch len(names) {
	case 0:
		return "nothing"
	case 1:
		return names[0]
	case 2:
		return names[0] + " or " + names[1]
	}
	return strings.Join(names[:len(names)-1], ", ") + ", or " + names[len(names)-1]
}
