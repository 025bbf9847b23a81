package bridge

import (
	"math"
	"sync"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// mirror is what one engine rank holds, as far as the bridge forwarded it: every stored block not
// removed since, per tier, in the order it was stored (so that a parent comes before its children),
// with its tokens_hash instead of its tokens. It answers the router's ResyncRequest: the engines
// have no way to list their cache, so the bridge keeps the list. About 60 bytes a block.
type mirror struct {
	mu    sync.Mutex
	tiers map[kvrouterv1.StorageTier]*tierMirror
}

type tierMirror struct {
	index  map[uint64]int32 // block hash -> position in blocks
	blocks []mirroredBlock  // in store order; removed ones are marked dead until compacted
	dead   int
}

type mirroredBlock struct {
	hash, parent, tokensHash uint64
	copies                   uint32 // announcements not yet removed (releaseLocked)
	hasParent, live          bool
}

func newMirror() *mirror {
	return &mirror{tiers: make(map[kvrouterv1.StorageTier]*tierMirror)}
}

// The methods below whose names end in Locked are called by the rank's translator with mu held:
// it reads and records the mirror as it translates each event, so that an event sees every event
// before it, in its own batch too, and a dump taken meanwhile sees whole events only. Events are
// recorded before they are published: a dump taken between the two already holds them, and the
// router then applies them a second time, which changes nothing (storing a block it holds, or
// removing one it lacks).

// storeLocked records a stored event of tier; its blocks carry their tokens_hash.
func (m *mirror) storeLocked(tier kvrouterv1.StorageTier, st *kvrouterv1.BlocksStored) {
	t := m.tier(tier)
	parent, hasParent := st.GetParentHash(), st.ParentHash != nil
	for _, b := range st.GetBlocks() {
		t.store(mirroredBlock{hash: b.GetBlockHash(), parent: parent, hasParent: hasParent, tokensHash: b.GetTokensHash(), live: true})
		parent, hasParent = b.GetBlockHash(), true
	}
}

// releaseLocked takes one announcement of block hash off tier and reports whether the block is
// gone from the tier, so that its removal is forwarded. Engines announce a block once per copy or
// chunk that holds it (vLLM caches one hash in several GPU blocks; its offloading connector lists a
// block shared by two chunks in both), and remove it as often: only the last removal empties the
// tier. With counted, remaining is the engine's own count of the copies left (vLLM's
// remaining_copy_counts), which replaces the mirror's. A block the mirror does not hold (stored
// before the bridge started) is gone at its first removal: the router may hold it.
func (m *mirror) releaseLocked(tier kvrouterv1.StorageTier, hash uint64, remaining int64, counted bool) (gone bool) {
	t := m.tiers[tier]
	var i int32
	var ok bool
	if t != nil {
		i, ok = t.index[hash]
	}
	if counted && remaining > 0 {
		if ok {
			t.blocks[i].copies = uint32(min(remaining, math.MaxUint32))
		}
		return false
	}
	if !ok {
		return true
	}
	if !counted && t.blocks[i].copies > 1 {
		t.blocks[i].copies--
		return false
	}
	t.remove(hash)
	return true
}

// keyLocked returns how block hash was keyed on the first tier (fastest first) that holds it.
func (m *mirror) keyLocked(hash uint64) (mirroredBlock, bool) {
	for _, tier := range allTiers {
		if t := m.tiers[tier]; t != nil {
			if i, ok := t.index[hash]; ok {
				return t.blocks[i], true
			}
		}
	}
	return mirroredBlock{}, false
}

// clearLocked forgets every tier: the router drops them all on a cleared event, whichever tier it
// names (§4.3).
func (m *mirror) clearLocked() { clear(m.tiers) }

// clear forgets everything: the engine restarted, or events were lost and nothing can tell which.
func (m *mirror) clear() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.clearLocked()
}

func (m *mirror) tier(t kvrouterv1.StorageTier) *tierMirror {
	tm := m.tiers[t]
	if tm == nil {
		tm = &tierMirror{index: make(map[uint64]int32)}
		m.tiers[t] = tm
	}
	return tm
}

func (t *tierMirror) store(b mirroredBlock) {
	if i, ok := t.index[b.hash]; ok {
		// Announced again (another copy, another chunk holding it): same place, newest content.
		b.copies = min(t.blocks[i].copies, math.MaxUint32-1) + 1
		t.blocks[i] = b
		return
	}
	b.copies = 1
	t.index[b.hash] = int32(len(t.blocks))
	t.blocks = append(t.blocks, b)
}

func (t *tierMirror) remove(hash uint64) {
	i, ok := t.index[hash]
	if !ok {
		return
	}
	delete(t.index, hash)
	t.blocks[i].live = false
	t.dead++
	if t.dead > 1024 && t.dead > len(t.blocks)/2 {
		t.compact()
	}
}

// compact drops removed blocks, keeping the others' order.
func (t *tierMirror) compact() {
	live := t.blocks[:0]
	for _, b := range t.blocks {
		if b.live {
			t.index[b.hash] = int32(len(live))
			live = append(live, b)
		}
	}
	clear(t.blocks[len(live):])
	t.blocks, t.dead = live, 0
}

// blocks returns the number of blocks mirrored, over every tier.
func (m *mirror) blocks() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for _, t := range m.tiers {
		n += len(t.index)
	}
	return n
}

// dump returns the mirrored blocks as stored events with tokens_hash, one event per run of blocks
// that chain (each the parent of the next), parents before children.
func (m *mirror) dump() []*kvrouterv1.KvEvent {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []*kvrouterv1.KvEvent
	for _, tier := range allTiers {
		t := m.tiers[tier]
		if t == nil {
			continue
		}
		runs := chainedRuns{tier: tier}
		for _, b := range t.blocks {
			if b.live {
				runs.add(b)
			}
		}
		out = append(out, runs.events...)
	}
	return out
}

// chainedRuns builds stored events with tokens_hash from blocks in order, one event per run of
// blocks that chain (each the parent of the next), so that a run travels as the engine sent it.
type chainedRuns struct {
	tier   kvrouterv1.StorageTier
	events []*kvrouterv1.KvEvent
	cur    *kvrouterv1.BlocksStored
	last   uint64
}

func (r *chainedRuns) add(b mirroredBlock) {
	if r.cur == nil || !b.hasParent || b.parent != r.last {
		r.cur = &kvrouterv1.BlocksStored{}
		if b.hasParent {
			parent := b.parent
			r.cur.ParentHash = &parent
		}
		r.events = append(r.events, &kvrouterv1.KvEvent{StorageTier: r.tier, Data: &kvrouterv1.KvEvent_Stored{Stored: r.cur}})
	}
	th := b.tokensHash
	r.cur.Blocks = append(r.cur.Blocks, &kvrouterv1.StoredBlock{BlockHash: b.hash, TokensHash: &th})
	r.last = b.hash
}
