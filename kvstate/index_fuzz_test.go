package kvstate

import (
	"errors"
	"testing"

	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// FuzzIndexMatchesModel applies any sequence of stores (at the root or after a parent, known or
// not, with duplicate and self-parenting blocks), removals (of held, unknown and repeated hashes)
// and clears to an index, for workers spread over two words of slots and every tier, and checks
// after every step that the index answers as indexModel does: every worker's overlap depths with a
// probe prompt, its block counts, and the number of blocks. At the end a snapshot of the index
// must restore to the same answers. The input is read as a little program, three bytes a step.
func FuzzIndexMatchesModel(f *testing.F) {
	f.Add([]byte{0, 1, 2, 0, 1, 3, 1, 1, 2, 2, 0, 0})
	f.Add([]byte{0, 70, 5, 0, 70, 9, 3, 70, 1, 0, 2, 200, 1, 2, 7})
	f.Add([]byte{0, 3, 0xff, 0, 3, 0x7f, 1, 3, 0xff, 4, 3, 0, 0, 3, 0x10})
	f.Add([]byte{0, 5, 0xe0, 0, 69, 0xe0, 2, 5, 0xe0, 0, 5, 0xe3, 2, 5, 0xe1}) // removals of held blocks
	f.Fuzz(func(t *testing.T, prog []byte) {
		if len(prog) > 600 {
			prog = prog[:600] // a few hundred steps find as much as more, faster
		}
		ix := NewIndex()
		model := indexModel{}
		var o Overlaps
		// Prompts are paths in a tree of 3 choices a block, up to 8 blocks: they share prefixes.
		prompt := func(b byte) (local, seq []uint64) {
			n := 1 + int(b>>5)
			local = make([]uint64, n)
			for i := range local {
				local[i] = uint64(1 + (int(b)>>(i%5))%3)
			}
			return local, blockhash.Sequence(nil, local)
		}
		engineHash := func(slot uint32, key uint64) uint64 { return key ^ uint64(slot%3)<<60 }
		const workers = 80 // two words of slots
		for step := 0; step+3 <= len(prog); step += 3 {
			op, who, arg := prog[step], prog[step+1], prog[step+2]
			slot, tier := uint32(who)%workers, Tier(who>>6)%NumTiers
			local, sq := prompt(arg)
			switch op % 5 {
			case 0, 1: // store from a point of the prompt; op 1 names the parent even when unheld
				from := int(arg) % len(sq)
				bs := make([]Block, 0, len(sq)-from)
				for i := from; i < len(sq); i++ {
					bs = append(bs, Block{Hash: engineHash(slot, sq[i]), Local: local[i]})
				}
				hasParent := from > 0 || op%5 == 1
				var parent uint64
				if from > 0 {
					parent = engineHash(slot, sq[from-1])
				} else if hasParent {
					parent = engineHash(slot, uint64(arg)<<40|1) // most likely unknown
				}
				var want error
				if hasParent {
					found := false
					for u := range NumTiers {
						_, ok := model.tiers(slot)[u][parent]
						found = found || ok
					}
					switch {
					case !found:
						want = ErrParentNotFound
					default:
						for _, b := range bs {
							if b.Hash == parent {
								want = ErrInvalidBlockSequence
							}
						}
					}
				}
				_, err := ix.Store(slot, tier, parent, hasParent, bs)
				if !errors.Is(err, want) {
					t.Fatalf("step %d: Store = %v, want %v", step/3, err, want)
				}
				if err == nil {
					for i, b := range bs {
						model.tiers(slot)[tier][b.Hash] = sq[from+i]
					}
				}
			case 2: // remove a suffix, some hashes twice, some unknown
				from := int(arg) % len(sq)
				var hashes []uint64
				for _, k := range sq[from:] {
					hashes = append(hashes, engineHash(slot, k), engineHash(slot, k))
				}
				hashes = append(hashes, uint64(arg)<<48|7)
				unknown := 0
				for _, h := range hashes {
					if _, ok := model.tiers(slot)[tier][h]; ok {
						delete(model.tiers(slot)[tier], h)
					} else {
						unknown++
					}
				}
				if got := ix.Remove(slot, tier, hashes); got != unknown {
					t.Fatalf("step %d: Remove = %d unknown, want %d", step/3, got, unknown)
				}
			case 3, 4: // a clear drops every tier of the worker (§4.3)
				ix.ClearWorker(slot)
				delete(model, slot)
			}
			_, q := prompt(arg ^ who)
			checkAgainstModel(t, step/3, ix, model, q, &o, workers)
		}
		_, q := prompt(0xA5)
		checkSnapshotAgainstModel(t, len(prog)/3, ix, model, q, workers)
	})
}
