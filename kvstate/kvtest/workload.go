// Package kvtest is the workload the tests and benchmarks of kvstate, its backends, policy and
// cmd/kvload share: the peers' prompt generator (peer-index-bench.md, "Workload shape": 100 roots
// of 512 blocks, prompts sharing 128-384 blocks of one, 64 pods), the steady-state KV events built
// from it, and the percentile and heap measures the benchmarks report. Everything is
// deterministic, so every program that generates it sees the same prompts.
package kvtest

import (
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

const (
	BlockSize = 16
	Vocab     = 128256 // Llama 3's vocabulary: token ids look like real ones

	// The peers' workload shape: 100 "system prompt" roots of 512 blocks; every prompt takes a
	// uniform 128..384-block prefix of one root, then unique blocks up to 512; one of 64 pods.
	Roots        = 100
	PromptBlocks = 512
	SharedMin    = 128
	SharedMax    = 384
	Pods         = 64
	Fill         = 4_000 // prompts filling the index of the lookup run (about 1.06M blocks)
	Seed         = 20261202

	// EngineTag turns a block's sequence hash into the engine's block_hash, which the index treats
	// as an opaque per-worker name: keeping the two different catches any confusion of them.
	EngineTag = 0xE4E4_0000_0000_E4E4
)

// Mix is a 64-bit finalizer (MurmurHash3's): a cheap, deterministic stream of token ids, which
// every workload generator of the module (tests, benchmarks, cmd/kvload) draws its tokens from.
func Mix(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

// Workload generates the peers' prompts (PeerShape) deterministically, with each prompt's pod and
// its blocks' hashes. A block is named by its content id (Prompts), from which its tokens, local
// hash and, along the prompt, its sequence hash follow.
type Workload struct {
	prompts   *Prompts
	salt      uint64
	rootLocal [][]uint64
	rootSeq   [][]uint64
	tokens    []uint32 // scratch
}

// Prompt is one generated prompt: a root prefix and a unique suffix, for one pod.
type Prompt struct {
	Pod        uint32
	Root       int
	Shared     int      // blocks taken from the root
	FirstID    uint64   // content id of the first suffix block; the suffix's ids are consecutive
	Local, Seq []uint64 // local and sequence hashes of the suffix blocks
}

// NewWorkload returns the generator seeded with seed; kvtest.Seed gives the prompts of the
// recorded benchmarks.
func NewWorkload(seed uint64) *Workload {
	w := &Workload{prompts: NewPrompts(PeerShape, rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))), salt: blockhash.Salt("", "")}
	for r := range Roots {
		local := make([]uint64, PromptBlocks)
		for i := range local {
			local[i] = w.localHash(RootBlock(r, i))
		}
		w.rootLocal = append(w.rootLocal, local)
		w.rootSeq = append(w.rootSeq, blockhash.Sequence(nil, local))
	}
	return w
}

// Salt is the hash salt of the workload's blocks (no LoRA, no cache salt).
func (w *Workload) Salt() uint64 { return w.salt }

func (w *Workload) localHash(id uint64) uint64 {
	w.tokens = BlockTokens(w.tokens[:0], id)
	return blockhash.Local(w.tokens, w.salt)
}

// Next draws the Next prompt: a root, a shared prefix length in [128, 384] and a pod, uniformly.
func (w *Workload) Next() *Prompt {
	p := &Prompt{}
	p.Root, p.Shared = w.prompts.Draw(PromptBlocks)
	p.Pod = uint32(w.prompts.Rand.IntN(Pods))
	n := PromptBlocks - p.Shared
	p.FirstID = w.prompts.NewIDs(n)
	p.Local = make([]uint64, n)
	p.Seq = make([]uint64, n)
	parent := w.rootSeq[p.Root][p.Shared-1]
	for i := range n {
		p.Local[i] = w.localHash(p.FirstID + uint64(i))
		parent = blockhash.Chain(parent, p.Local[i])
		p.Seq[i] = parent
	}
	return p
}

// Blocks appends the prompt's 512 stored Blocks (engine hash and local hash) to dst.
func (w *Workload) Blocks(p *Prompt, dst []kvstate.Block) []kvstate.Block {
	for i := range p.Shared {
		dst = append(dst, kvstate.Block{Hash: w.rootSeq[p.Root][i] ^ EngineTag, Local: w.rootLocal[p.Root][i]})
	}
	for i, l := range p.Local {
		dst = append(dst, kvstate.Block{Hash: p.Seq[i] ^ EngineTag, Local: l})
	}
	return dst
}

// SeqHashes appends the prompt's 512 sequence hashes to dst.
func (w *Workload) SeqHashes(p *Prompt, dst []uint64) []uint64 {
	dst = append(dst, w.rootSeq[p.Root][:p.Shared]...)
	return append(dst, p.Seq...)
}

// Tokens appends the prompt's 8,192 tokens to dst.
func (w *Workload) Tokens(p *Prompt, dst []uint32) []uint32 {
	for i := range p.Shared {
		dst = BlockTokens(dst, RootBlock(p.Root, i))
	}
	for i := range p.Local {
		dst = BlockTokens(dst, p.FirstID+uint64(i))
	}
	return dst
}

// HeapAlloc returns the bytes of live heap after two forced collections, as the peers measured.
func HeapAlloc() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// Percentile returns the q-quantile (nearest rank) of durations; it sorts them in place.
func Percentile(d []time.Duration, q float64) time.Duration {
	slices.Sort(d)
	i := int(q*float64(len(d))+0.5) - 1
	return d[min(max(i, 0), len(d)-1)]
}

// The ingestion workload runs in steady state over an index of about 1M blocks: Workers workers
// hold a FIFO of Live prompts of the ring; each step stores one more prompt (one KVEvents batch:
// EventsPerPrompt stored events of 128 blocks, each chained onto the previous one's last block) and
// evicts the oldest (one removed event of its 512 engine hashes). Local hashes come precomputed, as
// the server computes them before the change is applied.
const (
	Live            = Fill  // prompts held: about 1.06M blocks, as in the peers' lookup fill
	Ring            = 6_000 // distinct prompts cycled through (more than Live)
	EventsPerPrompt = 4     // stored events per prompt
	Model           = "bench"
	Workers         = Pods
)

// PromptEvents is one prompt's KV events: the batch that stores it and the one that evicts it.
type PromptEvents struct {
	Worker          kvstate.WorkerKey
	Stored, Removed []kvstate.Event
}

// ApplyPrompts returns the ring of Ring prompts' events, built once per process.
var ApplyPrompts = sync.OnceValue(func() []PromptEvents {
	w := NewWorkload(Seed)
	out := make([]PromptEvents, Ring)
	for i := range out {
		p := w.Next()
		bs := w.Blocks(p, nil)
		ap := PromptEvents{Worker: WorkerKey(p.Pod)}
		per := len(bs) / EventsPerPrompt
		for e := range EventsPerPrompt {
			ev := kvstate.Event{Kind: kvstate.EventStored, Tier: kvstate.TierDevice, Blocks: bs[e*per : (e+1)*per]}
			if e > 0 {
				ev.Parent, ev.HasParent = bs[e*per-1].Hash, true
			}
			ap.Stored = append(ap.Stored, ev)
		}
		hashes := make([]uint64, len(bs))
		for j, b := range bs {
			hashes[j] = b.Hash
		}
		ap.Removed = []kvstate.Event{{Kind: kvstate.EventRemoved, Tier: kvstate.TierDevice, Removed: hashes}}
		out[i] = ap
	}
	return out
})

// WorkerKey is the key of pod's worker (rank 0; ids start at 1).
func WorkerKey(pod uint32) kvstate.WorkerKey { return kvstate.WorkerKey{ID: uint64(pod) + 1} }
