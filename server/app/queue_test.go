package app

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/policy"
)

// overloadedFleet has one aggregated worker with a prefill capacity of 100 tokens, already loaded
// with 101 prefill tokens by request "x": over a queue threshold of 1.0.
func overloadedFleet(t *testing.T, queuePolicy string, maxDepth int) (*fleet, *Dispatcher) {
	f := newFleet(t)
	f.add(1, kvstate.RoleAggregated, 100)
	f.append(kvstate.Booked{Booking: kvstate.Booking{RequestID: "x", Hops: []kvstate.HopBooking{{Worker: kvstate.WorkerKey{ID: 1}, PrefillTokens: 101}}}})
	cfg := policy.DefaultConfig()
	threshold := 1.0
	cfg.QueueThreshold, cfg.QueuePolicy, cfg.QueueMaxDepth = &threshold, queuePolicy, maxDepth
	return f, f.dispatcher(cfg)
}

type routeResult struct {
	id  string
	dec *policy.Decision
	err error
}

// startRoute routes in the background and waits until the request is queued.
func startRoute(t *testing.T, ctx context.Context, r *Dispatcher, id string, tokens int, results chan<- routeResult) {
	t.Helper()
	before := r.QueueDepth()
	go func() {
		dec, err := r.Route(ctx, request(id, prompt(tokens)))
		results <- routeResult{id, dec, err}
	}()
	kvtest.Eventually(t, testTimeout, fmt.Sprintf("request %s to be queued", id), func() bool { return r.QueueDepth() != before })
}

func TestQueueWaitsUntilDeadline(t *testing.T) {
	f, r := overloadedFleet(t, policy.QueuePolicyFCFS, 10)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := r.Route(ctx, request("a", prompt(64)))
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Route() = %v, want context.DeadlineExceeded", err)
	}
	if diff := f.state.Load().BookingIDs(); len(diff) != 1 || r.QueueDepth() != 0 {
		t.Errorf("after a deadline: bookings %v, queue depth %d; want only x and an empty queue", diff, r.QueueDepth())
	}
}

func TestQueueFull(t *testing.T) {
	_, r := overloadedFleet(t, policy.QueuePolicyFCFS, 1)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	results := make(chan routeResult, 1)
	startRoute(t, ctx, r, "a", 64, results)
	if _, err := r.Route(ctx, request("b", prompt(64))); !errors.Is(err, ErrQueueFull) {
		t.Errorf("Route() with a full queue = %v, want ErrQueueFull", err)
	}
	cancel()
	<-results
}

// TestQueueOrder: when capacity frees, waiting requests are served in policy order, one at a time
// while each booking overloads the worker again (128 uncached tokens > 100).
func TestQueueOrder(t *testing.T) {
	tests := []struct {
		policy string
		want   []string
	}{
		{policy.QueuePolicyFCFS, []string{"first-long", "second-short"}},
		{policy.QueuePolicyWSPT, []string{"second-short", "first-long"}},
	}
	for _, tt := range tests {
		t.Run(tt.policy, func(t *testing.T) {
			f, r := overloadedFleet(t, tt.policy, 10)
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			results := make(chan routeResult, 2)
			startRoute(t, ctx, r, "first-long", 256, results)
			startRoute(t, ctx, r, "second-short", 128, results)
			var order []string
			for _, free := range []string{"x", ""} {
				if free == "" {
					free = order[0]
				}
				if _, err := f.log.Append(ctx, kvstate.Freed{RequestID: free}); err != nil {
					t.Fatalf("Free(%s) = %v", free, err)
				}
				res := <-results
				if res.err != nil || !res.dec.Booked {
					t.Fatalf("queued Route(%s) = %v, booked %v", res.id, res.err, res.dec != nil && res.dec.Booked)
				}
				order = append(order, res.id)
				if len(order) == 1 && r.QueueDepth() != 1 {
					t.Errorf("after one request left the queue, depth = %d, want 1 (the worker is overloaded again)", r.QueueDepth())
				}
			}
			if order[0] != tt.want[0] || order[1] != tt.want[1] {
				t.Errorf("served in order %v, want %v", order, tt.want)
			}
		})
	}
}
