package policy

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/kvstate"
)

// fewestRequests is a test-only scorer, to show what adding one takes: a type with a name and a
// Score method, then its registration. It ignores the cache and costs a worker its active requests.
type fewestRequests struct{}

func (fewestRequests) String() string { return "fewest_requests" }

func (fewestRequests) Score(_ *Hop, cands []Candidate) {
	for i := range cands {
		cands[i].Cost = float64(cands[i].Load.ActiveRequests)
	}
}

// warmButBusy is an aggregated fleet where Dynamo's cost and fewestRequests disagree: worker 1
// caches the whole prompt but runs two requests, worker 2 is cold and idle.
func warmButBusy(t *testing.T) (*fleet, []uint32) {
	f := newFleet(t)
	f.add(1, 0, kvstate.RoleAggregated, 0)
	f.add(2, 0, kvstate.RoleAggregated, 0)
	tokens := prompt(8 * testBlockSize)
	f.cache(1, tokens, 8)
	for _, id := range []string{"a", "b"} {
		f.append(kvstate.Booked{Booking: kvstate.Booking{RequestID: id, Hops: []kvstate.HopBooking{{Worker: kvstate.WorkerKey{ID: 1}}}}})
	}
	return f, tokens
}

// TestAddingAScorer registers fewestRequests and routes with it by name: where Dynamo's cost sends
// the prompt to its warm worker, the new scorer sends it to the idle one.
func TestAddingAScorer(t *testing.T) {
	t.Cleanup(RegisterScorer(fewestRequests{}))
	s, err := ParseScorer("fewest_requests")
	if err != nil {
		t.Fatalf("ParseScorer(fewest_requests) = %v", err)
	}
	if _, err := ParseScorer("nope"); err == nil || !strings.HasSuffix(err.Error(), "'dynamo' or 'fewest_requests'") {
		t.Errorf("ParseScorer(nope) = %v, want the registered names listed", err)
	}
	f, tokens := warmButBusy(t)
	pick := func(cfg Config) uint64 {
		t.Helper()
		dec, err := f.router(cfg).Decide(&Request{Model: "m", Tokens: tokens, QueryOnly: true}, nil)
		if err != nil {
			t.Fatalf("Decide() = %v", err)
		}
		return dec.Decode.Worker.Info.Key.ID
	}
	if got := pick(DefaultConfig()); got != 1 {
		t.Fatalf("with Dynamo's cost the prompt went to %d, want 1 (warm)", got)
	}
	cfg := DefaultConfig()
	cfg.Scorer = s
	if got := pick(cfg); got != 2 {
		t.Errorf("with fewest_requests the prompt went to %d, want 2 (idle)", got)
	}
}

// maxRequests is a test-only filter: a worker with more than n active requests is not used.
type maxRequests uint64

func (n maxRequests) String() string { return "max_requests" }

func (n maxRequests) Keep(_ *Hop, c *Candidate) bool { return c.Load.ActiveRequests <= uint64(n) }

// TestFilters: a filter drops candidates after the kernel's own rules, and a hop whose every
// candidate it drops fails with ErrNoEligibleWorkers, naming it; nothing is booked then.
func TestFilters(t *testing.T) {
	f, tokens := warmButBusy(t)
	dec, err := f.router(DefaultConfig(), WithFilters(maxRequests(1))).Route(context.Background(), &Request{ID: "r", Model: "m", Tokens: tokens})
	if err != nil || dec.Decode.Worker.Info.Key.ID != 2 {
		t.Fatalf("Route() with max_requests(1) = %v, %v; want worker 2 (1 runs two requests)", dec, err)
	}
	// 2 now runs r.
	_, err = f.router(DefaultConfig(), WithFilters(maxRequests(0))).Route(context.Background(), &Request{ID: "s", Model: "m", Tokens: tokens})
	if !errors.Is(err, ErrNoEligibleWorkers) || !strings.Contains(err.Error(), "filter max_requests dropped all 2 workers") {
		t.Errorf("Route() with max_requests(0) = %v, want ErrNoEligibleWorkers naming the filter", err)
	}
	if n := f.state.Load().Bookings(); n != 3 {
		t.Errorf("%d bookings, want 3 (a, b, r)", n)
	}
}
