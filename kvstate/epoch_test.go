package kvstate

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// TestRegistrationEpochs: every new stream's registration bumps the rank's epoch and ends the
// previous stream's (EpochEnds); changes sent under an old epoch fail with ErrSuperseded and change
// nothing; a re-announcement under the current epoch keeps it.
func TestRegistrationEpochs(t *testing.T) {
	s := NewState()
	res, err := s.Apply(WorkerUp{Info: info(w0r0)})
	if err != nil || res.Epoch != 1 {
		t.Fatalf("first registration = %+v, %v; want epoch 1", res, err)
	}
	first := s.EpochEnds(w0r0, 1)
	if _, err := s.Apply(KVEvents{Worker: w0r0, Epoch: 1, Events: []Event{stored(0, la)}}); err != nil {
		t.Fatalf("events under the current epoch = %v", err)
	}
	if res, err := s.Apply(WorkerUp{Info: info(w0r0)}); err != nil || res.Epoch != 2 {
		t.Fatalf("second stream's registration = %+v, %v; want epoch 2", res, err)
	}
	if !isClosed(first) || !isClosed(s.EpochEnds(w0r0, 1)) {
		t.Error("the first stream's epoch did not end when a second stream registered")
	}
	second := s.EpochEnds(w0r0, 2)
	before := viewState(t, s)
	for _, c := range []Change{
		KVEvents{Worker: w0r0, Epoch: 1, Events: []Event{storedAfter(1, la, lb)}},
		KVDump{Worker: w0r0, Epoch: 1, ThroughEventID: 5, Events: []Event{stored(0, lc)}},
		LoadReported{Worker: w0r0, Epoch: 1, KVUsedBlocks: 9},
		WorkerUp{Info: info(w0r0), Epoch: 1},
	} {
		if _, err := s.Apply(c); !errors.Is(err, ErrSuperseded) {
			t.Errorf("Apply(%T under the superseded epoch) = %v, want ErrSuperseded", c, err)
		}
	}
	if diff := cmp.Diff(before, viewState(t, s)); diff != "" {
		t.Errorf("superseded changes changed the state (-before +after):\n%s", diff)
	}
	if st := s.Worker(w0r0).Status(); st.LastEventID != 0 || st.KVUsedBlocks != 0 {
		t.Errorf("worker status after superseded changes = %+v, want event 0 and no load report", st)
	}

	// A re-announcement on the current stream keeps the epoch and its stream.
	moved := info(w0r0)
	moved.Endpoint = "elsewhere:1"
	if res, err := s.Apply(WorkerUp{Info: moved, Epoch: 2}); err != nil || res.Epoch != 2 {
		t.Fatalf("re-announcement = %+v, %v; want epoch 2 kept", res, err)
	}
	if isClosed(second) || s.Worker(w0r0).Info.Endpoint != "elsewhere:1" {
		t.Error("a re-announcement ended the current stream's epoch or did not update the details")
	}
	if _, err := s.Apply(KVEvents{Worker: w0r0, Epoch: 2, Events: []Event{storedAfter(1, la, lb)}}); err != nil {
		t.Errorf("events under the current epoch after a re-announcement = %v", err)
	}

	// A snapshot restore keeps the current stream's epoch going; a reset registration ends it.
	if _, err := s.Restore(s.EncodeSnapshot(nil, SnapshotHeader{Position: "1-1"})); err != nil {
		t.Fatal(err)
	}
	if isClosed(second) {
		t.Error("restoring a snapshot that holds the same registration ended its stream's epoch")
	}
	if res, err := s.Apply(WorkerUp{Info: info(w0r0), Reset: true}); err != nil || res.Epoch != 3 {
		t.Fatalf("reset registration = %+v, %v; want epoch 3", res, err)
	}
	if !isClosed(second) {
		t.Error("a reset registration did not end the previous stream's epoch")
	}
	third := s.EpochEnds(w0r0, 3)
	s.Apply(WorkerRemoved{Key: w0r0})
	if !isClosed(third) || !isClosed(s.EpochEnds(w0r0, 3)) {
		t.Error("removing the worker did not end its stream's epoch")
	}
	if _, err := s.Apply(WorkerUp{Info: info(w0r0), Epoch: 3}); !errors.Is(err, ErrUnknownWorker) {
		t.Errorf("re-announcing a removed worker = %v, want ErrUnknownWorker", err)
	}
}

// TestRemovalAfterATakeover: the removal a replica decides once its last stream for a worker closed
// names the newest epoch among the streams that closed there, so a superseded stream closing on one
// replica never removes the worker another replica's newer stream holds, and two streams closing in
// either order on one replica still lead to the worker's removal.
func TestRemovalAfterATakeover(t *testing.T) {
	// The superseded stream closes here after a newer stream (elsewhere) registered the rank.
	s := NewState()
	run(t, s, []step{up(w0r0), connect(w0r0), up(w0r0)}) // epoch 1 here, then epoch 2 from elsewhere
	presenceOf(s).Disconnected(w0r0, 100, 1)
	d := presenceOf(s).Disconnections()[w0r0]
	if res, _ := s.Apply(WorkerRemoved{Key: w0r0, Epoch: d.Epoch}); !res.Skipped || s.Worker(w0r0) == nil {
		t.Errorf("removal after the superseded stream closed (epoch %d) applied, want it skipped: the newer stream holds the rank", d.Epoch)
	}

	// Both streams here; the newer closes first, the superseded one last.
	s = NewState()
	run(t, s, []step{up(w0r0), connect(w0r0), connect(w0r0), up(w0r0)})
	presenceOf(s).Disconnected(w0r0, 100, 2)
	presenceOf(s).Disconnected(w0r0, 101, 1)
	d = presenceOf(s).Disconnections()[w0r0]
	if d.Epoch != 2 || d.Since != 101 {
		t.Errorf("disconnection = %+v, want since 101 under epoch 2 (the newest stream that closed)", d)
	}
	if res, _ := s.Apply(WorkerRemoved{Key: w0r0, Epoch: d.Epoch}); res.Skipped || s.Worker(w0r0) != nil {
		t.Error("removal after both streams closed was skipped, want the worker removed")
	}
}

// TestEpochsNeverRepeat: a registration appended through a log gets the incarnation the log stamped
// (State.Stamp) as its epoch, on every replica alike. A worker that is removed and registers again
// gets an epoch it never had, so a removal decided for its earlier incarnation (a late one, from a
// replica that was paused past the grace period) is skipped instead of removing the live worker.
// Before incarnations, the epoch restarted at 1 after a removal and the late removal matched it.
func TestEpochsNeverRepeat(t *testing.T) {
	s := NewState()
	l := NewMemLog(s)
	ctx := t.Context()
	up := func() uint64 {
		t.Helper()
		res, err := l.Append(ctx, WorkerUp{Info: info(w0r0)})
		if err != nil {
			t.Fatalf("registration = %v", err)
		}
		return res.Epoch
	}
	first := up()
	if res, err := l.Append(ctx, WorkerRemoved{Key: w0r0, Epoch: first}); err != nil || res.Skipped {
		t.Fatalf("removal of the first incarnation = %+v, %v; want it applied", res, err)
	}
	second := up()
	if second <= first {
		t.Fatalf("epoch after removal and a new registration = %d, want more than the removed %d", second, first)
	}
	// The late removal of the first incarnation, from the replica that decided it while paused.
	if res, err := l.Append(ctx, WorkerRemoved{Key: w0r0, Epoch: first}); err != nil || !res.Skipped || s.Worker(w0r0) == nil {
		t.Fatalf("late removal of incarnation %d = %+v, %v; want it skipped and the worker (epoch %d) kept", first, res, err, second)
	}
	// Another replica applying the same log gets the same epochs.
	other := NewState()
	for _, c := range []Change{
		l.state.Stamp(WorkerUp{Info: info(w1)}),
	} {
		want, err := s.Apply(c)
		if err != nil {
			t.Fatal(err)
		}
		got, err := other.Apply(c)
		if err != nil || got.Epoch != want.Epoch {
			t.Errorf("the same registration applied elsewhere = epoch %d, %v; want %d", got.Epoch, err, want.Epoch)
		}
	}
}

// TestStampIsUnique: concurrent registrations stamped on one replica get distinct incarnations, each
// above every epoch the state applied, even one far ahead of this replica's clock (set by a replica
// whose clock runs fast), and after the worker holding it was removed and the state restored from a
// snapshot.
func TestStampIsUnique(t *testing.T) {
	s := NewState()
	ahead := uint64(time.Now().Add(time.Hour).UnixNano())
	if _, err := s.Apply(WorkerUp{Info: info(w1), Incarnation: ahead}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Apply(WorkerRemoved{Key: w1, Epoch: ahead}); err != nil {
		t.Fatal(err)
	}
	restored := NewState()
	if _, err := restored.Restore(s.EncodeSnapshot(nil, SnapshotHeader{Position: "1-0"})); err != nil {
		t.Fatal(err)
	}
	for name, st := range map[string]*State{"original": s, "restored": restored} {
		const n = 64
		got := make(chan uint64, n)
		var wg sync.WaitGroup
		for range n {
			wg.Go(func() { got <- st.Stamp(WorkerUp{Info: info(w0r0)}).(WorkerUp).Incarnation })
		}
		wg.Wait()
		close(got)
		seen := map[uint64]bool{}
		for inc := range got {
			if inc <= ahead || seen[inc] {
				t.Errorf("%s: incarnation %d repeats or is not above the applied epoch %d", name, inc, ahead)
			}
			seen[inc] = true
		}
	}
	// A registration that names its epoch, or has one already, is left as it is.
	for _, c := range []Change{WorkerUp{Info: info(w0r0), Epoch: 3}, WorkerUp{Info: info(w0r0), Incarnation: 9}, Freed{RequestID: "r"}} {
		if got := s.Stamp(c); !cmp.Equal(got, c) {
			t.Errorf("Stamp(%+v) = %+v, want it unchanged", c, got)
		}
	}
}
