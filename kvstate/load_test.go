package kvstate

import (
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// hop is a HopBooking on key with the given prefill tokens and block keys.
func hop(key WorkerKey, prefill uint64, keys ...uint64) HopBooking {
	return HopBooking{Worker: key, Blocks: keys, PrefillTokens: prefill}
}

// bookReq is a Booked change of request id at time at.
func bookReq(id string, at int64, hops ...HopBooking) Booked {
	return Booked{Booking{RequestID: id, At: at, Hops: hops}}
}

// loadView is the load of the test workers w0r0 and w1 plus the live bookings.
type loadView struct {
	Loads    map[WorkerKey]SlotLoad
	Bookings []string
	Expired  uint64 // State.ExpiredBookings: every expiry so far, the setup's included
}

func viewLoad(t *testing.T, s *State) loadView {
	t.Helper()
	keys := []WorkerKey{w0r0, w1}
	slots := make([]uint32, len(keys))
	v := loadView{Loads: map[WorkerKey]SlotLoad{}, Bookings: s.Load().BookingIDs(), Expired: s.ExpiredBookings()}
	for i, k := range keys {
		slots[i] = s.Worker(k).Slot
		v.Loads[k] = s.Load().Slot(slots[i])
	}
	// Slots must agree with Slot, in the order asked.
	got := s.Load().Slots(nil, slots)
	want := []SlotLoad{v.Loads[keys[0]], v.Loads[keys[1]]}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("Load.Slots(%v) = %v, want %v (-want +got):\n%s", slots, got, want, diff)
	}
	if got := s.Load().Bookings(); got != len(v.Bookings) {
		t.Errorf("Load.Bookings() = %d, want %d (len(BookingIDs()))", got, len(v.Bookings))
	}
	return v
}

// TestLoad checks the router's own load bookkeeping (§3.5) through State.Apply: bookings add
// requests, prefill tokens and distinct blocks per worker; PrefillDone and Freed take them away
// exactly once; BookingsExpired frees only old bookings; a failing change changes nothing.
func TestLoad(t *testing.T) {
	abc := seq(la, lb, lc)
	abd := seq(la, lb, ld)
	tests := []struct {
		name       string
		setup      []Change // each must succeed
		change     Change
		wantErr    error // nil: success
		wantResult Result
		want       loadView // ignored when wantErr is set: the load must be unchanged
	}{
		{
			name:   "one booking",
			change: bookReq("r1", 1, hop(w0r0, 100, abc...)),
			want: loadView{
				Loads:    map[WorkerKey]SlotLoad{w0r0: {ActiveBlocks: 3, ActivePrefillTokens: 100, ActiveRequests: 1}, w1: {}},
				Bookings: []string{"r1"},
			},
		},
		{
			name:   "two bookings sharing blocks on one worker count shared blocks once",
			setup:  []Change{bookReq("r1", 1, hop(w0r0, 100, abc...))},
			change: bookReq("r2", 2, hop(w0r0, 50, abd...)),
			want: loadView{
				Loads:    map[WorkerKey]SlotLoad{w0r0: {ActiveBlocks: 4, ActivePrefillTokens: 150, ActiveRequests: 2}, w1: {}},
				Bookings: []string{"r1", "r2"},
			},
		},
		{
			name:   "the same blocks on two workers count on each",
			setup:  []Change{bookReq("r1", 1, hop(w0r0, 100, abc...))},
			change: bookReq("r2", 2, hop(w1, 50, abc...)),
			want: loadView{
				Loads: map[WorkerKey]SlotLoad{
					w0r0: {ActiveBlocks: 3, ActivePrefillTokens: 100, ActiveRequests: 1},
					w1:   {ActiveBlocks: 3, ActivePrefillTokens: 50, ActiveRequests: 1},
				},
				Bookings: []string{"r1", "r2"},
			},
		},
		{
			name:   "unique block keys are never shared",
			setup:  []Change{bookReq("r1", 1, hop(w0r0, 0, 101, 102))},
			change: bookReq("r2", 2, hop(w0r0, 0, 201, 202)),
			want: loadView{
				Loads:    map[WorkerKey]SlotLoad{w0r0: {ActiveBlocks: 4, ActiveRequests: 2}, w1: {}},
				Bookings: []string{"r1", "r2"},
			},
		},
		{
			name:   "a key repeated inside one booking counts once",
			change: bookReq("r1", 1, hop(w0r0, 0, 7, 7, 8)),
			want: loadView{
				Loads:    map[WorkerKey]SlotLoad{w0r0: {ActiveBlocks: 2, ActiveRequests: 1}, w1: {}},
				Bookings: []string{"r1"},
			},
		},
		{
			name:   "a key repeated inside one booking is released whole by Freed",
			setup:  []Change{bookReq("r1", 1, hop(w0r0, 0, 7, 7, 8))},
			change: Freed{RequestID: "r1"},
			want:   loadView{Loads: map[WorkerKey]SlotLoad{w0r0: {}, w1: {}}, Bookings: []string{}},
		},
		{
			name:   "a two-hop booking loads both workers",
			change: bookReq("r1", 1, hop(w0r0, 100, abc...), hop(w1, 0, abc...)),
			want: loadView{
				Loads: map[WorkerKey]SlotLoad{
					w0r0: {ActiveBlocks: 3, ActivePrefillTokens: 100, ActiveRequests: 1},
					w1:   {ActiveBlocks: 3, ActiveRequests: 1},
				},
				Bookings: []string{"r1"},
			},
		},
		{
			name:   "PrefillDone removes the request's prefill tokens only",
			setup:  []Change{bookReq("r1", 1, hop(w0r0, 100, abc...)), bookReq("r2", 2, hop(w0r0, 50, abd...))},
			change: PrefillDone{RequestID: "r1"},
			want: loadView{
				Loads:    map[WorkerKey]SlotLoad{w0r0: {ActiveBlocks: 4, ActivePrefillTokens: 50, ActiveRequests: 2}, w1: {}},
				Bookings: []string{"r1", "r2"},
			},
		},
		{
			name: "PrefillDone twice removes the prefill tokens once",
			setup: []Change{
				bookReq("r1", 1, hop(w0r0, 100, abc...)), bookReq("r2", 2, hop(w0r0, 50, abd...)),
				PrefillDone{RequestID: "r1"},
			},
			change: PrefillDone{RequestID: "r1"},
			want: loadView{
				Loads:    map[WorkerKey]SlotLoad{w0r0: {ActiveBlocks: 4, ActivePrefillTokens: 50, ActiveRequests: 2}, w1: {}},
				Bookings: []string{"r1", "r2"},
			},
		},
		{
			name:   "PrefillDone covers every hop",
			setup:  []Change{bookReq("r1", 1, hop(w0r0, 100, abc...), hop(w1, 30, abc...))},
			change: PrefillDone{RequestID: "r1"},
			want: loadView{
				Loads: map[WorkerKey]SlotLoad{
					w0r0: {ActiveBlocks: 3, ActiveRequests: 1},
					w1:   {ActiveBlocks: 3, ActiveRequests: 1},
				},
				Bookings: []string{"r1"},
			},
		},
		{
			name:   "Freed releases everything",
			setup:  []Change{bookReq("r1", 1, hop(w0r0, 100, abc...), hop(w1, 0, abc...))},
			change: Freed{RequestID: "r1"},
			want:   loadView{Loads: map[WorkerKey]SlotLoad{w0r0: {}, w1: {}}, Bookings: []string{}},
		},
		{
			name:   "Freed keeps blocks another booking still uses",
			setup:  []Change{bookReq("r1", 1, hop(w0r0, 100, abc...)), bookReq("r2", 2, hop(w0r0, 50, abd...))},
			change: Freed{RequestID: "r1"},
			want: loadView{
				Loads:    map[WorkerKey]SlotLoad{w0r0: {ActiveBlocks: 3, ActivePrefillTokens: 50, ActiveRequests: 1}, w1: {}},
				Bookings: []string{"r2"},
			},
		},
		{
			name: "Freed after PrefillDone does not take the prefill tokens twice",
			setup: []Change{
				bookReq("r1", 1, hop(w0r0, 100, abc...)), bookReq("r2", 2, hop(w0r0, 50, abd...)),
				PrefillDone{RequestID: "r1"},
			},
			change: Freed{RequestID: "r1"},
			want: loadView{
				Loads:    map[WorkerKey]SlotLoad{w0r0: {ActiveBlocks: 3, ActivePrefillTokens: 50, ActiveRequests: 1}, w1: {}},
				Bookings: []string{"r2"},
			},
		},
		{
			name:   "a freed id may be booked again",
			setup:  []Change{bookReq("r1", 1, hop(w0r0, 100, abc...)), Freed{RequestID: "r1"}},
			change: bookReq("r1", 2, hop(w1, 5, abd...)),
			want: loadView{
				Loads:    map[WorkerKey]SlotLoad{w0r0: {}, w1: {ActiveBlocks: 3, ActivePrefillTokens: 5, ActiveRequests: 1}},
				Bookings: []string{"r1"},
			},
		},
		{
			name:    "booking the same id twice is rejected",
			setup:   []Change{bookReq("r1", 1, hop(w0r0, 100, abc...))},
			change:  bookReq("r1", 2, hop(w1, 50, abd...)),
			wantErr: ErrAlreadyBooked,
		},
		{
			name:    "PrefillDone of an unknown id",
			setup:   []Change{bookReq("r1", 1, hop(w0r0, 100, abc...))},
			change:  PrefillDone{RequestID: "r2"},
			wantErr: ErrUnknownRequest,
		},
		{
			name:    "Freed of an unknown id",
			setup:   []Change{bookReq("r1", 1, hop(w0r0, 100, abc...))},
			change:  Freed{RequestID: "r2"},
			wantErr: ErrUnknownRequest,
		},
		{
			name:    "Freed twice",
			setup:   []Change{bookReq("r1", 1, hop(w0r0, 100, abc...)), bookReq("r2", 1, hop(w0r0, 1, abd...)), Freed{RequestID: "r1"}},
			change:  Freed{RequestID: "r1"},
			wantErr: ErrUnknownRequest,
		},
		{
			name:    "PrefillDone after Freed",
			setup:   []Change{bookReq("r1", 1, hop(w0r0, 100, abc...)), Freed{RequestID: "r1"}},
			change:  PrefillDone{RequestID: "r1"},
			wantErr: ErrUnknownRequest,
		},
		{
			// The first hop is valid: it must not be booked either.
			name:    "a booking naming an unregistered worker is rejected whole",
			setup:   []Change{bookReq("r0", 1, hop(w1, 1, abd...))},
			change:  bookReq("r1", 1, hop(w0r0, 100, abc...), hop(w2, 5, abc...)),
			wantErr: ErrUnknownWorker,
		},
		{
			name: "BookingsExpired frees only bookings made before Before",
			setup: []Change{
				bookReq("old", 100, hop(w0r0, 100, abc...)),
				bookReq("edge", 200, hop(w0r0, 10, abd...)),
				bookReq("new", 300, hop(w1, 5, abc...)),
			},
			change:     BookingsExpired{Before: 200},
			wantResult: Result{Expired: 1},
			want: loadView{
				Loads: map[WorkerKey]SlotLoad{
					w0r0: {ActiveBlocks: 3, ActivePrefillTokens: 10, ActiveRequests: 1},
					w1:   {ActiveBlocks: 3, ActivePrefillTokens: 5, ActiveRequests: 1},
				},
				Bookings: []string{"edge", "new"},
				Expired:  1,
			},
		},
		{
			name: "BookingsExpired counts every booking it frees",
			setup: []Change{
				bookReq("a", 100, hop(w0r0, 100, abc...)),
				bookReq("b", 150, hop(w0r0, 10, abd...), hop(w1, 1, abd...)),
				bookReq("c", 300, hop(w1, 5, abc...)),
			},
			change:     BookingsExpired{Before: 301},
			wantResult: Result{Expired: 3},
			want:       loadView{Loads: map[WorkerKey]SlotLoad{w0r0: {}, w1: {}}, Bookings: []string{}, Expired: 3},
		},
		{
			name: "BookingsExpired applied twice is harmless",
			setup: []Change{
				bookReq("old", 100, hop(w0r0, 100, abc...)),
				bookReq("new", 300, hop(w1, 5, abc...)),
				BookingsExpired{Before: 200},
			},
			change:     BookingsExpired{Before: 200},
			wantResult: Result{Expired: 0},
			want: loadView{
				Loads:    map[WorkerKey]SlotLoad{w0r0: {}, w1: {ActiveBlocks: 3, ActivePrefillTokens: 5, ActiveRequests: 1}},
				Bookings: []string{"new"},
				Expired:  1, // the setup's; the second expiry frees nothing
			},
		},
		{
			name: "BookingsExpired after PrefillDone does not take the prefill tokens twice",
			setup: []Change{
				bookReq("old", 100, hop(w0r0, 100, abc...)),
				bookReq("new", 300, hop(w0r0, 5, abd...)),
				PrefillDone{RequestID: "old"},
			},
			change:     BookingsExpired{Before: 200},
			wantResult: Result{Expired: 1},
			want: loadView{
				Loads:    map[WorkerKey]SlotLoad{w0r0: {ActiveBlocks: 3, ActivePrefillTokens: 5, ActiveRequests: 1}, w1: {}},
				Bookings: []string{"new"},
				Expired:  1,
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState()
			run(t, s, []step{up(w0r0), up(w1)})
			for _, c := range tc.setup {
				apply(c)(t, s)
			}
			before := viewLoad(t, s)
			res, err := s.Apply(tc.change)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("State.Apply(%#v) = %v, want %v", tc.change, err, tc.wantErr)
			}
			if diff := cmp.Diff(tc.wantResult, res); diff != "" {
				t.Errorf("State.Apply(%#v) = %+v, want %+v (-want +got):\n%s", tc.change, res, tc.wantResult, diff)
			}
			want := tc.want
			if tc.wantErr != nil {
				want = before
			}
			if diff := cmp.Diff(want, viewLoad(t, s)); diff != "" {
				t.Errorf("load after State.Apply(%#v) (-want +got):\n%s", tc.change, diff)
			}
		})
	}
}

// TestActiveDepths checks that ActiveDepths reports, per worker, the leading run of the prompt's
// blocks among the worker's active (booked) blocks: the blocks that would not be new load there.
func TestActiveDepths(t *testing.T) {
	tests := []struct {
		name  string
		setup []Change
		query []uint64 // local hashes of the prompt
		want  map[WorkerKey]uint32
	}{
		{
			name: "leading run per worker",
			setup: []Change{
				bookReq("r1", 1, hop(w0r0, 0, seq(la, lb, lc)...)),
				bookReq("r2", 1, hop(w1, 0, seq(la, lb)...)),
			},
			query: []uint64{la, lb, lc, ld},
			want:  map[WorkerKey]uint32{w0r0: 3, w1: 2},
		},
		{
			name: "blocks of several bookings on a worker combine",
			setup: []Change{
				bookReq("r1", 1, hop(w0r0, 0, seq(la, lb)...)),
				bookReq("r2", 1, hop(w0r0, 0, seq(la, lb, lc, ld)[2:]...)),
			},
			query: []uint64{la, lb, lc, ld, le},
			want:  map[WorkerKey]uint32{w0r0: 4},
		},
		{
			name:  "a run must start at the first block",
			setup: []Change{bookReq("r1", 1, hop(w0r0, 0, seq(la, lb, lc)[1:]...))},
			query: []uint64{la, lb, lc},
			want:  map[WorkerKey]uint32{},
		},
		{
			// W1 holds the block W0 misses, so the walk goes on; W0's run must still end there.
			name: "a missing middle block ends the run while another worker's goes on",
			setup: []Change{
				bookReq("r1", 1, hop(w0r0, 0, seq(la, lb, lc)[0], seq(la, lb, lc)[2])),
				bookReq("r2", 1, hop(w1, 0, seq(la, lb, lc)...)),
			},
			query: []uint64{la, lb, lc},
			want:  map[WorkerKey]uint32{w0r0: 1, w1: 3},
		},
		{
			name:  "a missing middle block ends the run",
			setup: []Change{bookReq("r1", 1, hop(w0r0, 0, seq(la, lb, lc)[0], seq(la, lb, lc)[2]))},
			query: []uint64{la, lb, lc},
			want:  map[WorkerKey]uint32{w0r0: 1},
		},
		{
			// Keys are sequence hashes: b at the root is not b after a.
			name:  "the same block at another position does not match",
			setup: []Change{bookReq("r1", 1, hop(w0r0, 0, seq(la)...)), bookReq("r2", 1, hop(w0r0, 0, seq(lb)...))},
			query: []uint64{la, lb},
			want:  map[WorkerKey]uint32{w0r0: 1},
		},
		{
			name:  "PrefillDone keeps the blocks active",
			setup: []Change{bookReq("r1", 1, hop(w0r0, 9, seq(la, lb)...)), PrefillDone{RequestID: "r1"}},
			query: []uint64{la, lb, lc},
			want:  map[WorkerKey]uint32{w0r0: 2},
		},
		{
			name: "Freed blocks are no longer active",
			setup: []Change{
				bookReq("r1", 1, hop(w0r0, 0, seq(la, lb, lc)...)), bookReq("r2", 1, hop(w0r0, 0, seq(la)...)),
				Freed{RequestID: "r1"},
			},
			query: []uint64{la, lb, lc},
			want:  map[WorkerKey]uint32{w0r0: 1},
		},
		{
			name:  "empty prompt",
			setup: []Change{bookReq("r1", 1, hop(w0r0, 0, seq(la, lb)...))},
			query: nil,
			want:  map[WorkerKey]uint32{},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState()
			run(t, s, []step{up(w0r0), up(w1)})
			for _, c := range tc.setup {
				apply(c)(t, s)
			}
			var o Overlaps
			s.Load().ActiveDepths(seq(tc.query...), &o)
			got := map[WorkerKey]uint32{}
			for _, k := range []WorkerKey{w0r0, w1} {
				d := o.Depths(s.Worker(k).Slot)
				if d[TierDevice] > 0 {
					got[k] = d[TierDevice]
				}
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("Load.ActiveDepths(%x) = %v, want %v (-want +got):\n%s", tc.query, got, tc.want, diff)
			}
		})
	}
}

// owned is bookReq's booking made by owner.
func owned(owner, id string, at int64, hops ...HopBooking) Booked {
	b := bookReq(id, at, hops...)
	b.Booking.Owner = owner
	return b
}

// held is what the bookings of a state hold, in all and by owner.
type held struct {
	All  int
	ByA  int
	ByB  int
	None int // HeldBlocksOf("") counts nothing: bookings without an owner are bound in all only
}

func heldOf(s *State) held {
	l := s.Load()
	return held{All: l.HeldBlocks(), ByA: l.HeldBlocksOf("a"), ByB: l.HeldBlocksOf("b"), None: l.HeldBlocksOf("")}
}

// TestHeldBlocksByOwner: what bookings hold is counted in all and by the credential that booked
// them, through every way a booking ends (free, expiry, its worker's removal), and a snapshot
// restored over a state with other bookings counts the snapshot's (it kept the old count before).
func TestHeldBlocksByOwner(t *testing.T) {
	s := NewState()
	run(t, s, []step{up(w0r0), up(w1),
		apply(owned("a", "a1", 10, hop(w0r0, 0, 1, 2, 3), hop(w1, 0, 1, 2, 3))),
		apply(owned("a", "a2", 20, hop(w1, 0, 4))),
		apply(owned("b", "b1", 30, hop(w0r0, 0, 5, 6))),
		apply(bookReq("n1", 40, hop(w0r0, 0, 7))),
	})
	steps := []struct {
		name   string
		change Change
		want   held
	}{
		{"booked", nil, held{All: 10, ByA: 7, ByB: 2}},
		{"a's second freed", Freed{RequestID: "a2"}, held{All: 9, ByA: 6, ByB: 2}},
		{"w1 removed", WorkerRemoved{Key: w1}, held{All: 6, ByA: 3, ByB: 2}},
		{"expired before 35", BookingsExpired{Before: 35}, held{All: 1}},
	}
	for _, st := range steps {
		if st.change != nil {
			if _, err := s.Apply(st.change); err != nil {
				t.Fatalf("%s: %v", st.name, err)
			}
		}
		if diff := cmp.Diff(st.want, heldOf(s)); diff != "" {
			t.Errorf("%s: held (-want +got):\n%s", st.name, diff)
		}
	}

	src := NewState()
	run(t, src, []step{up(w0r0), apply(owned("b", "b2", 50, hop(w0r0, 0, 8, 9, 10)))})
	if _, err := s.Restore(src.EncodeSnapshot(nil, SnapshotHeader{Position: "1-0"})); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(held{All: 3, ByB: 3}, heldOf(s)); diff != "" {
		t.Errorf("after restoring a snapshot: held (-want +got):\n%s", diff)
	}
	if _, err := s.Apply(Freed{RequestID: "b2"}); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(held{}, heldOf(s)); diff != "" {
		t.Errorf("after freeing the snapshot's booking: held (-want +got):\n%s", diff)
	}
}
