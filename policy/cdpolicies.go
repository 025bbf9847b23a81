package policy

import (
	"strings"
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
func (prefillLoad) Bypass(s CDSignals) bool { return s.PrefillBusy == SignalYes }

type islOrLoad struct{}

func (islOrLoad) String() string          { return "isl_or_load" }
func (islOrLoad) NeedsPrefillBusy() bool  { return true }
func (islOrLoad) Bypass(s CDSignals) bool { return s.ISLBounded || s.PrefillBusy == SignalYes }

// cdPolicies is the registry: every name a configuration or a request may give.
var cdPolicies = registry[CDPolicy]{kind: "conditional-disaggregation policy"}

// RegisterCDPolicy makes p available under its name, to the configuration and to per-request
// overrides, and returns what removes it again (for tests). A policy registers once, from an
// init function in its own file; a name registered twice is a programming error and panics.
func RegisterCDPolicy(p CDPolicy) (unregister func()) { return cdPolicies.register(p) }

// CDPolicyNames returns the registered policy names, quoted, in registration order: the list the
// validation messages give.
func CDPolicyNames() []string { return cdPolicies.quotedNames() }

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
