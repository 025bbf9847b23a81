package kvstate

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
)

const testModel = "m"

// Worker ranks used by the state tests: two ranks of engine 1 and one rank of engine 2.
var (
	w0r0 = WorkerKey{ID: 1, Rank: 0}
	w0r1 = WorkerKey{ID: 1, Rank: 1}
	w1   = WorkerKey{ID: 2, Rank: 0}
	w2   = WorkerKey{ID: 3, Rank: 0}
)

// info returns a registration of key for testModel with block size 16.
func info(key WorkerKey) WorkerInfo {
	return WorkerInfo{
		Key: key, Model: testModel, Role: RoleAggregated, BlockSize: 16,
		TotalKVBlocks: 1000, MaxNumBatchedTokens: 8192, Endpoint: fmt.Sprintf("w%d-%d:9000", key.ID, key.Rank),
		KVEventsEnabled: true,
	}
}

// step is one setup step of a state test.
type step func(t *testing.T, s *State)

// apply applies c and fails the test if it errs.
func apply(c Change) step {
	return func(t *testing.T, s *State) {
		t.Helper()
		if _, err := s.Apply(c); err != nil {
			t.Fatalf("State.Apply(%#v) = %v, want nil", c, err)
		}
	}
}

func up(key WorkerKey) step { return apply(WorkerUp{Info: info(key)}) }

// presences holds each test state's Presence: in these tests one State stands for one replica.
var presences sync.Map // *State -> *Presence

func presenceOf(s *State) *Presence {
	p, _ := presences.LoadOrStore(s, NewPresence())
	return p.(*Presence)
}

// connect opens a stream for the worker on the state's replica.
func connect(key WorkerKey) step {
	return func(t *testing.T, s *State) { presenceOf(s).Connected(key) }
}

// disconnect closes a stream for the worker that registered at its current epoch.
func disconnect(key WorkerKey, at int64) step {
	return func(t *testing.T, s *State) {
		var epoch uint64
		if w := s.Worker(key); w != nil {
			epoch = w.Status().Epoch
		}
		presenceOf(s).Disconnected(key, at, epoch)
	}
}

func events(key WorkerKey, evs ...Event) step { return apply(KVEvents{Worker: key, Events: evs}) }

func run(t *testing.T, s *State, steps []step) {
	t.Helper()
	for _, st := range steps {
		st(t, s)
	}
}

// stored is a device-tier stored event of the given blocks at the root.
func stored(id uint64, locals ...uint64) Event {
	return Event{ID: id, Kind: EventStored, Blocks: blocks(locals...)}
}

// storedAfter is a device-tier stored event of the given blocks chained onto the block with local
// hash parent.
func storedAfter(id uint64, parent uint64, locals ...uint64) Event {
	return Event{ID: id, Kind: EventStored, Parent: eh(parent), HasParent: true, Blocks: blocks(locals...)}
}

// removed is a device-tier removed event of the blocks with the given local hashes.
func removed(id uint64, locals ...uint64) Event {
	hashes := make([]uint64, len(locals))
	for i, l := range locals {
		hashes[i] = eh(l)
	}
	return Event{ID: id, Kind: EventRemoved, Removed: hashes}
}

// cleared is a device-tier cleared event; the tier does not narrow it (§4.3).
func cleared(id uint64) Event { return Event{ID: id, Kind: EventCleared} }

// inTier returns ev naming tier instead of the device tier.
func inTier(tier Tier, ev Event) Event {
	ev.Tier = tier
	return ev
}

// workerOverlap returns the worker's overlap blocks with the prompt in its model's index.
func workerOverlap(t *testing.T, s *State, key WorkerKey, locals ...uint64) TierCounts {
	t.Helper()
	w := s.Worker(key)
	if w == nil {
		t.Fatalf("State.Worker(%v) = nil, want a registered worker", key)
	}
	var o Overlaps
	s.Model(w.Info.Model).Index.Overlaps(seq(locals...), &o)
	return o.Blocks(w.Slot)
}

// TestKVEventsOrdering checks event-id ordering (§4.4) through State.Apply: in-order events apply,
// duplicates are dropped, a gap drops the rank's blocks and ignores events until a dump, and stored
// events that fail (§4.3) still consume their id. Rank 1 of the same engine holds [a,b,c] throughout
// and must never be affected by rank 0's events.
func TestKVEventsOrdering(t *testing.T) {
	gap := []step{events(w0r0, stored(0, la), storedAfter(1, la, lb), storedAfter(3, lb, lc))}
	gapAndDump := append(gap[:len(gap):len(gap)], apply(KVDump{Worker: w0r0, ThroughEventID: 4, Events: []Event{stored(77, la, lb)}}))
	tests := []struct {
		name        string
		setup       []step
		change      Change
		want        Result
		wantStatus  WorkerStatus
		wantOverlap TierCounts // rank 0's overlap with [a,b,c,d]
		wantBlocks  TierCounts // rank 0's Index.BlockCounts
	}{
		{
			name:        "in-order ids from 0 apply",
			change:      KVEvents{Worker: w0r0, Events: []Event{stored(0, la, lb), storedAfter(1, lb, lc, ld), removed(2, ld)}},
			want:        Result{LastEventID: 2, HasLastEvent: true, Applied: 3},
			wantStatus:  WorkerStatus{LastEventID: 2, HasLastEvent: true},
			wantOverlap: TierCounts{3},
			wantBlocks:  TierCounts{3},
		},
		{
			name:        "ids 0,1,3: gap at 3 drops the rank's blocks",
			change:      KVEvents{Worker: w0r0, Events: []Event{stored(0, la), storedAfter(1, la, lb), storedAfter(3, lb, lc)}},
			want:        Result{LastEventID: 1, HasLastEvent: true, Applied: 2, Ignored: 1, Gap: true, ExpectedEventID: 2, GotEventID: 3},
			wantStatus:  WorkerStatus{LastEventID: 1, HasLastEvent: true, AwaitingResync: true},
			wantOverlap: TierCounts{},
			wantBlocks:  TierCounts{},
		},
		{
			name:        "gap ignores the rest of its batch",
			change:      KVEvents{Worker: w0r0, Events: []Event{stored(0, la), stored(2, lx), stored(3, ly), stored(1, lb)}},
			want:        Result{LastEventID: 0, HasLastEvent: true, Applied: 1, Ignored: 3, Gap: true, ExpectedEventID: 1, GotEventID: 2},
			wantStatus:  WorkerStatus{LastEventID: 0, HasLastEvent: true, AwaitingResync: true},
			wantOverlap: TierCounts{},
			wantBlocks:  TierCounts{},
		},
		{
			name:        "gap in a later batch drops blocks stored by earlier batches",
			setup:       []step{events(w0r0, stored(0, la, lb), storedAfter(1, lb, lc))},
			change:      KVEvents{Worker: w0r0, Events: []Event{storedAfter(3, lc, ld)}},
			want:        Result{LastEventID: 1, HasLastEvent: true, Ignored: 1, Gap: true, ExpectedEventID: 2, GotEventID: 3},
			wantStatus:  WorkerStatus{LastEventID: 1, HasLastEvent: true, AwaitingResync: true},
			wantOverlap: TierCounts{},
			wantBlocks:  TierCounts{},
		},
		{
			name:        "after a gap even the expected id is ignored until a dump",
			setup:       gap,
			change:      KVEvents{Worker: w0r0, Events: []Event{storedAfter(2, la, lb), stored(4, la)}},
			want:        Result{LastEventID: 1, HasLastEvent: true, Ignored: 2},
			wantStatus:  WorkerStatus{LastEventID: 1, HasLastEvent: true, AwaitingResync: true},
			wantOverlap: TierCounts{},
			wantBlocks:  TierCounts{},
		},
		{
			name:        "a dump replaces the rank's blocks and ends the resync",
			setup:       gap,
			change:      KVDump{Worker: w0r0, ThroughEventID: 4, Events: []Event{stored(77, la, lb), storedAfter(78, lb, lc)}},
			want:        Result{LastEventID: 4, HasLastEvent: true, Applied: 2},
			wantStatus:  WorkerStatus{LastEventID: 4, HasLastEvent: true},
			wantOverlap: TierCounts{3},
			wantBlocks:  TierCounts{3},
		},
		{
			name:        "after a dump through N, event N+1 applies",
			setup:       gapAndDump,
			change:      KVEvents{Worker: w0r0, Events: []Event{storedAfter(5, lb, lc)}},
			want:        Result{LastEventID: 5, HasLastEvent: true, Applied: 1},
			wantStatus:  WorkerStatus{LastEventID: 5, HasLastEvent: true},
			wantOverlap: TierCounts{3},
			wantBlocks:  TierCounts{3},
		},
		{
			name:        "after a dump through N, ids up to N are duplicates",
			setup:       gapAndDump,
			change:      KVEvents{Worker: w0r0, Events: []Event{removed(3, la), removed(4, la)}},
			want:        Result{LastEventID: 4, HasLastEvent: true, Duplicates: 2},
			wantStatus:  WorkerStatus{LastEventID: 4, HasLastEvent: true},
			wantOverlap: TierCounts{2},
			wantBlocks:  TierCounts{2},
		},
		{
			name:        "after a dump through N, event N+2 is a gap again",
			setup:       gapAndDump,
			change:      KVEvents{Worker: w0r0, Events: []Event{storedAfter(6, lb, lc)}},
			want:        Result{LastEventID: 4, HasLastEvent: true, Ignored: 1, Gap: true, ExpectedEventID: 5, GotEventID: 6},
			wantStatus:  WorkerStatus{LastEventID: 4, HasLastEvent: true, AwaitingResync: true},
			wantOverlap: TierCounts{},
			wantBlocks:  TierCounts{},
		},
		{
			name:        "a dump without a pending resync replaces the blocks too",
			setup:       []step{events(w0r0, stored(0, lx, ly))},
			change:      KVDump{Worker: w0r0, ThroughEventID: 9, Events: []Event{stored(0, la, lb)}},
			want:        Result{LastEventID: 9, HasLastEvent: true, Applied: 1},
			wantStatus:  WorkerStatus{LastEventID: 9, HasLastEvent: true},
			wantOverlap: TierCounts{2},
			wantBlocks:  TierCounts{2},
		},
		{
			name:        "duplicate ids are dropped and change nothing",
			setup:       []step{events(w0r0, stored(0, la, lb), storedAfter(1, lb, lc))},
			change:      KVEvents{Worker: w0r0, Events: []Event{cleared(0), removed(1, la)}},
			want:        Result{LastEventID: 1, HasLastEvent: true, Duplicates: 2},
			wantStatus:  WorkerStatus{LastEventID: 1, HasLastEvent: true},
			wantOverlap: TierCounts{3},
			wantBlocks:  TierCounts{3},
		},
		{
			name:        "a replayed batch applies only its new tail",
			setup:       []step{events(w0r0, stored(0, la, lb))},
			change:      KVEvents{Worker: w0r0, Events: []Event{stored(0, la, lb), storedAfter(1, lb, lc)}},
			want:        Result{LastEventID: 1, HasLastEvent: true, Applied: 1, Duplicates: 1},
			wantStatus:  WorkerStatus{LastEventID: 1, HasLastEvent: true},
			wantOverlap: TierCounts{3},
			wantBlocks:  TierCounts{3},
		},
		{
			name:        "fresh worker: first event id 5 is a gap",
			change:      KVEvents{Worker: w0r0, Events: []Event{stored(5, la)}},
			want:        Result{Ignored: 1, Gap: true, ExpectedEventID: 0, GotEventID: 5},
			wantStatus:  WorkerStatus{AwaitingResync: true},
			wantOverlap: TierCounts{},
			wantBlocks:  TierCounts{},
		},
		{
			name:        "fresh worker: first event id 0 applies",
			change:      KVEvents{Worker: w0r0, Events: []Event{stored(0, la)}},
			want:        Result{LastEventID: 0, HasLastEvent: true, Applied: 1},
			wantStatus:  WorkerStatus{LastEventID: 0, HasLastEvent: true},
			wantOverlap: TierCounts{1},
			wantBlocks:  TierCounts{1},
		},
		{
			name:        "parent not found: counted, consumes its id, index unchanged",
			setup:       []step{events(w0r0, stored(0, la, lb))},
			change:      KVEvents{Worker: w0r0, Events: []Event{storedAfter(1, lx, lc)}},
			want:        Result{LastEventID: 1, HasLastEvent: true, Applied: 1, ParentNotFound: 1},
			wantStatus:  WorkerStatus{LastEventID: 1, HasLastEvent: true},
			wantOverlap: TierCounts{2},
			wantBlocks:  TierCounts{2},
		},
		{
			name:        "the event after a parent-not-found applies in order",
			setup:       []step{events(w0r0, stored(0, la, lb), storedAfter(1, lx, lc))},
			change:      KVEvents{Worker: w0r0, Events: []Event{storedAfter(2, lb, lc)}},
			want:        Result{LastEventID: 2, HasLastEvent: true, Applied: 1},
			wantStatus:  WorkerStatus{LastEventID: 2, HasLastEvent: true},
			wantOverlap: TierCounts{3},
			wantBlocks:  TierCounts{3},
		},
		{
			name:        "invalid block sequence: counted, consumes its id, index unchanged",
			setup:       []step{events(w0r0, stored(0, la, lb))},
			change:      KVEvents{Worker: w0r0, Events: []Event{storedAfter(1, lb, lc, lb)}},
			want:        Result{LastEventID: 1, HasLastEvent: true, Applied: 1, InvalidSequence: 1},
			wantStatus:  WorkerStatus{LastEventID: 1, HasLastEvent: true},
			wantOverlap: TierCounts{2},
			wantBlocks:  TierCounts{2},
		},
		{
			name:        "removed unknown hashes are counted",
			setup:       []step{events(w0r0, stored(0, la, lb))},
			change:      KVEvents{Worker: w0r0, Events: []Event{removed(1, lx, ly)}},
			want:        Result{LastEventID: 1, HasLastEvent: true, Applied: 1, UnknownRemoved: 2},
			wantStatus:  WorkerStatus{LastEventID: 1, HasLastEvent: true},
			wantOverlap: TierCounts{2},
			wantBlocks:  TierCounts{2},
		},
		{
			name:        "blocks stored again are counted",
			setup:       []step{events(w0r0, stored(0, la, lb))},
			change:      KVEvents{Worker: w0r0, Events: []Event{stored(1, la, lb, lc)}},
			want:        Result{LastEventID: 1, HasLastEvent: true, Applied: 1, DuplicateBlocks: 2},
			wantStatus:  WorkerStatus{LastEventID: 1, HasLastEvent: true},
			wantOverlap: TierCounts{3},
			wantBlocks:  TierCounts{3},
		},
		{
			name:        "cleared drops the rank's blocks",
			setup:       []step{events(w0r0, stored(0, la, lb))},
			change:      KVEvents{Worker: w0r0, Events: []Event{cleared(1)}},
			want:        Result{LastEventID: 1, HasLastEvent: true, Applied: 1},
			wantStatus:  WorkerStatus{LastEventID: 1, HasLastEvent: true},
			wantOverlap: TierCounts{},
			wantBlocks:  TierCounts{},
		},
		{
			// §4.1/§4.3: Cleared (AllBlocksCleared) drops everything of the worker rank; the host
			// blocks must not outlive the device prefix they continue.
			name:        "cleared at the device tier drops every tier of the rank",
			setup:       []step{events(w0r0, stored(0, la, lb), inTier(TierHost, storedAfter(1, lb, lc)), inTier(TierDisk, stored(2, la, lb, lc, ld)))},
			change:      KVEvents{Worker: w0r0, Events: []Event{cleared(3)}},
			want:        Result{LastEventID: 3, HasLastEvent: true, Applied: 1},
			wantStatus:  WorkerStatus{LastEventID: 3, HasLastEvent: true},
			wantOverlap: TierCounts{},
			wantBlocks:  TierCounts{},
		},
		{
			name:        "cleared naming the host tier drops the device blocks too",
			setup:       []step{events(w0r0, stored(0, la, lb), inTier(TierHost, storedAfter(1, lb, lc)))},
			change:      KVEvents{Worker: w0r0, Events: []Event{inTier(TierHost, cleared(2))}},
			want:        Result{LastEventID: 2, HasLastEvent: true, Applied: 1},
			wantStatus:  WorkerStatus{LastEventID: 2, HasLastEvent: true},
			wantOverlap: TierCounts{},
			wantBlocks:  TierCounts{},
		},
		{
			name:        "blocks stored after a clear start afresh",
			setup:       []step{events(w0r0, stored(0, la, lb), inTier(TierHost, storedAfter(1, lb, lc)))},
			change:      KVEvents{Worker: w0r0, Events: []Event{cleared(2), inTier(TierHost, stored(3, la))}},
			want:        Result{LastEventID: 3, HasLastEvent: true, Applied: 2},
			wantStatus:  WorkerStatus{LastEventID: 3, HasLastEvent: true},
			wantOverlap: TierCounts{0, 1},
			wantBlocks:  TierCounts{0, 1},
		},
		{
			name:        "parent-not-found inside a dump is counted",
			change:      KVDump{Worker: w0r0, ThroughEventID: 3, Events: []Event{stored(0, la), storedAfter(0, lx, ly)}},
			want:        Result{LastEventID: 3, HasLastEvent: true, Applied: 2, ParentNotFound: 1},
			wantStatus:  WorkerStatus{LastEventID: 3, HasLastEvent: true},
			wantOverlap: TierCounts{1},
			wantBlocks:  TierCounts{1},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState()
			run(t, s, []step{up(w0r0), up(w0r1), events(w0r1, stored(0, la, lb, lc))})
			run(t, s, tc.setup)
			got, err := s.Apply(tc.change)
			if err != nil {
				t.Fatalf("State.Apply(%#v) = %v, want nil", tc.change, err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("State.Apply(%#v) = %+v, want %+v (-want +got):\n%s", tc.change, got, tc.want, diff)
			}
			st := s.Worker(w0r0).Status()
			st.Epoch = 0 // epochs: TestWorkerEpochs
			if diff := cmp.Diff(tc.wantStatus, st); diff != "" {
				t.Errorf("Worker(%v).Status() (-want +got):\n%s", w0r0, diff)
			}
			if got := workerOverlap(t, s, w0r0, la, lb, lc, ld); got != tc.wantOverlap {
				t.Errorf("overlap of %v with [a,b,c,d] = %v, want %v", w0r0, got, tc.wantOverlap)
			}
			if got := s.Model(testModel).Index.BlockCounts(s.Worker(w0r0).Slot); got != tc.wantBlocks {
				t.Errorf("Index.BlockCounts(%v) = %v, want %v", w0r0, got, tc.wantBlocks)
			}
			if got, want := workerOverlap(t, s, w0r1, la, lb, lc, ld), (TierCounts{3}); got != want {
				t.Errorf("overlap of the other rank %v with [a,b,c,d] = %v, want %v", w0r1, got, want)
			}
			if got, want := s.Worker(w0r1).Status(), (WorkerStatus{Epoch: 1, HasLastEvent: true}); got != want {
				t.Errorf("Worker(%v).Status() = %+v, want %+v", w0r1, got, want)
			}
		})
	}
}

// TestKVChangesUnknownWorker checks that changes naming an unregistered rank fail with
// ErrUnknownWorker and register nothing.
func TestKVChangesUnknownWorker(t *testing.T) {
	tests := []struct {
		name   string
		change Change
	}{
		{"KVEvents", KVEvents{Worker: w0r1, Events: []Event{stored(0, la)}}},
		{"KVDump", KVDump{Worker: w0r1, ThroughEventID: 1, Events: []Event{stored(0, la)}}},
		{"LoadReported", LoadReported{Worker: w0r1, KVUsedBlocks: 3}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState()
			run(t, s, []step{up(w0r0)})
			if _, err := s.Apply(tc.change); !errors.Is(err, ErrUnknownWorker) {
				t.Errorf("State.Apply(%#v) = %v, want %v", tc.change, err, ErrUnknownWorker)
			}
			if w := s.Worker(w0r1); w != nil {
				t.Errorf("State.Worker(%v) = %+v, want nil", w0r1, w.Info)
			}
			if got := s.Model(testModel).Index.Len(); got != 0 {
				t.Errorf("Index.Len() = %d, want 0", got)
			}
		})
	}
}

// Views of the registry, for comparing whole states.
type (
	workerView struct {
		Info    WorkerInfo
		Slot    uint32
		Status  WorkerStatus
		Blocks  TierCounts // Index.BlockCounts
		Overlap TierCounts // overlap with the probe prompt [a,b,c,d,e]
		Load    SlotLoad
	}
	modelView struct {
		Name      string
		BlockSize uint32
		IndexLen  int
		Workers   []workerView // in Model.Workers() order
	}
	stateView struct {
		Models   []modelView // in State.Models() order
		Bookings []string    // Load.BookingIDs(), nil when empty
	}
)

func viewState(t *testing.T, s *State) stateView {
	t.Helper()
	v := stateView{Models: []modelView{}}
	if ids := s.Load().BookingIDs(); len(ids) > 0 {
		v.Bookings = ids
	}
	for _, m := range s.Models() {
		mv := modelView{Name: m.Name, BlockSize: m.BlockSize, IndexLen: m.Index.Len(), Workers: []workerView{}}
		var o Overlaps
		m.Index.Overlaps(seq(la, lb, lc, ld, le), &o)
		for _, w := range m.Workers() {
			if got := s.Worker(w.Info.Key); got != w {
				t.Errorf("State.Worker(%v) = %p, want the model's member %p", w.Info.Key, got, w)
			}
			mv.Workers = append(mv.Workers, workerView{
				Info: w.Info, Slot: w.Slot, Status: withoutEpoch(w.Status()),
				Blocks: m.Index.BlockCounts(w.Slot), Overlap: o.Blocks(w.Slot), Load: s.Load().Slot(w.Slot),
			})
		}
		v.Models = append(v.Models, mv)
	}
	return v
}

// book books request id on the given workers, each with prefill tokens 10 and the blocks [a,b].
func book(id string, keys ...WorkerKey) step {
	hops := make([]HopBooking, len(keys))
	for i, k := range keys {
		hops[i] = HopBooking{Worker: k, Blocks: seq(la, lb), PrefillTokens: 10}
	}
	return apply(Booked{Booking{RequestID: id, Hops: hops, At: 1}})
}

// TestRegistry checks worker registration and removal through State.Apply: models, block sizes,
// conflicting re-registrations, resets, removals (plain and conditional) and slot reuse. A failing
// change must leave the whole state view unchanged.
func TestRegistry(t *testing.T) {
	withTotal := func(i WorkerInfo, n uint64) WorkerInfo { i.TotalKVBlocks = n; return i }
	withModel := func(i WorkerInfo, m string) WorkerInfo { i.Model = m; return i }
	withRole := func(i WorkerInfo, r Role) WorkerInfo { i.Role = r; return i }
	withEndpoint := func(i WorkerInfo, e string) WorkerInfo { i.Endpoint, i.SupportsBypass = e, true; return i }
	loaded := SlotLoad{ActiveBlocks: 2, ActivePrefillTokens: 10, ActiveRequests: 1}
	held := []step{events(w0r0, stored(0, la, lb, lc))} // w0r0 holds [a,b,c], last event 0

	tests := []struct {
		name       string
		setup      []step
		change     Change
		wantErr    error // nil: success
		wantResult Result
		want       stateView // ignored when wantErr is set: the state must be unchanged
	}{
		{
			name:   "registering creates the model with the worker's block size",
			change: WorkerUp{Info: info(w0r0)},
			want: stateView{Models: []modelView{{Name: testModel, BlockSize: 16, Workers: []workerView{
				{Info: info(w0r0), Slot: 0},
			}}}},
		},
		{
			name:    "a second worker with another block size is rejected",
			setup:   []step{up(w0r0)},
			change:  WorkerUp{Info: withBS(info(w1), 32)},
			wantErr: ErrBlockSizeMismatch,
		},
		{
			name:   "a worker of another model may use another block size",
			setup:  []step{up(w0r0)},
			change: WorkerUp{Info: withBS(withModel(info(w1), "n"), 32)},
			want: stateView{Models: []modelView{
				{Name: testModel, BlockSize: 16, Workers: []workerView{{Info: info(w0r0), Slot: 0}}},
				{Name: "n", BlockSize: 32, Workers: []workerView{{Info: withBS(withModel(info(w1), "n"), 32), Slot: 1}}},
			}},
		},
		{
			name:   "Model.Workers() is sorted by key, not by registration",
			setup:  []step{up(w2), up(w0r1), up(w1)},
			change: WorkerUp{Info: info(w0r0)},
			want: stateView{Models: []modelView{{Name: testModel, BlockSize: 16, Workers: []workerView{
				{Info: info(w0r0), Slot: 3},
				{Info: info(w0r1), Slot: 1},
				{Info: info(w1), Slot: 2},
				{Info: info(w2), Slot: 0},
			}}}},
		},
		{
			name:   "re-hello with the same capacities keeps slot, event numbering, blocks and load",
			setup:  append([]step{up(w1), up(w0r0), book("r1", w0r0)}, held...),
			change: WorkerUp{Info: withEndpoint(info(w0r0), "moved:1")},
			want: stateView{
				Models: []modelView{{Name: testModel, BlockSize: 16, IndexLen: 3, Workers: []workerView{
					{
						Info: withEndpoint(info(w0r0), "moved:1"), Slot: 1,
						Status: WorkerStatus{HasLastEvent: true}, Blocks: TierCounts{3}, Overlap: TierCounts{3}, Load: loaded,
					},
					{Info: info(w1), Slot: 0},
				}}},
				Bookings: []string{"r1"},
			},
		},
		{
			name:    "different capacity without Reset is a conflict",
			setup:   append([]step{up(w0r0), book("r1", w0r0)}, held...),
			change:  WorkerUp{Info: withTotal(info(w0r0), 2000)},
			wantErr: ErrWorkerConflict,
		},
		{
			name:    "different role without Reset is a conflict",
			setup:   append([]step{up(w0r0)}, held...),
			change:  WorkerUp{Info: withRole(info(w0r0), RoleDecode)},
			wantErr: ErrWorkerConflict,
		},
		{
			name:    "different model without Reset is a conflict",
			setup:   append([]step{up(w0r0)}, held...),
			change:  WorkerUp{Info: withModel(info(w0r0), "n")},
			wantErr: ErrWorkerConflict,
		},
		{
			name:    "different block size without Reset is a conflict",
			setup:   append([]step{up(w0r0)}, held...),
			change:  WorkerUp{Info: withBS(info(w0r0), 32)},
			wantErr: ErrWorkerConflict,
		},
		{
			name:   "Reset accepts new capacities and drops blocks, event numbering and load",
			setup:  append([]step{up(w0r0), up(w1), book("r1", w0r0), book("r2", w0r0, w1)}, held...),
			change: WorkerUp{Info: withTotal(info(w0r0), 2000), Reset: true},
			want: stateView{
				Models: []modelView{{Name: testModel, BlockSize: 16, Workers: []workerView{
					{Info: withTotal(info(w0r0), 2000), Slot: 0},
					{Info: info(w1), Slot: 1, Load: loaded},
				}}},
				Bookings: []string{"r2"},
			},
		},
		{
			name:   "Reset with unchanged capacities drops blocks and event numbering",
			setup:  append([]step{up(w0r0)}, held...),
			change: WorkerUp{Info: info(w0r0), Reset: true},
			want: stateView{Models: []modelView{{Name: testModel, BlockSize: 16, Workers: []workerView{
				{Info: info(w0r0), Slot: 0},
			}}}},
		},
		{
			name:   "Reset of a model's sole worker may change the block size",
			setup:  append([]step{up(w0r0)}, held...),
			change: WorkerUp{Info: withBS(info(w0r0), 32), Reset: true},
			want: stateView{Models: []modelView{{Name: testModel, BlockSize: 32, Workers: []workerView{
				{Info: withBS(info(w0r0), 32), Slot: 0},
			}}}},
		},
		{
			name:    "Reset of one of several workers may not change the block size",
			setup:   append([]step{up(w0r0), up(w1)}, held...),
			change:  WorkerUp{Info: withBS(info(w0r0), 32), Reset: true},
			wantErr: ErrBlockSizeMismatch,
		},
		{
			name:   "Reset moving the sole worker to another model drops the old model",
			setup:  append([]step{up(w0r0)}, held...),
			change: WorkerUp{Info: withModel(info(w0r0), "n"), Reset: true},
			want: stateView{Models: []modelView{{Name: "n", BlockSize: 16, Workers: []workerView{
				{Info: withModel(info(w0r0), "n"), Slot: 0},
			}}}},
		},
		{
			name:   "Reset of an unknown worker registers it",
			change: WorkerUp{Info: info(w0r0), Reset: true},
			want: stateView{Models: []modelView{{Name: testModel, BlockSize: 16, Workers: []workerView{
				{Info: info(w0r0), Slot: 0},
			}}}},
		},
		{
			name: "WorkerRemoved drops the worker's blocks and its share of bookings",
			setup: []step{
				up(w0r0), up(w1),
				events(w0r0, stored(0, la, lb, lc, ld)), events(w1, stored(0, la, lb)),
				book("solo", w0r0), book("both", w0r0, w1),
			},
			change: WorkerRemoved{Key: w0r0},
			want: stateView{
				Models: []modelView{{Name: testModel, BlockSize: 16, IndexLen: 2, Workers: []workerView{
					{Info: info(w1), Slot: 1, Status: WorkerStatus{HasLastEvent: true}, Blocks: TierCounts{2}, Overlap: TierCounts{2}, Load: loaded},
				}}},
				Bookings: []string{"both"},
			},
		},
		{
			name:   "WorkerRemoved of the last worker drops the model",
			setup:  append([]step{up(w0r0), book("r1", w0r0)}, held...),
			change: WorkerRemoved{Key: w0r0},
			want:   stateView{Models: []modelView{}},
		},
		{
			name:       "WorkerRemoved of an unknown worker is skipped",
			setup:      []step{up(w0r0)},
			change:     WorkerRemoved{Key: w1},
			wantResult: Result{Skipped: true},
			want: stateView{Models: []modelView{{Name: testModel, BlockSize: 16, Workers: []workerView{
				{Info: info(w0r0), Slot: 0},
			}}}},
		},
		{
			name:   "WorkerRemoved for the current epoch applies",
			setup:  append([]step{up(w0r0), up(w1), connect(w0r0), disconnect(w0r0, 100)}, held...),
			change: WorkerRemoved{Key: w0r0, Epoch: 1},
			want: stateView{Models: []modelView{{Name: testModel, BlockSize: 16, Workers: []workerView{
				{Info: info(w1), Slot: 1},
			}}}},
		},
		{
			// A reconnect says hello again, which bumps the epoch: the removal is stale.
			name:       "WorkerRemoved for an earlier epoch is skipped",
			setup:      append([]step{up(w0r0), connect(w0r0), disconnect(w0r0, 100), connect(w0r0), up(w0r0)}, held...),
			change:     WorkerRemoved{Key: w0r0, Epoch: 1},
			wantResult: Result{Skipped: true},
			want: stateView{Models: []modelView{{Name: testModel, BlockSize: 16, IndexLen: 3, Workers: []workerView{
				{
					Info: info(w0r0), Slot: 0, Status: WorkerStatus{HasLastEvent: true},
					Blocks: TierCounts{3}, Overlap: TierCounts{3},
				},
			}}}},
		},
		{
			// A fresh start is a new registration, yet keeps counting epochs: a removal aimed at the
			// old process does not remove the new one.
			name:       "WorkerRemoved for the epoch before a fresh start is skipped",
			setup:      []step{up(w0r0), apply(WorkerUp{Info: info(w0r0), Reset: true})},
			change:     WorkerRemoved{Key: w0r0, Epoch: 1},
			wantResult: Result{Skipped: true},
			want: stateView{Models: []modelView{{Name: testModel, BlockSize: 16, Workers: []workerView{
				{Info: info(w0r0), Slot: 0},
			}}}},
		},
		{
			name: "a reused slot starts with no blocks and no load",
			setup: []step{
				up(w0r0), up(w1), book("r1", w0r0), book("r2", w0r0, w1),
				events(w0r0, stored(0, la, lb, lc)), events(w1, stored(0, la)),
				apply(WorkerRemoved{Key: w0r0}),
			},
			change: WorkerUp{Info: info(w2)},
			want: stateView{
				Models: []modelView{{Name: testModel, BlockSize: 16, IndexLen: 1, Workers: []workerView{
					{Info: info(w1), Slot: 1, Status: WorkerStatus{HasLastEvent: true}, Blocks: TierCounts{1}, Overlap: TierCounts{1}, Load: loaded},
					{Info: info(w2), Slot: 0},
				}}},
				Bookings: []string{"r2"},
			},
		},
		{
			// r2's hop on the departed worker went with it; freeing r2 must not touch the worker that
			// now has that slot.
			name: "freeing an old booking after its worker's slot was reused leaves the new worker alone",
			setup: []step{
				up(w0r0), up(w1), book("r2", w0r0, w1),
				apply(WorkerRemoved{Key: w0r0}), up(w2), book("r3", w2),
			},
			change: Freed{RequestID: "r2"},
			want: stateView{
				Models: []modelView{{Name: testModel, BlockSize: 16, Workers: []workerView{
					{Info: info(w1), Slot: 1},
					{Info: info(w2), Slot: 0, Load: loaded},
				}}},
				Bookings: []string{"r3"},
			},
		},
		{
			// The departed worker's blocks must be gone from its own model's index too (IndexLen 0).
			name: "a slot reused by another model's worker starts with no blocks and no load",
			setup: []step{
				up(w1), up(w0r0), events(w0r0, stored(0, la, lb, lc)), book("r1", w0r0),
				apply(WorkerRemoved{Key: w0r0}),
			},
			change: WorkerUp{Info: withModel(info(w2), "n")},
			want: stateView{Models: []modelView{
				{Name: testModel, BlockSize: 16, Workers: []workerView{{Info: info(w1), Slot: 0}}},
				{Name: "n", BlockSize: 16, Workers: []workerView{{Info: withModel(info(w2), "n"), Slot: 1}}},
			}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState()
			run(t, s, tc.setup)
			before := viewState(t, s)
			res, err := s.Apply(tc.change)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("State.Apply(%#v) = %v, want %v", tc.change, err, tc.wantErr)
			}
			res.Epoch = 0 // TestRegistrationEpochs checks epochs
			if diff := cmp.Diff(tc.wantResult, res); diff != "" {
				t.Errorf("State.Apply(%#v) = %+v, want %+v (-want +got):\n%s", tc.change, res, tc.wantResult, diff)
			}
			want := tc.want
			if tc.wantErr != nil {
				want = before
			}
			if diff := cmp.Diff(want, viewState(t, s)); diff != "" {
				t.Errorf("state after State.Apply(%#v) (-want +got):\n%s", tc.change, diff)
			}
		})
	}
}

// TestConnectionTracking checks Presence, the replica-local stream count, including across
// registrations that replace the Worker value.
func TestConnectionTracking(t *testing.T) {
	type probe struct {
		Connected    bool
		Disconnected map[WorkerKey]Disconnection
	}
	tests := []struct {
		name  string
		steps []step
		want  probe
	}{
		{
			name:  "registered, never connected: neither connected nor disconnected",
			steps: []step{up(w0r0)},
			want:  probe{Disconnected: map[WorkerKey]Disconnection{}},
		},
		{
			name:  "connected",
			steps: []step{up(w0r0), connect(w0r0)},
			want:  probe{Connected: true, Disconnected: map[WorkerKey]Disconnection{}},
		},
		{
			name:  "last stream closed",
			steps: []step{up(w0r0), connect(w0r0), disconnect(w0r0, 100)},
			want:  probe{Disconnected: map[WorkerKey]Disconnection{w0r0: {Since: 100, Epoch: 1}}},
		},
		{
			name:  "one of two streams closed",
			steps: []step{up(w0r0), connect(w0r0), connect(w0r0), disconnect(w0r0, 100)},
			want:  probe{Connected: true, Disconnected: map[WorkerKey]Disconnection{}},
		},
		{
			name:  "re-hello keeps the open stream",
			steps: []step{up(w0r0), connect(w0r0), up(w0r0)},
			want:  probe{Connected: true, Disconnected: map[WorkerKey]Disconnection{}},
		},
		{
			// A restarted engine says hello with Reset. The stream it says hello on is open; the
			// replica-local stream count must survive the reset of the replicated state.
			name:  "Reset hello keeps the open stream",
			steps: []step{up(w0r0), connect(w0r0), apply(WorkerUp{Info: info(w0r0), Reset: true})},
			want:  probe{Connected: true, Disconnected: map[WorkerKey]Disconnection{}},
		},
		{
			// The new process connects (Reset hello on a new stream) before the router notices that
			// the old stream is dead. When the old stream finally closes, the new one is still open:
			// the worker must not be reported disconnected (the housekeeper would remove it).
			name: "old stream closing after a Reset hello on a new stream leaves the worker connected",
			steps: []step{
				up(w0r0), connect(w0r0),
				apply(WorkerUp{Info: info(w0r0), Reset: true}), connect(w0r0),
				disconnect(w0r0, 100),
			},
			want: probe{Connected: true, Disconnected: map[WorkerKey]Disconnection{}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState()
			run(t, s, tc.steps)
			got := probe{Connected: presenceOf(s).IsConnected(w0r0), Disconnected: presenceOf(s).Disconnections()}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("connection state = %+v, want %+v (-want +got):\n%s", got, tc.want, diff)
			}
		})
	}
}

// TestPresenceOwesRemovals: a stream that never registered owes no removal, and one that opens
// and fails to register does not drop the removal an earlier close owes; a removal, once appended,
// is forgotten unless a stream opened since.
func TestPresenceOwesRemovals(t *testing.T) {
	p := NewPresence()
	p.Connected(w1)
	if since := p.Disconnected(w1, 100, 0); since != 0 || len(p.Disconnections()) != 0 {
		t.Errorf("a stream that never registered: Disconnected = %d, Disconnections = %v; want 0 and none", since, p.Disconnections())
	}

	p.Connected(w0r0)
	p.Disconnected(w0r0, 100, 3)
	p.Connected(w0r0) // a new stream, whose hello fails
	p.Disconnected(w0r0, 200, 0)
	want := map[WorkerKey]Disconnection{w0r0: {Since: 200, Epoch: 3}}
	if diff := cmp.Diff(want, p.Disconnections()); diff != "" {
		t.Errorf("after a failed registration (-want +got):\n%s", diff)
	}

	d := p.Disconnections()[w0r0]
	p.Connected(w0r0) // a stream opened before the removal was appended
	p.Forget(w0r0, d)
	if !p.IsConnected(w0r0) {
		t.Error("Forget dropped a worker whose stream opened again")
	}
	p.Disconnected(w0r0, 300, 4)
	d = p.Disconnections()[w0r0]
	p.Forget(w0r0, d)
	if got := p.Disconnections(); len(got) != 0 {
		t.Errorf("Disconnections after Forget = %v, want none", got)
	}
}

// TestKVEventsInvalidTier checks that an event naming a tier outside [0, NumTiers) cannot corrupt
// or crash the state: such an event is dropped and counted in Result.Invalid.
func TestKVEventsInvalidTier(t *testing.T) {
	tests := []struct {
		name   string
		change Change
	}{
		{"stored, tier 4", KVEvents{Worker: w0r0, Events: []Event{{ID: 1, Kind: EventStored, Tier: NumTiers, Blocks: blocks(lx)}}}},
		{"removed, tier 4", KVEvents{Worker: w0r0, Events: []Event{{ID: 1, Kind: EventRemoved, Tier: NumTiers, Removed: []uint64{eh(la)}}}}},
		{"cleared, tier 255", KVEvents{Worker: w0r0, Events: []Event{{ID: 1, Kind: EventCleared, Tier: 255}}}},
		{"stored in a dump, tier 4", KVDump{Worker: w0r0, ThroughEventID: 1, Events: []Event{{Kind: EventStored, Tier: NumTiers, Blocks: blocks(la, lb, lc)}}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState()
			run(t, s, []step{up(w0r0), up(w0r1), events(w0r0, stored(0, la, lb)), events(w0r1, stored(0, la, lb, lc))})
			func() {
				defer func() {
					if r := recover(); r != nil {
						t.Fatalf("State.Apply(%#v) panicked: %v", tc.change, r)
					}
				}()
				s.Apply(tc.change)
			}()
			for _, k := range []WorkerKey{w0r0, w0r1} {
				var got TierCounts
				m := s.Model(testModel)
				got = m.Index.BlockCounts(s.Worker(k).Slot)
				if got[TierHost]+got[TierDisk]+got[TierExternal] != 0 || got[TierDevice] > 3 {
					t.Errorf("Index.BlockCounts(%v) = %v after an invalid-tier event, want device blocks only", k, got)
				}
			}
			if got, want := workerOverlap(t, s, w0r1, la, lb, lc), (TierCounts{3}); got != want {
				t.Errorf("overlap of the other rank %v = %v, want %v", w0r1, got, want)
			}
		})
	}
}

// TestMemLog checks that Position counts exactly the changes that applied, and that a cancelled
// context appends (and applies) nothing.
func TestMemLog(t *testing.T) {
	type appendCall struct {
		change  Change
		wantErr error
	}
	tests := []struct {
		name         string
		cancelled    bool
		appends      []appendCall
		wantPosition uint64
		wantWorkers  []WorkerKey // registered afterwards
	}{
		{
			name: "successful appends are counted",
			appends: []appendCall{
				{WorkerUp{Info: info(w0r0)}, nil},
				{KVEvents{Worker: w0r0, Events: []Event{stored(0, la)}}, nil},
				{Booked{Booking{RequestID: "r1", Hops: []HopBooking{{Worker: w0r0}}}}, nil},
				{Freed{RequestID: "r1"}, nil},
			},
			wantPosition: 4,
			wantWorkers:  []WorkerKey{w0r0},
		},
		{
			name: "failed appends are not counted",
			appends: []appendCall{
				{Booked{Booking{RequestID: "r1", Hops: []HopBooking{{Worker: w0r0}}}}, ErrUnknownWorker},
				{WorkerUp{Info: info(w0r0)}, nil},
				{WorkerUp{Info: withBS(info(w1), 8)}, ErrBlockSizeMismatch},
				{Freed{RequestID: "nope"}, ErrUnknownRequest},
				{KVEvents{Worker: w1, Events: []Event{stored(0, la)}}, ErrUnknownWorker},
			},
			wantPosition: 1,
			wantWorkers:  []WorkerKey{w0r0},
		},
		{
			// A skipped conditional removal is a change that applied (as a no-op), so it counts.
			name: "skipped removal is counted",
			appends: []appendCall{
				{WorkerRemoved{Key: w1}, nil},
			},
			wantPosition: 1,
			wantWorkers:  []WorkerKey{},
		},
		{
			name:      "cancelled context appends nothing",
			cancelled: true,
			appends: []appendCall{
				{WorkerUp{Info: info(w0r0)}, context.Canceled},
				{BookingsExpired{Before: 1}, context.Canceled},
			},
			wantPosition: 0,
			wantWorkers:  []WorkerKey{},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState()
			l := NewMemLog(s)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tc.cancelled {
				cancel()
			}
			for _, a := range tc.appends {
				if _, err := l.Append(ctx, a.change); !errors.Is(err, a.wantErr) {
					t.Errorf("MemLog.Append(%#v) = %v, want %v", a.change, err, a.wantErr)
				}
			}
			if got := l.Position(); got != tc.wantPosition {
				t.Errorf("MemLog.Position() = %d, want %d", got, tc.wantPosition)
			}
			got := []WorkerKey{}
			for _, k := range []WorkerKey{w0r0, w0r1, w1, w2} {
				if s.Worker(k) != nil {
					got = append(got, k)
				}
			}
			if diff := cmp.Diff(tc.wantWorkers, got); diff != "" {
				t.Errorf("registered workers = %v, want %v (-want +got):\n%s", got, tc.wantWorkers, diff)
			}
		})
	}
}

func withBS(i WorkerInfo, n uint32) WorkerInfo { i.BlockSize = n; return i }

// TestStateConcurrent drives both MemLog lanes and the readers at once, for the race detector, then
// checks the deterministic end state: every worker holds its chain, every booking is freed.
func TestStateConcurrent(t *testing.T) {
	const (
		nWorkers  = 4
		nEvents   = 50
		nBookings = 200
	)
	s := NewState()
	l := NewMemLog(s)
	ctx := context.Background()
	keys := make([]WorkerKey, nWorkers)
	for i := range keys {
		keys[i] = WorkerKey{ID: uint64(i + 1)}
		if _, err := l.Append(ctx, WorkerUp{Info: info(keys[i])}); err != nil {
			t.Fatalf("MemLog.Append(WorkerUp %v) = %v, want nil", keys[i], err)
		}
	}
	locals := make([]uint64, nEvents)
	for i := range locals {
		locals[i] = uint64(0x100 + i)
	}
	prompt := seq(locals...)

	var wg sync.WaitGroup
	errs := make(chan error, nWorkers*nEvents+2*nBookings)
	for _, k := range keys {
		wg.Go(func() {
			for i := range nEvents {
				ev := Event{ID: uint64(i), Kind: EventStored, Blocks: blocks(locals[i])}
				if i > 0 {
					ev.Parent, ev.HasParent = eh(locals[i-1]), true
				}
				if _, err := l.Append(ctx, KVEvents{Worker: k, Events: []Event{ev}}); err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Go(func() {
		for i := range nBookings {
			id := fmt.Sprint("r", i)
			b := Booking{RequestID: id, Hops: []HopBooking{{Worker: keys[i%nWorkers], Blocks: prompt[:i%nEvents], PrefillTokens: 7}}}
			if _, err := l.Append(ctx, Booked{b}); err != nil {
				errs <- err
			}
			if _, err := l.Append(ctx, Freed{RequestID: id}); err != nil {
				errs <- err
			}
		}
	})
	wg.Go(func() {
		var o Overlaps
		m := s.Model(testModel)
		for range nBookings {
			m.Index.Overlaps(prompt, &o)
			s.Load().ActiveDepths(prompt, &o)
			for _, w := range m.Workers() {
				_ = w.Status()
				_ = s.Load().Slot(w.Slot)
			}
		}
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("concurrent MemLog.Append = %v, want nil", err)
	}
	for _, k := range keys {
		if got, want := workerOverlap(t, s, k, locals...), (TierCounts{nEvents}); got != want {
			t.Errorf("overlap of %v = %v, want %v", k, got, want)
		}
		if got := s.Load().Slot(s.Worker(k).Slot); got != (SlotLoad{}) {
			t.Errorf("Load.Slot(%v) = %+v, want zero", k, got)
		}
	}
	if got, want := l.Position(), uint64(nWorkers+nWorkers*nEvents+2*nBookings); got != want {
		t.Errorf("MemLog.Position() = %d, want %d", got, want)
	}
}

// TestStaleDumpRejected: a dump that reflects fewer events than already applied, with no resync
// pending, would move the worker's event numbering backwards; it is rejected and changes nothing.
func TestStaleDumpRejected(t *testing.T) {
	s := NewState()
	run(t, s, []step{up(w0r0), events(w0r0, stored(0, la), storedAfter(1, la, lb), storedAfter(2, lb, lc))})
	_, err := s.Apply(KVDump{Worker: w0r0, ThroughEventID: 1, Events: []Event{stored(0, la)}})
	if !errors.Is(err, ErrStaleDump) {
		t.Fatalf("State.Apply(stale KVDump) = %v, want ErrStaleDump", err)
	}
	if got := workerOverlap(t, s, w0r0, la, lb, lc); got[TierDevice] != 3 {
		t.Errorf("overlap after a rejected dump = %v, want 3 device blocks", got)
	}
	if st := s.Worker(w0r0).Status(); st.LastEventID != 2 {
		t.Errorf("last event id after a rejected dump = %d, want 2", st.LastEventID)
	}
	// A dump through the last applied id is a full refresh and is accepted.
	if _, err := s.Apply(KVDump{Worker: w0r0, ThroughEventID: 2, Events: []Event{stored(0, la)}}); err != nil {
		t.Errorf("State.Apply(KVDump through the last id) = %v, want nil", err)
	}
}

// TestSessionBindings: a booking with a session binds it to its last hop's worker until it expires;
// SessionsExpired forgets expired bindings only.
func TestSessionBindings(t *testing.T) {
	s := NewState()
	run(t, s, []step{up(w0r0), up(w1),
		apply(Booked{Booking: Booking{RequestID: "a", Hops: []HopBooking{{Worker: w1}, {Worker: w0r0}}, At: 1, Session: "s1", SessionExpires: 100}}),
		apply(Booked{Booking: Booking{RequestID: "b", Hops: []HopBooking{{Worker: w1}}, At: 1, Session: "s2", SessionExpires: 50}}),
	})
	if got, ok := s.Session(testModel, "s1", 99); !ok || got != w0r0 {
		t.Errorf("Session(s1, 99) = %v, %v; want %v, true", got, ok, w0r0)
	}
	if _, ok := s.Session(testModel, "s1", 100); ok {
		t.Error("Session(s1) at its expiry = bound, want unbound")
	}
	res, err := s.Apply(SessionsExpired{Before: 60})
	if err != nil || res.Expired != 1 || s.Sessions() != 1 {
		t.Errorf("SessionsExpired{60} = %+v, %v, %d left; want 1 expired, 1 left", res, err, s.Sessions())
	}
	// A rejected booking binds nothing.
	if _, err := s.Apply(Booked{Booking: Booking{RequestID: "a", Hops: []HopBooking{{Worker: w1}}, Session: "s3", SessionExpires: 100}}); !errors.Is(err, ErrAlreadyBooked) {
		t.Fatalf("duplicate booking = %v, want ErrAlreadyBooked", err)
	}
	if _, ok := s.Session(testModel, "s3", 0); ok {
		t.Error("a rejected booking bound its session")
	}
}

// TestSessionBindingOrder: of two bookings of one session, the one whose binding lasts longer binds
// it, in whichever order they apply (a replica applies its own bookings first; sharded logs
// interleave differently on each replica); equal expiries go to the larger worker key. Both orders
// end with the same digest.
func TestSessionBindingOrder(t *testing.T) {
	booking := func(id string, w WorkerKey, expires int64) Change {
		return Booked{Booking: Booking{RequestID: id, Hops: []HopBooking{{Worker: w}}, At: 1, Session: "s", SessionExpires: expires}}
	}
	for _, tt := range []struct {
		name         string
		first, later Change
		want         WorkerKey
	}{
		{"later booking last", booking("a", w1, 100), booking("b", w0r0, 200), w0r0},
		{"later booking first", booking("b", w0r0, 200), booking("a", w1, 100), w0r0},
		{"same expiry, larger key last", booking("a", w0r0, 100), booking("b", w1, 100), w1},
		{"same expiry, larger key first", booking("b", w1, 100), booking("a", w0r0, 100), w1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := NewState()
			run(t, s, []step{up(w0r0), up(w1), apply(tt.first), apply(tt.later)})
			if got, ok := s.Session(testModel, "s", 0); !ok || got != tt.want {
				t.Errorf("Session(s) = %v, %v; want %v, true", got, ok, tt.want)
			}
			other := NewState()
			run(t, other, []step{up(w0r0), up(w1), apply(tt.later), apply(tt.first)})
			if s.Digest() != other.Digest() {
				t.Errorf("digests differ between the two orders")
			}
		})
	}
}

// withoutEpoch zeroes the registration epoch, which TestWorkerEpochs covers, so the state tables
// need not spell it out.
func withoutEpoch(st WorkerStatus) WorkerStatus {
	st.Epoch = 0
	return st
}

// TestWorkerEpochs: every hello bumps a worker's registration epoch, a fresh start included; a new
// registration starts at 1; a removal names the epoch it was decided for.
func TestWorkerEpochs(t *testing.T) {
	s := NewState()
	epoch := func(k WorkerKey) uint64 { return s.Worker(k).Status().Epoch }
	run(t, s, []step{up(w0r0)})
	if got := epoch(w0r0); got != 1 {
		t.Errorf("epoch after the first hello = %d, want 1", got)
	}
	run(t, s, []step{up(w0r0), apply(WorkerUp{Info: info(w0r0), Reset: true}), up(w1)})
	if got := []uint64{epoch(w0r0), epoch(w1)}; !cmp.Equal(got, []uint64{3, 1}) {
		t.Errorf("epochs after re-hello, fresh start and a new worker = %v, want [3 1]", got)
	}
	if res, _ := s.Apply(WorkerRemoved{Key: w0r0, Epoch: 2}); !res.Skipped {
		t.Error("WorkerRemoved for epoch 2 applied to a worker at epoch 3")
	}
	if res, _ := s.Apply(WorkerRemoved{Key: w0r0, Epoch: 3}); res.Skipped || s.Worker(w0r0) != nil {
		t.Error("WorkerRemoved for the current epoch did not remove the worker")
	}
}

// TestRemovalAfterAMoveIsSkipped: a worker whose stream closed here and that said hello on another
// replica since (its hello reaches this replica through the log) is reported with the epoch it had
// when it left, so the removal this replica appends is skipped everywhere.
func TestRemovalAfterAMoveIsSkipped(t *testing.T) {
	s := NewState()
	run(t, s, []step{up(w0r0), connect(w0r0), disconnect(w0r0, 100), up(w0r0)}) // the last hello came from elsewhere
	d := presenceOf(s).Disconnections()[w0r0]
	if d.Epoch != 1 {
		t.Fatalf("disconnection epoch = %d, want 1 (the epoch when the stream closed)", d.Epoch)
	}
	if res, _ := s.Apply(WorkerRemoved{Key: w0r0, Epoch: d.Epoch}); !res.Skipped || s.Worker(w0r0) == nil {
		t.Error("the removal decided for the old epoch removed a worker that moved to another replica")
	}
}
