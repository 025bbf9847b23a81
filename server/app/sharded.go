package app

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
)

// Sharded routes over the shards of a log sharded by model (docs/architecture.md, "The shared
// log's order, and sharding it by model"): each shard is a state machine of its own, so each gets
// a Dispatcher of its own (its kernel reads that shard's state, its bookings go through that
// shard's log, its queue waits for that shard's capacity), and a request goes to its model's. It
// offers what a Dispatcher does, so the edge can hold either.
type Sharded struct {
	source kvstate.ShardSource
	config policy.Config
	// opts are every shard's dispatcher's: one clock, and one cap over what the bookings of every
	// shard hold together (BookingCap).
	opts Options

	mu          sync.Mutex
	dispatchers map[*kvstate.Shard]*Dispatcher

	idLocks [64]sync.Mutex // see lockID
}

// NewSharded returns a router over the shards source holds, deciding with cfg in each.
func NewSharded(source kvstate.ShardSource, cfg policy.Config, opts Options) *Sharded {
	opts.Clock = kvstate.ClockOr(opts.Clock)
	opts.Outcomes = outcomesOr(opts.Outcomes)
	return &Sharded{source: source, config: cfg, opts: opts, dispatchers: make(map[*kvstate.Shard]*Dispatcher)}
}

// Config returns the routing configuration.
func (s *Sharded) Config() policy.Config { return s.config }

// dispatcher returns the dispatcher of sh, made on first use.
func (s *Sharded) dispatcher(sh *kvstate.Shard) *Dispatcher {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := s.dispatchers[sh]
	if d == nil {
		d = New(sh.State, sh.Log, policy.NewKernel(policy.StateView(sh.State), s.config, policy.WithRand(s.opts.Rand)), s.opts)
		s.dispatchers[sh] = d
	}
	return d
}

// Route routes req in its model's shard. A model this replica holds no shard of has no worker
// here: policy.ErrUnknownModel, as a Dispatcher answers for a model without workers.
func (s *Sharded) Route(ctx context.Context, req *Request) (*policy.Decision, error) {
	sh, err := s.source.Find(ctx, req.Model)
	if err != nil {
		return nil, err
	}
	if sh == nil {
		return nil, fmt.Errorf("%w: %q", policy.ErrUnknownModel, req.Model)
	}
	if req.QueryOnly {
		return s.dispatcher(sh).Route(ctx, req)
	}
	// A request id names one booking in the whole deployment, as it does when one state holds
	// every model: a Free names no model, and must never end another model's booking. Each shard
	// checks its own bookings as it books; the others are checked here, with the id's lock held
	// from the check to the booking, so two Routes of one id on this replica cannot both book.
	unlock := s.lockID(req.ID)
	defer unlock()
	for _, other := range s.source.Shards() {
		if other != sh && other.State.Load().Booked(req.ID) {
			return nil, fmt.Errorf("%w: %q (for model %q)", kvstate.ErrAlreadyBooked, req.ID, other.Model)
		}
	}
	return s.dispatcher(sh).Route(ctx, req)
}

// lockID locks request id against another Route of the same id on this replica, and returns the
// unlock. Ids hash to a fixed set of locks: an unrelated id sharing one waits for a booking at most.
func (s *Sharded) lockID(id string) (unlock func()) {
	l := &s.idLocks[xxh3.HashString(id)%uint64(len(s.idLocks))]
	l.Lock()
	return l.Unlock
}

// PrefillComplete ends the prefill part of request id's booking, in the shard that holds it.
func (s *Sharded) PrefillComplete(ctx context.Context, id string) error {
	return s.endBooking(ctx, id, (*Dispatcher).PrefillComplete, kvstate.PrefillDone{RequestID: id, At: s.opts.Clock.Now().UnixNano()})
}

// Free ends request id's booking, in the shard that holds it.
func (s *Sharded) Free(ctx context.Context, id string) error {
	return s.endBooking(ctx, id, (*Dispatcher).Free, kvstate.Freed{RequestID: id, At: s.opts.Clock.Now().UnixNano()})
}

// endBooking ends request id's booking with end, in the shard whose state holds it. A request names
// no model, so when no shard here holds it yet (another replica booked it moments ago and the
// booking is still on its way through its shard's log), every shard is asked at once: each waits
// for the booking as its log does (the replication engine's watermarks), at most one holds it, and the others
// append nothing. When none here holds it, the shards of the models this replica does not serve
// are asked for it (kvstate.ShardSource.EndElsewhere), with change: either may be sent to any
// replica.
func (s *Sharded) endBooking(ctx context.Context, id string, end func(*Dispatcher, context.Context, string) error, change kvstate.Change) error {
	err := s.endHere(ctx, id, end)
	if !errors.Is(err, kvstate.ErrUnknownRequest) {
		return err
	}
	switch elsewhere := s.source.EndElsewhere(ctx, change); {
	case elsewhere == nil:
		s.endedElsewhere(ctx, id, change)
		return nil
	case !errors.Is(elsewhere, kvstate.ErrUnknownRequest):
		return fmt.Errorf("request_id %q: %w", id, elsewhere)
	}
	return err
}

// endedElsewhere reports to the outcomes a booking ended in a shard this replica does not serve:
// its dispatcher is elsewhere, and so is the booking's time (BookingSeen false).
func (s *Sharded) endedElsewhere(ctx context.Context, id string, change kvstate.Change) {
	o := s.opts.Outcomes
	if o == nil {
		return
	}
	switch c := change.(type) {
	case kvstate.PrefillDone:
		o.PrefillDone(ctx, EndedOutcome{RequestID: id, At: time.Unix(0, c.At)})
	case kvstate.Freed:
		o.Freed(ctx, EndedOutcome{RequestID: id, At: time.Unix(0, c.At), Cause: FreedByCaller})
	}
}

// endHere ends request id's booking with end in the shard of this replica that holds it.
func (s *Sharded) endHere(ctx context.Context, id string, end func(*Dispatcher, context.Context, string) error) error {
	shards := s.source.Shards()
	for _, sh := range shards {
		if sh.State.Load().Booked(id) {
			return end(s.dispatcher(sh), ctx, id)
		}
	}
	switch len(shards) {
	case 0:
		return fmt.Errorf("request_id %q: %w (never booked, already freed, or expired)", id, kvstate.ErrUnknownRequest)
	case 1:
		return end(s.dispatcher(shards[0]), ctx, id)
	}
	errs := make([]error, len(shards))
	var wg sync.WaitGroup
	for i, sh := range shards {
		wg.Go(func() { errs[i] = end(s.dispatcher(sh), ctx, id) })
	}
	wg.Wait()
	for _, err := range errs {
		if err == nil {
			return nil
		}
	}
	for _, err := range errs {
		if !errors.Is(err, kvstate.ErrUnknownRequest) {
			return err // a shard could not tell (its log unreachable): the caller may retry
		}
	}
	return errs[0]
}

// QueueDepth returns the number of requests waiting for capacity, in every shard.
func (s *Sharded) QueueDepth() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, d := range s.dispatchers {
		n += d.QueueDepth()
	}
	return n
}

// Routing is the routing calls as the edge makes them: a Dispatcher over one state, or Sharded over
// a state per model.
type Routing interface {
	Route(ctx context.Context, req *Request) (*policy.Decision, error)
	PrefillComplete(ctx context.Context, id string) error
	Free(ctx context.Context, id string) error
	Config() policy.Config
	QueueDepth() int
}

var (
	_ Routing = (*Dispatcher)(nil)
	_ Routing = (*Sharded)(nil)
)
