package policy_test

// Benchmarks of the routing decision, in the shape: 64 workers (all aggregated, or 16
// prefill + 48 decode), an index of about 1M blocks of 16 tokens, and prompts of 2,048 and 32,768
// tokens that share root prefixes with what is cached. Every Route call is timed on its own, so
// each benchmark reports p50-ns and p99-ns besides the mean ns/op. docs/BENCHMARKS.md records the
// results; scripts/bench.sh runs them. They need -bench: a plain `go test` runs none of this.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
)

const (
	benchModel       = "bench"
	benchBlockSize   = kvtest.BlockSize
	benchWorkers     = 64
	benchIndexBlocks = 1_000_000 // the fill stops once the index holds this many blocks

	// Cached and query prompts both take a uniform 25%..75% prefix of one of benchRoots roots of
	// 32k tokens, then unique blocks; half of the cached prompts are 2k tokens, half 32k.
	benchRoots       = 100
	benchRootBlocks  = 32768 / benchBlockSize
	benchQueries     = 256 // distinct query prompts per length, cycled through
	benchEventBlocks = 128 // blocks per stored event; a prompt's events chain by parent
	benchInFlight    = 128 // bookings alive at once in the booking variants
)

var benchShape = kvtest.Shape{Roots: benchRoots, SharedMin: 0.25, SharedMax: 0.75}

// promptGen makes the benchmarks' prompts (kvtest.Prompts of benchShape) with their blocks'
// hashes: a root's blocks are hashed once.
type promptGen struct {
	*kvtest.Prompts
	salt      uint64
	rootLocal [][]uint64
	rootSeq   [][]uint64
	tokens    []uint32 // scratch
}

func newPromptGen(seed uint64) *promptGen { return newPromptGenRoots(seed, 7, benchRootBlocks) }

// newPromptGenRoots is newPromptGen with roots of rootBlocks blocks (the curves vary the prompt
// length, and the roots with it), its random stream seeded by seed and stream.
func newPromptGenRoots(seed, stream uint64, rootBlocks int) *promptGen {
	g := &promptGen{Prompts: kvtest.NewPrompts(benchShape, rand.New(rand.NewPCG(seed, stream))), salt: blockhash.Salt("", "")}
	for r := range benchRoots {
		local := make([]uint64, rootBlocks)
		for i := range local {
			local[i] = g.localHash(kvtest.RootBlock(r, i))
		}
		g.rootLocal = append(g.rootLocal, local)
		g.rootSeq = append(g.rootSeq, blockhash.Sequence(nil, local))
	}
	return g
}

func (g *promptGen) localHash(id uint64) uint64 {
	g.tokens = kvtest.BlockTokens(g.tokens[:0], id)
	return blockhash.Local(g.tokens, g.salt)
}

// cached draws a prompt of n blocks to cache: its engine-named blocks.
func (g *promptGen) cached(n int) []kvstate.Block {
	return g.appendCached(make([]kvstate.Block, 0, n), n)
}

// appendCached is cached, appending to dst.
func (g *promptGen) appendCached(dst []kvstate.Block, n int) []kvstate.Block {
	root, shared := g.Draw(n)
	seq := uint64(0)
	first := g.NewIDs(n - shared)
	for i := range n {
		var local uint64
		if i < shared {
			local, seq = g.rootLocal[root][i], g.rootSeq[root][i]
		} else {
			local = g.localHash(first + uint64(i-shared))
			seq = blockhash.Chain(seq, local)
		}
		dst = append(dst, kvstate.Block{Hash: ^seq, Local: local}) // the engine's hash: any per-content name
	}
	return dst
}

// query draws a prompt's tokens: a root prefix, then blocks nobody has seen.
func (g *promptGen) query(tokens int) []uint32 {
	n := (tokens + kvtest.BlockSize - 1) / kvtest.BlockSize
	root, shared := g.Draw(n)
	out := make([]uint32, 0, n*kvtest.BlockSize)
	for _, id := range g.IDs(nil, root, shared, n) {
		out = kvtest.BlockTokens(out, id)
	}
	return out[:tokens]
}

// cachedPrompt is one prompt a worker holds, kept to evict it later.
type cachedPrompt struct {
	worker kvstate.WorkerKey
	blocks []kvstate.Block
}

// routeFixture is a fleet with a filled index, a router over it, and query prompts.
type routeFixture struct {
	state   *kvstate.State
	log     *kvstate.MemLog
	router  *app.Dispatcher
	workers []kvstate.WorkerKey
	gen     *promptGen
	queries map[int][][]uint32 // by prompt length in tokens

	mu     sync.Mutex // guards the ingestion bookkeeping below
	live   []cachedPrompt
	nextID map[kvstate.WorkerKey]uint64
}

var (
	fixturesMu sync.Mutex
	fixtures   = map[int]*routeFixture{} // by number of prefill workers
)

// fixture returns the fleet with the given number of prefill workers (the rest decode; 0 makes them
// all aggregated), building it on first use. Fixtures are shared by benchmarks: the booking
// variants free what they book, and ingestion keeps the index at its size.
func fixture(tb testing.TB, prefill int) *routeFixture {
	fixturesMu.Lock()
	defer fixturesMu.Unlock()
	if f := fixtures[prefill]; f != nil {
		return f
	}
	state := kvstate.NewState()
	log := kvstate.NewMemLog(state)
	f := &routeFixture{
		state: state, log: log, router: app.New(state, log, policy.NewKernel(policy.StateView(state), policy.DefaultConfig()), app.Options{}),
		gen: newPromptGen(20261202), queries: map[int][][]uint32{}, nextID: map[kvstate.WorkerKey]uint64{},
	}
	for i := range benchWorkers {
		role := kvstate.RoleAggregated
		if prefill > 0 {
			role = kvstate.RoleDecode
			if i < prefill {
				role = kvstate.RolePrefill
			}
		}
		key := kvstate.WorkerKey{ID: uint64(i) + 1}
		f.workers = append(f.workers, key)
		info := kvstate.WorkerInfo{
			Key: key, Model: benchModel, Role: role, BlockSize: benchBlockSize,
			TotalKVBlocks: 1 << 20, MaxNumBatchedTokens: 8192, KVEventsEnabled: true, SupportsBypass: true,
		}
		if _, err := log.Append(context.Background(), kvstate.WorkerUp{Info: info}); err != nil {
			tb.Fatalf("MemLog.Append(WorkerUp %v) = %v, want nil", key, err)
		}
	}
	ix := state.Model(benchModel).Index
	for i := 0; ix.Len() < benchIndexBlocks; i++ {
		if _, err := f.store(f.nextCached(i)); err != nil {
			tb.Fatal(err)
		}
	}
	for _, tokens := range []int{2048, 32768} {
		for range benchQueries {
			f.queries[tokens] = append(f.queries[tokens], f.gen.query(tokens))
		}
	}
	fixtures[prefill] = f
	return f
}

// nextCached draws the i-th prompt to cache, alternately 2k and 32k tokens, on a random worker.
func (f *routeFixture) nextCached(i int) cachedPrompt {
	n := 2048 / benchBlockSize
	if i%2 == 1 {
		n = 32768 / benchBlockSize
	}
	return cachedPrompt{worker: f.workers[f.gen.Rand.IntN(len(f.workers))], blocks: f.gen.cached(n)}
}

// store applies one prompt as a worker reports it: stored events of benchEventBlocks blocks, each
// chained onto the previous one, in one batch. It returns the blocks applied.
func (f *routeFixture) store(p cachedPrompt) (int, error) {
	var evs []kvstate.Event
	for start := 0; start < len(p.blocks); start += benchEventBlocks {
		ev := kvstate.Event{ID: f.eventID(p.worker), Kind: kvstate.EventStored, Tier: kvstate.TierDevice, Blocks: p.blocks[start:min(start+benchEventBlocks, len(p.blocks))]}
		if start > 0 {
			ev.Parent, ev.HasParent = p.blocks[start-1].Hash, true
		}
		evs = append(evs, ev)
	}
	res, err := f.log.Append(context.Background(), kvstate.KVEvents{Worker: p.worker, Events: evs})
	if err != nil || res.Applied != len(evs) || res.ParentNotFound > 0 {
		return 0, fmt.Errorf("KVEvents for %v: %+v, %v; want every event applied", p.worker, res, err)
	}
	f.live = append(f.live, p)
	return len(p.blocks), nil
}

// evict removes the oldest cached prompt from its worker and returns the blocks it named.
func (f *routeFixture) evict() (int, error) {
	p := f.live[0]
	f.live = f.live[1:]
	hashes := make([]uint64, len(p.blocks))
	for i, b := range p.blocks {
		hashes[i] = b.Hash
	}
	ev := kvstate.Event{ID: f.eventID(p.worker), Kind: kvstate.EventRemoved, Tier: kvstate.TierDevice, Removed: hashes}
	if _, err := f.log.Append(context.Background(), kvstate.KVEvents{Worker: p.worker, Events: []kvstate.Event{ev}}); err != nil {
		return 0, fmt.Errorf("KVEvents removing from %v: %v", p.worker, err)
	}
	return len(hashes), nil
}

func (f *routeFixture) eventID(w kvstate.WorkerKey) uint64 {
	id := f.nextID[w]
	f.nextID[w] = id + 1
	return id
}

// ingest churns the cache until stop closes: every round caches a new prompt and evicts the oldest,
// so the index keeps its size. With a rate, it paces itself to that many block events per second.
// It counts the block events it applied in events.
func (f *routeFixture) ingest(stop <-chan struct{}, rate float64, events *atomic.Int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	start := time.Now()
	for i := 0; ; i++ {
		select {
		case <-stop:
			return nil
		default:
		}
		stored, err := f.store(f.nextCached(i))
		if err != nil {
			return err
		}
		removed, err := f.evict()
		if err != nil {
			return err
		}
		if events.Add(int64(stored + removed)); rate > 0 {
			if ahead := time.Duration(float64(events.Load())/rate*1e9) - time.Since(start); ahead > 0 {
				time.Sleep(ahead) // real time is the point: the benchmark paces ingest at a rate in events/s
			}
		}
	}
}

// percentile returns the q-quantile (nearest rank) of durations; it sorts them in place.
func percentile(d []time.Duration, q float64) time.Duration {
	slices.Sort(d)
	i := int(q*float64(len(d))+0.5) - 1
	return d[min(max(i, 0), len(d)-1)]
}

// topologies are the fleets of the route benchmarks: the number of prefill workers among 64.
var topologies = []struct {
	name    string
	prefill int
}{{"agg64", 0}, {"disagg16p48d", 16}}

// BenchmarkRoute measures app.Dispatcher.Route (the kernel's decision, and its booking) on a
// fleet with about 1M cached blocks, query-only (a preview, nothing booked) and booking (each
// request booked, and freed benchInFlight requests later, so bookings stay alive meanwhile as they
// would in service). p50-ns and p99-ns are of the
// Route call alone; ns/op also includes the Free of the booking variant.
func BenchmarkRoute(b *testing.B) {
	for _, topo := range topologies {
		for _, tokens := range []int{2048, 32768} {
			for _, book := range []bool{false, true} {
				mode := map[bool]string{false: "query", true: "book"}[book]
				b.Run(fmt.Sprintf("fleet=%s/tokens=%dk/mode=%s", topo.name, tokens/1024, mode), func(b *testing.B) {
					f := fixture(b, topo.prefill)
					benchRoute(b, f, f.router, tokens, book)
				})
			}
		}
	}
}

// BenchmarkRouteConditionalDisagg compares Route on the disaggregated fleet with conditional
// disaggregation off (plain disaggregation) and on. With isl_or_load and a prefill busy threshold the
// decision previews both pools before the real selection: the most work conditional disaggregation
// adds. The target: p99 with it on within 1.5x of plain disaggregation.
func BenchmarkRouteConditionalDisagg(b *testing.B) {
	f := fixture(b, topologies[1].prefill)
	on := policy.DefaultConfig()
	on.ConditionalDisagg.Enabled, on.ConditionalDisagg.Policy = true, policy.ISLOrLoad
	threshold := 1.0
	on.ConditionalDisagg.PrefillBusyThreshold = &threshold
	routers := map[string]*app.Dispatcher{
		"off": app.New(f.state, f.log, policy.NewKernel(policy.StateView(f.state), policy.DefaultConfig()), app.Options{}),
		"on":  app.New(f.state, f.log, policy.NewKernel(policy.StateView(f.state), on), app.Options{}),
	}
	for _, tokens := range []int{2048, 32768} {
		for _, book := range []bool{false, true} {
			for _, cd := range []string{"off", "on"} {
				mode := map[bool]string{false: "query", true: "book"}[book]
				b.Run(fmt.Sprintf("tokens=%dk/mode=%s/cd=%s", tokens/1024, mode, cd), func(b *testing.B) {
					benchRoute(b, f, routers[cd], tokens, book)
				})
			}
		}
	}
}

// BenchmarkRouteUnderIngestion is BenchmarkRoute (aggregated fleet, query-only) while another
// goroutine applies KV events through the log: a new prompt cached and the oldest evicted, over
// and over, either flat out ("max") or paced at 200k block events/s (a busy fleet: 64 workers each
// storing and evicting about 1,600 blocks, 25k tokens, a second) or 1M (the bound: Route
// p99 must stay within twice its idle value).
func BenchmarkRouteUnderIngestion(b *testing.B) {
	for _, tokens := range []int{2048, 32768} {
		for _, rate := range []float64{200_000, 1_000_000, 0} {
			name := "max"
			if rate > 0 {
				name = fmt.Sprintf("%.0fk", rate/1e3)
			}
			b.Run(fmt.Sprintf("tokens=%dk/ingest=%s", tokens/1024, name), func(b *testing.B) {
				f := fixture(b, 0)
				stop, done := make(chan struct{}), make(chan struct{})
				var (
					events    atomic.Int64
					ingestErr error
				)
				go func() {
					defer close(done)
					ingestErr = f.ingest(stop, rate, &events)
				}()
				start := time.Now()
				benchRoute(b, f, f.router, tokens, false)
				close(stop)
				<-done
				if ingestErr != nil {
					b.Fatal(ingestErr)
				}
				b.ReportMetric(float64(events.Load())/time.Since(start).Seconds(), "ingest-block-events/s")
			})
		}
	}
}

// benchRoute routes the fixture's query prompts of the given length, timing every call.
func benchRoute(b *testing.B, f *routeFixture, router *app.Dispatcher, tokens int, book bool) {
	queries := f.queries[tokens]
	ids := make([]string, 4*benchInFlight)
	for i := range ids {
		ids[i] = fmt.Sprintf("bench-%d", i)
	}
	var (
		ctx    = context.Background()
		durs   = make([]time.Duration, 0, 1<<16)
		booked []string
	)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		req := &app.Request{Request: policy.Request{Model: benchModel, Tokens: queries[i%len(queries)], QueryOnly: !book}}
		if book {
			req.ID = ids[i%len(ids)]
		}
		start := time.Now()
		_, err := router.Route(ctx, req)
		durs = append(durs, time.Since(start))
		if err != nil {
			b.Fatalf("Route(%d tokens) = %v, want nil", tokens, err)
		}
		if book {
			if booked = append(booked, req.ID); len(booked) > benchInFlight {
				free(b, f, booked[0])
				booked = booked[1:]
			}
		}
		i++
	}
	for _, id := range booked {
		free(b, f, id)
	}
	b.ReportMetric(float64(percentile(durs, 0.50).Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(percentile(durs, 0.99).Nanoseconds()), "p99-ns")
	b.ReportMetric(float64(f.state.Model(benchModel).Index.Len()), "index-blocks")
}

func free(b *testing.B, f *routeFixture, id string) {
	if _, err := f.log.Append(context.Background(), kvstate.Freed{RequestID: id}); err != nil {
		b.Fatalf("MemLog.Append(Freed %q) = %v, want nil", id, err)
	}
}
