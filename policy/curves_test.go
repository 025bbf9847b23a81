package policy_test

// Scaling curves of the routing decision (issue 12, item 4 a-c): Route latency against prompt
// length, number of workers and index size, one variable at a time around the shape (64
// workers, about 1M blocks, 2,048-token prompts). Each point builds its own fleet, times every
// Route call on its own, and prints one Go-benchmark line per round and mode, so that
// scripts/summarize.awk, benchstat and cmd/kvcurves read them. Run them with scripts/bench.sh curves,
// or:
//
//	KVROUTER_CURVES=1 go test -run 'TestRouteCurves/tokens' -count=1 -v -timeout 30m ./policy
//
// Without KVROUTER_CURVES the test is skipped: a plain `go test` runs none of this.

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
)

// curveCenter is the point every curve passes through: the shape. Each curve varies one of
// its three coordinates.
var curveCenter = curvePoint{workers: 64, blocks: 1_000_000, tokens: 2048}

// The default points of each curve; KVROUTER_CURVE_TOKENS, KVROUTER_CURVE_WORKERS and
// KVROUTER_CURVE_BLOCKS (comma-separated, with k and M suffixes) replace them.
var (
	curveTokens  = []int{1 << 10, 2 << 10, 4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10}
	curveWorkers = []int{8, 16, 32, 64, 128, 256, 512, 1024}
	curveBlocks  = []int{10_000, 100_000, 1_000_000, 5_000_000, 20_000_000}
)

// curvePoint is one fleet of a curve: how many aggregated workers, how many distinct blocks the
// index holds (the fill stops once it holds this many), and the length of the cached and routed
// prompts in tokens.
type curvePoint struct{ workers, blocks, tokens int }

// curveFleet is a filled fleet with its router and query prompts.
type curveFleet struct {
	curvePoint
	state   *kvstate.State
	log     *kvstate.MemLog
	router  *app.Dispatcher
	queries [][]uint32
	walk    float64 // mean over the queries of the deepest cached prefix any worker holds, in blocks
	built   time.Duration
}

// TestRouteCurves measures the decision latency curves (see the file comment). Every point's
// fleet is built the same way (newCurveFleet), so the three curves cross at curveCenter and differ
// from it in one coordinate only.
func TestRouteCurves(t *testing.T) {
	if os.Getenv("KVROUTER_CURVES") == "" {
		t.Skip("set KVROUTER_CURVES=1 to run the routing scaling curves (minutes, up to 4 GB of heap)")
	}
	rounds := envInt(t, "KVROUTER_CURVE_ROUNDS", 3)
	per := envDuration(t, "KVROUTER_CURVE_TIME", 500*time.Millisecond)
	// The center's fleet is kept for the three curves that cross it; any other fleet is let go
	// before the next is built, so that only one large index is in memory at a time.
	var center *curveFleet
	run := func(t *testing.T, curve, x string, p curvePoint) {
		cur := center
		if p != curveCenter || center == nil {
			runtime.GC()
			cur = newCurveFleet(t, p)
			if p == curveCenter {
				center = cur
			}
		}
		for round := range rounds {
			for _, book := range []bool{false, true} {
				measureCurvePoint(t, cur, fmt.Sprintf("CurveRoute/curve=%s/%s/mode=%s", curve, x, modeName(book)), book, per, round)
			}
		}
	}
	t.Run("tokens", func(t *testing.T) {
		for _, n := range envPoints(t, "KVROUTER_CURVE_TOKENS", curveTokens) {
			p := curveCenter
			p.tokens = n
			run(t, "tokens", fmt.Sprintf("tokens=%d", n), p)
		}
	})
	t.Run("workers", func(t *testing.T) {
		for _, n := range envPoints(t, "KVROUTER_CURVE_WORKERS", curveWorkers) {
			p := curveCenter
			p.workers = n
			run(t, "workers", fmt.Sprintf("workers=%d", n), p)
		}
	})
	t.Run("index", func(t *testing.T) {
		for _, n := range envPoints(t, "KVROUTER_CURVE_BLOCKS", curveBlocks) {
			p := curveCenter
			p.blocks = n
			run(t, "index", fmt.Sprintf("blocks=%d", n), p)
		}
	})
}

func modeName(book bool) string { return map[bool]string{false: "query", true: "book"}[book] }

// newCurveFleet builds the fleet of point p. Prompts are p.tokens long, in 16-token blocks, and
// take a uniform 25-75% prefix of one of 100 roots as long as the prompt (system prompts), then
// blocks nobody has seen: the cached ones on a random worker, the routed ones unseen anywhere. So
// a routed prompt's cached prefix grows with its length, and every stage of the decision (hashing,
// the index walk, the active-load walk, booking) has work proportional to the prompt, as it would
// in service. The index is filled through MemLog.Append(KVEvents), as workers report: each cached
// prompt is one batch of stored events of 128 blocks chained by parent.
func newCurveFleet(t *testing.T, p curvePoint) *curveFleet {
	t.Helper()
	start := time.Now()
	state := kvstate.NewState()
	log := kvstate.NewMemLog(state)
	f := &curveFleet{curvePoint: p, state: state, log: log,
		router: app.New(state, log, policy.NewKernel(policy.StateView(state), policy.DefaultConfig()), app.Options{})}
	ctx := context.Background()
	workers := make([]kvstate.WorkerKey, p.workers)
	for i := range workers {
		workers[i] = kvstate.WorkerKey{ID: uint64(i) + 1}
		info := kvstate.WorkerInfo{
			Key: workers[i], Model: benchModel, Role: kvstate.RoleAggregated, BlockSize: benchBlockSize,
			TotalKVBlocks: 1 << 20, MaxNumBatchedTokens: 8192, KVEventsEnabled: true,
		}
		if _, err := log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
			t.Fatalf("MemLog.Append(WorkerUp %v) = %v, want nil", workers[i], err)
		}
	}
	n := p.tokens / benchBlockSize
	g := newPromptGenRoots(uint64(p.tokens)^uint64(p.workers)<<32, 12, n)
	nextEvent := make([]uint64, p.workers)
	ix := state.Model(benchModel).Index
	var blocks []kvstate.Block
	for ix.Len() < p.blocks {
		w := g.Rand.IntN(p.workers)
		blocks = g.appendCached(blocks[:0], n)
		var evs []kvstate.Event
		for s := 0; s < len(blocks); s += benchEventBlocks {
			ev := kvstate.Event{ID: nextEvent[w], Kind: kvstate.EventStored, Tier: kvstate.TierDevice, Blocks: blocks[s:min(s+benchEventBlocks, len(blocks))]}
			if s > 0 {
				ev.Parent, ev.HasParent = blocks[s-1].Hash, true
			}
			nextEvent[w]++
			evs = append(evs, ev)
		}
		res, err := log.Append(ctx, kvstate.KVEvents{Worker: workers[w], Events: evs})
		if err != nil || res.Applied != len(evs) || res.ParentNotFound > 0 {
			t.Fatalf("KVEvents for %v: %+v, %v; want every event applied", workers[w], res, err)
		}
	}
	// Distinct query prompts cycled through: 256, fewer for long prompts (at most 16M tokens).
	nq := min(256, max(32, (16<<20)/p.tokens))
	var (
		o      kvstate.Overlaps
		walked int
	)
	for range nq {
		q := g.query(n * benchBlockSize)
		f.queries = append(f.queries, q)
		ix.Overlaps(blockhash.Sequence(nil, blockhash.Locals(nil, q, benchBlockSize, g.salt)), &o)
		deepest := uint32(0)
		for _, w := range workers {
			deepest = max(deepest, o.Depths(state.Worker(w).Slot)[kvstate.TierDevice])
		}
		walked += int(deepest)
	}
	f.walk = float64(walked) / float64(nq)
	f.built = time.Since(start)
	t.Logf("fleet %d workers, %d-token prompts: %d blocks, built in %v", p.workers, p.tokens, ix.Len(), f.built.Round(time.Millisecond))
	return f
}

// measureCurvePoint routes f's query prompts for at least per (and at least 200 calls), timing
// every call, and prints one benchmark line: p50 and p99 of Route (in booking mode, each request is
// booked and freed benchInFlight requests later, as in BenchmarkRoute; the Free is not timed), the
// mean, the mean deepest cached prefix of the queries (walk-blocks: how far the index walk goes)
// and the mean cached prefix of the chosen worker (chosen-overlap-blocks).
func measureCurvePoint(t *testing.T, f *curveFleet, name string, book bool, per time.Duration, round int) {
	t.Helper()
	ctx := context.Background()
	var (
		durs    []time.Duration
		booked  []string
		total   time.Duration
		overlap uint64 // the chosen workers' cached prefixes, in blocks
	)
	start := time.Now()
	for i := 0; i < 200 || time.Since(start) < per; i++ {
		req := &app.Request{Request: policy.Request{Model: benchModel, Tokens: f.queries[i%len(f.queries)], QueryOnly: !book}}
		if book {
			req.ID = fmt.Sprintf("curve-%d-%d", round, i)
		}
		t0 := time.Now()
		dec, err := f.router.Route(ctx, req)
		d := time.Since(t0)
		if err != nil {
			t.Fatalf("Route(%d tokens) = %v, want nil", f.tokens, err)
		}
		durs, total = append(durs, d), total+d
		overlap += dec.Decode.Overlap[kvstate.TierDevice]
		if book {
			if booked = append(booked, req.ID); len(booked) > benchInFlight {
				f.free(t, booked[0])
				booked = booked[1:]
			}
		}
	}
	for _, id := range booked {
		f.free(t, id)
	}
	n := len(durs)
	curveLine(name, n,
		kvtest.Percentile(durs, 0.50).Nanoseconds(), "p50-ns", kvtest.Percentile(durs, 0.99).Nanoseconds(), "p99-ns",
		total.Nanoseconds()/int64(n), "ns/op", f.state.Model(benchModel).Index.Len(), "index-blocks",
		fmt.Sprintf("%.1f", f.walk), "walk-blocks", fmt.Sprintf("%.1f", float64(overlap)/float64(n)), "chosen-overlap-blocks")
}

func (f *curveFleet) free(t *testing.T, id string) {
	if _, err := f.log.Append(context.Background(), kvstate.Freed{RequestID: id}); err != nil {
		t.Fatalf("MemLog.Append(Freed %q) = %v, want nil", id, err)
	}
}

// curveLine prints one result in Go's benchmark format (name, iterations, then value-unit pairs),
// so that benchstat, scripts/summarize.awk and cmd/kvcurves read the curves like Go benchmarks.
func curveLine(name string, n int, metrics ...any) {
	line := fmt.Sprintf("Benchmark%s \t%d", name, n)
	for i := 0; i+1 < len(metrics); i += 2 {
		line += fmt.Sprintf(" \t%v %s", metrics[i], metrics[i+1])
	}
	fmt.Println(line)
}

func envInt(t *testing.T, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q: want a positive integer", name, s)
	}
	return n
}

func envDuration(t *testing.T, name string, def time.Duration) time.Duration {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		t.Fatalf("%s=%q: want a duration", name, s)
	}
	return d
}

// envPoints returns the points a curve's environment variable lists (comma-separated integers,
// with k = 1,000 and M = 1,000,000 suffixes; for tokens, 1k means 1,024), or def without one.
func envPoints(t *testing.T, name string, def []int) []int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	k := 1000
	if strings.HasSuffix(name, "TOKENS") {
		k = 1024
	}
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		mult := 1
		switch {
		case strings.HasSuffix(f, "k"):
			f, mult = strings.TrimSuffix(f, "k"), k
		case strings.HasSuffix(f, "M"):
			f, mult = strings.TrimSuffix(f, "M"), k*k
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			t.Fatalf("%s=%q: want comma-separated positive integers (k and M suffixes allowed)", name, s)
		}
		out = append(out, n*mult)
	}
	return out
}
