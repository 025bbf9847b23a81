package engine

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

func TestCacheAllocateAndEvict(t *testing.T) {
	type step struct {
		op          string // "alloc" or "release"
		hashes      []uint64
		wantHit     int
		wantStored  []uint64
		wantEvicted []uint64
		wantOK      bool
		wantUsed    int
		wantRefd    int
	}
	tests := []struct {
		name     string
		capacity int
		steps    []step
	}{
		{
			name: "a shared prefix is reused", capacity: 8,
			steps: []step{
				{op: "alloc", hashes: []uint64{1, 2, 3}, wantStored: []uint64{1, 2, 3}, wantOK: true, wantUsed: 3, wantRefd: 3},
				{op: "alloc", hashes: []uint64{1, 2, 4}, wantHit: 2, wantStored: []uint64{4}, wantOK: true, wantUsed: 4, wantRefd: 4},
				{op: "release", hashes: []uint64{1, 2, 3}, wantUsed: 4, wantRefd: 3},
				{op: "release", hashes: []uint64{1, 2, 4}, wantUsed: 4, wantRefd: 0},
				{op: "alloc", hashes: []uint64{1, 2, 3}, wantHit: 3, wantOK: true, wantUsed: 4, wantRefd: 3},
			},
		},
		{
			name: "tails are evicted before the prefix they follow", capacity: 4,
			steps: []step{
				{op: "alloc", hashes: []uint64{1, 2, 3}, wantStored: []uint64{1, 2, 3}, wantOK: true, wantUsed: 3, wantRefd: 3},
				{op: "release", hashes: []uint64{1, 2, 3}, wantUsed: 3},
				{op: "alloc", hashes: []uint64{7, 8}, wantStored: []uint64{7, 8}, wantEvicted: []uint64{3}, wantOK: true, wantUsed: 4, wantRefd: 2},
				{op: "alloc", hashes: []uint64{1, 9}, wantHit: 1, wantStored: []uint64{9}, wantEvicted: []uint64{2}, wantOK: true, wantUsed: 4, wantRefd: 4},
			},
		},
		{
			name: "a request that cannot fit changes nothing", capacity: 3,
			steps: []step{
				{op: "alloc", hashes: []uint64{1, 2}, wantStored: []uint64{1, 2}, wantOK: true, wantUsed: 2, wantRefd: 2},
				{op: "alloc", hashes: []uint64{5, 6}, wantOK: false, wantUsed: 2, wantRefd: 2},
				{op: "release", hashes: []uint64{1, 2}, wantUsed: 2},
				{op: "alloc", hashes: []uint64{5, 6}, wantStored: []uint64{5, 6}, wantEvicted: []uint64{2}, wantOK: true, wantUsed: 3, wantRefd: 2},
			},
		},
		{
			name: "its own cached blocks do not count as room", capacity: 3,
			steps: []step{
				{op: "alloc", hashes: []uint64{1, 2}, wantStored: []uint64{1, 2}, wantOK: true, wantUsed: 2, wantRefd: 2},
				{op: "release", hashes: []uint64{1, 2}, wantUsed: 2},
				// Blocks 1 and 2 are reused, so only one block of room is left for 3 and 4.
				{op: "alloc", hashes: []uint64{1, 2, 3, 4}, wantHit: 2, wantOK: false, wantUsed: 2},
				{op: "alloc", hashes: []uint64{1, 2, 3}, wantHit: 2, wantStored: []uint64{3}, wantOK: true, wantUsed: 3, wantRefd: 3},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := NewCache(tt.capacity)
			for i, s := range tt.steps {
				if s.op == "release" {
					c.Release(s.hashes)
				} else {
					hit, stored, evicted, ok := c.Allocate(s.hashes, nil, nil)
					got := []any{hit, stored, evicted, ok}
					want := []any{s.wantHit, s.wantStored, s.wantEvicted, s.wantOK}
					if diff := cmp.Diff(want, got, cmpopts.EquateEmpty()); diff != "" {
						t.Fatalf("step %d: Allocate(%v) (hit, stored, evicted, ok) mismatch (-want +got):\n%s", i, s.hashes, diff)
					}
				}
				if c.Used() != s.wantUsed || c.Referenced() != s.wantRefd {
					t.Fatalf("step %d: Used() = %d, Referenced() = %d; want %d, %d", i, c.Used(), c.Referenced(), s.wantUsed, s.wantRefd)
				}
			}
		})
	}
}

// TestCacheInvariants runs random requests through a small cache and checks after every step that
// it never holds more than its capacity, that every block a running request allocated is held,
// and that the blocks it announces (stored minus evicted) are exactly the blocks it holds: what the
// router learns from the events equals the cache.
func TestCacheInvariants(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const capacity = 64
	c := NewCache(capacity)
	announced := map[uint64]bool{}
	var running [][]uint64
	for step := range 20_000 {
		if len(running) > 0 && (rng.IntN(2) == 0 || len(running) > 8) {
			i := rng.IntN(len(running))
			c.Release(running[i])
			running = slices.Delete(running, i, i+1)
		} else {
			// A prompt of 1..20 blocks sharing a prefix of one of 5 "system prompts".
			n := 1 + rng.IntN(20)
			hashes := make([]uint64, n)
			hashes[0] = uint64(rng.IntN(5))
			for j := 1; j < n; j++ {
				hashes[j] = hashes[j-1]*31 + uint64(rng.IntN(3)) + 1000
			}
			hashes = slices.Compact(hashes)
			_, stored, evicted, ok := c.Allocate(hashes, nil, nil)
			for _, h := range evicted {
				delete(announced, h)
			}
			for _, h := range stored {
				announced[h] = true
			}
			if ok {
				running = append(running, hashes)
			}
		}
		if c.Used() > capacity || c.Used() != len(c.blocks) {
			t.Fatalf("step %d: Used() = %d with %d blocks, capacity %d", step, c.Used(), len(c.blocks), capacity)
		}
		for _, r := range running {
			if c.Lookup(r) != len(r) {
				t.Fatalf("step %d: a running request lost a block", step)
			}
		}
		if len(announced) != len(c.blocks) {
			t.Fatalf("step %d: the events announce %d blocks, the cache holds %d", step, len(announced), len(c.blocks))
		}
		for h := range announced {
			if !c.Contains(h) {
				t.Fatalf("step %d: block %d announced but not held", step, h)
			}
		}
	}
}
