package kvstate

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
)

// ErrLogUnavailable: the change could not be made durable in the shared log (its store is
// unreachable, or the log moved on while the change waited); the caller may retry.
var ErrLogUnavailable = errors.New("shared log unavailable")

// Log is the ordered event log every change to State goes through. Append returns once the change is
// durable (for the in-process log: applied) and reports what applying it did; a change that fails
// validation against the state returns an error and changes nothing. Implementations: MemLog (one
// replica, embedded) and replication.Log (a Redis stream that every replica tails; a SharedLog).
type Log interface {
	// Append makes c durable and applies it to the local state.
	Append(ctx context.Context, c Change) (Result, error)
	// Position returns how many changes the local state has applied.
	Position() uint64
}

// MemLog is the in-process Log: it applies each change to the state as it is appended.
//
// It keeps two lanes. Worker changes (registrations, KV events, load reports, removals) apply one at a
// time in append order, as do request changes (bookings, prefill-done, free, expiry). The lanes touch
// disjoint parts of the state, so a booking never waits behind a large KV batch.
type MemLog struct {
	state       *State
	workerLane  sync.Mutex
	requestLane sync.Mutex
	position    atomic.Uint64
}

// NewMemLog returns an in-process log applying to state.
func NewMemLog(state *State) *MemLog { return &MemLog{state: state} }

// Append applies c to the state. It honours ctx only before it starts.
func (l *MemLog) Append(ctx context.Context, c Change) (Result, error) {
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	lane := &l.workerLane
	switch c.(type) {
	case Booked, PrefillDone, Freed, BookingsExpired, SessionsExpired:
		lane = &l.requestLane
	}
	c = l.state.Stamp(c)
	lane.Lock()
	defer lane.Unlock()
	res, err := l.state.Apply(c)
	if err == nil {
		l.position.Add(1)
	}
	return res, err
}

// Position returns the number of changes applied.
func (l *MemLog) Position() uint64 { return l.position.Load() }
