package bridge

import (
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
	hasParent, live          bool
}

func newMirror() *mirror {
	return &mirror{tiers: make(map[kvrouterv1.StorageTier]*tierMirror)}
}

// apply records kvrouter events before they are published; stored blocks carry their tokens_hash.
// Recording first means a dump taken between the two already holds the events, which the router
// then applies a second time: storing a block it holds, or removing one it lacks, changes nothing.
func (m *mirror) apply(events []*kvrouterv1.KvEvent) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, ev := range events {
		switch d := ev.GetData().(type) {
		case *kvrouterv1.KvEvent_Stored:
			t := m.tier(ev.GetStorageTier())
			parent, hasParent := d.Stored.GetParentHash(), d.Stored.ParentHash != nil
			for _, b := range d.Stored.GetBlocks() {
				t.store(mirroredBlock{hash: b.GetBlockHash(), parent: parent, hasParent: hasParent, tokensHash: b.GetTokensHash(), live: true})
				parent, hasParent = b.GetBlockHash(), true
			}
		case *kvrouterv1.KvEvent_Removed:
			t := m.tier(ev.GetStorageTier())
			for _, h := range d.Removed.GetBlockHashes() {
				t.remove(h)
			}
		case *kvrouterv1.KvEvent_Cleared:
			// The router drops every tier of the rank on a cleared event, whichever tier it names
			// (§4.3); the mirror must hold what the router holds.
			clear(m.tiers)
		}
	}
}

// clear forgets everything: the engine restarted, or events were lost and nothing can tell which.
func (m *mirror) clear() {
	m.mu.Lock()
	defer m.mu.Unlock()
	clear(m.tiers)
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
		t.blocks[i] = b // stored again (an engine reporting a prefix hit): same place, newest content
		return
	}
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
		var cur *kvrouterv1.BlocksStored
		var last uint64
		for _, b := range t.blocks {
			if !b.live {
				continue
			}
			if cur == nil || !b.hasParent || b.parent != last {
				cur = &kvrouterv1.BlocksStored{}
				if b.hasParent {
					parent := b.parent
					cur.ParentHash = &parent
				}
				out = append(out, &kvrouterv1.KvEvent{StorageTier: tier, Data: &kvrouterv1.KvEvent_Stored{Stored: cur}})
			}
			th := b.tokensHash
			cur.Blocks = append(cur.Blocks, &kvrouterv1.StoredBlock{BlockHash: b.hash, TokensHash: &th})
			last = b.hash
		}
	}
	return out
}
