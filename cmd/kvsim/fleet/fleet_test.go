package fleet

import (
	"context"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/cmd/kvsim/engine"
	"github.com/kvrouter/kvrouter/cmd/kvsim/trace"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
	"github.com/kvrouter/kvrouter/policy"
)

// slice returns the first n requests of the Mooncake trace (traces/ in the repository).
func slice(t *testing.T, n int) []trace.Request {
	t.Helper()
	path, err := trace.Find("mooncake_conversation_trace.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	reqs, err := trace.LoadMooncake(f, 16)
	if err != nil {
		t.Fatal(err)
	}
	return reqs[:n]
}

// TestReplayInvariants replays a slice of the trace through each kind of fleet and checks what must
// hold whatever the policy: every request completes, in order of its own events; every booking is
// freed; no cache ever holds more than its capacity; and after the run the router's view of each
// worker's blocks equals the simulated engine's cache.
func TestReplayInvariants(t *testing.T) {
	reqs := slice(t, 150)
	model := engine.Llama31_8B_H100()
	model.TotalKVBlocks = 9000 // small caches (the longest prompt of the slice takes 7,576 blocks), so that eviction happens
	cd := policy.DefaultConfig()
	cd.ConditionalDisagg = policy.DefaultCDConfig()
	cd.ConditionalDisagg.Enabled = true
	var err error
	if cd.ConditionalDisagg.Policy, err = policy.LookupCDPolicy("isl_bounding"); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		cfg  Config
	}{
		{"aggregated, KV-aware", Config{Aggregated: 3, Routing: policy.DefaultConfig()}},
		{"disaggregated, KV-aware", Config{Prefill: 2, Decode: 2, Routing: policy.DefaultConfig()}},
		{"conditional disaggregation", Config{Prefill: 2, Decode: 2, Routing: cd}},
		{"disaggregated, round-robin", Config{Prefill: 2, Decode: 2, RoundRobin: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cfg := tt.cfg
			cfg.Model, cfg.TimeScale = model, 1
			res, err := Run(ctx, cfg, reqs)
			if err != nil {
				t.Fatalf("Run() = %v", err)
			}
			modes := map[policy.Mode]int{}
			for _, r := range res.Records {
				modes[r.Mode]++
				if r.FirstToken < r.Arrival || r.Done < r.FirstToken || r.Done == 0 {
					t.Fatalf("request %s: arrived %v, first token %v, done %v", r.ID, r.Arrival, r.FirstToken, r.Done)
				}
				if r.CachedTokens > r.PromptTokens {
					t.Fatalf("request %s: %d cached tokens of a %d-token prompt", r.ID, r.CachedTokens, r.PromptTokens)
				}
			}
			if res.Bookings != 0 {
				t.Errorf("%d bookings left after the run, want 0", res.Bookings)
			}
			for id, peak := range res.PeakBlocks {
				if peak > uint64(model.TotalKVBlocks) {
					t.Errorf("worker %d held %d blocks, capacity %d", id, peak, model.TotalKVBlocks)
				}
			}
			for id, n := range res.EngineBlocks {
				if res.RouterBlocks[id] != n {
					t.Errorf("worker %d: the router holds %d blocks, the engine %d", id, res.RouterBlocks[id], n)
				}
			}
			sum := res.Summarize()
			if sum.Requests != len(reqs) || sum.TTFTP50 <= 0 || sum.TTFTP99 < sum.TTFTP50 || sum.ITLP99 < sum.ITLP50 || sum.Throughput <= 0 {
				t.Errorf("Summarize() = %+v", sum)
			}
			t.Logf("%d requests in %v virtual; modes %v; TTFT p50 %v p99 %v, ITL p50 %v p99 %v, hit %.3f, bypass %.2f, goodput %.2f, util %.2f/%.2f, preemptions %d",
				len(res.Records), res.Span, modes, sum.TTFTP50, sum.TTFTP99, sum.ITLP50, sum.ITLP99, sum.HitRatio, sum.Bypass, sum.Goodput, sum.PrefillUtil, sum.DecodeUtil, sum.Preemptions)
		})
	}
}

// TestReplicasShareState replays the slice through one router replica, four replicas sharing a
// private Redis, and four that do not share: every replica's bookings end freed, and the shared
// replicas route as precisely, and find as many cache hits, as one replica.
func TestReplicasShareState(t *testing.T) {
	reqs := slice(t, 120)
	model := engine.Llama31_8B_H100()
	model.TotalKVBlocks = 9000
	redis := redistest.Start(t)
	tests := []struct {
		name      string
		replicas  int
		redisAddr string
	}{
		{"one replica", 1, ""},
		{"four sharing Redis", 4, redis.Addr},
		{"four not sharing", 4, ""},
	}
	sums := map[string]Summary{}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			res, err := Run(ctx, Config{Model: model, TimeScale: 1, Prefill: 2, Decode: 2, Routing: policy.DefaultConfig(),
				Replicas: tt.replicas, RedisAddr: tt.redisAddr}, reqs)
			if err != nil {
				t.Fatalf("Run() = %v", err)
			}
			if res.Bookings != 0 {
				t.Errorf("%d bookings left over the replicas, want 0", res.Bookings)
			}
			for id, n := range res.EngineBlocks {
				if res.RouterBlocks[id] != n {
					t.Errorf("worker %d: the router holds %d blocks, the engine %d", id, res.RouterBlocks[id], n)
				}
			}
			sums[tt.name] = res.Summarize()
			t.Logf("hit ratio %.4f, precision %.3f, TTFT p50 %v", sums[tt.name].HitRatio, sums[tt.name].Precision, sums[tt.name].TTFTP50)
		})
	}
	one, shared := sums["one replica"], sums["four sharing Redis"]
	if d := shared.HitRatio - one.HitRatio; d < -0.02 || d > 0.02 {
		t.Errorf("hit ratio: one replica %.4f, four sharing %.4f: want within 2 points", one.HitRatio, shared.HitRatio)
	}
	if d := shared.Precision - one.Precision; d < -0.02 || d > 0.02 {
		t.Errorf("routing precision: one replica %.3f, four sharing %.3f: want within 2 points", one.Precision, shared.Precision)
	}
}

// TestReplayIsDeterministic replays a slice twice with a load-aware policy on the simulator's
// default fleet (4 prefill, 4 decode workers), once with the host's cores kept busy: every input
// reaches the router on the virtual clock (events flushed and load reports applied before each
// decision) and the router's tie-breaks draw from the run's seed, so the records are equal to the
// nanosecond. A third run with another seed differs, or the seed would not be what decides.
func TestReplayIsDeterministic(t *testing.T) {
	reqs := slice(t, 300)
	model := engine.Llama31_8B_H100()
	cfg := policy.DefaultConfig()
	cfg.ConditionalDisagg = policy.DefaultCDConfig()
	cfg.ConditionalDisagg.Enabled = true
	busy := 1.0
	cfg.ConditionalDisagg.PrefillBusyThreshold = &busy
	var err error
	if cfg.ConditionalDisagg.Policy, err = policy.LookupCDPolicy("prefill_load"); err != nil {
		t.Fatal(err)
	}
	run := func(seed uint64, hog bool) []Record {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if hog {
			stop := make(chan struct{})
			var wg sync.WaitGroup
			for range runtime.GOMAXPROCS(0) {
				wg.Go(func() {
					for {
						select {
						case <-stop:
							return
						default:
						}
					}
				})
			}
			defer func() { close(stop); wg.Wait() }()
		}
		res, err := Run(ctx, Config{Model: model, TimeScale: 1, Prefill: 4, Decode: 4, Routing: cfg, Seed: seed}, reqs)
		if err != nil {
			t.Fatalf("Run() = %v", err)
		}
		return res.Records
	}
	quiet, busyHost := run(1, false), run(1, true)
	if diff := cmp.Diff(quiet, busyHost); diff != "" {
		t.Errorf("the same replay differs with the host busy (-quiet +busy):\n%s", diff)
	}
	if cmp.Equal(quiet, run(2, false)) {
		t.Errorf("seeds 1 and 2 gave the same records: the tie-breaks do not come from the seed")
	}
}
