package engine

import (
	"time"
)

// Seq is one request on a simulated engine: its prompt, what it must generate, and where it is.
type Seq struct {
	ID string
	// Prompt are the prompt's token ids; Blocks the cache names (sequence hashes) of its complete
	// blocks, BlockSize tokens each. A tail shorter than a block is computed but never cached.
	Prompt []uint32
	Blocks []uint64
	// OutputTokens is how many tokens to generate (at least 1).
	OutputTokens int
	// PrefillOnly: a prefill worker's job, done once the prompt is computed and its first token
	// out; the fleet then moves its KV to a decode worker.
	PrefillOnly bool
	// Transferred: the prompt's KV arrives from a prefill worker; the engine only allocates its
	// blocks and decodes.
	Transferred bool

	cached    int // prompt tokens found in the cache at admission
	computed  int // prompt tokens in the cache or computed so far
	generated int
	firstOut  bool // the first token was reported
	allocated int  // how many of Blocks (then of the output blocks) the cache holds for it
	outBlocks []uint64
}

// CachedTokens returns the prompt tokens found in the cache when the sequence was admitted.
func (s *Seq) CachedTokens() int { return s.cached }

// Generated returns the tokens generated so far.
func (s *Seq) Generated() int { return s.generated }

// Observer learns what an engine does, at the virtual time it happens.
type Observer interface {
	// Stored: blocks were written to the cache, in chain order; parent is the block before the
	// first (hasParent false for a prompt's first block). tokens returns block i's tokens.
	Stored(e *Engine, hashes []uint64, parent uint64, hasParent bool, tokens func(i int) []uint32)
	// Removed: blocks were evicted.
	Removed(e *Engine, hashes []uint64)
	// FirstToken: the sequence's first token is out (its prefill is done).
	FirstToken(e *Engine, s *Seq, at time.Duration)
	// Token: another token is out.
	Token(e *Engine, s *Seq, at time.Duration)
	// Finished: the sequence is done and its blocks released (for a PrefillOnly one, its prefill).
	Finished(e *Engine, s *Seq, at time.Duration)
}

// Engine is one simulated worker: it admits sequences into its cache, and runs forward passes that
// decode every running sequence by one token and prefill the others in chunks, within
// MaxNumBatchedTokens, as vLLM V1 schedules them (decodes first). It runs on a virtual clock that
// its caller advances: Step plans and times one pass.
type Engine struct {
	Name  string
	Model CostModel
	cache *Cache
	obs   Observer

	waiting []*Seq
	running []*Seq

	preemptions int

	// scratch
	chunks  []Chunk
	stored  []uint64
	evicted []uint64
	busy    time.Duration // total time spent in passes
}

// New returns an idle engine with an empty cache of model.TotalKVBlocks blocks.
func New(name string, model CostModel, obs Observer) *Engine {
	return &Engine{Name: name, Model: model, cache: NewCache(model.TotalKVBlocks), obs: obs}
}

// Cache returns the engine's cache (read it, do not change it).
func (e *Engine) Cache() *Cache { return e.cache }

// Submit queues a sequence; it is admitted at a coming pass, in arrival order.
func (e *Engine) Submit(s *Seq) { e.waiting = append(e.waiting, s) }

// Waiting and Running return how many sequences wait for admission and how many run: with the
// cache's referenced blocks, what the engine reports as its load.
func (e *Engine) Waiting() int { return len(e.waiting) }
func (e *Engine) Running() int { return len(e.running) }

// Busy returns the virtual time the engine spent in forward passes, for its utilisation.
func (e *Engine) Busy() time.Duration { return e.busy }

// Idle reports whether the engine has nothing to run.
func (e *Engine) Idle() bool { return len(e.waiting) == 0 && len(e.running) == 0 }

// Step runs one forward pass starting at now and returns its duration; the tokens it produces come
// out at now + duration. It returns 0 when there is nothing to run (or nothing that fits yet).
// When every running sequence waits for a block the full cache cannot give, the last admitted one
// is preempted, as vLLM does: its blocks are released and it goes back to the head of the queue,
// to be prefilled again (mostly from the cache) when it fits.
func (e *Engine) Step(now time.Duration) time.Duration {
	for {
		if d := e.step(now); d > 0 || !e.preempt() {
			return d
		}
	}
}

// Preemptions returns how many times a running sequence was preempted for lack of blocks.
func (e *Engine) Preemptions() int { return e.preemptions }

// preempt moves the last admitted running sequence back to the head of the queue, releasing its
// blocks; it reports false when nothing runs.
func (e *Engine) preempt() bool {
	if len(e.running) == 0 {
		return false
	}
	s := e.running[len(e.running)-1]
	e.running = e.running[:len(e.running)-1]
	e.cache.Release(s.Blocks[:s.allocated])
	if len(s.outBlocks) > 0 {
		e.cache.Release(s.outBlocks)
	}
	s.allocated, s.outBlocks, s.computed = 0, nil, 0
	s.Transferred = false // its KV is gone: it is computed here when it comes back
	e.waiting = append([]*Seq{s}, e.waiting...)
	e.preemptions++
	return true
}

func (e *Engine) step(now time.Duration) time.Duration {
	m := &e.Model
	budget := m.MaxNumBatchedTokens
	e.admit(&budget)
	decodes, context := 0, 0
	e.chunks = e.chunks[:0]
	type planned struct {
		s     *Seq
		chunk int
	}
	plan := make([]planned, 0, len(e.running))
	// Decodes first, then prefill chunks in admission order, within the token budget.
	for _, s := range e.running {
		if s.computed < len(s.Prompt) || budget == 0 {
			continue
		}
		if !e.growOutput(s) {
			continue // no block for its next tokens yet: it waits for one to be freed
		}
		decodes++
		context += len(s.Prompt) + s.generated
		budget--
		plan = append(plan, planned{s: s})
	}
	for _, s := range e.running {
		if s.computed >= len(s.Prompt) || budget == 0 {
			continue
		}
		c := min(len(s.Prompt)-s.computed, budget)
		budget -= c
		e.chunks = append(e.chunks, Chunk{New: c, Done: s.computed})
		plan = append(plan, planned{s: s, chunk: c})
	}
	d := m.Step(decodes, context, e.chunks)
	if d == 0 {
		return 0
	}
	e.busy += d
	end := now + d
	for _, p := range plan {
		s := p.s
		if p.chunk > 0 {
			s.computed += p.chunk
			if s.computed < len(s.Prompt) {
				continue
			}
		}
		s.generated++
		switch {
		case !s.firstOut:
			s.firstOut = true
			e.obs.FirstToken(e, s, end)
		default:
			e.obs.Token(e, s, end)
		}
		if s.PrefillOnly || s.generated >= s.OutputTokens {
			e.finish(s, end)
		}
	}
	return d
}

// admit moves waiting sequences into the cache while they fit, the token budget lasts and fewer
// than MaxNumSeqs run. The first that does not fit stops admission (first come, first served).
func (e *Engine) admit(budget *int) {
	n := 0
	for _, s := range e.waiting {
		if len(e.running) >= e.Model.MaxNumSeqs || *budget <= 0 {
			break
		}
		hit, stored, evicted, ok := e.cache.Allocate(s.Blocks, e.stored[:0], e.evicted[:0])
		e.stored, e.evicted = stored, evicted
		if !ok {
			break
		}
		e.announce(s, stored, evicted)
		s.allocated = len(s.Blocks)
		bs := e.Model.BlockSize
		s.cached = min(hit*bs, len(s.Prompt))
		s.computed = s.cached
		if s.Transferred {
			s.computed = len(s.Prompt) // the KV came from the prefill worker
		} else if s.computed == len(s.Prompt) {
			s.computed-- // a fully cached prompt still computes its last token, as vLLM does
		}
		e.running = append(e.running, s)
		n++
	}
	e.waiting = e.waiting[n:]
}

// growOutput makes sure a decoding sequence has a block for its next token: every BlockSize
// generated tokens take a new block, which is stored once full. It reports false when the cache
// has no room for it.
func (e *Engine) growOutput(s *Seq) bool {
	bs := e.Model.BlockSize
	total := len(s.Prompt) + s.generated // tokens in the cache after this step's token
	if total%bs != 0 || total/bs <= len(s.Blocks)+len(s.outBlocks) {
		return true
	}
	// A new output block, named after the sequence and its position: output is never shared.
	h := outputHash(s.ID, len(s.outBlocks))
	_, stored, evicted, ok := e.cache.Allocate([]uint64{h}, e.stored[:0], e.evicted[:0])
	e.stored, e.evicted = stored, evicted
	if !ok {
		return false
	}
	s.outBlocks = append(s.outBlocks, h)
	e.announceOutput(s, stored, evicted)
	return true
}

func (e *Engine) announce(s *Seq, stored, evicted []uint64) {
	if len(evicted) > 0 {
		e.obs.Removed(e, evicted)
	}
	// The stored blocks follow the prompt's order, but blocks still cached from an earlier prompt
	// may sit between them: each run of consecutive stored blocks is one chain, whose parent is the
	// block before it.
	bs := e.Model.BlockSize
	j := 0
	for i := 0; i < len(s.Blocks) && j < len(stored); {
		if s.Blocks[i] != stored[j] {
			i++
			continue
		}
		start := i
		for i < len(s.Blocks) && j < len(stored) && s.Blocks[i] == stored[j] {
			i++
			j++
		}
		var parent uint64
		if start > 0 {
			parent = s.Blocks[start-1]
		}
		e.obs.Stored(e, s.Blocks[start:i], parent, start > 0, func(k int) []uint32 {
			return s.Prompt[(start+k)*bs : (start+k+1)*bs]
		})
	}
}

func (e *Engine) announceOutput(s *Seq, stored, evicted []uint64) {
	if len(evicted) > 0 {
		e.obs.Removed(e, evicted)
	}
	if len(stored) == 0 {
		return
	}
	parent, hasParent := uint64(0), false
	switch k := len(s.outBlocks) - 1; {
	case k > 0:
		parent, hasParent = s.outBlocks[k-1], true
	case len(s.Blocks) > 0:
		parent, hasParent = s.Blocks[len(s.Blocks)-1], true
	}
	idx := len(s.outBlocks) - 1
	e.obs.Stored(e, stored, parent, hasParent, func(int) []uint32 { return outputTokens(s.ID, idx, e.Model.BlockSize) })
}

// finish releases a sequence's blocks and reports it done.
func (e *Engine) finish(s *Seq, at time.Duration) {
	e.cache.Release(s.Blocks[:s.allocated])
	if len(s.outBlocks) > 0 {
		e.cache.Release(s.outBlocks)
	}
	for i, r := range e.running {
		if r == s {
			e.running = append(e.running[:i], e.running[i+1:]...)
			break
		}
	}
	e.obs.Finished(e, s, at)
}

// outputHash names output block i of a sequence (FNV-1a over the id, then the index).
func outputHash(id string, i int) uint64 {
	h := uint64(14695981039346656037)
	for j := 0; j < len(id); j++ {
		h = (h ^ uint64(id[j])) * 1099511628211
	}
	h = (h ^ uint64(i) ^ 0x5bd1e995) * 1099511628211
	return h | 1<<63 // apart from prompt hashes' low range in tests
}

// outputTokens returns the made-up tokens of output block i of a sequence.
func outputTokens(id string, i, blockSize int) []uint32 {
	out := make([]uint32, blockSize)
	h := outputHash(id, i)
	for k := range out {
		h ^= h >> 33
		h *= 0xff51afd7ed558ccd
		h ^= h >> 33
		out[k] = uint32(h%120_000) + 1000
	}
	return out
}
