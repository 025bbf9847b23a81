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
}

// ApplyReplicated applies a change read from the replicated log. It differs from Apply only for
// request changes, which a replica may already have applied locally in another order:
//   - a booking older than an applied expiry cutoff records no load, and hops naming workers the
//     log has already removed are skipped (as the removal would have dropped them had the booking
//     come first); its session is bound all the same;
//   - a Free or PrefillDone naming no booking changes nothing. It is appended only by a replica
//     that holds the booking, after the booking (each replica publishes its own request changes in
//     the order it applied them), so it never precedes its booking in the log: when it names none,
//     the booking ended already (its workers were removed, or it expired) on every replica.
func (s *State) ApplyReplicated(c Change) (Result, error) {
	switch c := c.(type) {
	case Booked:
		err := s.bookReplicated(c.Booking)
		if err == nil {
			s.signalCapacity()
		}
		return Result{}, err
	case PrefillDone:
		if err := s.load.prefillDone(c.RequestID); err == nil {
			s.signalCapacity()
		} else if !errors.Is(err, ErrUnknownRequest) {
			return Result{}, err
		}
		return Result{}, nil
	case Freed:
		if err := s.load.free(c.RequestID); err == nil {
			s.signalCapacity()
		} else if !errors.Is(err, ErrUnknownRequest) {
			return Result{}, err
		}
		return Result{}, nil
	case BookingsExpired:
		s.rep.mu.Lock()
		s.rep.expiredBefore = max(s.rep.expiredBefore, c.Before)
		s.rep.mu.Unlock()
		return s.Apply(c)
	}
	return s.Apply(c)
}

func (s *State) bookReplicated(b Booking) error {
	s.rep.mu.Lock()
	expired := b.At < s.rep.expiredBefore
	s.rep.mu.Unlock()
	if expired {
		s.mu.RLock()
		s.bindBookingLocked(b)
		s.mu.RUnlock()
		return nil
	}
	return s.book(b, true)
}
