package kvstate

import (
	"errors"
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

// ref is one (worker slot, tier) membership of a node, packed as slot<<2 | tier.
type ref uint32

func makeRef(slot uint32, tier Tier) ref { return ref(slot<<2 | uint32(tier)) }
func (r ref) slot() uint32               { return uint32(r >> 2) }
func (r ref) tier() Tier                 { return Tier(r & 3) }

// node is one block position in the prefix tree: the chain of local hashes from the root, keyed by
// its sequence hash, with the workers (and tiers) holding it.
type node struct {
	key  uint64
	refs []ref
}

func (n *node) has(r ref) bool {
	for _, x := range n.refs {
		if x == r {
			return true
		}
	}
	return false
}

func (n *node) drop(r ref) bool {
	for i, x := range n.refs {
		if x == r {
			last := len(n.refs) - 1
			n.refs[i] = n.refs[last]
			n.refs = n.refs[:last]
			return true
		}
	}
	return false
}

// workerBlocks maps one worker's engine block hashes to nodes, per tier. It resolves parents and
// removals, which name blocks by the engine's hash, not by position.
type workerBlocks struct {
	byHash [NumTiers]map[uint64]*node
}

func (w *workerBlocks) lookup(tier Tier, hash uint64) *node {
	if n := w.byHash[tier][hash]; n != nil {
		return n
	}
	// A block offloaded to a slower tier may chain onto a parent still held in another tier.
	for t := range w.byHash {
		if Tier(t) != tier {
			if n := w.byHash[t][hash]; n != nil {
				return n
			}
		}
	}
	return nil
}

// probeBatch is how many map probes the index's hot loops issue back to back before using them.
//
// Profile lesson (docs/BENCHMARKS.md, "Profiles"): at 1M blocks the maps are far larger than the
// CPU caches, and 50-60% of the time of Overlaps and Store went to the first touch of each probed
// map group (runtime maps.ctrlGroup.matchH2): one cache miss per block. The misses came one at a
// time because the work between two probes (following the node pointer, data-dependent branches
// over its refs) kept the CPU from starting the next one early. Probing a few independent keys in a
// tight loop first lets their misses overlap: lookups got about 40% faster and stores about 25%,
// with the same results. (Remove gained nothing measurable from it, so it probes one at a time.)
const probeBatch = 8

// Index is the prefix index of one model: which worker holds which prompt prefix, in which tier.
//
// The tree is stored flat: a node's identity is the chained sequence hash of the local hashes on its
// path (blockhash.Chain), so a node is found by one map probe and a prompt's overlap is a walk over its
// sequence hashes with no pointer chasing. Semantics follow Dynamo's radix tree (§4.3): a store chains
// onto its parent or starts at the root, a removal takes the worker off one node, and a worker's
// overlap ends at the first block it does not hold.
//
// Index is safe for concurrent use. Overlap queries take a read lock; each applied event takes the
// write lock for the duration of that one event.
type Index struct {
	mu      sync.RWMutex
	nodes   map[uint64]*node
	workers map[uint32]*workerBlocks // by slot
}

// NewIndex returns an empty index.
func NewIndex() *Index {
	return &Index{nodes: make(map[uint64]*node), workers: make(map[uint32]*workerBlocks)}
}

// Store applies a stored event for the worker in slot: the blocks form a chain continuing the
// parent (engine hash) if hasParent, else starting at the root. Re-storing a block is idempotent.
// It returns the number of blocks that were already held, or an error and no change at all.
func (ix *Index) Store(slot uint32, tier Tier, parent uint64, hasParent bool, blocks []Block) (duplicates int, err error) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	wb := ix.workers[slot]
	var key uint64
	if hasParent {
		var pn *node
		if wb != nil {
			pn = wb.lookup(tier, parent)
		}
		if pn == nil {
			return 0, ErrParentNotFound
		}
		for _, b := range blocks {
			if b.Hash == parent {
				return 0, ErrInvalidBlockSequence
			}
		}
		key = pn.key
	}
	if wb == nil {
		wb = &workerBlocks{}
		ix.workers[slot] = wb
	}
	byHash := wb.byHash[tier]
	if byHash == nil {
		byHash = make(map[uint64]*node)
		wb.byHash[tier] = byHash
	}
	r := makeRef(slot, tier)
	var keys [probeBatch]uint64
	for start := 0; start < len(blocks); start += probeBatch {
		chunk := blocks[start:min(start+probeBatch, len(blocks))]
		for j, b := range chunk {
			if start+j == 0 && !hasParent {
				key = b.Local
			} else {
				key = blockhash.Chain(key, b.Local)
			}
			keys[j] = key
		}
		// Warm the cache with the chunk's probes (see probeBatch; a discarded map lookup is still
		// made). The loop below probes again, from cache, since applying one block may change what
		// the next one finds.
		for j, b := range chunk {
			_ = ix.nodes[keys[j]]
			_ = byHash[b.Hash]
		}
		for j, b := range chunk {
			n := ix.nodes[keys[j]]
			if n == nil {
				n = &node{key: keys[j], refs: make([]ref, 0, 1)}
				ix.nodes[keys[j]] = n
			}
			if old := byHash[b.Hash]; old != nil && old != n {
				// The engine reused a hash for other content: the old block is gone.
				ix.dropRef(old, r)
			}
			if n.has(r) {
				duplicates++
			} else {
				n.refs = append(n.refs, r)
			}
			byHash[b.Hash] = n
		}
	}
	return duplicates, nil
}

// Remove applies a removed event: the worker no longer holds the blocks (engine hashes) in tier.
// It returns how many hashes were unknown (a warning in Dynamo, not an error).
func (ix *Index) Remove(slot uint32, tier Tier, hashes []uint64) (unknown int) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	wb := ix.workers[slot]
	if wb == nil || wb.byHash[tier] == nil {
		return len(hashes)
	}
	byHash := wb.byHash[tier]
	r := makeRef(slot, tier)
	for _, h := range hashes {
		n := byHash[h]
		if n == nil {
			unknown++
			continue
		}
		delete(byHash, h)
		ix.dropRef(n, r)
	}
	return unknown
}

// Clear removes every block the worker holds in tier.
func (ix *Index) Clear(slot uint32, tier Tier) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.clearLocked(slot, tier)
}

// ClearWorker removes every block the worker holds, in every tier.
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
	r := makeRef(slot, tier)
	for _, n := range wb.byHash[tier] {
		ix.dropRef(n, r)
	}
	wb.byHash[tier] = nil
}

func (ix *Index) dropRef(n *node, r ref) {
	if n.drop(r) && len(n.refs) == 0 {
		delete(ix.nodes, n.key)
	}
}

// BlockCounts returns how many blocks the worker holds per tier.
func (ix *Index) BlockCounts(slot uint32) TierCounts {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	var c TierCounts
	if wb := ix.workers[slot]; wb != nil {
		for t, m := range wb.byHash {
			c[t] = uint64(len(m))
		}
	}
	return c
}

// Len returns the number of distinct block positions in the index.
func (ix *Index) Len() int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return len(ix.nodes)
}

// Overlaps fills o with every worker's overlap with the prompt whose sequence hashes are seq. The walk
// never stops early, so every score is exact (Dynamo's early exit only gives a lower bound, §10.10).
func (ix *Index) Overlaps(seq []uint64, o *Overlaps) {
	o.reset()
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	var batch [probeBatch]*node
	for i := range seq {
		j := i % probeBatch
		if j == 0 {
			// Look the next blocks up together (see probeBatch). Those past the first missing
			// block are looked up in vain; the walk stops there all the same.
			for k, h := range seq[i:min(i+probeBatch, len(seq))] {
				batch[k] = ix.nodes[h]
			}
		}
		n := batch[j]
		if n == nil {
			return
		}
		depth := uint32(i)
		advanced := false
		for _, r := range n.refs {
			d := o.entry(r.slot())
			// A worker's run in tier t (counting every tier at least as fast) continues only if it
			// reached this block without a break.
			for t := r.tier(); t < NumTiers; t++ {
				if d[t] == depth {
					d[t] = depth + 1
					advanced = true
				}
			}
		}
		if !advanced {
			return
		}
	}
}

// Overlaps holds per-worker overlap depths of one prompt. It is scratch space reused across queries:
// clearing it costs nothing because entries are stamped with the query they belong to.
type Overlaps struct {
	epoch uint32
	stamp []uint32
	depth [][NumTiers]uint32
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
