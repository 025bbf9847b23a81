package kvstate

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// indexModel is the plainest possible statement of the index's semantics: per worker and tier, the
// engine hashes the worker holds and the block (sequence hash) each names.
type indexModel map[uint32]*[NumTiers]map[uint64]uint64

func (m indexModel) tiers(slot uint32) *[NumTiers]map[uint64]uint64 {
	if m[slot] == nil {
		m[slot] = &[NumTiers]map[uint64]uint64{{}, {}, {}, {}}
	}
	return m[slot]
}

// holds reports whether the worker holds the block key in tier.
func (m indexModel) holds(slot uint32, tier Tier, key uint64) bool {
	if m[slot] == nil {
		return false
	}
	for _, k := range m[slot][tier] {
		if k == key {
			return true
		}
	}
	return false
}

// depths is Overlaps.Depths by definition: depth[t] counts the leading blocks the worker holds in
// tier t or a faster one.
func (m indexModel) depths(slot uint32, seq []uint64) [NumTiers]uint32 {
	var d [NumTiers]uint32
	for t := range NumTiers {
		for int(d[t]) < len(seq) {
			held := false
			for u := Tier(0); u <= Tier(t); u++ {
				held = held || m.holds(slot, u, seq[d[t]])
			}
			if !held {
				break
			}
			d[t]++
		}
	}
	return d
}

// TestIndexMatchesModel applies random stores (at the root or after a held parent, in any tier),
// removals and clears for 150 workers (three words of slots, so blocks have holder sets of several
// words) and for 40 (one word: the walk's fast path) and checks every worker's overlap depths, block
// counts and the index's length against indexModel after every step, and that a snapshot of the
// index decodes to the same answers.
func TestIndexMatchesModel(t *testing.T) {
	for _, workers := range []int{150, 40} {
		t.Run(fmt.Sprintf("workers=%d", workers), func(t *testing.T) { indexMatchesModel(t, workers) })
	}
}

func indexMatchesModel(t *testing.T, workers int) {
	const steps = 3000
	rng := rand.New(rand.NewPCG(3, 4))
	ix := NewIndex()
	model := indexModel{}
	// Prompts are paths in a small tree (3 choices a block), so they share prefixes of every length.
	prompt := func() (local, seq []uint64) {
		local = make([]uint64, 1+rng.IntN(20))
		for i := range local {
			local[i] = uint64(1 + rng.IntN(3))
		}
		return local, blockhash.Sequence(nil, local)
	}
	// Workers hash blocks their own way (engines with different hash seeds): engine hashes are
	// per worker.
	engineHash := func(slot uint32, key uint64) uint64 { return key ^ uint64(slot%7)<<56 }
	var o Overlaps
	for step := range steps {
		slot := uint32(rng.IntN(workers))
		// Most activity is on a few workers, so blocks gather many holders.
		if rng.IntN(2) == 0 {
			slot = uint32(rng.IntN(5)) * uint32((workers-1)/4)
		}
		tier := Tier(rng.IntN(int(NumTiers)))
		local, sq := prompt()
		switch op := rng.IntN(10); {
		case op < 6: // store, after a random prefix of the prompt as parent
			from := rng.IntN(len(sq))
			bs := make([]Block, 0, len(sq)-from)
			for i := from; i < len(sq); i++ {
				bs = append(bs, Block{Hash: engineHash(slot, sq[i]), Local: local[i]})
			}
			var parent uint64
			hasParent := from > 0
			wantErr := error(nil)
			if hasParent {
				parent = engineHash(slot, sq[from-1])
				_, inTier := model.tiers(slot)[tier][parent]
				found := inTier
				for u := range NumTiers {
					_, ok := model.tiers(slot)[u][parent]
					found = found || ok
				}
				if !found {
					wantErr = ErrParentNotFound
				}
			}
			_, err := ix.Store(slot, tier, parent, hasParent, bs)
			if !errors.Is(err, wantErr) {
				t.Fatalf("step %d: Store = %v, want %v", step, err, wantErr)
			}
			if err == nil {
				for i, b := range bs {
					model.tiers(slot)[tier][b.Hash] = sq[from+i]
				}
			}
		case op < 9: // remove a random suffix
			from := rng.IntN(len(sq))
			var hashes []uint64
			for _, k := range sq[from:] {
				hashes = append(hashes, engineHash(slot, k))
				delete(model.tiers(slot)[tier], engineHash(slot, k))
			}
			ix.Remove(slot, tier, hashes)
		default: // a clear drops every tier of the worker, never one (§4.3)
			ix.ClearWorker(slot)
			delete(model, slot)
		}
		_, q := prompt()
		checkAgainstModel(t, step, ix, model, q, &o, workers)
		if step%500 == 499 {
			checkSnapshotAgainstModel(t, step, ix, model, q, workers)
		}
	}
}

func checkAgainstModel(t *testing.T, step int, ix *Index, model indexModel, q []uint64, o *Overlaps, workers int) {
	t.Helper()
	ix.Overlaps(q, o)
	blocks := map[uint64]bool{}
	for slot := range uint32(workers) {
		if got, want := o.Depths(slot), model.depths(slot, q); got != want {
			t.Fatalf("step %d: worker %d depths %v, want %v", step, slot, got, want)
		}
		var want TierCounts
		if m := model[slot]; m != nil {
			for u := range NumTiers {
				want[u] = uint64(len(m[u]))
				for _, k := range m[u] {
					blocks[k] = true
				}
			}
		}
		if got := ix.BlockCounts(slot); got != want {
			t.Fatalf("step %d: worker %d BlockCounts %v, want %v", step, slot, got, want)
		}
	}
	if ix.Len() != len(blocks) {
		t.Fatalf("step %d: Len() = %d, want %d", step, ix.Len(), len(blocks))
	}
}

// checkSnapshotAgainstModel round-trips the index through a State snapshot of one model.
func checkSnapshotAgainstModel(t *testing.T, step int, ix *Index, model indexModel, q []uint64, workers int) {
	t.Helper()
	s := NewState()
	for w := range workers {
		info := WorkerInfo{Key: WorkerKey{ID: uint64(w) + 1}, Model: "m", Role: RoleAggregated, BlockSize: 16, KVEventsEnabled: true}
		if _, err := s.Apply(WorkerUp{Info: info}); err != nil {
			t.Fatal(err)
		}
	}
	s.models["m"].Index = ix
	r := NewState()
	if _, err := r.Restore(s.EncodeSnapshot(nil, SnapshotHeader{})); err != nil {
		t.Fatalf("step %d: Restore: %v", step, err)
	}
	var o Overlaps
	checkAgainstModel(t, step, r.models["m"].Index, model, q, &o, workers)
}

// TestStoreInChunksShowsPrefixes stores and removes long chains while other goroutines query them:
// Store releases the write lock between chunks of storeChunk blocks, so a reader may see part of
// an event, but only a prefix of whole chunks, never a hole or a block out of order.
func TestStoreInChunksShowsPrefixes(t *testing.T) {
	const length = 5*storeChunk + 7
	local := make([]uint64, length)
	for i := range local {
		local[i] = uint64(i) + 1
	}
	sq := blockhash.Sequence(nil, local)
	bs := make([]Block, length)
	hashes := make([]uint64, length)
	for i := range bs {
		bs[i] = Block{Hash: eh(sq[i]), Local: local[i]}
		hashes[i] = eh(sq[i])
	}
	ix := NewIndex()
	done := make(chan struct{})
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			var o Overlaps
			for {
				select {
				case <-done:
					errs <- nil
					return
				default:
				}
				ix.Overlaps(sq, &o)
				if d := o.Depths(0)[TierDevice]; d%storeChunk != 0 && d != length {
					errs <- fmt.Errorf("a reader saw depth %d: not a whole number of chunks", d)
					return
				}
			}
		}()
	}
	for range 300 {
		if _, err := ix.Store(0, TierDevice, 0, false, bs); err != nil {
			t.Fatal(err)
		}
		ix.Remove(0, TierDevice, hashes)
	}
	close(done)
	for range 2 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}
