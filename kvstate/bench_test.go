package kvstate_test

// Benchmarks of hashing, event ingestion and the prefix index, in the shape of the issue (64
// workers, 16-token blocks, an index of about 1M blocks) and of the peers' index benchmark
// (/work/shared/reference/peer-index-bench.md). docs/BENCHMARKS.md records the results and the
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
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
)

const (
	benchBlockSize = 16
	benchVocab     = 128256 // Llama 3's vocabulary: token ids look like real ones

	// The peers' workload shape: 100 "system prompt" roots of 512 blocks; every prompt takes a
	// uniform 128..384-block prefix of one root, then unique blocks up to 512; one of 64 pods.
	peerRoots        = 100
	peerPromptBlocks = 512
	peerSharedMin    = 128
	peerSharedMax    = 384
	peerPods         = 64
	peerInsertRun    = 10_000 // prompts inserted into an empty index
	peerFill         = 4_000  // prompts filling the index of the lookup run (about 1.06M blocks)
	peerLookups      = 10_000 // lookups per query shape
	peerHashCalls    = 2_000  // hashing-only calls
	peerSeed         = 20261202

	// engineTag turns a block's sequence hash into the engine's block_hash, which the index treats
	// as an opaque per-worker name: keeping the two different catches any confusion of them.
	engineTag = 0xE4E4_0000_0000_E4E4
)

// mix is a 64-bit finalizer (MurmurHash3's): a cheap, deterministic stream of token ids.
func mix(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

// blockTokens appends the tokens of the block with content id to dst. Equal ids give equal tokens,
// so prompts that share block ids share cached prefixes.
func blockTokens(dst []uint32, id uint64) []uint32 {
	for i := range uint64(benchBlockSize) {
		dst = append(dst, uint32(mix(id*benchBlockSize+i+1)%benchVocab))
	}
	return dst
}

// peerWorkload generates the peers' prompts deterministically. A block is named by a content id
// (root r's block i is r<<32|i; unique blocks count up from 1<<48), from which its tokens, local
// hash and, along the prompt, its sequence hash follow.
type peerWorkload struct {
	rng       *rand.Rand
	salt      uint64
	rootLocal [][]uint64
	rootSeq   [][]uint64
	nextID    uint64
	tokens    []uint32 // scratch
}

// peerPrompt is one generated prompt: a root prefix and a unique suffix, for one pod.
type peerPrompt struct {
	pod        uint32
	root       int
	shared     int      // blocks taken from the root
	firstID    uint64   // content id of the first suffix block; the suffix's ids are consecutive
	local, seq []uint64 // local and sequence hashes of the suffix blocks
}

func newPeerWorkload(seed uint64) *peerWorkload {
	w := &peerWorkload{rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), salt: kvstate.SaltHash("", ""), nextID: 1 << 48}
	for r := range peerRoots {
		local := make([]uint64, peerPromptBlocks)
		for i := range local {
			local[i] = w.localHash(uint64(r)<<32 | uint64(i))
		}
		w.rootLocal = append(w.rootLocal, local)
		w.rootSeq = append(w.rootSeq, kvstate.SequenceHashes(nil, local))
	}
	return w
}

func (w *peerWorkload) localHash(id uint64) uint64 {
	w.tokens = blockTokens(w.tokens[:0], id)
	return kvstate.LocalBlockHash(w.tokens, w.salt)
}

// next draws the next prompt: a root, a shared prefix length in [128, 384] and a pod, uniformly.
func (w *peerWorkload) next() *peerPrompt {
	p := &peerPrompt{root: w.rng.IntN(peerRoots)}
	p.shared = peerSharedMin + w.rng.IntN(peerSharedMax-peerSharedMin+1)
	p.pod = uint32(w.rng.IntN(peerPods))
	p.firstID = w.nextID
	n := peerPromptBlocks - p.shared
	w.nextID += uint64(n)
	p.local = make([]uint64, n)
	p.seq = make([]uint64, n)
	parent := w.rootSeq[p.root][p.shared-1]
	for i := range n {
		p.local[i] = w.localHash(p.firstID + uint64(i))
		parent = kvstate.ChainHash(parent, p.local[i])
		p.seq[i] = parent
	}
	return p
}

// blocks appends the prompt's 512 stored blocks (engine hash and local hash) to dst.
func (w *peerWorkload) blocks(p *peerPrompt, dst []kvstate.Block) []kvstate.Block {
	for i := range p.shared {
		dst = append(dst, kvstate.Block{Hash: w.rootSeq[p.root][i] ^ engineTag, Local: w.rootLocal[p.root][i]})
	}
	for i, l := range p.local {
		dst = append(dst, kvstate.Block{Hash: p.seq[i] ^ engineTag, Local: l})
	}
	return dst
}

// seq appends the prompt's 512 sequence hashes to dst.
func (w *peerWorkload) seq(p *peerPrompt, dst []uint64) []uint64 {
	dst = append(dst, w.rootSeq[p.root][:p.shared]...)
	return append(dst, p.seq...)
}

// promptTokens appends the prompt's 8,192 tokens to dst.
func (w *peerWorkload) promptTokens(p *peerPrompt, dst []uint32) []uint32 {
	for i := range p.shared {
		dst = blockTokens(dst, uint64(p.root)<<32|uint64(i))
	}
	for i := range p.local {
		dst = blockTokens(dst, p.firstID+uint64(i))
	}
	return dst
}

// heapAlloc returns the bytes of live heap after two forced collections, as the peers measured.
func heapAlloc() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// percentile returns the q-quantile (nearest rank) of durations; it sorts them in place.
func percentile(d []time.Duration, q float64) time.Duration {
	slices.Sort(d)
	i := int(q*float64(len(d))+0.5) - 1
	return d[min(max(i, 0), len(d)-1)]
}

// indexPairs counts (block, worker) entries: every pod's blocks, summed over tiers.
func indexPairs(ix *kvstate.Index) uint64 {
	var n uint64
	for pod := range uint32(peerPods) {
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
	w := newPeerWorkload(peerSeed)
	prompts := make([]*peerPrompt, peerInsertRun)
	for i := range prompts {
		prompts[i] = w.next()
	}
	buf := make([]kvstate.Block, 0, peerPromptBlocks)
	durs := make([]time.Duration, len(prompts))
	ix := kvstate.NewIndex()
	base := heapAlloc()
	var total time.Duration
	for i, p := range prompts {
		buf = w.blocks(p, buf[:0])
		start := time.Now()
		_, err := ix.Store(p.pod, kvstate.TierDevice, 0, false, buf)
		durs[i] = time.Since(start)
		if err != nil {
			t.Fatalf("Index.Store(prompt %d) = %v, want nil", i, err)
		}
		total += durs[i]
	}
	heap := heapAlloc() - base
	blocks, pairs := ix.Len(), indexPairs(ix)
	inserted := len(prompts) * peerPromptBlocks
	p50, p99 := percentile(durs, 0.50), percentile(durs, 0.99)
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
	w := newPeerWorkload(peerSeed)
	fill := make([]*peerPrompt, peerFill)
	for i := range fill {
		fill[i] = w.next()
	}
	buf := make([]kvstate.Block, 0, peerPromptBlocks)
	empty := heapAlloc()
	ix := kvstate.NewIndex()
	base := heapAlloc()
	for i, p := range fill {
		if _, err := ix.Store(p.pod, kvstate.TierDevice, 0, false, w.blocks(p, buf[:0])); err != nil {
			t.Fatalf("Index.Store(prompt %d) = %v, want nil", i, err)
		}
	}
	heap := heapAlloc() - base
	blocks, pairs := ix.Len(), indexPairs(ix)
	t.Logf("lookup fill: %d prompts: %d blocks, %d (block, pod) pairs (peers: 1,060,377 and 1,816,993); heap %.1f MB: %.1f B/pair, %.1f B/block; empty index %d B",
		len(fill), blocks, pairs, float64(heap)/1e6, float64(heap)/float64(pairs), float64(heap)/float64(blocks), int64(base)-int64(empty))
	benchLine("PeerMemory/run=lookup-fill", len(fill), blocks, "blocks", pairs, "pairs",
		fmt.Sprintf("%.1f", float64(heap)/1e6), "heap-MB",
		fmt.Sprintf("%.1f", float64(heap)/float64(pairs)), "B/pair", fmt.Sprintf("%.1f", float64(heap)/float64(blocks)), "B/block")

	rng := rand.New(rand.NewPCG(peerSeed, 2))
	var (
		o      kvstate.Overlaps
		seq    []uint64
		tokens []uint32
		local  []uint64
		durs   = make([]time.Duration, peerLookups)
	)
	// query returns the next query prompt of a shape: a stored prompt (every block present) or a
	// new prompt sharing a root prefix, with an unseen suffix.
	query := func(shape string) *peerPrompt {
		if shape == "hit" {
			return fill[rng.IntN(len(fill))]
		}
		return w.next()
	}
	// check verifies one lookup's answer: a hit overlaps fully on its own pod; no pod overlaps a
	// partial query beyond its shared root prefix.
	check := func(shape string, p *peerPrompt) {
		best := uint32(0)
		for pod := range uint32(peerPods) {
			best = max(best, o.Depths(pod)[kvstate.TierDevice])
		}
		if shape == "hit" && o.Depths(p.pod)[kvstate.TierDevice] != peerPromptBlocks || shape == "partial" && best > uint32(p.shared) {
			t.Fatalf("%s lookup: pod %d overlap %d, best %d (shared prefix %d)", shape, p.pod, o.Depths(p.pod)[kvstate.TierDevice], best, p.shared)
		}
	}
	for _, hashing := range []bool{false, true} {
		for _, shape := range []string{"hit", "partial"} {
			var total time.Duration
			for i := range durs {
				p := query(shape)
				if hashing {
					tokens = w.promptTokens(p, tokens[:0])
					start := time.Now()
					local = kvstate.LocalBlockHashes(local[:0], tokens, benchBlockSize, w.salt)
					seq = kvstate.SequenceHashes(seq[:0], local)
					ix.Overlaps(seq, &o)
					durs[i] = time.Since(start)
				} else {
					seq = w.seq(p, seq[:0])
					start := time.Now()
					ix.Overlaps(seq, &o)
					durs[i] = time.Since(start)
				}
				total += durs[i]
				check(shape, p)
			}
			p50, p99 := percentile(durs, 0.50), percentile(durs, 0.99)
			mode := map[bool]string{false: "excluded", true: "included"}[hashing]
			t.Logf("lookup %-7s hashing %s: p50 %s µs, p99 %s µs, %.0f ns/block (p50/512), mean %s µs",
				shape, mode, micros(p50), micros(p99), float64(p50)/peerPromptBlocks, micros(total/time.Duration(len(durs))))
			benchLine(fmt.Sprintf("PeerLookup/shape=%s/hashing=%s", shape, mode), len(durs),
				p50.Nanoseconds(), "p50-ns", p99.Nanoseconds(), "p99-ns", fmt.Sprintf("%.1f", float64(p50)/peerPromptBlocks), "ns/block")
		}
	}

	// Hashing alone: 8,192 tokens to 512 sequence hashes, as the peers timed llm-d's and AIBrix's.
	hd := durs[:peerHashCalls]
	for i := range hd {
		tokens = w.promptTokens(fill[rng.IntN(len(fill))], tokens[:0])
		start := time.Now()
		local = kvstate.LocalBlockHashes(local[:0], tokens, benchBlockSize, w.salt)
		seq = kvstate.SequenceHashes(seq[:0], local)
		hd[i] = time.Since(start)
	}
	p50 := percentile(hd, 0.50)
	t.Logf("hashing 8,192 tokens to 512 sequence hashes: p50 %s µs, %.1f ns/block", micros(p50), float64(p50)/peerPromptBlocks)
	benchLine("PeerHash/tokens=8192", len(hd), p50.Nanoseconds(), "p50-ns", fmt.Sprintf("%.1f", float64(p50)/peerPromptBlocks), "ns/block")
	runtime.KeepAlive(fill)
}

// BenchmarkHash measures hashing a prompt: local block hashes and chained sequence hashes, block
// size 16, for the two prompt lengths.
func BenchmarkHash(b *testing.B) {
	for _, n := range []int{2048, 32768} {
		b.Run(fmt.Sprintf("tokens=%dk", n/1024), func(b *testing.B) {
			w := newPeerWorkload(peerSeed)
			tokens := make([]uint32, 0, n)
			for id := uint64(0); len(tokens) < n; id++ {
				tokens = blockTokens(tokens, id)
			}
			var local, seq []uint64
			b.SetBytes(int64(4 * n))
			b.ReportAllocs()
			for b.Loop() {
				local = kvstate.LocalBlockHashes(local[:0], tokens, benchBlockSize, w.salt)
				seq = kvstate.SequenceHashes(seq[:0], local)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/token")
		})
	}
}

// Event ingestion runs in steady state over an index of about 1M blocks: 64 workers hold a FIFO of
// applyLive peer-shape prompts; each iteration stores one more prompt through State.Apply (one
// KVEvents batch: 4 stored events of 128 blocks, each chained onto the previous one's last block)
// and evicts the oldest (one removed event of its 512 engine hashes). Local hashes come
// precomputed, as the server computes them before the change is applied.
const (
	applyLive    = peerFill // prompts held: about 1.06M blocks, as in the peers' lookup fill
	applyRing    = 6_000    // distinct prompts cycled through (more than applyLive)
	applyEvents  = 4        // stored events per prompt
	benchModel   = "bench"
	benchWorkers = peerPods
)

// applyPrompt is one prompt's KV events: the batch that stores it and the one that evicts it.
type applyPrompt struct {
	worker          kvstate.WorkerKey
	stored, removed []kvstate.Event
}

var applyPrompts = sync.OnceValue(func() []applyPrompt {
	w := newPeerWorkload(peerSeed)
	out := make([]applyPrompt, applyRing)
	for i := range out {
		p := w.next()
		bs := w.blocks(p, nil)
		ap := applyPrompt{worker: benchWorker(p.pod)}
		per := len(bs) / applyEvents
		for e := range applyEvents {
			ev := kvstate.Event{Kind: kvstate.EventStored, Tier: kvstate.TierDevice, Blocks: bs[e*per : (e+1)*per]}
			if e > 0 {
				ev.Parent, ev.HasParent = bs[e*per-1].Hash, true
			}
			ap.stored = append(ap.stored, ev)
		}
		hashes := make([]uint64, len(bs))
		for j, b := range bs {
			hashes[j] = b.Hash
		}
		ap.removed = []kvstate.Event{{Kind: kvstate.EventRemoved, Tier: kvstate.TierDevice, Removed: hashes}}
		out[i] = ap
	}
	return out
})

func benchWorker(pod uint32) kvstate.WorkerKey { return kvstate.WorkerKey{ID: uint64(pod) + 1} }

// benchState returns a state with benchWorkers aggregated workers of benchModel registered.
func benchState(tb testing.TB) *kvstate.State {
	s := kvstate.NewState()
	for pod := range uint32(benchWorkers) {
		info := kvstate.WorkerInfo{Key: benchWorker(pod), Model: benchModel, Role: kvstate.RoleAggregated, BlockSize: benchBlockSize, TotalKVBlocks: 1 << 20, KVEventsEnabled: true}
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
	ring := applyPrompts()
	a := &eventApplier{tb: b, state: benchState(b), nextID: make(map[kvstate.WorkerKey]uint64)}
	for i := range applyLive {
		a.apply(ring[i].worker, ring[i].stored)
	}
	var (
		storeTime, removeTime time.Duration
		stored, removed       int
		i                     int
	)
	b.ReportAllocs()
	for b.Loop() {
		in, out := &ring[(applyLive+i)%len(ring)], &ring[i%len(ring)]
		t0 := time.Now()
		a.apply(in.worker, in.stored)
		t1 := time.Now()
		res := a.apply(out.worker, out.removed)
		t2 := time.Now()
		storeTime, removeTime = storeTime+t1.Sub(t0), removeTime+t2.Sub(t1)
		stored += peerPromptBlocks
		removed += len(out.removed[0].Removed) - res.UnknownRemoved
		i++
	}
	events := stored + removed
	b.ReportMetric(float64(events)/b.Elapsed().Seconds(), "block-events/s")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(events), "ns/block-event")
	b.ReportMetric(float64(stored)/storeTime.Seconds(), "stored-blocks/s")
	b.ReportMetric(float64(removed)/removeTime.Seconds(), "removed-blocks/s")
	b.ReportMetric(float64(a.state.Model(benchModel).Index.Len()), "index-blocks")
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
		info := kvstate.WorkerInfo{Key: benchWorker(w), Model: benchModel, Role: kvstate.RoleAggregated, BlockSize: benchBlockSize, KVEventsEnabled: true}
		if _, err := s.Apply(kvstate.WorkerUp{Info: info}); err != nil {
			t.Fatal(err)
		}
	}
	ix := s.Model(benchModel).Index
	slots := make([]uint32, workers)
	for w := range slots {
		slots[w] = s.Worker(benchWorker(uint32(w))).Slot
	}
	// Prompts are paths in a small tree of local hashes (3 choices per block), so they share
	// prefixes of every length.
	prompt := func() []uint64 {
		local := make([]uint64, 1+rng.IntN(40))
		for i := range local {
			local[i] = uint64(1 + rng.IntN(3))
		}
		return kvstate.SequenceHashes(nil, local)
	}
	local := func(seq []uint64) []uint64 { // recovers local hashes from the tree's 3 choices
		out := make([]uint64, len(seq))
		for i := range seq {
			for l := uint64(1); l <= 3; l++ {
				if i == 0 && l == seq[0] || i > 0 && kvstate.ChainHash(seq[i-1], l) == seq[i] {
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
		key := benchWorker(uint32(w))
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
				ev.Parent, ev.HasParent = seq[start-1]^engineTag, true
			}
			for i, l := range local(seq)[start:] {
				ev.Blocks = append(ev.Blocks, kvstate.Block{Hash: seq[start+i] ^ engineTag, Local: l})
				held[w][seq[start+i]] = true
			}
			nextEvent[w]++
			apply(kvstate.KVEvents{Worker: key, Events: []kvstate.Event{ev}})
		case 1: // remove a random suffix of the prompt's blocks
			from := rng.IntN(len(seq))
			ev := kvstate.Event{ID: nextEvent[w], Kind: kvstate.EventRemoved, Tier: kvstate.TierDevice}
			for _, h := range seq[from:] {
				ev.Removed = append(ev.Removed, h^engineTag)
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
