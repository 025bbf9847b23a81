package policy

import "fmt"

// A hop's worker is chosen in three steps, each behind a small interface in the spirit of llm-d's
// scheduler plugins: filters drop candidates the hop must not use, the scorer gives every remaining
// candidate a cost, and the picker chooses one from the costs. The kernel's own eligibility rules
// (role, pins, allow-list, router_queue_threshold) run before any filter, so their errors stay the
// ones Dynamo's callers expect. Dynamo's cost (DynamoCost) and selection (TemperaturePicker) are the
// defaults; a scorer is one file with its type and its RegisterScorer call.

// Hop is what filters, scorers and pickers know about the hop they serve.
type Hop struct {
	// Name is the hop (HopPrefill, HopDecode, HopAggregated, or a preview hop of conditional
	// disaggregation).
	Name    string
	Request *Request
	Prompt  Prompt
	// Weights are the hop's effective weights (configuration, request override, hop adjustments).
	Weights Weights
	// MinActivePrefill is the least active prefill load among the hop's candidates.
	MinActivePrefill uint64
}

// Filter drops candidates a hop must not use. When filters drop every candidate the hop fails with
// ErrNoEligibleWorkers naming the filter that dropped the last one.
type Filter interface {
	// String returns the filter's name, for errors and metrics.
	String() string
	// Keep reports whether the hop may use the candidate.
	Keep(h *Hop, c *Candidate) bool
}

// Scorer gives every candidate of a hop its cost; lower is better. It sees the hop's candidates
// together, so a scorer may normalise across them.
type Scorer interface {
	// String returns the scorer's configuration name.
	String() string
	// Score sets Cost on every candidate.
	Score(h *Hop, cands []Candidate)
}

// Picker chooses a candidate from the hop's costs, returning its index.
type Picker interface {
	Pick(h *Hop, costs []float64, r Rand) int
}

// DynamoCost is Dynamo's KV-router cost (Weights.Cost, §3.3), the default scorer.
var DynamoCost Scorer = dynamoCost{}

type dynamoCost struct{}

func (dynamoCost) String() string { return "dynamo" }

func (dynamoCost) Score(h *Hop, cands []Candidate) {
	for i := range cands {
		cands[i].Cost = h.Weights.Cost(&cands[i], h.Prompt, h.MinActivePrefill)
	}
}

// TemperaturePicker is Dynamo's selection (Pick, §3.4) at the hop's router_temperature: the
// cheapest candidate with ties at random, or a softmax sample above temperature 0. It is the
// default picker.
type TemperaturePicker struct{}

// Pick chooses with Pick at h.Weights.Temperature.
func (TemperaturePicker) Pick(h *Hop, costs []float64, r Rand) int {
	return Pick(costs, h.Weights.Temperature, r)
}

func init() { RegisterScorer(DynamoCost) }

// scorers is the registry of scorers the configuration may name.
var scorers = registry[Scorer]{kind: "scorer"}

// RegisterScorer makes s available to the configuration under its name and returns what removes
// it again (for tests). A scorer registers once, from an init function in its own file.
func RegisterScorer(s Scorer) (unregister func()) { return scorers.register(s) }

// ScorerNames returns the registered scorer names, quoted, in registration order.
func ScorerNames() []string { return scorers.quotedNames() }

// ParseScorer returns the scorer registered under name.
func ParseScorer(name string) (Scorer, error) {
	if s, ok := scorers.lookup(name); ok {
		return s, nil
	}
	return nil, fmt.Errorf("unknown scorer: %q, expected %s", name, orList(ScorerNames()))
}
