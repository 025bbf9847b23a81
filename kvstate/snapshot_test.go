package kvstate

import (
	"encoding/hex"
	"errors"
	"testing"
)

// richState builds a state touching every part a snapshot must carry.
func richState(t *testing.T) *State {
	t.Helper()
	s := NewState()
	run(t, s, []step{
		up(w0r0), up(w0r1), up(w1), up(w1), // w1 at epoch 2
		events(w0r0, stored(0, la, lb, lc), Event{ID: 1, Tier: TierHost, Kind: EventStored, HasParent: true, Parent: eh(lc), Blocks: blocks(ld)}),
		events(w0r1, stored(0, la, lb), removed(1, lb)),
		events(w1, stored(0, la), stored(2, lb)), // a gap: w1 awaits a dump
		apply(LoadReported{Worker: w0r0, KVUsedBlocks: 42, WaitingRequests: 3}),
		apply(Booked{Booking: Booking{RequestID: "r1", At: 10, Hops: []HopBooking{{Worker: w0r1, PrefillTokens: 100}, {Worker: w0r0, Blocks: []uint64{7, 8, 9}}}, Session: "chat", SessionExpires: 1 << 40}}),
		apply(Booked{Booking: Booking{RequestID: "r2", At: 20, Hops: []HopBooking{{Worker: w0r0, Blocks: []uint64{7, 10}, PrefillTokens: 50}}}}),
		apply(PrefillDone{RequestID: "r2"}),
	})
	if _, err := s.ApplyReplicated(Freed{RequestID: "early", At: 30}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ApplyReplicated(BookingsExpired{Before: 5}); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestSnapshotRestoresTheSameState(t *testing.T) {
	src := richState(t)
	header := SnapshotHeader{Position: "1700000000000-7", Generation: "0123456789abcdef/seeded", Entry: 1234}
	data := src.EncodeSnapshot(nil, header)
	dst := NewState()
	run(t, dst, []step{up(w2)}) // whatever was there is replaced
	got, err := dst.Restore(data)
	if err != nil || got != header {
		t.Fatalf("Restore() = %+v, %v; want %+v", got, err, header)
	}
	if h, err := ReadSnapshotHeader(data); err != nil || h != header {
		t.Errorf("ReadSnapshotHeader() = %+v, %v; want %+v", h, err, header)
	}
	if a, b := src.Digest(), dst.Digest(); a != b {
		t.Fatalf("digest after restore = %x, want %x", b, a)
	}
	if dst.Worker(w2) != nil {
		t.Error("a worker absent from the snapshot survived the restore")
	}
	// The restored state behaves like the original under the same changes.
	for _, c := range []Change{
		Freed{RequestID: "r1"},
		KVEvents{Worker: w0r0, Events: []Event{storedAfter(2, lb, lx)}},
		KVDump{Worker: w1, ThroughEventID: 5, Events: []Event{stored(0, la)}},
		Booked{Booking: Booking{RequestID: "early", At: 40, Hops: []HopBooking{{Worker: w1}}}},
	} {
		r1, e1 := src.ApplyReplicated(c)
		r2, e2 := dst.ApplyReplicated(c)
		if !errors.Is(e2, e1) || r1 != r2 {
			t.Errorf("ApplyReplicated(%T): original %+v %v, restored %+v %v", c, r1, e1, r2, e2)
		}
	}
	if a, b := src.Digest(), dst.Digest(); a != b {
		t.Errorf("digest after the same changes = %x, want %x", b, a)
	}
	if got := dst.Load().Slot(dst.Worker(w0r0).Slot); got.ActiveBlocks != 2 || got.ActivePrefillTokens != 0 {
		t.Errorf("restored load of %v = %+v, want r2's 2 blocks and its prefill done", w0r0, got)
	}
}

// TestFreezeIsACopy: what Freeze captured is what Encode writes, whatever changes the state takes in
// between: stores, removals, bookings, frees and a worker's removal.
func TestFreezeIsACopy(t *testing.T) {
	src := richState(t)
	want := src.Digest()
	frozen := src.Freeze(SnapshotHeader{Position: "1-0"})
	for _, c := range []Change{
		Freed{RequestID: "r1"},
		KVEvents{Worker: w0r0, Events: []Event{storedAfter(2, lb, lx)}},
		KVDump{Worker: w1, ThroughEventID: 5, Events: []Event{stored(0, la)}},
		Booked{Booking: Booking{RequestID: "late", At: 40, Hops: []HopBooking{{Worker: w1}}}},
		WorkerRemoved{Key: w0r0},
	} {
		if _, err := src.ApplyReplicated(c); err != nil {
			t.Fatalf("ApplyReplicated(%T) = %v", c, err)
		}
	}
	if src.Digest() == want {
		t.Fatal("the changes after Freeze changed nothing; the test would prove nothing")
	}
	dst := NewState()
	if _, err := dst.Restore(frozen.Encode(nil)); err != nil {
		t.Fatalf("Restore(frozen) = %v", err)
	}
	if got := dst.Digest(); got != want {
		t.Errorf("digest of the frozen snapshot = %x, want the state's at Freeze %x", got, want)
	}
}

// v2Snapshot is richState's snapshot (header position "5-0", generation "g/seeded", entry 9) as the
// release before incarnations wrote it (version 2): sessions without a model, a tombstone for the
// early Free of "early", no largest epoch.
const v2Snapshot = "0203352d3008672f73656564656409030100016d0310e80780400977312d303a393030300001010101002a030101016d0310e80780400977312d313a3930303000010101010000000200016d0310e80780400977322d303a39303030000102000101000001016d100418ae455c1e73d13f01008ccb6332c805d4b80100ea2c73b73ccb2d1401010a000000000000000200040200030b000000000000e08ccb6332c805d4b80a000000000000e00a000000000000000c000000000000e018ae455c1e73d13f010d000000000000e0ea2c73b73ccb2d14000001010a000000000000e00a0000000000000000000002027231140201006400000307000000000000000800000000000000090000000000000000000272322801000207000000000000000a00000000000000320101046368617401008080808080400a01056561726c7901003c"

// TestSnapshotVersion2: a snapshot of the previous release restores to the state this release
// builds from the same changes: each session under its decode worker's model, the tombstone
// dropped (an end never precedes its booking in the log), the largest epoch that of its workers.
func TestSnapshotVersion2(t *testing.T) {
	v2, err := hex.DecodeString(v2Snapshot)
	if err != nil {
		t.Fatal(err)
	}
	dst := NewState()
	h, err := dst.Restore(v2)
	if want := (SnapshotHeader{Position: "5-0", Generation: "g/seeded", Entry: 9}); err != nil || h != want {
		t.Fatalf("Restore(version 2) = %+v, %v; want %+v", h, err, want)
	}
	if dst.Digest() != richState(t).Digest() {
		t.Error("a version 2 snapshot restored to a different state than this release builds")
	}
	if w, ok := dst.Session(testModel, "chat", 0); !ok || w != w0r0 {
		t.Errorf("Session(chat) after restoring version 2 = %v, %v; want %v", w, ok, w0r0)
	}
}

// v3Snapshot is richState's snapshot (header position "5-0", generation "g/seeded", entry 9) as the
// release before booking owners wrote it (version 3).
const v3Snapshot = "0303352d3008672f73656564656409030100016d0310e80780400977312d303a393030300001010101002a030101016d0310e80780400977312d313a3930303000010101010000000200016d0310e80780400977322d303a39303030000102000101000001016d1004ea2c73b73ccb2d1401018ccb6332c805d4b801000a0000000000000002000418ae455c1e73d13f01000201010a000000000000e00a0000000000000000000000030b000000000000e08ccb6332c805d4b80a000000000000e00a000000000000000c000000000000e018ae455c1e73d13f010d000000000000e0ea2c73b73ccb2d14000002027231140201006400000307000000000000000800000000000000090000000000000000000272322801000207000000000000000a00000000000000320101016d046368617401008080808080400a02"

// TestSnapshotVersion3: a snapshot of the release before booking owners restores to the state this
// release builds from the same changes (richState's bookings have no owner).
func TestSnapshotVersion3(t *testing.T) {
	v3, err := hex.DecodeString(v3Snapshot)
	if err != nil {
		t.Fatal(err)
	}
	dst := NewState()
	h, err := dst.Restore(v3)
	if want := (SnapshotHeader{Position: "5-0", Generation: "g/seeded", Entry: 9}); err != nil || h != want {
		t.Fatalf("Restore(version 3) = %+v, %v; want %+v", h, err, want)
	}
	if dst.Digest() != richState(t).Digest() {
		t.Error("a version 3 snapshot restored to a different state than this release builds")
	}
}

// TestSnapshotVersion1: a snapshot written before generations (version 1: no generation after the
// position) restores, with an empty generation.
func TestSnapshotVersion1(t *testing.T) {
	v2, err := hex.DecodeString(v2Snapshot)
	if err != nil {
		t.Fatal(err)
	}
	// Version 1 is version 2 without the generation and the entry number after the position: byte
	// 0 is the version, then the position's length and its 3 bytes, then the generation's length
	// and its 8 bytes, then the entry (one byte).
	v1 := append([]byte{1}, v2[1:5]...)
	v1 = append(v1, v2[15:]...)
	dst := NewState()
	h, err := dst.Restore(v1)
	if err != nil || h != (SnapshotHeader{Position: "5-0"}) {
		t.Fatalf("Restore(version 1) = %+v, %v", h, err)
	}
	if dst.Digest() != richState(t).Digest() {
		t.Error("a version 1 snapshot restored to a different state")
	}
}

func TestSnapshotRejectsCorruption(t *testing.T) {
	data := richState(t).EncodeSnapshot(nil, SnapshotHeader{Position: "5-0"})
	for name, bad := range map[string][]byte{
		"empty":     nil,
		"version 0": append([]byte{0}, data[1:]...),
		"truncated": data[:len(data)/2],
		"trailing":  append(append([]byte(nil), data...), 1),
	} {
		s := richState(t)
		before := s.Digest()
		if _, err := s.Restore(bad); !errors.Is(err, ErrCorruptEntry) {
			t.Errorf("%s: Restore() = %v, want ErrCorruptEntry", name, err)
		}
		if s.Digest() != before {
			t.Errorf("%s: a failed restore changed the state", name)
		}
	}
}

// TestSnapshotOfABlockUnderTwoEngineHashes: a worker may store the same block under two engine
// hashes (the engine hashed more than the tokens), and removing one drops the worker from the block
// while the other hash still names it. The snapshot of such a state restores to the same state.
func TestSnapshotOfABlockUnderTwoEngineHashes(t *testing.T) {
	s := NewState()
	run(t, s, []step{up(w0r0)})
	for _, c := range []Change{
		KVEvents{Worker: w0r0, Events: []Event{
			{ID: 0, Kind: EventStored, Blocks: []Block{{Hash: 0xa1, Local: la}}},
			{ID: 1, Kind: EventStored, Blocks: []Block{{Hash: 0xa2, Local: la}}}, // the same block again
			{ID: 2, Kind: EventRemoved, Removed: []uint64{0xa1}},
		}},
	} {
		if _, err := s.Apply(c); err != nil {
			t.Fatal(err)
		}
	}
	if got := s.Model(info(w0r0).Model).Index.Len(); got != 0 {
		t.Fatalf("Index.Len() = %d after the removal, want 0: the worker no longer holds the block", got)
	}
	r := NewState()
	if _, err := r.Restore(s.EncodeSnapshot(nil, SnapshotHeader{Position: "1-0"})); err != nil {
		t.Fatalf("Restore() = %v", err)
	}
	if a, b := s.Digest(), r.Digest(); a != b {
		t.Errorf("digest after restore = %x, want %x", b, a)
	}
}

// FuzzRestore: restoring arbitrary bytes never panics.
func FuzzRestore(f *testing.F) {
	f.Add(NewState().EncodeSnapshot(nil, SnapshotHeader{Position: "0"}))
	small := NewState()
	small.Apply(WorkerUp{Info: info(w0r0)})
	small.Apply(KVEvents{Worker: w0r0, Events: []Event{stored(0, la, lb)}})
	f.Add(small.EncodeSnapshot(nil, SnapshotHeader{Position: "1-1", Generation: "g/fresh/1"}))
	f.Fuzz(func(t *testing.T, data []byte) {
		_, _ = NewState().Restore(data)
	})
}
