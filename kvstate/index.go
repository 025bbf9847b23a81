package kvstate

import (
	"errors"
	"math/bits"
	"sync"

	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// Errors of applying KV events. They drop the one event they concern and leave the index unchanged;
// they are counted, never fatal to the worker's stream (Dynamo §4.3).
var (
	// ErrParentNotFound: a stored event names a parent block this worker does not hold.
	ErrParentNotFound = errors.New("parent block not found")
	// ErrInvalidBlockSequence: a stored event's blocks contain its own parent hash.
	ErrInvalidBlockSequence = errors.New("stored blocks contain their own parent hash")
)

// workerBlocks maps one worker's engine block hashes to the sequence hashes of the blocks, per tier.
// It resolves parents and removals, which name blocks by the engine's hash, not by position.
type workerBlocks struct {
	byHash [NumTiers]*flatMap[uint64]
}

func newWorkerBlocks() *workerBlocks {
	w := &workerBlocks{}
	for t := range w.byHash {
		w.byHash[t] = newFlatMap[uint64]()
	}
	return w
}

// lookup returns the sequence hash of the worker's block with engine hash in tier, or failing that
// in another tier: a block offloaded to a slower tier may chain onto a parent still held in another.
func (w *workerBlocks) lookup(tier Tier, hash uint64) (key uint64, ok bool) {
	if k := w.byHash[tier].get(hash); k != nil {
		return *k, true
	}
	for t := range w.byHash {
		if Tier(t) != tier {
			if k := w.byHash[t].get(hash); k != nil {
				return *k, true
			}
		}
	}
	return 0, false
}

// probeBatch is how many table probes the index's hot loops issue back to back before using them.
//
// Profile lesson (docs/benchmarks/history.md, "Profiles and changes"): at 1M blocks the tables are
// far larger than the CPU caches, and most of the time of Overlaps and Store goes to the first
// touch of each probed slot: one cache miss per block. The misses came one at a time while the work
// between two probes (data-dependent branches over the holders) kept the CPU from starting the next
// one early. Probing a few independent keys in a tight loop first lets their misses overlap.
const probeBatch = 8

// walkBatch is probeBatch for the overlap walk, whose probes are cheaper to issue (a touch of the
// home slot, nothing written): in one interleaved run of the peer lookup benchmark, batches of 32
// took a 512-block hit lookup from 33 µs to 29 µs against batches of 8 (16: 31 µs); partial lookups
// did not change.
const walkBatch = 32

// storeChunk is how many blocks of a stored or removed event are applied under one hold of the
// write lock. A 512-block event takes about 100 µs; between chunks, overlap queries waiting for the
// lock get their turn, so a Route never waits behind a whole large event. Readers may see a prefix
// of the event applied, which is a state the worker could have reported with smaller events.
const storeChunk = 64

// Index is the prefix index of one model: which worker holds which prompt prefix, in which tier.
//
// The tree is stored flat: a block's identity is the chained sequence hash of the local hashes on its
// path (blockhash.Chain), so a block is found by one table probe and a prompt's overlap is a walk over
// its sequence hashes with no pointer chasing. Each block's holders are bitsets over worker slots
// (holderSet), so a step of the walk is a few word operations. Semantics follow Dynamo's radix tree
// (§4.3): a store chains onto its parent or starts at the root, a removal takes the worker off one
// block, and a worker's overlap ends at the first block it does not hold.
//
// Index is safe for concurrent use. Overlap queries take a read lock; an applied event takes the
// write lock (a large stored or removed event once per storeChunk blocks).
type Index struct {
	mu      sync.RWMutex
	nodes   *flatMap[holderSet] // by sequence hash
	extra   extraWords
	workers map[uint32]*workerBlocks // by slot
	warm    uint64                   // sink of touch: a load whose value nobody uses is compiled away
	budget  *indexBudget             // shared by the state's indexes; nil (a bare index): no cap, no count
}

// NewIndex returns an empty index.
func NewIndex() *Index {
	return &Index{nodes: newFlatMap[holderSet](), workers: make(map[uint32]*workerBlocks)}
}

// Store applies a stored event for the worker in slot: the blocks form a chain continuing the
// parent (engine hash) if hasParent, else starting at the root. Re-storing a block is idempotent.
// It returns the number of blocks that were already held, or an error and no change at all.
func (ix *Index) Store(slot uint32, tier Tier, parent uint64, hasParent bool, blocks []Block) (duplicates int, err error) {
	ix.mu.Lock()
	locked := true
	defer func() {
		if locked {
			ix.mu.Unlock()
		}
	}()
	wb := ix.workers[slot]
	var key uint64
	if hasParent {
		var ok bool
		if wb != nil {
			key, ok = wb.lookup(tier, parent)
		}
		if !ok {
			return 0, ErrParentNotFound
		}
		for _, b := range blocks {
			if b.Hash == parent {
				return 0, ErrInvalidBlockSequence
			}
		}
	}
	if wb == nil {
		wb = newWorkerBlocks()
		ix.workers[slot] = wb
	}
	// Nothing below can fail, so releasing the lock between chunks never exposes a half-applied
	// error. Only this worker's stream changes its blocks, and it is applying this event.
	byHash := wb.byHash[tier]
	var keys [probeBatch]uint64
	for start := 0; start < len(blocks); start += probeBatch {
		if start > 0 && start%storeChunk == 0 {
			ix.mu.Unlock()
			ix.mu.Lock()
		}
		chunk := blocks[start:min(start+probeBatch, len(blocks))]
		for j, b := range chunk {
			if start+j == 0 && !hasParent {
				key = b.Local
			} else {
				key = blockhash.Chain(key, b.Local)
			}
			keys[j] = key
		}
		// Warm the cache with the chunk's probes (see probeBatch). The loop below probes again, from
		// cache, since applying one block may change what the next one finds.
		for j, b := range chunk {
			ix.warm ^= ix.nodes.touch(keys[j]) ^ byHash.touch(b.Hash)
		}
		for j, b := range chunk {
			if ix.budget != nil && ix.nodes.get(keys[j]) == nil && !ix.budget.take() {
				// No room for a new position: neither it nor the rest of the chain is indexed.
				ix.budget.refused.Add(uint64(len(blocks) - start - j))
				locked = false
				ix.mu.Unlock()
				return duplicates, nil
			}
			held, existed := byHash.upsert(b.Hash)
			if existed && *held != keys[j] {
				// The engine reused a hash for other content: the old block is gone.
				ix.dropHolder(*held, slot, tier)
			}
			*held = keys[j]
			hs, _ := ix.nodes.upsert(keys[j])
			if !ix.extra.add(hs, slot, tier) {
				duplicates++
			}
		}
	}
	locked = false
	ix.mu.Unlock()
	return duplicates, nil
}

// Remove applies a removed event: the worker no longer holds the blocks (engine hashes) in tier.
// It returns how many hashes were unknown (a warning in Dynamo, not an error).
//
// Like Store, it probes a batch of blocks before changing any (their cache misses overlap: a
// removal costs two random reads, the worker's table and the block's) and lets readers in between
// chunks of storeChunk hashes.
func (ix *Index) Remove(slot uint32, tier Tier, hashes []uint64) (unknown int) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	wb := ix.workers[slot]
	if wb == nil {
		return len(hashes)
	}
	byHash := wb.byHash[tier]
	var keys [probeBatch]uint64
	var found [probeBatch]bool
	for start := 0; start < len(hashes); start += probeBatch {
		if start > 0 && start%storeChunk == 0 {
			ix.mu.Unlock()
			ix.mu.Lock()
			if wb = ix.workers[slot]; wb == nil { // cleared meanwhile (the worker is gone)
				return unknown + len(hashes) - start
			}
			byHash = wb.byHash[tier]
		}
		chunk := hashes[start:min(start+probeBatch, len(hashes))]
		for _, h := range chunk {
			ix.warm ^= byHash.touch(h)
		}
		for j, h := range chunk {
			if k := byHash.get(h); k != nil {
				keys[j], found[j] = *k, true
				ix.warm ^= ix.nodes.touch(*k)
			} else {
				found[j] = false
			}
		}
		for j, h := range chunk {
			if !found[j] {
				unknown++
				continue
			}
			// The chunk may name a hash twice: the second finds it deleted, unknown.
			if byHash.delete(h) {
				ix.dropHolder(keys[j], slot, tier)
			} else {
				unknown++
			}
		}
	}
	return unknown
}

// ClearWorker removes every block the worker holds, in every tier. It is the only clear: a Cleared
// event, a gap, a dump and the worker's removal all drop the whole worker rank (§4.3), never one tier.
func (ix *Index) ClearWorker(slot uint32) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for t := Tier(0); t < NumTiers; t++ {
		ix.clearLocked(slot, t)
	}
	delete(ix.workers, slot)
}

func (ix *Index) clearLocked(slot uint32, tier Tier) {
	wb := ix.workers[slot]
	if wb == nil {
		return
	}
	wb.byHash[tier].all(func(_ uint64, key *uint64) { ix.dropHolder(*key, slot, tier) })
	wb.byHash[tier].clear()
}

// dropHolder takes the worker off the block with sequence hash key, and the block off the index once
// nobody holds it.
func (ix *Index) dropHolder(key uint64, slot uint32, tier Tier) {
	hs := ix.nodes.get(key)
	if hs == nil || !ix.extra.remove(hs, slot, tier) {
		return
	}
	if hs.bits == 0 {
		ix.extra.release(hs)
		ix.nodes.delete(key)
		if ix.budget != nil {
			ix.budget.used.Add(-1)
		}
	}
}

// clone returns a private copy of the index (for a snapshot; see State.Freeze).
func (ix *Index) clone() *Index {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	c := &Index{nodes: ix.nodes.clone(), workers: make(map[uint32]*workerBlocks, len(ix.workers))}
	c.extra.listPool = ix.extra.clone()
	for slot, wb := range ix.workers {
		cw := &workerBlocks{}
		for t, m := range wb.byHash {
			cw.byHash[t] = m.clone()
		}
		c.workers[slot] = cw
	}
	return c
}

// BlockCounts returns how many blocks the worker holds per tier.
func (ix *Index) BlockCounts(slot uint32) TierCounts {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	var c TierCounts
	if wb := ix.workers[slot]; wb != nil {
		for t, m := range wb.byHash {
			c[t] = uint64(m.len())
		}
	}
	return c
}

// Len returns the number of distinct block positions in the index.
func (ix *Index) Len() int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.nodes.len()
}

// Overlaps fills o with every worker's overlap with the prompt whose sequence hashes are seq. The walk
// never stops early, so every score is exact (Dynamo's early exit only gives a lower bound, §10.10).
func (ix *Index) Overlaps(seq []uint64, o *Overlaps) {
	o.reset()
	if len(seq) == 0 {
		return
	}
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	var batch [walkBatch]*holderSet
	for i := range seq {
		j := i % walkBatch
		if j == 0 {
			// Look the next blocks up together (see walkBatch). Those past the first missing
			// block are looked up in vain; the walk stops there all the same.
			next := seq[i:min(i+walkBatch, len(seq))]
			for _, h := range next {
				o.warm ^= ix.nodes.touch(h)
			}
			for k, h := range next {
				batch[k] = ix.nodes.get(h)
			}
		}
		hs := batch[j]
		if hs == nil {
			o.finish(uint32(i))
			return
		}
		if i == 0 {
			o.start(hs, ix.extra.words(hs))
		} else if !o.step(hs, ix.extra.words(hs), uint32(i)) {
			return
		}
	}
	o.finish(uint32(len(seq)))
}

// Overlaps holds per-worker overlap depths of one prompt. It is scratch space reused across queries:
// clearing it costs nothing because entries are stamped with the query they belong to.
type Overlaps struct {
	epoch  uint32
	stamp  []uint32
	depth  [][NumTiers]uint32
	active []activeWord // the index walk's workers still running, by word of slots
	warm   uint64       // sink of touch (see Index.warm)
}

// activeWord is the state of the index walk for the workers in one word of slots.
type activeWord struct {
	word uint32
	runs [NumTiers]uint64 // runs[t]: workers whose run in tier t, or a faster one, is unbroken
	seen [NumTiers]uint64 // the current block's holders in this word, each counted in its tier and slower ones
}

// start begins the walk at the prompt's first block with its holders.
func (o *Overlaps) start(hs *holderSet, extra []holderWord) {
	o.active = o.active[:0]
	o.startWord(hs.first())
	for _, w := range extra {
		o.startWord(w)
	}
}

func (o *Overlaps) startWord(w holderWord) {
	a := o.find(w.word())
	if a == nil {
		o.active = append(o.active, activeWord{word: w.word()})
		a = &o.active[len(o.active)-1]
	}
	for t := w.tier(); t < NumTiers; t++ {
		a.runs[t] |= w.bits
	}
}

func (o *Overlaps) find(word uint32) *activeWord {
	for i := range o.active {
		if o.active[i].word == word {
			return &o.active[i]
		}
	}
	return nil
}

// step moves the walk to the block at depth, held by hs: a worker's run in a tier ends where it does
// not hold the block in that tier or a faster one, and its depth there is recorded. It reports
// whether any worker is still running.
//
// Profile lesson (peer lookup benchmark, 512-block hit): step took a third of the walk, 20 ns a
// block, most of it copying each 72-byte activeWord out of the slice and back. It now works in
// place, and the usual case (every running worker in one word of slots, one holder word) skips the
// seen bookkeeping altogether.
func (o *Overlaps) step(hs *holderSet, extra []holderWord, depth uint32) bool {
	if len(o.active) == 1 && len(extra) == 0 {
		a, w := &o.active[0], hs.first()
		var seen uint64
		if w.word() == a.word {
			seen = w.bits
		}
		from := w.tier() // the block counts in its tier and every slower one
		alive := false
		for t := range a.runs {
			still := a.runs[t]
			if Tier(t) >= from {
				still &= seen
			} else {
				still = 0
			}
			if ended := a.runs[t] &^ still; ended != 0 {
				o.record(a.word, Tier(t), ended, depth)
			}
			a.runs[t] = still
			alive = alive || still != 0
		}
		if !alive {
			o.active = o.active[:0]
		}
		return alive
	}
	for i := range o.active {
		o.active[i].seen = [NumTiers]uint64{}
	}
	o.see(hs.first())
	for _, w := range extra {
		o.see(w)
	}
	kept := 0
	for i := range o.active {
		a := &o.active[i]
		alive := false
		for t := range a.runs {
			still := a.runs[t] & a.seen[t]
			if ended := a.runs[t] &^ still; ended != 0 {
				o.record(a.word, Tier(t), ended, depth)
			}
			a.runs[t] = still
			alive = alive || still != 0
		}
		if alive {
			if kept != i {
				o.active[kept] = *a
			}
			kept++
		}
	}
	o.active = o.active[:kept]
	return kept > 0
}

func (o *Overlaps) see(w holderWord) {
	if a := o.find(w.word()); a != nil {
		for t := w.tier(); t < NumTiers; t++ {
			a.seen[t] |= w.bits
		}
	}
}

// finish ends the walk after depth blocks: every worker still running reached it.
func (o *Overlaps) finish(depth uint32) {
	for _, a := range o.active {
		for t, run := range a.runs {
			o.record(a.word, Tier(t), run, depth)
		}
	}
	o.active = o.active[:0]
}

// record sets the depth in tier of the workers of word whose bits are set.
func (o *Overlaps) record(word uint32, tier Tier, set uint64, depth uint32) {
	for ; set != 0; set &= set - 1 {
		o.entry(word<<6 | uint32(bits.TrailingZeros64(set)))[tier] = depth
	}
}

func (o *Overlaps) reset() {
	o.epoch++
	if o.epoch == 0 { // wrapped: forget every stamp
		clear(o.stamp)
		o.epoch = 1
	}
}

func (o *Overlaps) entry(slot uint32) *[NumTiers]uint32 {
	if int(slot) >= len(o.stamp) {
		n := max(int(slot)+1, 2*len(o.stamp), 64)
		o.stamp = append(o.stamp, make([]uint32, n-len(o.stamp))...)
		o.depth = append(o.depth, make([][NumTiers]uint32, n-len(o.depth))...)
	}
	if o.stamp[slot] != o.epoch {
		o.stamp[slot] = o.epoch
		o.depth[slot] = [NumTiers]uint32{}
	}
	return &o.depth[slot]
}

// Depths returns the worker's cumulative overlap depth per tier: Depths()[t] is the number of leading
// blocks the worker holds in tier t or a faster one. Depths are non-decreasing in t.
func (o *Overlaps) Depths(slot uint32) [NumTiers]uint32 {
	if int(slot) < len(o.stamp) && o.stamp[slot] == o.epoch {
		return o.depth[slot]
	}
	return [NumTiers]uint32{}
}

// Blocks returns the worker's overlap split by tier: the device prefix, then the further blocks held
// in host memory or better, then on disk or better, then anywhere (external).
func (o *Overlaps) Blocks(slot uint32) TierCounts {
	d := o.Depths(slot)
	var c TierCounts
	prev := uint32(0)
	for t, v := range d {
		c[t] = uint64(v - prev)
		prev = v
	}
	return c
}
