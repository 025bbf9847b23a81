package kvstate

import (
	"errors"
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// Made-up local hashes of blocks ("a", "b", ...). They stand in for blockhash.Local values; the index
// only cares that they differ.
const (
	la uint64 = 0xa
	lb uint64 = 0xb
	lc uint64 = 0xc
	ld uint64 = 0xd
	le uint64 = 0xe
	lx uint64 = 0x78 // "x": a block no test stores unless it says so
	ly uint64 = 0x79
)

// eh returns the engine's block_hash of the block with local hash l. Engine hashes are opaque to the
// index; deriving them keeps them distinct from every local and sequence hash in these tests.
func eh(l uint64) uint64 { return 0xE0000000_00000000 | l }

// blocks returns stored blocks with the given local hashes and their engine hashes.
func blocks(locals ...uint64) []Block {
	out := make([]Block, len(locals))
	for i, l := range locals {
		out[i] = Block{Hash: eh(l), Local: l}
	}
	return out
}

// seq returns the sequence hashes of a prompt whose blocks have the given local hashes.
func seq(locals ...uint64) []uint64 { return blockhash.Sequence(nil, locals) }

// indexOp is one step of building an index for a test case.
type indexOp func(t *testing.T, ix *Index)

// store stores locals at the root for slot in tier, failing the test on error.
func store(slot uint32, tier Tier, locals ...uint64) indexOp {
	return func(t *testing.T, ix *Index) {
		t.Helper()
		if _, err := ix.Store(slot, tier, 0, false, blocks(locals...)); err != nil {
			t.Fatalf("Index.Store(%d, %v, root, %x) = %v, want nil", slot, tier, locals, err)
		}
	}
}

// storeAfter stores locals for slot in tier, chained onto the block with local hash parent.
func storeAfter(slot uint32, tier Tier, parent uint64, locals ...uint64) indexOp {
	return func(t *testing.T, ix *Index) {
		t.Helper()
		if _, err := ix.Store(slot, tier, eh(parent), true, blocks(locals...)); err != nil {
			t.Fatalf("Index.Store(%d, %v, parent %x, %x) = %v, want nil", slot, tier, parent, locals, err)
		}
	}
}

// remove removes the blocks with the given local hashes from slot's tier.
func remove(slot uint32, tier Tier, locals ...uint64) indexOp {
	return func(t *testing.T, ix *Index) {
		t.Helper()
		hashes := make([]uint64, len(locals))
		for i, l := range locals {
			hashes[i] = eh(l)
		}
		ix.Remove(slot, tier, hashes)
	}
}

// storeRaw stores the given blocks at the root for slot in tier.
func storeRaw(slot uint32, tier Tier, bs ...Block) indexOp {
	return func(t *testing.T, ix *Index) {
		t.Helper()
		if _, err := ix.Store(slot, tier, 0, false, bs); err != nil {
			t.Fatalf("Index.Store(%d, %v, root, %v) = %v, want nil", slot, tier, bs, err)
		}
	}
}

func clearWorker(slot uint32) indexOp {
	return func(t *testing.T, ix *Index) { ix.ClearWorker(slot) }
}

func buildIndex(t *testing.T, ops []indexOp) *Index {
	t.Helper()
	ix := NewIndex()
	for _, op := range ops {
		op(t, ix)
	}
	return ix
}

// testSlots are the slots every index test looks at; tests use no others.
var testSlots = []uint32{0, 1, 2, 3}

// overlapBlocks returns Overlaps.Blocks of every test slot with a non-zero overlap with the prompt.
func overlapBlocks(ix *Index, locals ...uint64) map[uint32]TierCounts {
	var o Overlaps
	ix.Overlaps(seq(locals...), &o)
	out := map[uint32]TierCounts{}
	for _, s := range testSlots {
		if c := o.Blocks(s); c.Total() > 0 {
			out[s] = c
		}
	}
	return out
}

// overlapDepths returns Overlaps.Depths of every test slot with a non-zero overlap with the prompt.
func overlapDepths(ix *Index, locals ...uint64) map[uint32][NumTiers]uint32 {
	var o Overlaps
	ix.Overlaps(seq(locals...), &o)
	out := map[uint32][NumTiers]uint32{}
	for _, s := range testSlots {
		if d := o.Depths(s); d != ([NumTiers]uint32{}) {
			out[s] = d
		}
	}
	return out
}

// indexView is everything observable about an index, for "unchanged" and "changed to" checks.
type indexView struct {
	Len    int
	Counts map[uint32]TierCounts       // non-zero BlockCounts per test slot
	Depths map[uint32][NumTiers]uint32 // overlap depths with the probe prompt [a,b,c,d,e]
	Side   map[uint32][NumTiers]uint32 // overlap depths with the probe prompt [a,x,y]
}

func viewIndex(ix *Index) indexView {
	v := indexView{Len: ix.Len(), Counts: map[uint32]TierCounts{}}
	for _, s := range testSlots {
		if c := ix.BlockCounts(s); c.Total() > 0 {
			v.Counts[s] = c
		}
	}
	v.Depths = overlapDepths(ix, la, lb, lc, ld, le)
	v.Side = overlapDepths(ix, la, lx, ly)
	return v
}

// TestIndexOverlaps checks overlap scores (§4.3, §10.10) for indexes built by stores, removals and
// clears. Every case lists every slot with a non-zero overlap, so a spurious score fails too.
func TestIndexOverlaps(t *testing.T) {
	tests := []struct {
		name  string
		ops   []indexOp
		query []uint64 // local hashes of the prompt
		want  map[uint32]TierCounts
		// wantDepths, when set, are the cumulative depths per tier (Overlaps.Depths).
		wantDepths map[uint32][NumTiers]uint32
	}{
		{
			name:  "10.10: W0 [a,b,c], W1 [a,b], query [a,b,c,d] scores W0=3, W1=2",
			ops:   []indexOp{store(0, TierDevice, la, lb, lc), store(1, TierDevice, la, lb)},
			query: []uint64{la, lb, lc, ld},
			want:  map[uint32]TierCounts{0: {3}, 1: {2}},
		},
		{
			// Dynamo's per-block tree with early exit would report W0=3 here (§10.10); this index
			// never exits early.
			name:  "10.10: W0 [a,b,c,d,e], W1 [a,b], query [a,b,c,d,e] scores W0=5, W1=2 (no early exit)",
			ops:   []indexOp{store(0, TierDevice, la, lb, lc, ld, le), store(1, TierDevice, la, lb)},
			query: []uint64{la, lb, lc, ld, le},
			want:  map[uint32]TierCounts{0: {5}, 1: {2}},
		},
		{
			name:  "empty index scores nobody",
			query: []uint64{la, lb},
			want:  map[uint32]TierCounts{},
		},
		{
			name:  "empty query scores nobody",
			ops:   []indexOp{store(0, TierDevice, la, lb)},
			query: nil,
			want:  map[uint32]TierCounts{},
		},
		{
			name:  "overlap ends where the prompt diverges",
			ops:   []indexOp{store(0, TierDevice, la, lb, lc)},
			query: []uint64{la, lx, lc},
			want:  map[uint32]TierCounts{0: {1}},
		},
		{
			// Nodes are keyed by the whole prefix: the same tokens at another position are another block.
			name:  "a stored suffix does not match a prompt starting with it",
			ops:   []indexOp{store(0, TierDevice, la, lb, lc)},
			query: []uint64{lb, lc},
			want:  map[uint32]TierCounts{},
		},
		{
			name:  "diverging branches score each worker on its own branch",
			ops:   []indexOp{store(0, TierDevice, la, lb, lc), store(1, TierDevice, la, lx, ly)},
			query: []uint64{la, lx, ly},
			want:  map[uint32]TierCounts{0: {1}, 1: {3}},
		},
		{
			name:  "store [a,b] then [c] with parent hash(b) chains to [a,b,c]",
			ops:   []indexOp{store(0, TierDevice, la, lb), storeAfter(0, TierDevice, lb, lc)},
			query: []uint64{la, lb, lc},
			want:  map[uint32]TierCounts{0: {3}},
		},
		{
			name:  "chaining onto a middle block forks the worker's prefix",
			ops:   []indexOp{store(0, TierDevice, la, lb, lc), storeAfter(0, TierDevice, la, lx, ly)},
			query: []uint64{la, lx, ly},
			want:  map[uint32]TierCounts{0: {3}},
		},
		{
			name: "removing middle block b of W0 cuts W0's overlap for [a,b,c] to 1",
			ops: []indexOp{
				store(0, TierDevice, la, lb, lc), store(1, TierDevice, la, lb, lc),
				remove(0, TierDevice, lb),
			},
			query: []uint64{la, lb, lc},
			want:  map[uint32]TierCounts{0: {1}, 1: {3}},
		},
		{
			name:  "removing the first block leaves no overlap",
			ops:   []indexOp{store(0, TierDevice, la, lb, lc), remove(0, TierDevice, la)},
			query: []uint64{la, lb, lc},
			want:  map[uint32]TierCounts{},
		},
		{
			// W0's orphaned block c still sits under the prefix [a,b,c]; when another worker brings
			// [a,b] back, W0 must not be credited with c, because it does not hold b.
			name: "a removed block re-created by another worker does not revive W0's tail",
			ops: []indexOp{
				store(0, TierDevice, la, lb, lc), remove(0, TierDevice, lb),
				store(1, TierDevice, la, lb),
			},
			query: []uint64{la, lb, lc},
			want:  map[uint32]TierCounts{0: {1}, 1: {2}},
		},
		{
			name:  "re-storing the same blocks is idempotent",
			ops:   []indexOp{store(0, TierDevice, la, lb, lc), store(0, TierDevice, la, lb, lc)},
			query: []uint64{la, lb, lc, ld},
			want:  map[uint32]TierCounts{0: {3}},
		},
		{
			name: "removing a re-stored block once removes it",
			ops: []indexOp{
				store(0, TierDevice, la, lb, lc), store(0, TierDevice, la, lb, lc),
				remove(0, TierDevice, lc),
			},
			query: []uint64{la, lb, lc},
			want:  map[uint32]TierCounts{0: {2}},
		},
		{
			name:       "W0 [a,b] on device and [c,d] on host chained onto device b: device 2, host 2",
			ops:        []indexOp{store(0, TierDevice, la, lb), storeAfter(0, TierHost, lb, lc, ld)},
			query:      []uint64{la, lb, lc, ld},
			want:       map[uint32]TierCounts{0: {2, 2, 0, 0}},
			wantDepths: map[uint32][NumTiers]uint32{0: {2, 4, 4, 4}},
		},
		{
			name:       "a block on both device and host counts once, in the faster tier",
			ops:        []indexOp{store(0, TierDevice, la, lb), store(0, TierHost, la, lb)},
			query:      []uint64{la, lb, lc},
			want:       map[uint32]TierCounts{0: {2, 0, 0, 0}},
			wantDepths: map[uint32][NumTiers]uint32{0: {2, 2, 2, 2}},
		},
		{
			name:       "host copy longer than the device copy extends the host depth only",
			ops:        []indexOp{store(0, TierDevice, la, lb), store(0, TierHost, la, lb, lc)},
			query:      []uint64{la, lb, lc, ld},
			want:       map[uint32]TierCounts{0: {2, 1, 0, 0}},
			wantDepths: map[uint32][NumTiers]uint32{0: {2, 3, 3, 3}},
		},
		{
			name:       "external blocks beyond the device prefix count in the external tier only",
			ops:        []indexOp{store(0, TierDevice, la), storeAfter(0, TierExternal, la, lb, lc)},
			query:      []uint64{la, lb, lc},
			want:       map[uint32]TierCounts{0: {1, 0, 0, 2}},
			wantDepths: map[uint32][NumTiers]uint32{0: {1, 1, 1, 3}},
		},
		{
			name:       "disk-only prefix has no device or host depth",
			ops:        []indexOp{store(0, TierDisk, la, lb)},
			query:      []uint64{la, lb},
			want:       map[uint32]TierCounts{0: {0, 0, 2, 0}},
			wantDepths: map[uint32][NumTiers]uint32{0: {0, 0, 2, 2}},
		},
		{
			// The device block b chains onto a parent held only on the host (cross-tier parent lookup).
			name:       "device block after a host-only first block: device 0, host 2",
			ops:        []indexOp{store(0, TierHost, la), storeAfter(0, TierDevice, la, lb)},
			query:      []uint64{la, lb},
			want:       map[uint32]TierCounts{0: {0, 2, 0, 0}},
			wantDepths: map[uint32][NumTiers]uint32{0: {0, 2, 2, 2}},
		},
		{
			name: "tiers of different workers do not mix",
			ops: []indexOp{
				store(0, TierDevice, la, lb), storeAfter(0, TierHost, lb, lc),
				store(1, TierHost, la, lb, lc, ld),
			},
			query: []uint64{la, lb, lc, ld},
			want:  map[uint32]TierCounts{0: {2, 1, 0, 0}, 1: {0, 4, 0, 0}},
		},
		{
			// §10.10 "Cleared for (W0, rank 0) ⇒ W0 rank 1 untouched": the two ranks are slots 0 and 1.
			name: "clearing slot 0 leaves slot 1 untouched",
			ops: []indexOp{
				store(0, TierDevice, la, lb, lc), store(1, TierDevice, la, lb, lc),
				clearWorker(0),
			},
			query: []uint64{la, lb, lc},
			want:  map[uint32]TierCounts{1: {3}},
		},
		{
			// The host blocks remain, but they continue a prefix the worker no longer holds.
			name: "removing the device blocks breaks a host continuation",
			ops: []indexOp{
				store(0, TierDevice, la, lb), storeAfter(0, TierHost, lb, lc, ld),
				remove(0, TierDevice, la, lb),
			},
			query: []uint64{la, lb, lc, ld},
			want:  map[uint32]TierCounts{},
		},
		{
			name: "ClearWorker drops every tier of one slot only",
			ops: []indexOp{
				store(0, TierDevice, la, lb), storeAfter(0, TierHost, lb, lc), store(0, TierDisk, la, lb, lc, ld),
				store(1, TierDevice, la),
				clearWorker(0),
			},
			query: []uint64{la, lb, lc, ld},
			want:  map[uint32]TierCounts{1: {1}},
		},
		{
			// The engine named block x with the hash it used for a: a is gone from W0's cache.
			name:  "an engine hash reused for other content replaces the old block",
			ops:   []indexOp{store(0, TierDevice, la, lb), storeRaw(0, TierDevice, Block{Hash: eh(la), Local: lx})},
			query: []uint64{la, lb},
			want:  map[uint32]TierCounts{},
		},
		{
			name:  "an engine hash reused for other content: the new block is held",
			ops:   []indexOp{store(0, TierDevice, la, lb), storeRaw(0, TierDevice, Block{Hash: eh(la), Local: lx})},
			query: []uint64{lx},
			want:  map[uint32]TierCounts{0: {1}},
		},
		{
			name:  "storing again after ClearWorker starts afresh",
			ops:   []indexOp{store(0, TierDevice, la, lb, lc), clearWorker(0), store(0, TierDevice, la)},
			query: []uint64{la, lb, lc},
			want:  map[uint32]TierCounts{0: {1}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := buildIndex(t, tc.ops)
			got := overlapBlocks(ix, tc.query...)
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("Overlaps(%x).Blocks = %v, want %v (-want +got):\n%s", tc.query, got, tc.want, diff)
			}
			if tc.wantDepths != nil {
				gotDepths := overlapDepths(ix, tc.query...)
				if diff := cmp.Diff(tc.wantDepths, gotDepths); diff != "" {
					t.Errorf("Overlaps(%x).Depths = %v, want %v (-want +got):\n%s", tc.query, gotDepths, tc.wantDepths, diff)
				}
			}
		})
	}
}

// TestIndexStoreErrors checks that a rejected store reports its error and changes nothing: not the
// number of nodes, not any worker's block counts, not any overlap.
func TestIndexStoreErrors(t *testing.T) {
	tests := []struct {
		name    string
		ops     []indexOp
		slot    uint32
		parent  uint64 // engine hash
		blocks  []Block
		wantErr error
	}{
		{
			name:    "unknown parent on a worker with no blocks",
			slot:    0,
			parent:  eh(lb),
			blocks:  blocks(lc),
			wantErr: ErrParentNotFound,
		},
		{
			name:    "unknown parent on a worker with other blocks",
			ops:     []indexOp{store(0, TierDevice, la, lb)},
			slot:    0,
			parent:  eh(lx),
			blocks:  blocks(lc),
			wantErr: ErrParentNotFound,
		},
		{
			// The parent must be held by the same worker, not just be somewhere in the index.
			name:    "parent held only by another worker",
			ops:     []indexOp{store(1, TierDevice, la, lb)},
			slot:    0,
			parent:  eh(lb),
			blocks:  blocks(lc),
			wantErr: ErrParentNotFound,
		},
		{
			name:    "parent removed earlier",
			ops:     []indexOp{store(0, TierDevice, la, lb), remove(0, TierDevice, lb)},
			slot:    0,
			parent:  eh(lb),
			blocks:  blocks(lc),
			wantErr: ErrParentNotFound,
		},
		{
			name:    "parent cleared earlier",
			ops:     []indexOp{store(0, TierDevice, la, lb), store(1, TierDevice, la, lb), clearWorker(0)},
			slot:    0,
			parent:  eh(lb),
			blocks:  blocks(lc),
			wantErr: ErrParentNotFound,
		},
		{
			name:    "blocks contain the parent hash",
			ops:     []indexOp{store(0, TierDevice, la, lb)},
			slot:    0,
			parent:  eh(lb),
			blocks:  blocks(lc, lb),
			wantErr: ErrInvalidBlockSequence,
		},
		{
			name:    "first block is the parent itself",
			ops:     []indexOp{store(0, TierDevice, la, lb)},
			slot:    0,
			parent:  eh(lb),
			blocks:  blocks(lb, lc),
			wantErr: ErrInvalidBlockSequence,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := buildIndex(t, tc.ops)
			before := viewIndex(ix)
			dups, err := ix.Store(tc.slot, TierDevice, tc.parent, true, tc.blocks)
			if !errors.Is(err, tc.wantErr) {
				t.Errorf("Index.Store(%d, device, %x, %v) error = %v, want %v", tc.slot, tc.parent, tc.blocks, err, tc.wantErr)
			}
			if dups != 0 {
				t.Errorf("Index.Store(%d, device, %x, %v) duplicates = %d, want 0", tc.slot, tc.parent, tc.blocks, dups)
			}
			if diff := cmp.Diff(before, viewIndex(ix)); diff != "" {
				t.Errorf("Index changed by a rejected Store (-before +after):\n%s", diff)
			}
		})
	}
}

// TestIndexStore checks what a successful store returns (duplicate blocks) and leaves behind.
func TestIndexStore(t *testing.T) {
	tests := []struct {
		name       string
		ops        []indexOp
		slot       uint32
		tier       Tier
		parent     uint64 // local hash of the parent block; 0 = root
		locals     []uint64
		raw        []Block // stored instead of blocks(locals...) when set
		wantDups   int
		wantCounts TierCounts // BlockCounts(slot) afterwards
		wantLen    int
	}{
		{
			name:       "fresh store",
			locals:     []uint64{la, lb, lc},
			wantCounts: TierCounts{3},
			wantLen:    3,
		},
		{
			name:       "same blocks again are all duplicates",
			ops:        []indexOp{store(0, TierDevice, la, lb, lc)},
			locals:     []uint64{la, lb, lc},
			wantDups:   3,
			wantCounts: TierCounts{3},
			wantLen:    3,
		},
		{
			name:       "extending a stored prefix repeats its blocks",
			ops:        []indexOp{store(0, TierDevice, la, lb)},
			locals:     []uint64{la, lb, lc},
			wantDups:   2,
			wantCounts: TierCounts{3},
			wantLen:    3,
		},
		{
			name:       "re-storing a chained block via its parent is a duplicate",
			ops:        []indexOp{store(0, TierDevice, la, lb, lc)},
			parent:     lb,
			locals:     []uint64{lc},
			wantDups:   1,
			wantCounts: TierCounts{3},
			wantLen:    3,
		},
		{
			name:       "the same blocks in another tier are new",
			ops:        []indexOp{store(0, TierDevice, la, lb)},
			tier:       TierHost,
			locals:     []uint64{la, lb},
			wantCounts: TierCounts{2, 2},
			wantLen:    2,
		},
		{
			name:       "the same blocks on another worker are new",
			ops:        []indexOp{store(0, TierDevice, la, lb)},
			slot:       1,
			locals:     []uint64{la, lb},
			wantCounts: TierCounts{2},
			wantLen:    2,
		},
		{
			// a's node loses its only holder and goes; x's node is new.
			name:       "an engine hash reused for other content drops the old block",
			ops:        []indexOp{store(0, TierDevice, la)},
			raw:        []Block{{Hash: eh(la), Local: lx}},
			wantCounts: TierCounts{1},
			wantLen:    1,
		},
		{
			name:       "an empty store changes nothing",
			locals:     nil,
			wantCounts: TierCounts{},
			wantLen:    0,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := buildIndex(t, tc.ops)
			parent, hasParent := uint64(0), tc.parent != 0
			if hasParent {
				parent = eh(tc.parent)
			}
			bs := blocks(tc.locals...)
			if tc.raw != nil {
				bs = tc.raw
			}
			dups, err := ix.Store(tc.slot, tc.tier, parent, hasParent, bs)
			if err != nil {
				t.Fatalf("Index.Store(%d, %v, %x, %x) = %v, want nil", tc.slot, tc.tier, parent, tc.locals, err)
			}
			if dups != tc.wantDups {
				t.Errorf("Index.Store(%d, %v, %x, %x) duplicates = %d, want %d", tc.slot, tc.tier, parent, tc.locals, dups, tc.wantDups)
			}
			if got := ix.BlockCounts(tc.slot); got != tc.wantCounts {
				t.Errorf("Index.BlockCounts(%d) = %v, want %v", tc.slot, got, tc.wantCounts)
			}
			if got := ix.Len(); got != tc.wantLen {
				t.Errorf("Index.Len() = %d, want %d", got, tc.wantLen)
			}
		})
	}
}

// TestIndexRemove checks removals: unknown hashes are counted and change nothing, known ones take the
// worker off exactly that block.
func TestIndexRemove(t *testing.T) {
	// Every case starts from W0 (slot 0) holding [a,b,c] and W1 (slot 1) holding [a,b] on the device.
	base := []indexOp{store(0, TierDevice, la, lb, lc), store(1, TierDevice, la, lb)}
	tests := []struct {
		name        string
		slot        uint32
		tier        Tier
		locals      []uint64 // local hashes of the removed blocks (engine hashes are eh(local))
		wantUnknown int
		want        indexView
	}{
		{
			name:        "unknown hash is counted and nothing else changes",
			slot:        0,
			locals:      []uint64{lx},
			wantUnknown: 1,
			want: indexView{
				Len:    3,
				Counts: map[uint32]TierCounts{0: {3}, 1: {2}},
				Depths: map[uint32][NumTiers]uint32{0: {3, 3, 3, 3}, 1: {2, 2, 2, 2}},
				Side:   map[uint32][NumTiers]uint32{0: {1, 1, 1, 1}, 1: {1, 1, 1, 1}},
			},
		},
		{
			name:        "worker holding nothing: every hash unknown",
			slot:        2,
			locals:      []uint64{la, lb},
			wantUnknown: 2,
			want: indexView{
				Len:    3,
				Counts: map[uint32]TierCounts{0: {3}, 1: {2}},
				Depths: map[uint32][NumTiers]uint32{0: {3, 3, 3, 3}, 1: {2, 2, 2, 2}},
				Side:   map[uint32][NumTiers]uint32{0: {1, 1, 1, 1}, 1: {1, 1, 1, 1}},
			},
		},
		{
			name:        "hash held in another tier is unknown in this one",
			slot:        0,
			tier:        TierHost,
			locals:      []uint64{lc},
			wantUnknown: 1,
			want: indexView{
				Len:    3,
				Counts: map[uint32]TierCounts{0: {3}, 1: {2}},
				Depths: map[uint32][NumTiers]uint32{0: {3, 3, 3, 3}, 1: {2, 2, 2, 2}},
				Side:   map[uint32][NumTiers]uint32{0: {1, 1, 1, 1}, 1: {1, 1, 1, 1}},
			},
		},
		{
			name:        "known and unknown hashes in one event",
			slot:        0,
			locals:      []uint64{lc, lx},
			wantUnknown: 1,
			want: indexView{
				Len:    2,
				Counts: map[uint32]TierCounts{0: {2}, 1: {2}},
				Depths: map[uint32][NumTiers]uint32{0: {2, 2, 2, 2}, 1: {2, 2, 2, 2}},
				Side:   map[uint32][NumTiers]uint32{0: {1, 1, 1, 1}, 1: {1, 1, 1, 1}},
			},
		},
		{
			name:        "the same hash twice: the second is unknown",
			slot:        0,
			locals:      []uint64{lc, lc},
			wantUnknown: 1,
			want: indexView{
				Len:    2,
				Counts: map[uint32]TierCounts{0: {2}, 1: {2}},
				Depths: map[uint32][NumTiers]uint32{0: {2, 2, 2, 2}, 1: {2, 2, 2, 2}},
				Side:   map[uint32][NumTiers]uint32{0: {1, 1, 1, 1}, 1: {1, 1, 1, 1}},
			},
		},
		{
			name:   "a block another worker still holds keeps its node",
			slot:   1,
			locals: []uint64{la, lb},
			want: indexView{
				Len:    3,
				Counts: map[uint32]TierCounts{0: {3}},
				Depths: map[uint32][NumTiers]uint32{0: {3, 3, 3, 3}},
				Side:   map[uint32][NumTiers]uint32{0: {1, 1, 1, 1}},
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := buildIndex(t, base)
			hashes := make([]uint64, len(tc.locals))
			for i, l := range tc.locals {
				hashes[i] = eh(l)
			}
			if got := ix.Remove(tc.slot, tc.tier, hashes); got != tc.wantUnknown {
				t.Errorf("Index.Remove(%d, %v, %x) = %d, want %d", tc.slot, tc.tier, hashes, got, tc.wantUnknown)
			}
			if diff := cmp.Diff(tc.want, viewIndex(ix)); diff != "" {
				t.Errorf("Index after Remove (-want +got):\n%s", diff)
			}
		})
	}
}

// TestIndexLen follows one index through a sequence of changes and checks that a node disappears
// exactly when the last worker (in any tier) lets go of it.
func TestIndexLen(t *testing.T) {
	ix := NewIndex()
	steps := []struct {
		name       string
		op         indexOp
		wantLen    int
		wantCounts map[uint32]TierCounts
	}{
		{"W0 stores [a,b,c]", store(0, TierDevice, la, lb, lc), 3, map[uint32]TierCounts{0: {3}}},
		{"W1 stores [a,b]: shared nodes", store(1, TierDevice, la, lb), 3, map[uint32]TierCounts{0: {3}, 1: {2}}},
		{"W1 stores [a,b] on host", store(1, TierHost, la, lb), 3, map[uint32]TierCounts{0: {3}, 1: {2, 2}}},
		{"W0 removes c: last holder", remove(0, TierDevice, lc), 2, map[uint32]TierCounts{0: {2}, 1: {2, 2}}},
		{"W0 removes b: W1 still holds it", remove(0, TierDevice, lb), 2, map[uint32]TierCounts{0: {1}, 1: {2, 2}}},
		{"W1 removes its device blocks: host still holds b", remove(1, TierDevice, la, lb), 2, map[uint32]TierCounts{0: {1}, 1: {0, 2}}},
		{"W1 removed: only W0's a is left", clearWorker(1), 1, map[uint32]TierCounts{0: {1}}},
		{"W0 removed: empty", clearWorker(0), 0, map[uint32]TierCounts{}},
	}
	for _, st := range steps {
		st.op(t, ix)
		if got := ix.Len(); got != st.wantLen {
			t.Errorf("after %q: Index.Len() = %d, want %d", st.name, got, st.wantLen)
		}
		got := map[uint32]TierCounts{}
		for _, s := range testSlots {
			if c := ix.BlockCounts(s); c.Total() > 0 {
				got[s] = c
			}
		}
		if diff := cmp.Diff(st.wantCounts, got); diff != "" {
			t.Errorf("after %q: Index.BlockCounts = %v, want %v (-want +got):\n%s", st.name, got, st.wantCounts, diff)
		}
	}
}

// TestOverlapsReuse checks that an Overlaps reused across queries never leaks scores from an earlier
// query, including across growth to a high slot and across the wrap-around of its query counter.
func TestOverlapsReuse(t *testing.T) {
	ix := buildIndex(t, []indexOp{
		store(0, TierDevice, la, lb, lc),
		store(1, TierDevice, lx, ly),
		store(200, TierDevice, la, lb),
	})
	tests := []struct {
		name   string
		epoch  uint32 // when set, the Overlaps' query counter just before the second query
		first  []uint64
		second []uint64
		slots  []uint32
		want   map[uint32][NumTiers]uint32 // Depths after the second query
	}{
		{
			name:   "second query forgets the first",
			first:  []uint64{la, lb, lc},
			second: []uint64{lx, ly},
			slots:  []uint32{0, 1, 200},
			want:   map[uint32][NumTiers]uint32{0: {}, 1: {2, 2, 2, 2}, 200: {}},
		},
		{
			name:   "high slot grows the scratch space",
			first:  []uint64{lx},
			second: []uint64{la, lb, lc},
			slots:  []uint32{0, 1, 200, 1000},
			want:   map[uint32][NumTiers]uint32{0: {3, 3, 3, 3}, 1: {}, 200: {2, 2, 2, 2}, 1000: {}},
		},
		{
			// The first query ran at counter 1; the second wraps the counter around to 1 again and
			// must not take the first query's entries for its own.
			name:   "query counter wrap-around forgets the first query",
			epoch:  math.MaxUint32,
			first:  []uint64{la, lb, lc},
			second: []uint64{lx, ly},
			slots:  []uint32{0, 1, 200},
			want:   map[uint32][NumTiers]uint32{0: {}, 1: {2, 2, 2, 2}, 200: {}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var o Overlaps
			ix.Overlaps(seq(tc.first...), &o)
			if tc.epoch != 0 {
				o.epoch = tc.epoch
			}
			ix.Overlaps(seq(tc.second...), &o)
			got := map[uint32][NumTiers]uint32{}
			for _, s := range tc.slots {
				got[s] = o.Depths(s)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("Overlaps(%x) after Overlaps(%x): Depths = %v, want %v (-want +got):\n%s", tc.second, tc.first, got, tc.want, diff)
			}
		})
	}
}
