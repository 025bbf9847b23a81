package kvstate_test

// Benchmarks of hashing, event ingestion and the prefix index, in the shape of the issue (64
// workers, 16-token blocks, an index of about 1M blocks) and of the peers' index benchmark (the
// harness that measures llm-d's and AIBrix's indexes beside this one, kept outside the repository).
// docs/BENCHMARKS.md records the results and the
// commands; scripts/bench.sh runs them.
//
// A plain `go test` runs only TestBatchedProbesMatchModel (milliseconds): the Go benchmarks need
// -bench, and TestPeerIndexBench, which builds 1M-block indexes, needs KVROUTER_PEER_BENCH=1.

import (
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

const (
	peerInsertRun = 10_000 // prompts inserted into an empty index
	peerLookups   = 10_000 // lookups per query shape
	peerHashCalls = 2_000  // hashing-only calls
)

// indexPairs counts (block, worker) entries: every pod's blocks, summed over tiers.
func indexPairs(ix *kvstate.Index) uint64 {
	var n uint64
	for pod := range uint32(kvtest.Pods) {
		n += ix.BlockCounts(pod).Total()
	}
	return n
}

// benchLine prints one result in Go's benchmark format, so that benchstat can take medians over
// runs of TestPeerIndexBench just as it does for the Go benchmarks.
func benchLine(name string, n int, metrics ...any) {
	line := fmt.Sprintf("Benchmark%s \t%d", name, n)
	for i := 0; i+1 < len(metrics); i += 2 {
		line += fmt.Sprintf(" \t%v %s", metrics[i], metrics[i+1])
	}
	fmt.Println(line)
}

func micros(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/1e3) }

// TestPeerIndexBench measures the index on the peers' workload (peer-index-bench.md, "Workload
// shape"): the insert run (10,000 prompts of 512 blocks into an empty index, each Index.Store call
// timed on its own) and the lookup run (a 4,000-prompt fill, its heap cost, then 10,000 "hit" and
// 10,000 "partial" lookups timed one by one, without and with hashing from tokens). Run it with
// scripts/bench.sh, or:
//
//	KVROUTER_PEER_BENCH=1 go test -run 'TestPeerIndexBench/lookup' -count=1 -v ./kvstate
func TestPeerIndexBench(t *testing.T) {
	if os.Getenv("KVROUTER_PEER_BENCH") == "" {
		t.Skip("set KVROUTER_PEER_BENCH=1 to run the peer-shape index benchmark (about 30 s, 1 GB of heap)")
	}
	t.Run("insert", peerInsert)
	t.Run("lookup", peerLookup)
}

// peerInsert is the insert run: Index.Store of one 512-block chain for one pod per call, hashing
// excluded (local hashes precomputed; the chaining of sequence hashes is inside Store).
func peerInsert(t *testing.T) {
	w := kvtest.NewWorkload(kvtest.Seed)
	prompts := make([]*kvtest.Prompt, peerInsertRun)
	for i := range prompts {
		prompts[i] = w.Next()
	}
	buf := make([]kvstate.Block, 0, kvtest.PromptBlocks)
	durs := make([]time.Duration, len(prompts))
	ix := kvstate.NewIndex()
	base := kvtest.HeapAlloc()
	var total time.Duration
	for i, p := range prompts {
		buf = w.Blocks(p, buf[:0])
		start := time.Now()
		_, err := ix.Store(p.Pod, kvstate.TierDevice, 0, false, buf)
		durs[i] = time.Since(start)
		if err != nil {
			t.Fatalf("Index.Store(prompt %d) = %v, want nil", i, err)
		}
		total += durs[i]
	}
	heap := kvtest.HeapAlloc() - base
	blocks, pairs := ix.Len(), indexPairs(ix)
	inserted := len(prompts) * kvtest.PromptBlocks
	p50, p99 := kvtest.Percentile(durs, 0.50), kvtest.Percentile(durs, 0.99)
	t.Logf("insert run: %d prompts, %d block inserts in %v: %.0f blocks/s, %.0f ns/block; per call p50 %s µs, p99 %s µs",
		len(prompts), inserted, total, float64(inserted)/total.Seconds(), float64(total)/float64(inserted), micros(p50), micros(p99))
	t.Logf("after the insert run: %d blocks, %d (block, pod) pairs, heap %.1f MB: %.1f B/pair, %.1f B/block",
		blocks, pairs, float64(heap)/1e6, float64(heap)/float64(pairs), float64(heap)/float64(blocks))
	benchLine("PeerInsert/hashing=excluded", len(prompts),
		fmt.Sprintf("%.0f", float64(inserted)/total.Seconds()), "blocks/s",
		fmt.Sprintf("%.1f", float64(total)/float64(inserted)), "ns/block",
		p50.Nanoseconds(), "p50-ns", p99.Nanoseconds(), "p99-ns")
	benchLine("PeerMemory/run=insert", len(prompts), blocks, "blocks", pairs, "pairs",
		fmt.Sprintf("%.1f", float64(heap)/1e6), "heap-MB",
		fmt.Sprintf("%.1f", float64(heap)/float64(pairs)), "B/pair", fmt.Sprintf("%.1f", float64(heap)/float64(blocks)), "B/block")
	runtime.KeepAlive(prompts)
}

// peerLookup is the lookup run: fill, memory, then the timed lookups.
func peerLookup(t *testing.T) {
	w := kvtest.NewWorkload(kvtest.Seed)
	fill := make([]*kvtest.Prompt, kvtest.Fill)
	for i := range fill {
		fill[i] = w.Next()
	}
	buf := make([]kvstate.Block, 0, kvtest.PromptBlocks)
	empty := kvtest.HeapAlloc()
	ix := kvstate.NewIndex()
	base := kvtest.HeapAlloc()
	for i, p := range fill {
		if _, err := ix.Store(p.Pod, kvstate.TierDevice, 0, false, w.Blocks(p, buf[:0])); err != nil {
			t.Fatalf("Index.Store(prompt %d) = %v, want nil", i, err)
		}
	}
	heap := kvtest.HeapAlloc() - base
	blocks, pairs := ix.Len(), indexPairs(ix)
	t.Logf("lookup fill: %d prompts: %d blocks, %d (block, pod) pairs (peers: 1,060,377 and 1,816,993); heap %.1f MB: %.1f B/pair, %.1f B/block; empty index %d B",
		len(fill), blocks, pairs, float64(heap)/1e6, float64(heap)/float64(pairs), float64(heap)/float64(blocks), int64(base)-int64(empty))
	benchLine("PeerMemory/run=lookup-fill", len(fill), blocks, "blocks", pairs, "pairs",
		fmt.Sprintf("%.1f", float64(heap)/1e6), "heap-MB",
		fmt.Sprintf("%.1f", float64(heap)/float64(pairs)), "B/pair", fmt.Sprintf("%.1f", float64(heap)/float64(blocks)), "B/block")

	rng := rand.New(rand.NewPCG(kvtest.Seed, 2))
	var (
		o      kvstate.Overlaps
		seq    []uint64
		tokens []uint32
		local  []uint64
		durs   = make([]time.Duration, peerLookups)
	)
	// query returns the next query prompt of a shape: a stored prompt (every block present) or a
	// new prompt sharing a root prefix, with an unseen suffix.
	query := func(shape string) *kvtest.Prompt {
		if shape == "hit" {
			return fill[rng.IntN(len(fill))]
		}
		return w.Next()
	}
	// check verifies one lookup's answer: a hit overlaps fully on its own pod; no pod overlaps a
	// partial query beyond its shared root prefix.
	check := func(shape string, p *kvtest.Prompt) {
		best := uint32(0)
		for pod := range uint32(kvtest.Pods) {
			best = max(best, o.Depths(pod)[kvstate.TierDevice])
		}
		if shape == "hit" && o.Depths(p.Pod)[kvstate.TierDevice] != kvtest.PromptBlocks || shape == "partial" && best > uint32(p.Shared) {
			t.Fatalf("%s lookup: pod %d overlap %d, best %d (shared prefix %d)", shape, p.Pod, o.Depths(p.Pod)[kvstate.TierDevice], best, p.Shared)
		}
	}
	for _, hashing := range []bool{false, true} {
		for _, shape := range []string{"hit", "partial"} {
			var total time.Duration
			for i := range durs {
				p := query(shape)
				if hashing {
					tokens = w.Tokens(p, tokens[:0])
					start := time.Now()
					local = blockhash.Locals(local[:0], tokens, kvtest.BlockSize, w.Salt())
					seq = blockhash.Sequence(seq[:0], local)
					ix.Overlaps(seq, &o)
					durs[i] = time.Since(start)
				} else {
					seq = w.SeqHashes(p, seq[:0])
					start := time.Now()
					ix.Overlaps(seq, &o)
					durs[i] = time.Since(start)
				}
				total += durs[i]
				check(shape, p)
			}
			p50, p99 := kvtest.Percentile(durs, 0.50), kvtest.Percentile(durs, 0.99)
			mode := map[bool]string{false: "excluded", true: "included"}[hashing]
			t.Logf("lookup %-7s hashing %s: p50 %s µs, p99 %s µs, %.0f ns/block (p50/512), mean %s µs",
				shape, mode, micros(p50), micros(p99), float64(p50)/kvtest.PromptBlocks, micros(total/time.Duration(len(durs))))
			benchLine(fmt.Sprintf("PeerLookup/shape=%s/hashing=%s", shape, mode), len(durs),
				p50.Nanoseconds(), "p50-ns", p99.Nanoseconds(), "p99-ns", fmt.Sprintf("%.1f", float64(p50)/kvtest.PromptBlocks), "ns/block")
		}
	}

	// Hashing alone: 8,192 tokens to 512 sequence hashes, as the peers timed llm-d's and AIBrix's.
	hd := durs[:peerHashCalls]
	for i := range hd {
		tokens = w.Tokens(fill[rng.IntN(len(fill))], tokens[:0])
		start := time.Now()
		local = blockhash.Locals(local[:0], tokens, kvtest.BlockSize, w.Salt())
		seq = blockhash.Sequence(seq[:0], local)
		hd[i] = time.Since(start)
	}
	p50 := kvtest.Percentile(hd, 0.50)
	t.Logf("hashing 8,192 tokens to 512 sequence hashes: p50 %s µs, %.1f ns/block", micros(p50), float64(p50)/kvtest.PromptBlocks)
	benchLine("PeerHash/tokens=8192", len(hd), p50.Nanoseconds(), "p50-ns", fmt.Sprintf("%.1f", float64(p50)/kvtest.PromptBlocks), "ns/block")
	runtime.KeepAlive(fill)
}

// BenchmarkHash measures hashing a prompt: local block hashes and chained sequence hashes, block
// size 16, for the two prompt lengths.
func BenchmarkHash(b *testing.B) {
	for _, n := range []int{2048, 32768} {
		b.Run(fmt.Sprintf("tokens=%dk", n/1024), func(b *testing.B) {
			w := kvtest.NewWorkload(kvtest.Seed)
			tokens := make([]uint32, 0, n)
			for id := uint64(0); len(tokens) < n; id++ {
				tokens = kvtest.BlockTokens(tokens, id)
			}
			var local, seq []uint64
			b.SetBytes(int64(4 * n))
			b.ReportAllocs()
			for b.Loop() {
				local = blockhash.Locals(local[:0], tokens, kvtest.BlockSize, w.Salt())
				seq = blockhash.Sequence(seq[:0], local)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/token")
		})
	}
}

// benchState returns a state with benchWorkers aggregated workers of benchModel registered.
func benchState(tb testing.TB) *kvstate.State {
	s := kvstate.NewState()
	for pod := range uint32(kvtest.Workers) {
		info := kvstate.WorkerInfo{Key: kvtest.WorkerKey(pod), Model: kvtest.Model, Role: kvstate.RoleAggregated, BlockSize: kvtest.BlockSize, TotalKVBlocks: 1 << 20, KVEventsEnabled: true}
		if _, err := s.Apply(kvstate.WorkerUp{Info: info}); err != nil {
			tb.Fatalf("State.Apply(WorkerUp %v) = %v, want nil", info.Key, err)
		}
	}
	return s
}

// eventApplier applies prompts' events in order, numbering each worker's events.
type eventApplier struct {
	tb     testing.TB
	state  *kvstate.State
	nextID map[kvstate.WorkerKey]uint64
}

func (a *eventApplier) apply(worker kvstate.WorkerKey, evs []kvstate.Event) kvstate.Result {
	for i := range evs {
		evs[i].ID = a.nextID[worker]
		a.nextID[worker]++
	}
	res, err := a.state.Apply(kvstate.KVEvents{Worker: worker, Events: evs})
	if err != nil || res.Applied != len(evs) || res.ParentNotFound+res.InvalidSequence > 0 || res.Gap {
		a.tb.Fatalf("State.Apply(KVEvents for %v) = %+v, %v; want every event applied", worker, res, err)
	}
	return res
}

// BenchmarkApply measures KV-event ingestion on one goroutine (so per core), in steady state at
// about 1M blocks: block-events/s counts stored and removed blocks over the whole loop.
func BenchmarkApply(b *testing.B) {
	ring := kvtest.ApplyPrompts()
	a := &eventApplier{tb: b, state: benchState(b), nextID: make(map[kvstate.WorkerKey]uint64)}
	for i := range kvtest.Live {
		a.apply(ring[i].Worker, ring[i].Stored)
	}
	var (
		storeTime, removeTime time.Duration
		stored, removed       int
		i                     int
	)
	b.ReportAllocs()
	for b.Loop() {
		in, out := &ring[(kvtest.Live+i)%len(ring)], &ring[i%len(ring)]
		t0 := time.Now()
		a.apply(in.Worker, in.Stored)
		t1 := time.Now()
		res := a.apply(out.Worker, out.Removed)
		t2 := time.Now()
		storeTime, removeTime = storeTime+t1.Sub(t0), removeTime+t2.Sub(t1)
		stored += kvtest.PromptBlocks
		removed += len(out.Removed[0].Removed) - res.UnknownRemoved
		i++
	}
	events := stored + removed
	b.ReportMetric(float64(events)/b.Elapsed().Seconds(), "block-events/s")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(events), "ns/block-event")
	b.ReportMetric(float64(stored)/storeTime.Seconds(), "stored-blocks/s")
	b.ReportMetric(float64(removed)/removeTime.Seconds(), "removed-blocks/s")
	b.ReportMetric(float64(a.state.Model(kvtest.Model).Index.Len()), "index-blocks")
}

// TestBatchedProbesMatchModel guards the batched map probes of Index.Store, Index.Overlaps and
// Load (see probeBatch in index.go): chains of every length around the batch size are stored,
// removed, booked and freed at random, and every overlap must equal a plain model's: a worker's
// depth is the number of leading sequence hashes it holds.
func TestBatchedProbesMatchModel(t *testing.T) {
	const workers, rounds = 6, 400
	rng := rand.New(rand.NewPCG(1, 2))
	s := kvstate.NewState()
	for w := range uint32(workers) {
		info := kvstate.WorkerInfo{Key: kvtest.WorkerKey(w), Model: kvtest.Model, Role: kvstate.RoleAggregated, BlockSize: kvtest.BlockSize, KVEventsEnabled: true}
		if _, err := s.Apply(kvstate.WorkerUp{Info: info}); err != nil {
			t.Fatal(err)
		}
	}
	ix := s.Model(kvtest.Model).Index
	slots := make([]uint32, workers)
	for w := range slots {
		slots[w] = s.Worker(kvtest.WorkerKey(uint32(w))).Slot
	}
	// Prompts are paths in a small tree of local hashes (3 choices per block), so they share
	// prefixes of every length.
	prompt := func() []uint64 {
		local := make([]uint64, 1+rng.IntN(40))
		for i := range local {
			local[i] = uint64(1 + rng.IntN(3))
		}
		return blockhash.Sequence(nil, local)
	}
	local := func(seq []uint64) []uint64 { // recovers local hashes from the tree's 3 choices
		out := make([]uint64, len(seq))
		for i := range seq {
			for l := uint64(1); l <= 3; l++ {
				if i == 0 && l == seq[0] || i > 0 && blockhash.Chain(seq[i-1], l) == seq[i] {
					out[i] = l
				}
			}
		}
		return out
	}
	held := make([]map[uint64]bool, workers)  // the model of the index
	active := make([]map[uint64]int, workers) // the model of Load's active blocks
	for w := range held {
		held[w], active[w] = map[uint64]bool{}, map[uint64]int{}
	}
	nextEvent := make([]uint64, workers)
	var bookings []string
	bookedBy := map[string]struct {
		w    int
		keys []uint64
	}{}
	apply := func(c kvstate.Change) {
		t.Helper()
		if _, err := s.Apply(c); err != nil {
			t.Fatalf("State.Apply(%T) = %v", c, err)
		}
	}
	var o kvstate.Overlaps
	for round := range rounds {
		w := rng.IntN(workers)
		key := kvtest.WorkerKey(uint32(w))
		seq := prompt()
		switch op := rng.IntN(4); op {
		case 0: // store the prompt, continuing a held prefix when there is one
			start := 0
			for start < len(seq) && held[w][seq[start]] {
				start++
			}
			start = rng.IntN(start + 1)
			if start == len(seq) {
				continue
			}
			ev := kvstate.Event{ID: nextEvent[w], Kind: kvstate.EventStored, Tier: kvstate.TierDevice}
			if start > 0 {
				ev.Parent, ev.HasParent = seq[start-1]^kvtest.EngineTag, true
			}
			for i, l := range local(seq)[start:] {
				ev.Blocks = append(ev.Blocks, kvstate.Block{Hash: seq[start+i] ^ kvtest.EngineTag, Local: l})
				held[w][seq[start+i]] = true
			}
			nextEvent[w]++
			apply(kvstate.KVEvents{Worker: key, Events: []kvstate.Event{ev}})
		case 1: // remove a random suffix of the prompt's blocks
			from := rng.IntN(len(seq))
			ev := kvstate.Event{ID: nextEvent[w], Kind: kvstate.EventRemoved, Tier: kvstate.TierDevice}
			for _, h := range seq[from:] {
				ev.Removed = append(ev.Removed, h^kvtest.EngineTag)
				delete(held[w], h)
			}
			nextEvent[w]++
			apply(kvstate.KVEvents{Worker: key, Events: []kvstate.Event{ev}})
		case 2: // book the prompt's blocks
			id := fmt.Sprintf("r%d", round)
			apply(kvstate.Booked{Booking: kvstate.Booking{RequestID: id, Hops: []kvstate.HopBooking{{Worker: key, Blocks: seq}}}})
			for _, h := range seq {
				active[w][h]++
			}
			bookings = append(bookings, id)
			bookedBy[id] = struct {
				w    int
				keys []uint64
			}{w, seq}
		case 3: // free a random booking
			if len(bookings) == 0 {
				continue
			}
			i := rng.IntN(len(bookings))
			id := bookings[i]
			bookings = slices.Delete(bookings, i, i+1)
			apply(kvstate.Freed{RequestID: id})
			b := bookedBy[id]
			for _, h := range b.keys {
				if active[b.w][h]--; active[b.w][h] == 0 {
					delete(active[b.w], h)
				}
			}
		}
		q := prompt()
		ix.Overlaps(q, &o)
		for w := range workers {
			want := 0
			for want < len(q) && held[w][q[want]] {
				want++
			}
			if got := o.Depths(slots[w])[kvstate.TierDevice]; int(got) != want {
				t.Fatalf("round %d: Index.Overlaps: worker %d depth %d, want %d", round, w, got, want)
			}
		}
		s.Load().ActiveDepths(q, &o)
		for w := range workers {
			want := 0
			for want < len(q) && active[w][q[want]] > 0 {
				want++
			}
			if got := o.Depths(slots[w])[kvstate.TierDevice]; int(got) != want {
				t.Fatalf("round %d: Load.ActiveDepths: worker %d depth %d, want %d", round, w, got, want)
			}
		}
	}
}

// BenchmarkSnapshot measures a snapshot of the state BenchmarkApply fills (about 1.06M blocks over 64
// workers) in its two steps: Freeze, the part that holds the state still (its copy of the index is
// what a replica's local bookings wait for), and Encode, which holds nothing; then Restore, what a
// replica's cold start pays.
func BenchmarkSnapshot(b *testing.B) {
	ring := kvtest.ApplyPrompts()
	a := &eventApplier{tb: b, state: benchState(b), nextID: make(map[kvstate.WorkerKey]uint64)}
	for i := range kvtest.Live {
		a.apply(ring[i].Worker, ring[i].Stored)
	}
	var freeze, encode, restore time.Duration
	var size int
	for b.Loop() {
		t0 := time.Now()
		f := a.state.Freeze(kvstate.SnapshotHeader{Position: "1-0"})
		t1 := time.Now()
		data := f.Encode(nil)
		t2 := time.Now()
		if _, err := kvstate.NewState().Restore(data); err != nil {
			b.Fatal(err)
		}
		freeze, encode, restore = freeze+t1.Sub(t0), encode+t2.Sub(t1), restore+time.Since(t2)
		size = len(data)
	}
	n := float64(b.N)
	b.ReportMetric(float64(freeze.Microseconds())/n, "freeze-µs")
	b.ReportMetric(float64(encode.Microseconds())/n, "encode-µs")
	b.ReportMetric(float64(restore.Microseconds())/n, "restore-µs")
	b.ReportMetric(float64(size)/1e6, "MB")
	b.ReportMetric(float64(a.state.Model(kvtest.Model).Index.Len()), "index-blocks")
}

// BenchmarkColdStart measures what a replica's cold start costs in this process: restoring a
// snapshot of 10M blocks (64 workers, the peers' prompt shape) into an empty state. Redis and the
// network add reading about 400 MB in 1 MiB pieces. It needs about 4 GB of memory and a minute to
// build its state, so it only runs when asked for by name:
//
//	go test -run '^$' -bench 'BenchmarkColdStart' -benchtime 3x ./kvstate
func BenchmarkColdStart(b *testing.B) {
	const blocks = 10_000_000
	s := benchState(b)
	a := &eventApplier{tb: b, state: s, nextID: make(map[kvstate.WorkerKey]uint64)}
	w := kvtest.NewWorkload(kvtest.Seed)
	ix := s.Model(kvtest.Model).Index
	var buf []kvstate.Block
	for ix.Len() < blocks {
		p := w.Next()
		buf = w.Blocks(p, buf[:0])
		a.apply(kvtest.WorkerKey(p.Pod), []kvstate.Event{{Kind: kvstate.EventStored, Tier: kvstate.TierDevice, Blocks: buf}})
	}
	data := s.EncodeSnapshot(nil, kvstate.SnapshotHeader{Position: "1-0"})
	b.ResetTimer()
	for b.Loop() {
		if _, err := kvstate.NewState().Restore(data); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "restore-ms")
	b.ReportMetric(float64(len(data))/1e6, "snapshot-MB")
	b.ReportMetric(float64(ix.Len()), "index-blocks")
}
