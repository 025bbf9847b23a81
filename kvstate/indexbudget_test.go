package kvstate

import "testing"

// TestIndexCap: past max_index_blocks a stored event is indexed up to the cap and the rest of its
// chain is refused and counted; blocks other workers already hold cost nothing; evictions and a
// removed worker give room back; a restored snapshot counts what it holds.
func TestIndexCap(t *testing.T) {
	s := NewState()
	s.SetMaxIndexBlocks(5)
	run(t, s, []step{up(w0r0), up(w1)})
	type counts struct{ used, refused int64 }
	check := func(what string, want counts) {
		t.Helper()
		if got := (counts{s.IndexBlocks(), int64(s.IndexBlocksRefused())}); got != want {
			t.Errorf("%s: index blocks %d, refused %d; want %d, %d", what, got.used, got.refused, want.used, want.refused)
		}
	}
	run(t, s, []step{events(w0r0, stored(0, 1, 2, 3, 4, 5, 6, 7))})
	check("a chain of 7 into room for 5", counts{5, 2})
	if got := workerOverlap(t, s, w0r0, 1, 2, 3, 4, 5, 6, 7); got[TierDevice] != 5 {
		t.Errorf("overlap of the capped chain = %d blocks, want the 5 indexed", got[TierDevice])
	}
	run(t, s, []step{events(w1, stored(0, 1, 2, 3))})
	check("blocks already in the index", counts{5, 2})
	if got := workerOverlap(t, s, w1, 1, 2, 3); got[TierDevice] != 3 {
		t.Errorf("second worker's overlap = %d blocks, want 3 (its blocks are all held already)", got[TierDevice])
	}
	// Worker 0 evicts 4 and 5 (nobody else holds them): room for two new blocks.
	run(t, s, []step{events(w0r0, removed(1, 4, 5))})
	check("after an eviction", counts{3, 2})
	run(t, s, []step{events(w1, storedAfter(1, 3, 8, 9, 10))})
	check("a chain of 3 into room for 2", counts{5, 3})

	restored := NewState()
	restored.SetMaxIndexBlocks(5)
	if _, err := restored.Restore(s.EncodeSnapshot(nil, SnapshotHeader{})); err != nil {
		t.Fatal(err)
	}
	if got := restored.IndexBlocks(); got != 5 {
		t.Errorf("restored state counts %d index blocks, want 5", got)
	}
	run(t, restored, []step{events(w0r0, storedAfter(2, 3, 11))})
	if got := restored.IndexBlocksRefused(); got != 1 {
		t.Errorf("restored state at its cap refused %d blocks, want 1", got)
	}

	run(t, s, []step{apply(WorkerRemoved{Key: w1}), apply(WorkerRemoved{Key: w0r0})})
	check("every worker gone", counts{0, 3})
}
