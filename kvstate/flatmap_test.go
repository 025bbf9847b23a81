package kvstate

import (
	"math/rand/v2"
	"testing"
)

// TestFlatMapMatchesMap drives flatMap (empty, or sized for some keys up front) and a Go map through the same random inserts, updates and
// deletes, with keys that are random, sequential (like small engine hashes) or multiples of a large
// power of two, and the key 0. The table grows through many rebuilds and segment splits; after every
// step the two must agree on the changed key, and at checkpoints on every key and the length.
func TestFlatMapMatchesMap(t *testing.T) {
	keyShapes := map[string]func(r *rand.Rand, n int) uint64{
		"random":     func(r *rand.Rand, n int) uint64 { return r.Uint64() },
		"sequential": func(r *rand.Rand, n int) uint64 { return uint64(r.IntN(n)) },
		"strided":    func(r *rand.Rand, n int) uint64 { return uint64(r.IntN(n)) << 40 },
	}
	makers := map[string]func() *flatMap[uint64]{
		"empty":        newFlatMap[uint64],
		"sized 5,000":  func() *flatMap[uint64] { return newFlatMapSized[uint64](5_000) },
		"sized 60,000": func() *flatMap[uint64] { return newFlatMapSized[uint64](60_000) },
	}
	for name, key := range keyShapes {
		for made, newMap := range makers {
			t.Run(name+"/"+made, func(t *testing.T) {
				r := rand.New(rand.NewPCG(7, 9))
				m := newMap()
				want := map[uint64]uint64{}
				var keys []uint64
				const steps, universe = 300_000, 60_000
				for step := range steps {
					// Mostly inserts early on, balanced later, so the table grows and then churns.
					var k uint64
					if len(keys) > 0 && r.IntN(3) == 0 {
						k = keys[r.IntN(len(keys))]
					} else {
						k = key(r, universe)
					}
					switch op := r.IntN(10); {
					case op < 6 || step < steps/3:
						v, existed := m.upsert(k)
						_, had := want[k]
						if existed != had {
							t.Fatalf("step %d: upsert(%#x) existed = %v, want %v", step, k, existed, had)
						}
						if had && *v != want[k] {
							t.Fatalf("step %d: upsert(%#x) = %d, want %d", step, k, *v, want[k])
						}
						if !had {
							keys = append(keys, k)
						}
						*v = uint64(step) + 1
						want[k] = uint64(step) + 1
					default:
						_, had := want[k]
						if got := m.delete(k); got != had {
							t.Fatalf("step %d: delete(%#x) = %v, want %v", step, k, got, had)
						}
						delete(want, k)
						if m.get(k) != nil {
							t.Fatalf("step %d: get(%#x) after delete != nil", step, k)
						}
					}
					if step%50_000 == 0 || step == steps-1 {
						checkFlatMap(t, m, want)
					}
				}
				if len(m.segs) < 4 {
					t.Fatalf("only %d segments: the test never split one", len(m.segs))
				}
			})
		}
	}
}

func checkFlatMap(t *testing.T, m *flatMap[uint64], want map[uint64]uint64) {
	t.Helper()
	if m.len() != len(want) {
		t.Fatalf("len() = %d, want %d", m.len(), len(want))
	}
	for k, v := range want {
		if got := m.get(k); got == nil || *got != v {
			t.Fatalf("get(%#x) = %v, want %d", k, got, v)
		}
	}
	seen := 0
	m.all(func(k uint64, v *uint64) {
		seen++
		if want[k] != *v {
			t.Fatalf("all: %#x = %d, want %d", k, *v, want[k])
		}
	})
	if seen != len(want) {
		t.Fatalf("all visited %d keys, want %d", seen, len(want))
	}
	for _, s := range m.segs {
		if n := 0; true {
			for _, e := range s.slots {
				if e.key != 0 {
					n++
				}
			}
			if n != s.n {
				t.Fatalf("segment counts %d keys, holds %d", s.n, n)
			}
			if 5*n > 4*len(s.slots) {
				t.Fatalf("segment is %d/%d full, over 80%%", n, len(s.slots))
			}
		}
	}
}
