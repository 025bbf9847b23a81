package replication

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

// Options configure a Log.
type Options struct {
	// Prefix names the log in its store (for Redis, the prefix of its keys, hash tag included:
	// "kvr:{prod}"). It appears in log lines.
	Prefix string
	// LoadGate, when set, bounds the snapshot loads (read and restore) that run at once: the logs
	// of one replica's shards share one, so that a cold start restores as many shards at once as
	// there are cores, and each restore's snapshot buffer is garbage before the next ones read
	// theirs (fresh memory is most of a restore's cost: docs/benchmarks/history.md, "Cold start from
	// the snapshots of a sharded log").
	LoadGate chan struct{}
	// Replica identifies this process in the log (its own entries carry it).
	Replica string
	// SnapshotEvery is how many applied changes (a KV batch counting one per block event) trigger an
	// attempt to write a snapshot (one replica at a time writes, under a lease); SnapshotInterval
	// triggers one after that long regardless. Zero means kvstate.DefaultSnapshotEvery.
	// The log is trimmed behind the previous snapshot, so the memory the store holds for it stays
	// bounded by about two snapshot periods of changes.
	SnapshotEvery    uint64
	SnapshotInterval time.Duration
	// ReadBlock is how long one tail read blocks waiting for new entries.
	ReadBlock time.Duration
	// ReadCount is the most entries one tail read returns.
	ReadCount int64
	// MaxBuffered bounds the worker changes a replica keeps while Redis is unreachable (applied
	// locally, published when Redis returns). Past it, changes still apply locally, and the workers
	// concerned are asked to resync once Redis is back.
	MaxBuffered int
	// ReseedWindow is how long a fresh generation (created by a replica without state on an empty
	// Redis) may be replaced by a replica with state reseeding a lost log (generation.go).
	ReseedWindow time.Duration
	// WatermarkInterval is how often a replica writes its watermark: the time before which
	// everything it applied locally is in the stream (watermark.go). A MarkPrefillComplete or Free
	// for a request a replica does not hold waits for every other replica's watermark to pass the
	// time of the call, about this long, before it answers that the request is not booked.
	WatermarkInterval time.Duration
	// WatermarkWait bounds that wait: past it, with a replica still behind (cut off from Redis,
	// paused), the call is kvstate.ErrLogUnavailable, to retry.
	WatermarkWait time.Duration
	// ReplicaTimeout is how long a replica's watermark may stay still before the replica is taken
	// for dead (its unpublished bookings lost with it), so that it no longer holds such calls up.
	// Set it to the booking expiry: a replica cut off for longer publishes bookings older than that,
	// which the first housekeeper to see them expires.
	ReplicaTimeout time.Duration
	// NoFreshWindow says no replica can hold lost state of this log (a shard made for a model new
	// to a deployment whose Redis kept its data: replication.Shards knows): a fresh generation is the
	// whole shared state at once, not incomplete for ReseedWindow. A replica with state may still
	// reseed it within the window.
	NoFreshWindow bool
	// IndexBookings keeps the booking index beside the stream (bookingindex.go): a log sharded by
	// model does, so that a replica that does not serve its model can end its bookings.
	IndexBookings bool
	Logger        *slog.Logger
}

// Log is the kvstate.Log of a deployment with several replicas: a log in a store that every replica
// appends to and tails, applying every entry in the log's order.
//
// Worker changes are appended, then awaited until this replica's tailer has applied them, so their
// result (and the ack a worker gets) reflects log order, and an ack means the events are durable.
// Booking changes are applied locally at once, since routing never waits on Redis, and published in
// the background; the tailer skips them when they come back. Entries from the log are applied with
// State.ApplyReplicated, which makes the two orders converge.
type Log struct {
	store logstore.LogStore
	state *kvstate.State
	opts  Options

	seq      atomic.Uint64 // this replica's entry numbers
	position atomic.Uint64 // entries applied from the stream
	lastID   atomic.Value  // string: stream id of the last applied entry

	appliedMu sync.Mutex
	appliedCh chan struct{} // closed and replaced whenever the tailer applied entries

	// The log's generation (generation.go).
	gen         atomic.Value  // string: the generation this replica follows
	genLost     atomic.Bool   // the log's generation is not ours: appends are fenced, the state may be incomplete
	stalled     atomic.Bool   // stopped before an entry or snapshot of a newer version (stall)
	genReported atomic.Bool   // the current loss was logged
	genKick     chan struct{} // an append was fenced: check the generation
	freshUntil  atomic.Int64  // unix ns: until then a replica with state may still replace our fresh generation
	genChanges  atomic.Uint64
	genFate     map[string]bool // under mu: pending changes of a replaced generation are published (true) or dropped
	lastEntry   atomic.Uint64   // number of the last entry applied (0: none yet, or unnumbered entries)
	rewound     atomic.Bool     // an entry came whose number this replica had applied already
	joined      chan struct{}   // closed once this replica follows a generation
	joinedOnce  sync.Once

	// localMu keeps local-first applies out while a snapshot of the state is encoded.
	localMu sync.RWMutex
	// localOrder makes a local-first change's apply, its number and its place in the outbox (or
	// the outage buffer) one step (appendLocalFirst, appendBuffered): changes are published in the
	// order they applied, and a watermark covers every change applied before it
	// (runWatermarks). Booking changes apply under the load's lock anyway, so it costs them no
	// parallelism.
	localOrder sync.Mutex

	mu      sync.Mutex
	waiters map[uint64]chan appliedEntry // own entries awaited by Append
	// unechoed are own entries published in the background and not yet read back from the stream;
	// true if they were applied locally when appended (the tailer then skips them), false if the
	// state they were applied to was replaced since (the tailer applies them).
	unechoed map[uint64]bool
	// queued are own changes applied locally and not appended yet: in the outbox, the outage buffer
	// or the publisher's hands. After the state is replaced they are the ones still to come back.
	queued map[uint64]struct{}

	outbox chan outgoing // locally applied bookings to publish
	// uncertain is set when an append got no reply (the connection broke): its entry may be in the
	// stream although the append failed. Retrying it blindly would append it twice, and a booking
	// appended again after its Free would be booked again everywhere; so retries of queued changes
	// wait until this replica has read the stream past the failure (resolveUncertain), which
	// confirms the changes that did go in.
	uncertain atomic.Bool

	// The committer (commit): worker changes waiting to be appended, joined into one entry.
	commitMu      sync.Mutex
	commitQueue   []commitRequest
	commitStopped bool
	commitKick    chan struct{}

	// Degraded mode (Redis unreachable), under mu.
	degraded   atomic.Bool
	buffer     []buffered                // worker changes applied locally during an outage, oldest first
	bufferedBy map[kvstate.WorkerKey]int // buffered changes per worker: their events are not acked yet
	resync     map[kvstate.WorkerKey]bool
	flushKick  chan struct{}
	// LostChanges counts changes that could not be kept for publishing (buffer or outbox full).
	LostChanges atomic.Int64

	// Snapshot bookkeeping, owned by the tailer goroutine.
	sinceSnapshot uint64
	lastSnapshot  time.Time
	dueSince      time.Time // when the next snapshot fell due (zero: not due)
	// A snapshot is encoded and written by a goroutine of its own (snapshot.go): writing says one
	// is under way, snapshotFailed that the last one failed (the next is tried at once), snapshots
	// tracks the goroutine so Run returns only after it.
	writing        atomic.Bool
	snapshotFailed atomic.Bool
	snapshots      sync.WaitGroup

	// Stats for metrics.
	SnapshotBytes   atomic.Int64 // size of the last snapshot written or loaded
	SnapshotWritten atomic.Int64 // unix nanoseconds of the last snapshot this replica wrote or loaded
	SnapshotLoads   atomic.Int64 // snapshots loaded (at start, or after falling behind)
	SnapshotWrites  atomic.Int64 // snapshots this replica wrote
	streamLen       atomic.Int64 // the stream's length, refreshed by the tailer
	observers       atomic.Pointer[kvstate.Observers]
	// known are the other replicas whose watermarks this one has seen, with the latest, in Redis
	// microseconds (watermark.go).
	knownMu        sync.Mutex
	known          map[string]int64
	ready          chan struct{} // closed once the replica has loaded the snapshot and read the stream to its end
	readyOnce      sync.Once
	reachableSince atomic.Int64 // unix nanoseconds since Redis answers again (or since start)
}

func (l *Log) markReady() { l.readyOnce.Do(func() { close(l.ready) }) }

// Ready is closed once the replica has caught up with the log at start (snapshot loaded, stream read
// to its end): before that it must not serve, its state is partial.
func (l *Log) Ready() <-chan struct{} { return l.ready }

// ReachableFor returns how long Redis has answered without interruption.
func (l *Log) ReachableFor() time.Duration {
	if l.degraded.Load() {
		return 0
	}
	return time.Since(time.Unix(0, l.reachableSince.Load()))
}

// Observe installs observers; safe to call at any time.
func (l *Log) Observe(o kvstate.Observers) { l.observers.Store(&o) }

// stall records that this replica met an entry or snapshot (at where) of a newer version than it
// reads, and says so once at ERROR. It stays stalled (Incomplete, health NOT_SERVING for the shared
// state) until restarted on a release that reads it.
func (l *Log) stall(where string, err error) {
	if !l.stalled.Swap(true) {
		l.opts.Logger.Error("the shared log holds a newer version than this replica reads; it stopped applying the log: upgrade this replica",
			"at", where, "err", err)
	}
}

// Stats returns the log's current figures.
func (l *Log) Stats() kvstate.SharedLogStats {
	st := kvstate.SharedLogStats{
		Degraded: l.Degraded(), Incomplete: l.Incomplete(), BufferedChanges: l.BufferedChanges(),
		LostChanges: l.LostChanges.Load(), Length: l.streamLen.Load(), SnapshotBytes: l.SnapshotBytes.Load(),
		GenerationChanges: l.GenerationChanges(), NewerVersion: l.stalled.Load(),
	}
	if ns := l.SnapshotWritten.Load(); ns != 0 {
		st.SnapshotAt = time.Unix(0, ns)
	}
	return st
}

// Backend names the store ("redis", "embedded").
func (l *Log) Backend() string { return l.store.Name() }

// The Redis log is a shared log that buffers through outages.
var _ kvstate.BufferingLog = (*Log)(nil)

type appliedEntry struct {
	res kvstate.Result
	err error
}

type outgoing struct {
	seq  uint64
	data []byte
	gen  string // the generation it was applied locally in
	// traceParent is the W3C traceparent of the traced call that appends it ("" when untraced):
	// replicas link their apply of the entry to that call (Observers.ApplyTraced).
	traceParent string
	// index is what the entry changes in the booking index (Options.IndexBookings).
	index []logstore.IndexOp
}

// outgoingOf returns the change c as an entry to append, numbered seq, in this replica's generation.
func (l *Log) outgoingOf(seq uint64, data []byte, c kvstate.Change) outgoing {
	o := outgoing{seq: seq, data: data, gen: l.Generation()}
	if l.opts.IndexBookings {
		o.index = indexOps(c)
	}
	return o
}

// withDefaults returns the options with every unset one at its default.
func (opts Options) withDefaults() Options {
	if opts.ReadBlock <= 0 {
		opts.ReadBlock = time.Second
	}
	if opts.ReadCount <= 0 {
		opts.ReadCount = 512
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.SnapshotEvery == 0 {
		opts.SnapshotEvery = kvstate.DefaultSnapshotEvery
	}
	if opts.SnapshotInterval <= 0 {
		opts.SnapshotInterval = 5 * time.Minute
	}
	if opts.MaxBuffered <= 0 {
		opts.MaxBuffered = 100_000
	}
	if opts.ReseedWindow <= 0 {
		opts.ReseedWindow = 10 * time.Second
	}
	if opts.WatermarkInterval <= 0 {
		opts.WatermarkInterval = 50 * time.Millisecond
	}
	if opts.WatermarkWait <= 0 {
		opts.WatermarkWait = 2 * time.Second
	}
	if opts.ReplicaTimeout <= 0 {
		opts.ReplicaTimeout = 5 * time.Minute
	}
	return opts
}

// New returns a log over store applying to state. Call Run to tail the log; until it runs,
// appends of worker changes wait.
func New(store logstore.LogStore, state *kvstate.State, opts Options) *Log {
	opts = opts.withDefaults()
	// Entries are recognised as this replica's by its id and a counter that restarts with the
	// process: a restarted replica with the same name (a container's hostname and pid 1) must not
	// take its predecessor's entries for its own.
	opts.Replica = fmt.Sprintf("%s-%08x", opts.Replica, rand.Uint32())
	l := &Log{
		store: store, state: state, opts: opts,
		waiters:    make(map[uint64]chan appliedEntry),
		unechoed:   make(map[uint64]bool),
		queued:     make(map[uint64]struct{}),
		outbox:     make(chan outgoing, 65536),
		bufferedBy: make(map[kvstate.WorkerKey]int),
		resync:     make(map[kvstate.WorkerKey]bool),
		flushKick:  make(chan struct{}, 1),
		commitKick: make(chan struct{}, 1),
		genKick:    make(chan struct{}, 1),
		genFate:    make(map[string]bool),
		known:      make(map[string]int64),
		joined:     make(chan struct{}),
		ready:      make(chan struct{}),
	}
	l.gen.Store("")
	l.reachableSince.Store(time.Now().UnixNano())
	l.lastID.Store("0")
	return l
}

// Position returns how many stream entries this replica has applied.
func (l *Log) Position() uint64 { return l.position.Load() }

// Pending returns how many of this replica's changes were published in the background and have not
// yet come back through the stream: while it is 0 and the replica has read the whole stream, it has
// applied exactly what every other caught-up replica has.
func (l *Log) Pending() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.unechoed)
}

// stateReplacedLocked forgets what this replica applied locally first, after its state was replaced
// by a snapshot (a reload, or a restore after falling behind): of its own changes, only those not
// appended yet are sure to come back through the stream, and they must be applied when they do.
// They stay pending until then. The caller holds mu.
func (l *Log) stateReplacedLocked() {
	clear(l.unechoed)
	for seq := range l.queued {
		l.unechoed[seq] = false
	}
}

// LastID returns the stream id of the last applied entry ("0" before the first).
func (l *Log) LastID() string { return l.lastID.Load().(string) }

// Append makes c durable in the stream. Booking changes apply locally first and publish in the
// background; others return once this replica has applied them from the stream.
func (l *Log) Append(ctx context.Context, c kvstate.Change) (kvstate.Result, error) {
	if err := ctx.Err(); err != nil {
		return kvstate.Result{}, err
	}
	c = l.state.Stamp(c)
	switch c.(type) {
	case kvstate.Booked:
		return l.appendLocalFirst(c)
	case kvstate.PrefillDone, kvstate.Freed:
		return l.appendBookingEnd(ctx, c)
	}
	select {
	case <-l.joined: // appends are fenced by the generation: none before this replica has one
	case <-ctx.Done():
		return kvstate.Result{}, ctx.Err()
	}
	l.mu.Lock()
	buffering := len(l.buffer) > 0
	l.mu.Unlock()
	if buffering {
		// Redis was unreachable and older changes still wait: keep this one behind them.
		return l.appendBuffered(c)
	}
	seq := l.seq.Add(1)
	done := make(chan appliedEntry, 1)
	l.mu.Lock()
	l.waiters[seq] = done
	l.mu.Unlock()
	entry := l.outgoingOf(seq, kvstate.EncodeEntry(nil, c), c)
	o := l.observers.Load()
	if o != nil && o.TraceParent != nil {
		entry.traceParent = o.TraceParent(ctx)
	}
	start := time.Now()
	if err := l.commit(ctx, entry); err != nil {
		l.mu.Lock()
		delete(l.waiters, seq)
		l.mu.Unlock()
		if ctx.Err() != nil {
			return kvstate.Result{}, ctx.Err()
		}
		if errors.Is(err, errStopped) {
			return kvstate.Result{}, fmt.Errorf("%w: %v", kvstate.ErrLogUnavailable, err)
		}
		if !errors.Is(err, errFenced) {
			l.setDegraded(err)
		}
		// Fenced (the log's generation changed) or Redis unreachable: kept here until it can be published.
		return l.appendBuffered(c)
	}
	l.setDegraded(nil)
	if o != nil && o.Append != nil {
		o.Append(time.Since(start))
	}
	select {
	case a := <-done:
		return a.res, a.err
	case <-ctx.Done():
		// The entry is in the stream and will be applied; only the wait is abandoned.
		l.mu.Lock()
		delete(l.waiters, seq)
		l.mu.Unlock()
		return kvstate.Result{}, ctx.Err()
	}
}

// errStopped: the log's Run has returned; nothing more is appended through it.
var errStopped = errors.New("the shared log is stopping")

// commitRequest is a worker change handed to the committer, and where its append's error goes.
type commitRequest struct {
	entry  outgoing
	result chan error
}

// commit hands e to the committer and returns once it is in the stream (nil), the append failed, or
// ctx ended (the entry may still be appended then; its apply wakes no one).
//
// Why a committer: every Publish stream appends its own batches, and with one Redis command each, a
// replica's cost per block was dominated by per-command costs (the round trip, the script, the
// entry every replica reads back). The committer appends whatever accumulated while its previous
// append was in flight as one joined entry (addEntries), so an idle log appends at once and a busy
// one pays those costs once for many batches (docs/benchmarks/history.md, "Where the CPU per block
// event went, and the committer").
func (l *Log) commit(ctx context.Context, e outgoing) error {
	req := commitRequest{entry: e, result: make(chan error, 1)}
	l.commitMu.Lock()
	if l.commitStopped {
		l.commitMu.Unlock()
		return errStopped
	}
	l.commitQueue = append(l.commitQueue, req)
	l.commitMu.Unlock()
	select {
	case l.commitKick <- struct{}{}:
	default:
	}
	select {
	case err := <-req.result:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// runCommitter appends the changes handed to commit until ctx ends; then it fails those still
// queued, and any handed over later, with errStopped.
func (l *Log) runCommitter(ctx context.Context) {
	var batch []commitRequest
	var entries []outgoing
	for {
		select {
		case <-ctx.Done():
			l.commitMu.Lock()
			l.commitStopped = true
			queued := l.commitQueue
			l.commitQueue = nil
			l.commitMu.Unlock()
			for _, req := range queued {
				req.result <- errStopped
			}
			return
		case <-l.commitKick:
		}
		for {
			l.commitMu.Lock()
			batch, l.commitQueue = l.commitQueue, batch[:0]
			l.commitMu.Unlock()
			if len(batch) == 0 {
				break
			}
			entries = entries[:0]
			for _, req := range batch {
				entries = append(entries, req.entry)
			}
			for i, err := range l.addEntries(ctx, entries) {
				if err != nil && ctx.Err() != nil {
					err = errStopped // cut by the stop, not by Redis: no outage to report
				}
				batch[i].result <- err
			}
			clear(batch) // drop the references to delivered requests and their data
			clear(entries)
		}
	}
}
