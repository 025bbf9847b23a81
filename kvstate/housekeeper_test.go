package kvstate

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// fakeClock is a Housekeeper.Now that returns whatever the test set.
type fakeClock struct{ now time.Time }

func (c *fakeClock) Now() time.Time { return c.now }

// reconnectingLog forwards to a MemLog, but first reconnects the worker a WorkerRemoved names (a new
// stream and its hello): it replays a reconnect that lands between the housekeeper's look at the
// state and its removal.
type reconnectingLog struct {
	*MemLog
	state *State
}

func (l reconnectingLog) Append(ctx context.Context, c Change) (Result, error) {
	if r, ok := c.(WorkerRemoved); ok {
		presenceOf(l.state).Connected(r.Key)
		if w := l.state.Worker(r.Key); w != nil {
			if _, err := l.MemLog.Append(ctx, WorkerUp{Info: w.Info}); err != nil {
				return Result{}, err
			}
		}
	}
	return l.MemLog.Append(ctx, c)
}

// TestHousekeeperSweep checks one Sweep with a fake clock: a worker disconnected for at least Grace
// is removed (with its blocks and bookings), one that reconnected or has not waited long enough is
// kept, and bookings older than BookingExpiry are expired while newer ones are kept. wantAppended
// checks that a sweep with nothing to do appends nothing to the log.
func TestHousekeeperSweep(t *testing.T) {
	const (
		grace  = 10 * time.Second
		expiry = 300 * time.Second
	)
	t0 := time.Unix(1_000_000, 0)
	at := func(d time.Duration) int64 { return t0.Add(d).UnixNano() }
	bookAt := func(id string, key WorkerKey, d time.Duration) step {
		return apply(bookReq(id, at(d), hop(key, 10, seq(la, lb)...)))
	}
	// Every case starts with w0r0 and w1 registered and connected, w0r0 holding [a,b,c].
	tests := []struct {
		name         string
		steps        []step
		reconnect    bool // the removal races a reconnect (reconnectingLog)
		cancelled    bool // Sweep runs with a cancelled context
		sweepAt      time.Duration
		wantWorkers  []WorkerKey
		wantBookings []string
		wantAppended uint64
	}{
		{
			name:         "disconnected for less than Grace: kept",
			steps:        []step{disconnect(w0r0, at(0))},
			sweepAt:      grace - time.Nanosecond,
			wantWorkers:  []WorkerKey{w0r0, w1},
			wantBookings: []string{},
		},
		{
			name:         "disconnected for exactly Grace: removed",
			steps:        []step{disconnect(w0r0, at(0))},
			sweepAt:      grace,
			wantWorkers:  []WorkerKey{w1},
			wantBookings: []string{},
			wantAppended: 1,
		},
		{
			name:         "disconnected for longer than Grace: removed with its bookings",
			steps:        []step{bookAt("solo", w0r0, 0), bookAt("other", w1, 0), disconnect(w0r0, at(0))},
			sweepAt:      grace + time.Minute,
			wantWorkers:  []WorkerKey{w1},
			wantBookings: []string{"other"},
			wantAppended: 1,
		},
		{
			name:         "every worker past Grace is removed",
			steps:        []step{disconnect(w0r0, at(0)), disconnect(w1, at(time.Second))},
			sweepAt:      grace + time.Second,
			wantWorkers:  []WorkerKey{},
			wantBookings: []string{},
			wantAppended: 2,
		},
		{
			name:         "reconnected before Grace: kept",
			steps:        []step{disconnect(w0r0, at(0)), connect(w0r0)},
			sweepAt:      time.Hour,
			wantWorkers:  []WorkerKey{w0r0, w1},
			wantBookings: []string{},
		},
		{
			name:         "grace counts from the latest disconnect",
			steps:        []step{disconnect(w0r0, at(0)), connect(w0r0), disconnect(w0r0, at(8*time.Second))},
			sweepAt:      grace + 2*time.Second,
			wantWorkers:  []WorkerKey{w0r0, w1},
			wantBookings: []string{},
		},
		{
			name:         "grace from the latest disconnect elapsed: removed",
			steps:        []step{disconnect(w0r0, at(0)), connect(w0r0), disconnect(w0r0, at(8*time.Second))},
			sweepAt:      8*time.Second + grace,
			wantWorkers:  []WorkerKey{w1},
			wantBookings: []string{},
			wantAppended: 1,
		},
		{
			name:         "connected workers are never removed",
			sweepAt:      24 * time.Hour,
			wantWorkers:  []WorkerKey{w0r0, w1},
			wantBookings: []string{},
		},
		{
			// The removal is appended, but for the epoch it saw; the reconnect's hello bumped the
			// epoch, so it is skipped.
			name:         "a reconnect racing the removal keeps the worker",
			steps:        []step{disconnect(w0r0, at(0))},
			reconnect:    true,
			sweepAt:      time.Hour,
			wantWorkers:  []WorkerKey{w0r0, w1},
			wantBookings: []string{},
			wantAppended: 2,
		},
		{
			name: "bookings older than BookingExpiry are expired, newer ones kept",
			steps: []step{
				bookAt("old", w0r0, -expiry-time.Second),
				bookAt("edge", w0r0, -expiry),
				bookAt("new", w1, 0),
			},
			sweepAt:      0,
			wantWorkers:  []WorkerKey{w0r0, w1},
			wantBookings: []string{"edge", "new"},
			wantAppended: 1,
		},
		{
			name:         "bookings younger than BookingExpiry append nothing",
			steps:        []step{bookAt("a", w0r0, 0), bookAt("b", w1, time.Second)},
			sweepAt:      expiry,
			wantWorkers:  []WorkerKey{w0r0, w1},
			wantBookings: []string{"a", "b"},
		},
		{
			name:         "bookings and workers expire in one sweep",
			steps:        []step{bookAt("a", w1, 0), bookAt("b", w1, expiry), disconnect(w0r0, at(expiry))},
			sweepAt:      expiry + grace,
			wantWorkers:  []WorkerKey{w1},
			wantBookings: []string{"b"},
			wantAppended: 2,
		},
		{
			name:         "a cancelled context changes nothing",
			steps:        []step{bookAt("old", w1, -2*expiry), disconnect(w0r0, at(0))},
			cancelled:    true,
			sweepAt:      time.Hour,
			wantWorkers:  []WorkerKey{w0r0, w1},
			wantBookings: []string{"old"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState()
			mem := NewMemLog(s)
			var log Log = mem
			if tc.reconnect {
				log = reconnectingLog{MemLog: mem, state: s}
			}
			run(t, s, []step{
				up(w0r0), up(w1), connect(w0r0), connect(w1),
				events(w0r0, stored(0, la, lb, lc)),
			})
			run(t, s, tc.steps)
			clock := &fakeClock{now: t0.Add(tc.sweepAt)}
			h := &Housekeeper{
				State: s, Log: log, Presence: presenceOf(s), Grace: grace, BookingExpiry: expiry,
				Clock: ClockFunc(clock.Now), Logger: slog.New(slog.DiscardHandler),
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tc.cancelled {
				cancel()
			}
			before := log.Position()
			h.Sweep(ctx)

			if got := log.Position() - before; got != tc.wantAppended {
				t.Errorf("Sweep appended %d changes, want %d", got, tc.wantAppended)
			}
			gotWorkers := []WorkerKey{}
			for _, k := range []WorkerKey{w0r0, w1} {
				if s.Worker(k) != nil {
					gotWorkers = append(gotWorkers, k)
				}
			}
			if diff := cmp.Diff(tc.wantWorkers, gotWorkers); diff != "" {
				t.Errorf("workers after Sweep = %v, want %v (-want +got):\n%s", gotWorkers, tc.wantWorkers, diff)
			}
			if diff := cmp.Diff(tc.wantBookings, s.Load().BookingIDs()); diff != "" {
				t.Errorf("Load.BookingIDs() after Sweep (-want +got):\n%s", diff)
			}
			// A removed w0r0 takes its blocks along; a kept one still has them.
			wantLen := 0
			if s.Worker(w0r0) != nil {
				wantLen = 3
			}
			if m := s.Model(testModel); m != nil && m.Index.Len() != wantLen {
				t.Errorf("Index.Len() after Sweep = %d, want %d", m.Index.Len(), wantLen)
			}
		})
	}
}

// TestHousekeeperRemovesOnce: a worker whose stream closed here and that registered again on another
// replica (its hello reaches this state through the log) costs one skipped removal, not one per
// sweep for ever: the appended removal settles what this replica owed for the close.
func TestHousekeeperRemovesOnce(t *testing.T) {
	s := NewState()
	log := NewMemLog(s)
	run(t, s, []step{up(w0r0), connect(w0r0), disconnect(w0r0, 100), up(w0r0)}) // the last hello came from elsewhere
	h := &Housekeeper{State: s, Log: log, Presence: presenceOf(s), Grace: time.Second, BookingExpiry: time.Hour,
		Clock: ClockFunc(func() time.Time { return time.Unix(0, 100).Add(time.Minute) }), Logger: slog.New(slog.DiscardHandler)}
	before := log.Position()
	for range 3 {
		h.Sweep(context.Background())
	}
	if got := log.Position() - before; got != 1 {
		t.Errorf("three sweeps appended %d changes, want 1 (one skipped removal)", got)
	}
	if s.Worker(w0r0) == nil {
		t.Error("the worker that registered elsewhere was removed")
	}
}

// TestHousekeeperLogsTheWorker: the removal's log line names the worker as "worker connected"
// does (id/rank, a string also in JSON) and the worker's own model, not the shard's (which a
// shard serving every model does not have).
func TestHousekeeperLogsTheWorker(t *testing.T) {
	s := NewState()
	run(t, s, []step{up(w0r0), connect(w0r0), disconnect(w0r0, 100)})
	model := s.Worker(w0r0).Info.Model
	var logs bytes.Buffer
	h := &Housekeeper{State: s, Log: NewMemLog(s), Presence: presenceOf(s), Grace: time.Second, BookingExpiry: time.Hour,
		Clock: ClockFunc(func() time.Time { return time.Unix(0, 100).Add(time.Minute) }), Logger: slog.New(slog.NewJSONHandler(&logs, nil))}
	h.Sweep(context.Background())
	var line struct{ Msg, Worker, Model string }
	if err := json.Unmarshal(logs.Bytes(), &line); err != nil {
		t.Fatalf("log %q: %v", logs.String(), err)
	}
	want := struct{ Msg, Worker, Model string }{"removed worker after grace period", w0r0.String(), model}
	if diff := cmp.Diff(want, line); diff != "" || model == "" {
		t.Errorf("log line (-want +got):\n%s", diff)
	}
}
