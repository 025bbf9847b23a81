package app

import (
	"context"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
)

// Outcomes hears what happened to each request a dispatcher routed: it was booked, its prefill was
// done, it was freed. It is how metrics, tracing and (later) the self-tuning of thresholds learn
// how decisions turned out, without the routing path knowing who listens. A dispatcher is given one
// in Options.Outcomes; the default, NoOutcomes, hears nothing.
//
// The dispatcher calls it synchronously, on the goroutine of the Route, PrefillComplete or Free
// that caused the outcome, once the change is in the log and before that call returns; calls for
// different requests run concurrently. Implementations must therefore be safe for concurrent use,
// fast and never block: incrementing a counter, observing a histogram or adding a span event is
// what belongs here; anything slower (exporting, tuning, a lock held for long) belongs on the
// implementation's own goroutine, fed through a bounded channel it drops from when full.
//
// Synchronous calls rather than a channel the dispatcher feeds, because: the outcomes are plain
// values, so a call costs a few nanoseconds and allocates nothing on Route's path, where a channel
// costs a send and a goroutine wake-up per outcome; a dispatcher-owned channel would have to choose
// for every listener between blocking routing and dropping outcomes, while each listener knows
// which its data can afford (a counter must not drop, a trace sample may); and each request's
// outcomes reach the listener in the order they happened (booked, prefill done, freed) with the
// request's context, which a tracer needs to find its span.
type Outcomes interface {
	// Booked reports a Route whose decision was booked.
	Booked(ctx context.Context, o BookedOutcome)
	// PrefillDone reports a PrefillComplete that ended a booking's prefill part.
	PrefillDone(ctx context.Context, o EndedOutcome)
	// Freed reports a booking freed by Free, or undone because its Route's caller left.
	Freed(ctx context.Context, o EndedOutcome)
}

// NoOutcomes is the default Outcomes: it hears nothing, and a dispatcher given it (or none) skips
// building outcomes at all.
type NoOutcomes struct{}

// Booked does nothing.
func (NoOutcomes) Booked(context.Context, BookedOutcome) {}

// PrefillDone does nothing.
func (NoOutcomes) PrefillDone(context.Context, EndedOutcome) {}

// Freed does nothing.
func (NoOutcomes) Freed(context.Context, EndedOutcome) {}

// BookedOutcome is a booked decision: where the request went, why, what the prompt was and what
// the chosen workers looked like when the kernel decided, which is what tuning a threshold needs
// to compare against how the request then fared.
type BookedOutcome struct {
	RequestID, Model, Owner, SessionID string
	// At is when the request was booked (the booking's time), on the dispatcher's clock.
	At time.Time
	// Routed is how long the Route took until the booking, on the dispatcher's clock: deciding,
	// waiting in the queue for capacity, and appending the booking.
	Routed time.Duration
	Mode   policy.Mode
	Reason policy.Reason
	// PromptTokens and PromptBlocks are the prompt's tokens and complete (hashed) blocks.
	PromptTokens, PromptBlocks uint64
	// Prefill is the prefill hop of a disaggregated decision; zero in the other modes.
	Prefill HopOutcome
	// Decode is the decode hop, or the one worker of an aggregated or bypass decision.
	Decode HopOutcome
}

// HopOutcome is one hop of a booked decision.
type HopOutcome struct {
	Worker kvstate.WorkerKey
	// Overlap is the prompt's cached blocks on the worker per tier, as the decision scored them.
	Overlap kvstate.TierCounts
	// Load is the worker's load when the kernel decided, before this booking.
	Load kvstate.SlotLoad
	// PrefillTokens is what the booking charges the worker until prefill is done (0: none).
	PrefillTokens uint64
}

// EndedOutcome is the end of a booking's prefill part (PrefillDone) or of the whole booking
// (Freed).
type EndedOutcome struct {
	RequestID string
	// At is when it ended, on the dispatcher's clock.
	At time.Time
	// SinceBooked is At minus the booking's time: time to prefill done, or the booking's life. The
	// booking carries its time, so this holds on any replica, the booking one's or not, as long as
	// the clocks agree.
	SinceBooked time.Duration
	// BookingSeen says SinceBooked is known: false when this replica's state did not hold the
	// booking as it ended it (the booking still on its way here through the shared log, or in a
	// shard of a model this replica does not serve).
	BookingSeen bool
	// Hops is the booking's hops, when seen: 2 for a request prefilled on one worker and decoded on
	// another (RemotePrefill), 1 for one prefilled where it decodes (a bypass, or an aggregated
	// worker).
	Hops int
	// Cause says why a booking was freed; zero for PrefillDone.
	Cause FreeCause
}

// RemotePrefill reports whether the booking was prefilled on a worker of its own, as far as the
// booking tells (BookingSeen).
func (o EndedOutcome) RemotePrefill() bool { return o.Hops > 1 }

// FreeCause says why a booking was freed.
type FreeCause uint8

// Causes of a free. A booking expired by the housekeeper (booking_expiry) is not a dispatcher's
// outcome: kvstate's housekeeper frees it without naming it.
const (
	// FreedByCaller: the caller freed it (Free).
	FreedByCaller FreeCause = iota + 1
	// FreedCallerGone: the Route's caller left while it was being booked, and the dispatcher undid
	// the booking it would never learn of.
	FreedCallerGone
)

// String returns the cause's lower-case name (a metric label).
func (c FreeCause) String() string {
	switch c {
	case FreedByCaller:
		return "caller"
	case FreedCallerGone:
		return "caller_gone"
	}
	return "unspecified"
}

// outcomesOr returns o, or nil when o hears nothing (nil or NoOutcomes): the dispatcher then skips
// reading its clock and building outcomes.
func outcomesOr(o Outcomes) Outcomes {
	if _, none := o.(NoOutcomes); none {
		return nil
	}
	return o
}

// bookedOutcome describes the booked decision dec of req, booked as b after a Route that started
// at start.
func bookedOutcome(req *Request, dec *policy.Decision, b *kvstate.Booking, start time.Time) BookedOutcome {
	at := time.Unix(0, b.At)
	o := BookedOutcome{
		RequestID: req.ID, Model: req.Model, Owner: req.Owner, SessionID: req.SessionID,
		At: at, Routed: at.Sub(start), Mode: dec.Mode, Reason: dec.Reason,
		PromptTokens: dec.PromptTokens, PromptBlocks: dec.PromptBlocks,
		Decode: hopOutcome(&dec.Decode, dec.Load),
	}
	if dec.Prefill != nil {
		o.Prefill = hopOutcome(dec.Prefill, dec.Load)
	}
	return o
}

// hopOutcome describes the hop c of a decision booked as hops.
func hopOutcome(c *policy.Choice, hops []kvstate.HopBooking) HopOutcome {
	h := HopOutcome{Worker: c.Worker.Info.Key, Overlap: c.Overlap, Load: c.Load}
	for _, hb := range hops {
		if hb.Worker == h.Worker {
			h.PrefillTokens += hb.PrefillTokens
		}
	}
	return h
}

// endedOutcome describes the end at now of request id's booking, booked at bookedAt (unix
// nanoseconds) on hops when seen.
func endedOutcome(id string, now time.Time, bookedAt int64, hops int, seen bool, cause FreeCause) EndedOutcome {
	o := EndedOutcome{RequestID: id, At: now, BookingSeen: seen, Cause: cause}
	if seen {
		o.SinceBooked, o.Hops = now.Sub(time.Unix(0, bookedAt)), hops
	}
	return o
}
