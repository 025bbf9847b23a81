// Package app is the orchestration layer of routing: it asks the pure decision kernel
// (policy.Kernel) where a request runs, books the decision through the log so that every replica
// counts its load, binds the request's session to its decode worker, and queues requests the kernel
// finds overloaded until capacity frees. The gRPC edge (server) calls it; so can an in-process
// simulator, which then routes exactly as the server does.
package app

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
)

// Request is a routing request: the kernel's request, the session it belongs to and who books it.
type Request struct {
	policy.Request
	// SessionID binds the conversation to its decode worker for session_affinity_ttl; empty for none.
	SessionID string
	// Owner is the credential that books the request ("" without credentials), and OwnerMaxBlocks
	// the most block keys its bookings may hold together (0: no bound; BookingCap).
	Owner          string
	OwnerMaxBlocks int
}

// Dispatcher decides, books and queues routing requests. It is safe for concurrent use.
type Dispatcher struct {
	state    *kvstate.State
	log      kvstate.Log
	kernel   *policy.Kernel
	cfg      policy.Config // the kernel's, read once: the queue's and sessions' settings
	queue    *queue
	clock    kvstate.Clock
	cap      *BookingCap
	outcomes Outcomes // nil: none (NoOutcomes)
}

// Options are what a dispatcher may be given beside its state, log and kernel.
type Options struct {
	// Clock reads booking, free and session times; nil: kvstate.SystemClock.
	Clock kvstate.Clock
	// Cap bounds what this replica's bookings hold; nil: no bound.
	Cap *BookingCap
	// Outcomes hears what happened to each routed request (booked, prefill done, freed); nil:
	// NoOutcomes. It is called on the routing path and must not block (see Outcomes).
	Outcomes Outcomes
	// Rand draws the decisions' tie-breaks and softmax samples (policy.WithRand); nil: the global
	// source. It must be safe for concurrent use (policy.NewSeededRand): the simulator seeds it so
	// that one seed gives one result.
	Rand policy.Rand
}

// BookingCap bounds the blocks a replica's bookings hold (kvstate.Load.HeldBlocks), every model's
// together: a booking pins its prompt's block keys on every replica and in the shared log until
// it is freed or expires (a 1M-token prompt about 1 MB for booking_expiry, 300 s), and a caller's
// Route rate counts calls, not tokens. A Route whose booking would pass Max is refused
// (ErrBookingsFull) before it is booked. Each replica checks its own view, which replicated
// bookings join, so racing replicas may pass it by one booking each.
//
// What one credential's bookings hold is bounded too (Request.OwnerMaxBlocks, counted by HeldBy),
// so that one caller, buggy or hostile, cannot take all of Max and leave the others none.
type BookingCap struct {
	Max    int                    // most blocks held; 0: no bound
	Held   func() int             // the blocks held now
	HeldBy func(owner string) int // the blocks owner's bookings hold now
}

// CapOver returns the BookingCap of max block keys over what the bookings of every shard of source
// hold, with the per-owner count for Request.OwnerMaxBlocks.
func CapOver(max int, source kvstate.ShardSource) *BookingCap {
	if one, ok := source.(kvstate.OneShard); ok {
		load := one.Shard.State.Load() // no slice of shards a call: Route's path allocates little
		return &BookingCap{Max: max, Held: load.HeldBlocks, HeldBy: load.HeldBlocksOf}
	}
	return &BookingCap{
		Max: max,
		Held: func() int {
			n := 0
			for _, sh := range source.Shards() {
				n += sh.State.Load().HeldBlocks()
			}
			return n
		},
		HeldBy: func(owner string) int {
			n := 0
			for _, sh := range source.Shards() {
				n += sh.State.Load().HeldBlocksOf(owner)
			}
			return n
		},
	}
}

// ErrBookingsFull refuses a Route whose booking would pass BookingCap.Max.
var ErrBookingsFull = errors.New("the bookings of this router hold max_booked_blocks block keys already")

// ErrCredentialBookingsFull refuses a Route whose booking would take its credential's bookings past
// Request.OwnerMaxBlocks.
var ErrCredentialBookingsFull = errors.New("this credential's bookings hold max_booked_blocks_per_credential block keys already")

// room checks that a booking of hops by req's owner fits under the caps.
func (c *BookingCap) room(req *Request, hops []kvstate.HopBooking) error {
	if c == nil {
		return nil
	}
	n := 0
	for _, h := range hops {
		n += len(h.Blocks)
	}
	return c.roomFor(req, n)
}

// roomBefore checks, before the decision, that a booking of a long prompt of n blocks (its model's
// block size known, its hashes not yet computed) can fit: whatever the decision, it holds the
// prompt's blocks once (on its decode or aggregated hop; a prefill hop holds none), so a caller at
// its cap is refused before its prompt is hashed and the workers are scored, which for a 1M-token
// prompt is most of what the call costs. Prompts under roomBeforeBlocks cost less to decide than to
// count twice; room checks every booking, exactly, after the decision.
func (c *BookingCap) roomBefore(req *Request, n uint64) error {
	if c == nil || n < roomBeforeBlocks {
		return nil
	}
	return c.roomFor(req, int(n))
}

// roomBeforeBlocks is the least prompt, in blocks, that roomBefore checks.
const roomBeforeBlocks = 1024

// roomFor checks that a booking of req holding n block keys fits under the caps.
func (c *BookingCap) roomFor(req *Request, n int) error {
	if most := req.OwnerMaxBlocks; most > 0 && req.Owner != "" && c.HeldBy != nil {
		if held := c.HeldBy(req.Owner); held+n > most {
			return fmt.Errorf("%w (credential %q: %d held, this request would add %d, max_booked_blocks_per_credential %d): free finished requests, or retry later",
				ErrCredentialBookingsFull, req.Owner, held, n, most)
		}
	}
	if c.Max > 0 {
		if held := c.Held(); held+n > c.Max {
			return fmt.Errorf("%w (%d held, this request would add %d, max_booked_blocks %d): free finished requests, or retry later", ErrBookingsFull, held, n, c.Max)
		}
	}
	return nil
}

// New returns a dispatcher routing with kernel over state and booking through log. The kernel's
// configuration also drives the queue (router_queue_*) and sessions (session_affinity_ttl).
func New(state *kvstate.State, log kvstate.Log, kernel *policy.Kernel, opts Options) *Dispatcher {
	cfg := kernel.Config()
	return &Dispatcher{
		state: state, log: log, kernel: kernel, cfg: cfg, clock: kvstate.ClockOr(opts.Clock), cap: opts.Cap,
		outcomes: outcomesOr(opts.Outcomes), queue: newQueue(max(1, cfg.QueueMaxDepth), state.CapacityChanged),
	}
}

// Config returns the routing configuration: the dispatcher's copy of its kernel's, which the
// kernel does not share.
func (d *Dispatcher) Config() policy.Config { return d.cfg }

// Route decides where req runs and, unless it is query-only, books its load. It keys req's prompt
// once, before the decision (key), and every later step reads that key. With
// router_queue_threshold set, a request whose every eligible worker is overloaded waits in the
// queue until capacity frees or ctx ends. A booked decision is reported to Options.Outcomes.
func (d *Dispatcher) Route(ctx context.Context, req *Request) (*policy.Decision, error) {
	if err := d.caughtUp(ctx); err != nil {
		return nil, err
	}
	var start time.Time
	if d.outcomes != nil {
		start = d.clock.Now()
	}
	key, err := d.key(req)
	if err != nil {
		return nil, err
	}
	if key != nil {
		defer keyedPrompts.Put(key)
	}
	dec, err := d.route(ctx, req, key, start)
	if errors.Is(err, policy.ErrAllWorkersOverloaded) && d.cfg.QueueThreshold != nil {
		dec, err = d.queue.wait(ctx, d.queueKey(req, key), func() (*policy.Decision, error) { return d.route(ctx, req, key, start) })
	}
	if err != nil && (errors.Is(err, policy.ErrUnknownModel) || errors.Is(err, policy.ErrPinnedWorkerNotFound)) {
		if sl, ok := d.log.(kvstate.SharedLog); ok && sl.Incomplete() {
			// The worker may well exist: this replica's state is not the whole shared state.
			return nil, fmt.Errorf("%w: %v, but this replica's shared state may be incomplete (the shared log was lost and is being re-established, or a replica holding it may still reseed it); retry", kvstate.ErrLogUnavailable, err)
		}
	}
	return dec, err
}

// readyWait bounds how long a Route waits for its shared log to catch up (a shard another replica
// created a moment ago starts here when it is first asked for).
const readyWait = 2 * time.Second

// caughtUp waits, up to readyWait, until a shared log has caught up with the log for the first
// time: before, the state is partial, and a Route would route from it (or answer that a model has
// no worker) as if it were whole.
func (d *Dispatcher) caughtUp(ctx context.Context) error {
	sl, ok := d.log.(kvstate.SharedLog)
	if !ok {
		return nil
	}
	ready := sl.Ready()
	select {
	case <-ready:
		return nil
	default:
	}
	t := time.NewTimer(readyWait)
	defer t.Stop()
	select {
	case <-ready:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return fmt.Errorf("%w: this replica is still loading the shared state; retry", kvstate.ErrLogUnavailable)
	}
}

// keyedPrompts pools the keyed prompts of Routes in flight, every dispatcher's: a prompt's hashes
// are the one buffer of a Route that grows with its prompt (16 bytes a block), and reusing them
// keeps Route from allocating them anew, as the kernel's pooled scratch did when it hashed.
var keyedPrompts = sync.Pool{New: func() any { return new(policy.KeyedPrompt) }}

// key keys req's prompt once for the whole Route (policy.KeyedPrompt): the booking cap's check, the
// queue's order and every try of the decision read this one key. Between learning the model's
// block size and hashing, it checks that a long prompt's booking can fit (roomBefore), so that a
// caller at its cap is refused before its prompt is hashed. For a model no worker serves it keys
// nothing and returns nil: the decision answers ErrUnknownModel (or keys the prompt itself if the
// model arrived in between). The caller puts a returned key back in keyedPrompts.
func (d *Dispatcher) key(req *Request) (*policy.KeyedPrompt, error) {
	blockSize, ok := d.kernel.BlockSize(req.Model)
	if !ok {
		return nil, nil
	}
	if !req.QueryOnly {
		if err := d.cap.roomBefore(req, policy.Prompt{Tokens: req.PromptTokens(), BlockSize: blockSize}.Blocks()); err != nil {
			return nil, err
		}
	}
	key := keyedPrompts.Get().(*policy.KeyedPrompt)
	key.Key(&req.Request, blockSize)
	return key, nil
}

// route makes one attempt: decide with the Route's keyed prompt, then book.
func (d *Dispatcher) route(ctx context.Context, req *Request, key *policy.KeyedPrompt, start time.Time) (*policy.Decision, error) {
	preq := &req.Request
	if worker, ok := d.session(req); ok {
		bound := worker // declared here, so only a request with a session allocates it
		r := req.Request
		r.SessionWorker = &bound
		preq = &r
	}
	dec, err := d.kernel.Decide(preq, key)
	if err != nil || preq.QueryOnly {
		return dec, err
	}
	if err := d.cap.room(req, dec.Load); err != nil {
		return nil, err
	}
	b := kvstate.Booking{RequestID: req.ID, Model: req.Model, Owner: req.Owner, At: d.clock.Now().UnixNano(), Hops: dec.Load}
	if ttl := d.cfg.SessionAffinityTTL; ttl > 0 && req.SessionID != "" {
		b.Session, b.SessionExpires = req.SessionID, b.At+ttl.Nanoseconds()
	}
	if _, err := d.log.Append(ctx, kvstate.Booked{Booking: b}); err != nil {
		return nil, err
	}
	if d.outcomes != nil {
		d.outcomes.Booked(ctx, bookedOutcome(req, dec, &b, start))
	}
	if err := ctx.Err(); err != nil {
		// The caller left while this was booked and will never learn the answer: undo the booking
		// rather than leave its load until it expires. (A caller that frees after cancelling, as
		// clients/go does, may have been answered NOT_FOUND just before the booking applied.)
		_ = d.free(context.WithoutCancel(ctx), req.ID, FreedCallerGone)
		return nil, err
	}
	dec.Booked = true
	return dec, nil
}

// session returns the decode worker the request's session is bound to, when session affinity is on
// and the request pins no decode worker itself.
func (d *Dispatcher) session(req *Request) (kvstate.WorkerKey, bool) {
	if d.cfg.SessionAffinityTTL <= 0 || req.SessionID == "" || req.DecodePin != nil {
		return kvstate.WorkerKey{}, false
	}
	return d.state.Session(req.Model, req.SessionID, d.clock.Now().UnixNano())
}

// queueKey orders waiting requests: arrival order for FCFS; for WSPT the uncached prompt tokens,
// smallest first, from the Route's keyed prompt.
func (d *Dispatcher) queueKey(req *Request, key *policy.KeyedPrompt) float64 {
	if d.cfg.QueuePolicy != policy.QueuePolicyWSPT {
		return 0 // ties fall back to arrival order
	}
	return float64(max(1, d.kernel.UncachedTokens(&req.Request, key)))
}

// QueueDepth returns the number of requests waiting for capacity.
func (d *Dispatcher) QueueDepth() int { return d.queue.depth() }

// PrefillComplete ends the prefill part of request id's booking: its prefill worker no longer
// carries the prompt's tokens.
func (d *Dispatcher) PrefillComplete(ctx context.Context, id string) error {
	now := d.clock.Now()
	return d.endBooking(ctx, id, kvstate.PrefillDone{RequestID: id, At: now.UnixNano()}, now, 0)
}

// Free ends request id's booking on every worker.
func (d *Dispatcher) Free(ctx context.Context, id string) error {
	return d.free(ctx, id, FreedByCaller)
}

// free appends the Freed of request id, reporting it with cause.
func (d *Dispatcher) free(ctx context.Context, id string, cause FreeCause) error {
	now := d.clock.Now()
	return d.endBooking(ctx, id, kvstate.Freed{RequestID: id, At: now.UnixNano()}, now, cause)
}

// endBooking appends a PrefillDone or Freed made at now, and reports it to the outcomes (a Freed
// with cause). Both modes answer alike: kvstate.ErrUnknownRequest when no replica holds the
// booking, and nothing is appended (or reported) then.
func (d *Dispatcher) endBooking(ctx context.Context, id string, c kvstate.Change, now time.Time, cause FreeCause) error {
	var bookedAt int64
	var hops int
	var seen bool
	if d.outcomes != nil {
		// Read before the append: once freed, the booking and its time are gone.
		bookedAt, hops, seen = d.state.Load().BookedAt(id)
	}
	_, err := d.log.Append(ctx, c)
	switch {
	case errors.Is(err, kvstate.ErrUnknownRequest):
		return fmt.Errorf("request_id %q: %w (never booked, already freed, or expired)", id, err)
	case err != nil:
		return fmt.Errorf("request_id %q: %w", id, err)
	}
	if d.outcomes == nil {
		return nil
	}
	if _, freed := c.(kvstate.Freed); !freed {
		if !seen { // the booking reached this replica while the append waited for it
			bookedAt, hops, seen = d.state.Load().BookedAt(id)
		}
		d.outcomes.PrefillDone(ctx, endedOutcome(id, now, bookedAt, hops, seen, 0))
		return nil
	}
	d.outcomes.Freed(ctx, endedOutcome(id, now, bookedAt, hops, seen, cause))
	return nil
}
