package kvstate

import (
	"errors"
	"sync"
)

// replicated holds what applying changes in log order needs beyond the state itself, so that every
// replica converges whatever order its own bookings were applied in locally.
type replicated struct {
	mu sync.Mutex
	// expiredBefore is the latest BookingsExpired cutoff applied: a booking older than it, arriving
	// later in the log, had already expired on the replica that applied it first.
	expiredBefore int64
	// tombstones remember a Free or PrefillDone that arrived before its booking (another replica
	// received it while the booking was still on its way through the log).
	tombstones map[string]tombstone
}

type tombstone struct {
	freed, prefillDone bool
	at                 int64
}

// ApplyReplicated applies a change read from the replicated log. It differs from Apply only for
// request changes, which a replica may already have applied locally in another order:
//   - a booking older than an applied expiry cutoff is dropped, and hops naming workers the log has
//     already removed are skipped;
//   - a Free or PrefillDone for a request not yet booked is remembered (a tombstone) and applied to
//     the booking when it arrives; tombstones expire with bookings.
func (s *State) ApplyReplicated(c Change) (Result, error) {
	switch c := c.(type) {
	case Booked:
		err := s.bookReplicated(c.Booking)
		if err == nil {
			s.signalCapacity()
		}
		return Result{}, err
	case PrefillDone:
		if err := s.load.prefillDone(c.RequestID); errors.Is(err, ErrUnknownRequest) {
			s.remember(c.RequestID, false, c.At)
		}
		s.signalCapacity()
		return Result{}, nil
	case Freed:
		if err := s.load.free(c.RequestID); errors.Is(err, ErrUnknownRequest) {
			s.remember(c.RequestID, true, c.At)
		}
		s.signalCapacity()
		return Result{}, nil
	case BookingsExpired:
		s.rep.mu.Lock()
		s.rep.expiredBefore = max(s.rep.expiredBefore, c.Before)
		for id, t := range s.rep.tombstones {
			if t.at < c.Before {
				delete(s.rep.tombstones, id)
			}
		}
		s.rep.mu.Unlock()
		return s.Apply(c)
	}
	return s.Apply(c)
}

func (s *State) remember(id string, freed bool, at int64) {
	s.rep.mu.Lock()
	defer s.rep.mu.Unlock()
	if s.rep.tombstones == nil {
		s.rep.tombstones = make(map[string]tombstone)
	}
	t := s.rep.tombstones[id]
	t.freed = t.freed || freed
	t.prefillDone = t.prefillDone || !freed
	t.at = max(t.at, at)
	s.rep.tombstones[id] = t
}

func (s *State) bookReplicated(b Booking) error {
	s.rep.mu.Lock()
	expired := b.At < s.rep.expiredBefore
	t, hasTomb := s.rep.tombstones[b.RequestID]
	if hasTomb {
		delete(s.rep.tombstones, b.RequestID)
	}
	s.rep.mu.Unlock()
	if expired || t.freed {
		return nil
	}
	if err := s.book(b, true); err != nil {
		return err
	}
	if t.prefillDone {
		_ = s.load.prefillDone(b.RequestID)
	}
	return nil
}

// Tombstones returns how many early Free/PrefillDone changes are remembered (for tests and metrics).
func (s *State) Tombstones() int {
	s.rep.mu.Lock()
	defer s.rep.mu.Unlock()
	return len(s.rep.tombstones)
}
