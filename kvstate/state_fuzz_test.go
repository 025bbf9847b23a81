package kvstate

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// FuzzApplyEvents applies any sequence of changes, valid and invalid, to two states the same way
// (one with Apply, one with ApplyReplicated, as the replica that received them and another that
// reads them from the log), some of them under an index cap: registrations (with conflicting
// capacities and block sizes), KV batches (in order, duplicated, with gaps, out-of-range tiers and
// kinds, unknown parents), dumps (stale ones too) and removals. It checks that both states give the
// same answers and the same digest after every step, that the index count the cap keeps equals the
// indexes' true size, that every worker's block counts match its index, and that a snapshot
// restores to the same digest. The input is read as a little program, four bytes a step.
func FuzzApplyEvents(f *testing.F) {
	f.Add([]byte{0, 1, 0, 0, 1, 1, 0, 5, 1, 1, 1, 5, 3, 1, 0, 0})
	f.Add([]byte{0, 1, 0, 0, 0, 2, 0, 0, 1, 1, 0, 0xe7, 1, 2, 3, 0x67, 2, 1, 9, 3, 4, 1, 0, 0})
	f.Add([]byte{0, 1, 1, 1, 1, 1, 7, 0xff, 1, 1, 0, 0x10, 5, 1, 0, 0, 1, 1, 2, 0x41})
	f.Fuzz(func(t *testing.T, prog []byte) {
		if len(prog) > 800 {
			prog = prog[:800]
		}
		capped := len(prog) > 0 && prog[0]&0x80 != 0
		direct, replicated := NewState(), NewState()
		if capped {
			direct.SetMaxIndexBlocks(int(prog[0]&0x7f) + 1)
			replicated.SetMaxIndexBlocks(int(prog[0]&0x7f) + 1)
		}
		nextID := map[WorkerKey]uint64{}
		for step := 0; step+4 <= len(prog); step += 4 {
			op, who, a, b := prog[step], prog[step+1], prog[step+2], prog[step+3]
			key := WorkerKey{ID: uint64(who%4) + 1, Rank: uint32(who>>2) % 2}
			c := change(op, key, a, b, nextID)
			r1, e1 := direct.Apply(c)
			r2, e2 := replicated.ApplyReplicated(c)
			if (e1 == nil) != (e2 == nil) || (e1 != nil && !errors.Is(e2, errors.Unwrap(e1)) && e1.Error() != e2.Error()) {
				t.Fatalf("step %d %T: Apply = %v, ApplyReplicated = %v", step/4, c, e1, e2)
			}
			if e1 == nil && r1.LastEventID != r2.LastEventID {
				t.Fatalf("step %d %T: Apply = %+v, ApplyReplicated = %+v", step/4, c, r1, r2)
			}
			if a, b := direct.Digest(), replicated.Digest(); a != b {
				t.Fatalf("step %d %T: digests differ: %x, %x", step/4, c, a, b)
			}
			checkIndexInvariants(t, direct)
		}
		restored := NewState()
		if _, err := restored.Restore(direct.EncodeSnapshot(nil, SnapshotHeader{})); err != nil {
			t.Fatalf("Restore() = %v", err)
		}
		if a, b := direct.Digest(), restored.Digest(); a != b {
			t.Fatalf("digest after a snapshot round trip = %x, want %x", b, a)
		}
		checkIndexInvariants(t, restored)
	})
}

// change builds the change a fuzz step names.
func change(op byte, key WorkerKey, a, b byte, nextID map[WorkerKey]uint64) Change {
	tier := Tier(b>>6) % (NumTiers + 1) // NumTiers itself is out of range: dropped, counted
	blocks := func() []Block {
		n := 1 + int(a%6)
		bs := make([]Block, n)
		local := make([]uint64, n)
		for i := range local {
			local[i] = uint64(1 + (int(b)+i)%5)
		}
		for i, s := range blockhash.Sequence(nil, local) {
			bs[i] = Block{Hash: s ^ uint64(key.ID)<<56, Local: local[i]}
		}
		return bs
	}
	id := func() uint64 { // mostly the next id; sometimes a duplicate or a gap
		n := nextID[key]
		switch a >> 6 {
		case 1:
			if n > 0 {
				return n - 1
			}
		case 2:
			n += 2
		}
		nextID[key] = n + 1
		return n
	}
	switch op % 6 {
	case 0:
		info := WorkerInfo{Key: key, Model: fmt.Sprintf("m%d", a%2), Role: RoleAggregated, BlockSize: 16 << (b % 2),
			TotalKVBlocks: 1000, Endpoint: "w"}
		if a&0x10 != 0 {
			nextID[key] = 0
		}
		return WorkerUp{Info: info, Reset: a&0x10 != 0}
	case 1:
		bs := blocks()
		ev := Event{ID: id(), Tier: tier, Kind: EventStored, Blocks: bs}
		if b&1 != 0 {
			ev.Parent, ev.HasParent = bs[0].Hash^uint64(b), true // usually unknown
		}
		return KVEvents{Worker: key, Events: []Event{ev}}
	case 2:
		bs := blocks()
		return KVEvents{Worker: key, Events: []Event{{ID: id(), Tier: tier, Kind: EventRemoved, Removed: []uint64{bs[len(bs)-1].Hash, bs[0].Hash}}}}
	case 3:
		return KVEvents{Worker: key, Events: []Event{{ID: id(), Tier: tier, Kind: EventKind(b % 5)}}} // cleared, or kinds out of range
	case 4:
		through := uint64(a)
		nextID[key] = through + 1
		return KVDump{Worker: key, ThroughEventID: through, Events: []Event{{Tier: tier % NumTiers, Kind: EventStored, Blocks: blocks()}}}
	default:
		return WorkerRemoved{Key: key}
	}
}

// checkIndexInvariants: the count the index cap keeps is the indexes' size, and every worker's
// block counts are what its index holds for it.
func checkIndexInvariants(t *testing.T, s *State) {
	t.Helper()
	total := 0
	for _, m := range s.Models() {
		total += m.Index.Len()
		for _, w := range m.Workers() {
			counts := m.Index.BlockCounts(w.Slot)
			for tier, n := range counts {
				if n > uint64(m.Index.Len()) {
					t.Fatalf("worker %v holds %d blocks in tier %d of an index of %d", w.Info.Key, n, tier, m.Index.Len())
				}
			}
		}
	}
	if got := s.IndexBlocks(); got != int64(total) {
		t.Fatalf("the cap counts %d index blocks, the indexes hold %d", got, total)
	}
}
