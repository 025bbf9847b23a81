package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
)

// Publishing is the worker side of the application: it admits the workers that register and
// keeps, for each, a PublishSession that applies what the worker publishes (KV events, dumps, load)
// through its model's log and answers it (Replies): registrations, acks once a change is durable,
// and resync requests when the router lost what the worker sent. The protocol lives here rather
// than in a transport, so that the gRPC edge only maps messages, and any other transport (or a test)
// drives the same sessions.
type Publishing struct {
	opts  PublishOptions
	dumps dumpBudget
}

// PublishOptions configure the sessions of a replica.
type PublishOptions struct {
	// Shards holds the state and log of each model; a session works in its worker's model's shard.
	Shards   kvstate.ShardSource
	Presence *kvstate.Presence // this replica's sessions
	Clock    kvstate.Clock
	Logger   *slog.Logger
	// ConditionalDisagg is on: decode workers without KV events are worth a warning.
	ConditionalDisagg bool
	// MaxWorkersPerModel bounds the ranks one model registers, MaxRanksPerWorker those of one
	// worker id in a model, MaxModels the models a registration may create (0: no bound).
	MaxWorkersPerModel, MaxRanksPerWorker, MaxModels int
	// MaxDumpBlocks bounds the stored blocks of a whole dump, over all its parts (0: no bound).
	MaxDumpBlocks int
	// MaxDumpBytesInFlight bounds what the dumps in parts of every session hold, together, between
	// their parts (0: no bound).
	MaxDumpBytesInFlight int64
	// Observer hears what the sessions do, for metrics and tracing; nil: nobody.
	Observer PublishObserver
}

// PublishObserver hears what sessions do. Its calls are made on the session's goroutine and must
// not block.
type PublishObserver interface {
	// Appending is called before a session appends change for the worker info to log; it returns the
	// context to append with (a tracer's span in it) and a function to call with the append's
	// result, or nil when it wants none.
	Appending(ctx context.Context, log kvstate.Log, info kvstate.WorkerInfo, change kvstate.Change) (context.Context, func(kvstate.Result, error))
	// Applied reports the result of an applied batch of events or dump.
	Applied(res kvstate.Result)
	// Resynced reports a dump asked of a worker.
	Resynced()
	// Superseded reports a session ended because a newer one registered its worker rank.
	Superseded()
}

// Replies is how a session answers its worker, through the transport that carries it. An error
// ends the session (the transport is gone).
type Replies interface {
	// Registered answers a registration with the last event id the router holds for the rank.
	Registered(lastEventID uint64, hasLastEvent bool) error
	// Ack acknowledges every event through eventID as durable.
	Ack(eventID uint64) error
	// Resync asks the worker for a dump of what it holds, from expectedEventID on.
	Resync(reason string, expectedEventID uint64) error
}

// NewPublishing returns the sessions' home with opts.
func NewPublishing(opts PublishOptions) *Publishing {
	opts.Clock = kvstate.ClockOr(opts.Clock)
	if opts.Presence == nil {
		opts.Presence = kvstate.NewPresence()
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Observer == nil {
		opts.Observer = noPublishObserver{}
	}
	return &Publishing{opts: opts, dumps: dumpBudget{limit: opts.MaxDumpBytesInFlight}}
}

// DumpBytesInFlight returns what the dumps in parts of every session hold between their parts.
func (p *Publishing) DumpBytesInFlight() int64 { return p.dumps.used.Load() }

// PublishSession is one registered worker rank's session: what it publishes applies at the epoch
// it registered with, so that once a newer session registers the rank nothing more of this one
// applies. It is not safe for concurrent use: one transport stream drives it, message by message.
type PublishSession struct {
	p       *Publishing
	shard   *kvstate.Shard
	replies Replies
	info    kvstate.WorkerInfo // the registered hello
	logger  *slog.Logger
	epoch   uint64
	// restores is the state's restore count at registration: a registration that ends with a
	// snapshot reload is not a takeover.
	restores uint64
	ended    <-chan struct{}
	release  func() // lets go of the worker's lease
	// buffering is the shard's log when it may buffer appends (a shared log in an outage): acks
	// then wait until the change is published, and Refresh must be called now and then.
	buffering kvstate.BufferingLog
	acked     uint64
	hasAck    bool
	dump      *pendingDump
	// dumpAsked is set once a resync was sent, until a dump applies: the worker is asked once.
	dumpAsked bool
}

// Open registers the worker rank of info (starting afresh when fresh) and returns its session,
// after answering Registered through replies. It refuses a registration past the replica's caps
// (max_models, max_workers_per_model, max_ranks_per_worker) or of a worker rank registered with
// another model. The caller closes the session when its stream ends.
func (p *Publishing) Open(ctx context.Context, info kvstate.WorkerInfo, fresh bool, replies Replies) (*PublishSession, error) {
	if err := p.modelRoom(info.Model); err != nil {
		return nil, err
	}
	sh, err := p.opts.Shards.Open(ctx, info.Model)
	if err != nil {
		return nil, fmt.Errorf("hello.model: %w", err)
	}
	if err := p.admit(sh.State, info); err != nil {
		return nil, err
	}
	if err := p.oneModel(ctx, info, fresh); err != nil {
		return nil, err
	}
	// The worker counts as connected before its hello applies, so the housekeeper cannot remove it
	// in between.
	p.opts.Presence.Connected(info.Key)
	res, err := p.append(ctx, sh, info, kvstate.WorkerUp{Info: info, Reset: fresh})
	if err != nil {
		p.opts.Presence.Disconnected(info.Key, p.opts.Clock.Now().UnixNano(), 0) // no epoch: owes no removal
		return nil, err
	}
	s := &PublishSession{p: p, shard: sh, replies: replies, info: info, epoch: res.Epoch,
		restores: sh.State.Restores(), logger: p.opts.Logger.With("worker", info.Key.String(), "model", info.Model, "role", info.Role.String())}
	s.ended = sh.State.EpochEnds(info.Key, s.epoch)
	s.buffering, _ = sh.Log.(kvstate.BufferingLog)
	s.hold(ctx)
	s.logger.Info("worker connected", "endpoint", info.Endpoint, "block_size", info.BlockSize, "fresh_start", fresh)
	if p.opts.ConditionalDisagg && info.Role == kvstate.RoleDecode && !info.KVEventsEnabled {
		s.logger.Warn("decode worker publishes no KV events: its cache is invisible to the router, so conditional disaggregation will never bypass to it; enable KV events on the engine (vLLM --kv-events-config, TensorRT-LLM --publish-kv-events)")
	}
	if err := s.sendRegistered(); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// hold takes the worker's lease at the session's epoch: it keeps the worker alive, for every
// replica, while the session is open here.
func (s *PublishSession) hold(ctx context.Context) {
	var liveness kvstate.Liveness = kvstate.LocalLiveness{}
	if s.shard.Liveness != nil {
		liveness = s.shard.Liveness
	}
	s.release = liveness.Hold(ctx, s.info.Key, s.epoch)
}

// Close ends the session: it lets go of the worker's lease and of its dump in parts, and starts the
// worker's grace period (from now, not from when the session opened).
func (s *PublishSession) Close() {
	s.release()
	s.dropDump()
	s.p.opts.Presence.Disconnected(s.info.Key, s.p.opts.Clock.Now().UnixNano(), s.epoch)
}

// Info returns the registered worker rank, as its latest hello described it.
func (s *PublishSession) Info() kvstate.WorkerInfo { return s.info }

// Logger returns the session's logger, which names its worker rank.
func (s *PublishSession) Logger() *slog.Logger { return s.logger }

// Ended returns a channel closed when the session no longer holds its worker rank (a newer session
// registered it, or the state removed the worker); Lost then says why.
func (s *PublishSession) Ended() <-chan struct{} { return s.ended }

// Buffering reports whether the session's log may buffer appends: the transport then calls Refresh
// between messages and now and then while the worker is idle (every second), so that buffered
// changes are acked once durable and a lost state is asked for again.
func (s *PublishSession) Buffering() bool { return s.buffering != nil }

// Lost returns the refusal that ends a session that no longer holds its worker rank, or nil while
// it does.
func (s *PublishSession) Lost() error {
	switch err := s.shard.State.Holds(s.info.Key, s.epoch); {
	case err != nil && s.shard.State.Restores() != s.restores:
		// The state was reloaded from a snapshot that does not hold this registration (the shared
		// log was lost and reseeded, or this replica fell behind its trim point): register again.
		return unavailable("worker %v: the router reloaded its shared state, which does not hold this stream's registration; reconnect and register again", s.info.Key)
	case isSuperseded(err):
		s.p.opts.Observer.Superseded()
		return precondition("WORKER_SUPERSEDED", "worker %v: a newer Publish stream registered this worker_id and dp_rank (on this or another replica); this stream no longer publishes for it. Two processes with the same worker_id? Do not reconnect automatically on this status", s.info.Key)
	case err != nil:
		return unavailable("worker %v was removed from the router's state; reconnect and register again", s.info.Key)
	}
	return nil
}

// MessageKind is the kind of a message a worker publishes.
type MessageKind uint8

// The kinds of message.
const (
	MessageHello MessageKind = iota + 1
	MessageEvents
	MessageDump
	MessageLoad
	MessageLeave
)

// String returns the kind's name, as the protocol's field names it.
func (k MessageKind) String() string {
	switch k {
	case MessageHello:
		return "hello"
	case MessageEvents:
		return "events"
	case MessageDump:
		return "dump"
	case MessageLoad:
		return "load"
	case MessageLeave:
		return "leave"
	}
	return "an empty message"
}

// Expect checks that a message of kind may come now, before the transport reads its content: a
// dump in parts takes only its parts and load reports until its last part. Hello, Events, Dump and
// Load check it again.
func (s *PublishSession) Expect(kind MessageKind) error {
	if kind == MessageDump || kind == MessageLoad || kind == MessageLeave {
		return nil
	}
	return s.noDumpInProgress(kind)
}

// Hello applies a repeated registration: it must describe the same worker as the first (its
// endpoint and flags may change) and must not start afresh.
func (s *PublishSession) Hello(ctx context.Context, info kvstate.WorkerInfo, fresh bool) error {
	if err := s.noDumpInProgress(MessageHello); err != nil {
		return err
	}
	if !info.SameCapacity(s.info) || fresh {
		return precondition("HELLO_CHANGED", "hello: a second hello on a stream must repeat the first (worker %v model %q role %v block_size %d total_kv_blocks %d max_num_batched_tokens %d) and must not set fresh_start; open a new stream to re-register",
			s.info.Key, s.info.Model, s.info.Role, s.info.BlockSize, s.info.TotalKVBlocks, s.info.MaxNumBatchedTokens)
	}
	if _, err := s.p.append(ctx, s.shard, info, kvstate.WorkerUp{Info: info, Epoch: s.epoch}); err != nil {
		return s.appendError(err)
	}
	s.info = info
	return s.sendRegistered()
}

// Events applies a batch of KV events, whose ids must strictly increase, and acks it once durable.
// A gap in the worker's event ids drops its blocks and asks it for a dump.
func (s *PublishSession) Events(ctx context.Context, events []kvstate.Event) error {
	if err := s.noDumpInProgress(MessageEvents); err != nil {
		return err
	}
	if len(events) == 0 {
		return invalidField("events.events", "must not be empty")
	}
	for i := 1; i < len(events); i++ {
		if err := EventOrder("events.events", i, events[i-1].ID, events[i].ID); err != nil {
			return err
		}
	}
	res, err := s.p.append(ctx, s.shard, s.info, kvstate.KVEvents{Worker: s.info.Key, Epoch: s.epoch, Events: events})
	if err != nil {
		return s.appendError(err)
	}
	s.p.opts.Observer.Applied(res)
	if res.Gap {
		s.logger.Warn("event id gap; dropped the worker's blocks and asked for a dump", "expected", res.ExpectedEventID, "got", res.GotEventID)
		if err := s.askDump(fmt.Sprintf("gap: expected event %d, got %d", res.ExpectedEventID, res.GotEventID), res.ExpectedEventID); err != nil {
			return err
		}
	}
	if res.Buffered {
		return nil // applied here, not durable yet: acked once published (Refresh)
	}
	return s.ack(res)
}

// EventOrder checks the rule that the event ids of a batch strictly increase: the id of
// field[i] must exceed prev, the id before it. A transport that validates a message as it converts
// it checks it there, so that the first broken rule of an event is the one reported; Events checks
// it again.
func EventOrder(field string, i int, prev, id uint64) error {
	if i > 0 && id <= prev {
		return invalidField(fmt.Sprintf("%s[%d].event_id", field, i), "must be greater than the previous event's id %d within a batch (got %d)", prev, id)
	}
	return nil
}

// LoadReport is a worker rank's load, as its engine reports it.
type LoadReport struct {
	Rank            uint32
	KVUsedBlocks    uint64
	WaitingRequests uint64
}

// Load applies a load report of the session's rank.
func (s *PublishSession) Load(ctx context.Context, r LoadReport) error {
	if r.Rank != s.info.Key.Rank {
		return invalidField("load.dp_rank", "must equal the stream's registered dp_rank %d (got %d)", s.info.Key.Rank, r.Rank)
	}
	_, err := s.shard.Log.Append(ctx, kvstate.LoadReported{Worker: s.info.Key, Epoch: s.epoch, KVUsedBlocks: r.KVUsedBlocks, WaitingRequests: r.WaitingRequests})
	if err != nil {
		return s.appendError(err)
	}
	return nil
}

// MaxLeaveReasonBytes bounds a leave's reason, which goes to the router's log.
const MaxLeaveReasonBytes = 256

// Leave removes the session's worker rank now, with its blocks and its share of bookings, on every
// replica: the worker stopped serving, and a grace period (meant for a worker that reconnects)
// would keep routing requests to it. The removal names the session's epoch, so it is skipped if a
// newer stream registered the rank meanwhile. The transport ends the stream once it returns nil.
// A leave may come during a dump in parts, which it drops.
func (s *PublishSession) Leave(ctx context.Context, reason string) error {
	if len(reason) > MaxLeaveReasonBytes {
		return invalidField("leave.reason", "must be at most %d bytes (got %d)", MaxLeaveReasonBytes, len(reason))
	}
	res, err := s.p.append(ctx, s.shard, s.info, kvstate.WorkerRemoved{Key: s.info.Key, Epoch: s.epoch})
	if err != nil {
		return s.appendError(err)
	}
	if res.Skipped {
		// A newer stream holds the rank: this one's leave is not the worker's any more.
		if lost := s.Lost(); lost != nil {
			return lost
		}
	}
	s.dropDump()
	s.logger.Info("worker left: removed with its blocks", "reason", reason)
	return nil
}

// Refresh acks events that became durable since, and asks for a dump when the log says so or when
// the state no longer holds what this session acked (the shared log lost it). It does nothing
// unless the session is Buffering.
func (s *PublishSession) Refresh() error {
	l := s.buffering
	if l == nil {
		return nil
	}
	if l.TakeResync(s.info.Key) {
		if err := s.askDump("shared log outage: events were lost for the other replicas", 0); err != nil {
			return err
		}
	}
	if l.Buffered(s.info.Key) > 0 {
		return nil
	}
	w := s.shard.State.Worker(s.info.Key)
	if w == nil {
		return nil
	}
	st := w.Status()
	if s.hasAck && (!st.HasLastEvent || st.LastEventID < s.acked) && !s.dumpAsked {
		held := "none"
		if st.HasLastEvent {
			held = fmt.Sprint(st.LastEventID)
		}
		s.logger.Warn("the shared state lost events this stream acked: asking the worker for a dump", "acked", s.acked, "held", held)
		return s.askDump(fmt.Sprintf("the router's shared state lost events (acked through %d, holds %s); send a dump", s.acked, held), nextEventID(st))
	}
	return s.ack(kvstate.Result{LastEventID: st.LastEventID, HasLastEvent: st.HasLastEvent})
}

// append appends change for info to sh's log, with the observer around it.
func (p *Publishing) append(ctx context.Context, sh *kvstate.Shard, info kvstate.WorkerInfo, change kvstate.Change) (kvstate.Result, error) {
	appendCtx, done := p.opts.Observer.Appending(ctx, sh.Log, info, change)
	res, err := sh.Log.Append(appendCtx, change)
	if done != nil {
		done(res, err)
	}
	return res, err
}

// appendError maps an append's error; a change refused because a newer session holds the rank ends
// the session as superseded.
func (s *PublishSession) appendError(err error) error {
	if isSuperseded(err) {
		if lost := s.Lost(); lost != nil {
			return lost
		}
	}
	return err
}

// noDumpInProgress refuses a message of kind while a dump in parts waits for its last part.
func (s *PublishSession) noDumpInProgress(kind MessageKind) error {
	if d := s.dump; d != nil {
		return precondition("DUMP_IN_PROGRESS", "%s: a dump in parts is in progress (through_event_id %d, %d blocks so far): send its remaining parts, the last without more_follows, first",
			kind, d.through, d.events.Blocks())
	}
	return nil
}

// sendRegistered answers a hello with the last event id held for the rank, and asks for a dump at
// once if the rank is waiting for one (the request may have been lost with a previous session).
func (s *PublishSession) sendRegistered() error {
	w := s.shard.State.Worker(s.info.Key)
	if w == nil {
		return unavailable("worker %v was removed while registering; reconnect", s.info.Key)
	}
	st := w.Status()
	if err := s.replies.Registered(st.LastEventID, st.HasLastEvent); err != nil {
		return err
	}
	if st.AwaitingResync {
		s.dumpAsked = true
		return s.replies.Resync("a dump is still awaited after an event id gap", nextEventID(st))
	}
	return nil
}

// askDump asks the worker for a dump, once until a dump applies.
func (s *PublishSession) askDump(reason string, expected uint64) error {
	s.dumpAsked = true
	s.p.opts.Observer.Resynced()
	return s.replies.Resync(reason, expected)
}

// ack sends a cumulative ack when the applied event id moved forward. An ack never goes back: a
// state that lost acked events asks for a dump instead (Refresh), and acks resume with it.
func (s *PublishSession) ack(res kvstate.Result) error {
	if !res.HasLastEvent || (s.hasAck && res.LastEventID <= s.acked) {
		return nil
	}
	s.acked, s.hasAck = res.LastEventID, true
	return s.replies.Ack(res.LastEventID)
}

// nextEventID is the event id a dump asked of a worker in st starts from.
func nextEventID(st kvstate.WorkerStatus) uint64 {
	if st.HasLastEvent {
		return st.LastEventID + 1
	}
	return 0
}

// dumpBudget bounds the memory that the dumps in parts of all the sessions of a replica hold
// between their parts, together (max_dump_bytes_in_flight): a session may hold a million-block
// dump for as long as its worker takes to send it, and many sessions may.
type dumpBudget struct {
	limit int64 // 0: no bound
	used  atomic.Int64
}

// take counts n more bytes held, unless that would pass the limit (then it counts nothing).
func (b *dumpBudget) take(n int64) bool {
	for {
		cur := b.used.Load()
		if n > 0 && b.limit > 0 && cur+n > b.limit {
			return false
		}
		if b.used.CompareAndSwap(cur, cur+n) {
			return true
		}
	}
}

// noPublishObserver hears nothing.
type noPublishObserver struct{}

func (noPublishObserver) Appending(ctx context.Context, _ kvstate.Log, _ kvstate.WorkerInfo, _ kvstate.Change) (context.Context, func(kvstate.Result, error)) {
	return ctx, nil
}
func (noPublishObserver) Applied(kvstate.Result) {}
func (noPublishObserver) Resynced()              {}
func (noPublishObserver) Superseded()            {}

// dumpRetryDelay is suggested to a worker whose dump found the replica's budget for dumps in parts
// full: other workers' dumps complete within seconds.
const dumpRetryDelay = 2 * time.Second

// isSuperseded reports whether err says a newer session registered the worker rank.
func isSuperseded(err error) bool { return errors.Is(err, kvstate.ErrSuperseded) }

// invalidField returns the policy.FieldError of a message field that breaks its rule.
func invalidField(field, format string, args ...any) error {
	return &policy.FieldError{Field: field, Rule: fmt.Sprintf(format, args...)}
}
