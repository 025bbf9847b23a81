package kvstate

import "time"

// Clock tells the time where the router's bookkeeping reads it: when a booking was made, freed or
// expires, when a worker's stream closed and its grace period ends, how long a session binds. It is
// given at construction, never swapped after: production runs on SystemClock, the simulator
// (cmd/kvsim) on its simulated time, and tests on a clock they move.
type Clock interface {
	Now() time.Time
}

// SystemClock is the machine's clock.
var SystemClock Clock = systemClock{}

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

// ClockFunc is a function used as a Clock.
type ClockFunc func() time.Time

// Now returns f().
func (f ClockFunc) Now() time.Time { return f() }

// ClockOr returns c, or SystemClock when c is nil: the default of every Clock option.
func ClockOr(c Clock) Clock {
	if c == nil {
		return SystemClock
	}
	return c
}
