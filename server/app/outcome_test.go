package app

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
)

// testClock is a clock the test moves; safe for the dispatcher's goroutines to read meanwhile.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *testClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// outcome is one call of Outcomes, as recordedOutcomes keeps it.
type outcome struct {
	Kind   string // booked, prefill_done or freed
	Booked BookedOutcome
	Ended  EndedOutcome
}

// recordedOutcomes keeps every outcome by request id, in the order each request's arrived: the
// order of outcomes of different requests is their goroutines' to decide.
type recordedOutcomes struct {
	mu   sync.Mutex
	byID map[string][]outcome
}

func (r *recordedOutcomes) add(id string, o outcome) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.byID == nil {
		r.byID = make(map[string][]outcome)
	}
	r.byID[id] = append(r.byID[id], o)
}

func (r *recordedOutcomes) Booked(_ context.Context, o BookedOutcome) {
	r.add(o.RequestID, outcome{Kind: "booked", Booked: o})
}

func (r *recordedOutcomes) PrefillDone(_ context.Context, o EndedOutcome) {
	r.add(o.RequestID, outcome{Kind: "prefill_done", Ended: o})
}

func (r *recordedOutcomes) Freed(_ context.Context, o EndedOutcome) {
	r.add(o.RequestID, outcome{Kind: "freed", Ended: o})
}

func (r *recordedOutcomes) get() map[string][]outcome {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.byID
}

// TestOutcomes routes, marks prefill complete and frees through a real Dispatcher and checks what
// its outcome hook heard, each request's outcomes in order, with the durations measured on the
// dispatcher's clock, which the test moves between the calls.
func TestOutcomes(t *testing.T) {
	t0 := time.Unix(1000, 0)
	tokens := prompt(16 * testBlockSize) // 16 blocks
	w := func(id uint64) kvstate.WorkerKey { return kvstate.WorkerKey{ID: id} }
	cached := func(n uint64) kvstate.TierCounts { return kvstate.TierCounts{kvstate.TierDevice: n} }
	for _, tc := range []struct {
		name string
		// setup registers the workers and caches what it likes; it may wrap the log.
		setup func(f *fleet, cancel context.CancelFunc) kvstate.Log
		// steps run after the Route of "r", which must answer routeErr.
		steps    func(t *testing.T, d *Dispatcher, clk *testClock)
		routeErr error
		want     map[string][]outcome
	}{
		{
			name: "aggregated: booked, prefill done, freed",
			setup: func(f *fleet, _ context.CancelFunc) kvstate.Log {
				f.add(1, kvstate.RoleAggregated, 8192)
				f.cache(1, tokens, 4)
				return f.log
			},
			steps: func(t *testing.T, d *Dispatcher, clk *testClock) {
				clk.advance(250 * time.Millisecond)
				mustEnd(t, d.PrefillComplete, "r")
				clk.advance(2 * time.Second)
				mustEnd(t, d.Free, "r")
			},
			want: map[string][]outcome{"r": {
				{Kind: "booked", Booked: BookedOutcome{
					RequestID: "r", Model: "m", Owner: "alice", SessionID: "chat", At: t0,
					Mode: policy.ModeAggregated, Reason: policy.ReasonNoPrefillWorkers, PromptTokens: 256, PromptBlocks: 16,
					// It prefills the 12 uncached blocks itself.
					Decode: HopOutcome{Worker: w(1), Overlap: cached(4), PrefillTokens: 12 * testBlockSize},
				}},
				{Kind: "prefill_done", Ended: EndedOutcome{RequestID: "r", At: t0.Add(250 * time.Millisecond),
					SinceBooked: 250 * time.Millisecond, BookingSeen: true, Hops: 1}},
				{Kind: "freed", Ended: EndedOutcome{RequestID: "r", At: t0.Add(2250 * time.Millisecond),
					SinceBooked: 2250 * time.Millisecond, BookingSeen: true, Hops: 1, Cause: FreedByCaller}},
			}},
		},
		{
			name: "disaggregated: both hops, the decode worker's load before the booking",
			setup: func(f *fleet, _ context.CancelFunc) kvstate.Log {
				f.add(10, kvstate.RolePrefill, 8192)
				f.add(20, kvstate.RoleDecode, 8192)
				f.cache(10, tokens, 4)
				f.append(kvstate.Booked{Booking: kvstate.Booking{RequestID: "busy", At: t0.UnixNano(),
					Hops: []kvstate.HopBooking{{Worker: w(20), Blocks: []uint64{1, 2, 3}}}}})
				return f.log
			},
			steps: func(t *testing.T, d *Dispatcher, clk *testClock) {
				clk.advance(100 * time.Millisecond)
				mustEnd(t, d.PrefillComplete, "r")
				clk.advance(time.Second)
				mustEnd(t, d.Free, "r")
			},
			want: map[string][]outcome{"r": {
				{Kind: "booked", Booked: BookedOutcome{
					RequestID: "r", Model: "m", Owner: "alice", SessionID: "chat", At: t0,
					Mode: policy.ModeDisaggregated, Reason: policy.ReasonConditionalDisaggOff, PromptTokens: 256, PromptBlocks: 16,
					Prefill: HopOutcome{Worker: w(10), Overlap: cached(4), PrefillTokens: 12 * testBlockSize},
					Decode:  HopOutcome{Worker: w(20), Load: kvstate.SlotLoad{ActiveBlocks: 3, ActiveRequests: 1}},
				}},
				{Kind: "prefill_done", Ended: EndedOutcome{RequestID: "r", At: t0.Add(100 * time.Millisecond),
					SinceBooked: 100 * time.Millisecond, BookingSeen: true, Hops: 2}},
				{Kind: "freed", Ended: EndedOutcome{RequestID: "r", At: t0.Add(1100 * time.Millisecond),
					SinceBooked: 1100 * time.Millisecond, BookingSeen: true, Hops: 2, Cause: FreedByCaller}},
			}},
		},
		{
			name: "the caller left while it was booked: booked, then undone",
			setup: func(f *fleet, cancel context.CancelFunc) kvstate.Log {
				f.add(1, kvstate.RoleAggregated, 8192)
				return cancelOnBook{Log: f.log, cancel: cancel}
			},
			routeErr: context.Canceled,
			steps: func(t *testing.T, d *Dispatcher, _ *testClock) {
				if err := d.Free(context.Background(), "r"); !errors.Is(err, kvstate.ErrUnknownRequest) {
					t.Errorf("Free(r) after it was undone = %v, want ErrUnknownRequest (and no outcome)", err)
				}
			},
			want: map[string][]outcome{"r": {
				{Kind: "booked", Booked: BookedOutcome{
					RequestID: "r", Model: "m", Owner: "alice", SessionID: "chat", At: t0,
					Mode: policy.ModeAggregated, Reason: policy.ReasonNoPrefillWorkers, PromptTokens: 256, PromptBlocks: 16,
					Decode: HopOutcome{Worker: w(1), PrefillTokens: 256},
				}},
				{Kind: "freed", Ended: EndedOutcome{RequestID: "r", At: t0, BookingSeen: true, Hops: 1, Cause: FreedCallerGone}},
			}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFleet(t)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			log := tc.setup(f, cancel)
			clk := &testClock{now: t0}
			rec := &recordedOutcomes{}
			d := New(f.state, log, policy.NewKernel(policy.StateView(f.state), policy.DefaultConfig(), policy.WithRand(keepFirst{})),
				Options{Clock: clk, Outcomes: rec})
			req := request("r", tokens)
			req.Owner, req.SessionID = "alice", "chat"
			if _, err := d.Route(ctx, req); !errors.Is(err, tc.routeErr) || (err == nil) != (tc.routeErr == nil) {
				t.Fatalf("Route(r) = %v, want %v", err, tc.routeErr)
			}
			tc.steps(t, d, clk)
			if diff := cmp.Diff(tc.want, rec.get()); diff != "" {
				t.Errorf("outcomes mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// TestOutcomeOfAQueuedRoute: a Route that waits in the queue for capacity is reported booked once
// it is, with the wait in Routed; the PrefillComplete that freed the capacity is reported too.
// synctest tells when the Route is waiting, so no test sleeps.
func TestOutcomeOfAQueuedRoute(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		t0 := time.Unix(1000, 0)
		f := newFleet(t)
		f.add(1, kvstate.RoleAggregated, 100)
		// x holds 101 prefill tokens: over router_queue_threshold 1.0 of the worker's 100.
		f.append(kvstate.Booked{Booking: kvstate.Booking{RequestID: "x", At: t0.UnixNano(),
			Hops: []kvstate.HopBooking{{Worker: kvstate.WorkerKey{ID: 1}, PrefillTokens: 101}}}})
		cfg := policy.DefaultConfig()
		threshold := 1.0
		cfg.QueueThreshold = &threshold
		clk := &testClock{now: t0}
		rec := &recordedOutcomes{}
		d := New(f.state, f.log, policy.NewKernel(policy.StateView(f.state), cfg, policy.WithRand(keepFirst{})),
			Options{Clock: clk, Outcomes: rec})

		routed := make(chan error, 1)
		go func() {
			_, err := d.Route(context.Background(), request("r", prompt(64)))
			routed <- err
		}()
		synctest.Wait() // r waits in the queue
		if n := d.QueueDepth(); n != 1 {
			t.Fatalf("QueueDepth() = %d, want r queued", n)
		}
		clk.advance(300 * time.Millisecond)
		mustEnd(t, d.PrefillComplete, "x")
		if err := <-routed; err != nil {
			t.Fatalf("Route(r) = %v", err)
		}
		at := t0.Add(300 * time.Millisecond)
		want := map[string][]outcome{
			"x": {{Kind: "prefill_done", Ended: EndedOutcome{RequestID: "x", At: at, SinceBooked: 300 * time.Millisecond, BookingSeen: true, Hops: 1}}},
			"r": {{Kind: "booked", Booked: BookedOutcome{
				RequestID: "r", Model: "m", At: at, Routed: 300 * time.Millisecond,
				Mode: policy.ModeAggregated, Reason: policy.ReasonNoPrefillWorkers, PromptTokens: 64, PromptBlocks: 4,
				// Decided once x's prefill was done: the worker still runs x, its prefill no longer.
				Decode: HopOutcome{Worker: kvstate.WorkerKey{ID: 1}, Load: kvstate.SlotLoad{ActiveRequests: 1}, PrefillTokens: 64},
			}}},
		}
		if diff := cmp.Diff(want, rec.get()); diff != "" {
			t.Errorf("outcomes mismatch (-want +got):\n%s", diff)
		}
	})
}

// TestNoOutcomes: a dispatcher given NoOutcomes, or none, routes and ends bookings as ever.
func TestNoOutcomes(t *testing.T) {
	for name, o := range map[string]Outcomes{"nil": nil, "NoOutcomes": NoOutcomes{}} {
		t.Run(name, func(t *testing.T) {
			f := newFleet(t)
			f.add(1, kvstate.RoleAggregated, 8192)
			d := New(f.state, f.log, policy.NewKernel(policy.StateView(f.state), policy.DefaultConfig()), Options{Outcomes: o})
			if d.outcomes != nil {
				t.Errorf("the dispatcher keeps %T as its outcomes, want none", d.outcomes)
			}
			if _, err := d.Route(context.Background(), request("r", prompt(64))); err != nil {
				t.Fatal(err)
			}
			mustEnd(t, d.PrefillComplete, "r")
			mustEnd(t, d.Free, "r")
		})
	}
}

// mustEnd calls end (PrefillComplete or Free) for request id and fails the test on an error.
func mustEnd(t *testing.T, end func(context.Context, string) error, id string) {
	t.Helper()
	if err := end(context.Background(), id); err != nil {
		t.Fatalf("ending %s: %v", id, err)
	}
}
