package redislog

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
)

// Options configure a Log.
type Options struct {
	// Prefix starts every key, hash tag included, e.g. "kvr:{prod}". Every key of a deployment
	// shares the tag, so the layout works unchanged on Redis Cluster.
	Prefix string
	// Replica identifies this process in the log (its own entries carry it).
	Replica string
	// SnapshotEvery is how many applied changes (a KV batch counting one per block event) trigger an
	// attempt to write a snapshot (one replica at a time writes, under a lease); SnapshotInterval
	// triggers one after that long regardless. Zero means DefaultSnapshotEvery.
	// The stream is trimmed behind the previous snapshot, so the Redis memory the log holds stays
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
	// BookingArrivalWait is how long a replica waits for a booking it does not hold to arrive from
	// another replica (which publishes its bookings in the background) before it answers that a
	// MarkPrefillComplete or Free names a request that is not booked.
	BookingArrivalWait time.Duration
	Logger             *slog.Logger
}

// Stream returns the name of the log stream.
func (o Options) Stream() string { return o.Prefix + ":log" }

// SnapshotKey holds the latest snapshot, which names the stream id it covers.
func (o Options) SnapshotKey() string { return o.Prefix + ":snapshot" }

// SnapshotLeaseKey says which replica writes the next snapshot.
func (o Options) SnapshotLeaseKey() string { return o.Prefix + ":snapshot-lease" }

// SnapshotPositionKey holds the stream id the latest snapshot covers (without its bulk).
func (o Options) SnapshotPositionKey() string { return o.Prefix + ":snapshot-position" }

// takeLease takes the lease KEYS[1] for ARGV[1] for ARGV[2] milliseconds, or extends it if ARGV[1]
// holds it already. It returns 1 when ARGV[1] holds the lease.
var takeLease = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return 0
`)

// Log is the kvstate.Log of a deployment with several replicas: a Redis stream that every replica
// appends to and tails, applying every entry in stream order (DESIGN "Redis mode").
//
// Worker changes are appended, then awaited until this replica's tailer has applied them, so their
// result (and the ack a worker gets) reflects log order, and an ack means the events are durable.
// Booking changes are applied locally at once, since routing never waits on Redis, and published in
// the background; the tailer skips them when they come back. Entries from the log are applied with
// State.ApplyReplicated, which makes the two orders converge.
type Log struct {
	rdb   redis.UniversalClient
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

	mu      sync.Mutex
	waiters map[uint64]chan appliedEntry // own entries awaited by Append
	// unechoed are own entries published in the background and not yet read back from the stream;
	// true if they were applied locally when appended (the tailer then skips them).
	unechoed map[uint64]bool

	outbox chan outgoing // locally applied bookings to publish

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

	// Stats for metrics.
	SnapshotBytes   atomic.Int64 // size of the last snapshot written or loaded
	SnapshotWritten atomic.Int64 // unix nanoseconds of the last snapshot this replica wrote or loaded
	SnapshotLoads   atomic.Int64 // snapshots loaded (at start, or after falling behind)
	streamLen       atomic.Int64 // the stream's length, refreshed by the tailer
	observers       atomic.Pointer[kvstate.Observers]
	ready           chan struct{} // closed once the replica has loaded the snapshot and read the stream to its end
	readyOnce       sync.Once
	reachableSince  atomic.Int64 // unix nanoseconds since Redis answers again (or since start)
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

// Backend names the store: "redis".
func (l *Log) Backend() string { return "redis" }

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
}

// buffered is a worker change applied locally while Redis was unreachable, waiting to be published.
type buffered struct {
	outgoing
	worker    kvstate.WorkerKey
	hasWorker bool
}

// changeWeight is how much a change counts toward the next snapshot: the replay it would cost a
// replica starting from the previous one (a KV batch of 512 blocks is 512 block events, not one).
func changeWeight(c kvstate.Change) uint64 {
	var n uint64
	switch c := c.(type) {
	case kvstate.KVEvents:
		for _, e := range c.Events {
			n += uint64(max(len(e.Blocks), len(e.Removed), 1))
		}
	case kvstate.KVDump:
		for _, e := range c.Events {
			n += uint64(max(len(e.Blocks), 1))
		}
	default:
		n = 1
	}
	return n
}

// changeWorker returns the worker rank a change concerns, if any.
func changeWorker(c kvstate.Change) (kvstate.WorkerKey, bool) {
	switch c := c.(type) {
	case kvstate.WorkerUp:
		return c.Info.Key, true
	case kvstate.WorkerRemoved:
		return c.Key, true
	case kvstate.KVEvents:
		return c.Worker, true
	case kvstate.KVDump:
		return c.Worker, true
	case kvstate.LoadReported:
		return c.Worker, true
	}
	return kvstate.WorkerKey{}, false
}

const (
	fieldEntry   = "e"
	fieldReplica = "r"
	fieldSeq     = "s"
	// fieldGeneration is the generation the entry was appended in, fieldNumber its number in it
	// (generation.go).
	fieldGeneration = "g"
	fieldNumber     = "n"
)

// DefaultSnapshotEvery is the default SnapshotEvery, kvrouter serve's too. A cold start replays
// about this many block events after the snapshot it loads at most, while a snapshot of a 1M-block
// state holds its writer's tailer for 0.5-2 s of encoding and writing (docs/BENCHMARKS.md): so
// snapshots are coarse.
const DefaultSnapshotEvery = 1_000_000

// New returns a log over rdb applying to state. Call Run to tail the stream; until it runs,
// appends of worker changes wait.
func New(rdb redis.UniversalClient, state *kvstate.State, opts Options) *Log {
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
		opts.SnapshotEvery = DefaultSnapshotEvery
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
	if opts.BookingArrivalWait <= 0 {
		opts.BookingArrivalWait = 100 * time.Millisecond
	}
	// Entries are recognised as this replica's by its id and a counter that restarts with the
	// process: a restarted replica with the same name (a container's hostname and pid 1) must not
	// take its predecessor's entries for its own.
	opts.Replica = fmt.Sprintf("%s-%08x", opts.Replica, rand.Uint32())
	l := &Log{
		rdb: rdb, state: state, opts: opts,
		waiters:    make(map[uint64]chan appliedEntry),
		unechoed:   make(map[uint64]bool),
		outbox:     make(chan outgoing, 65536),
		bufferedBy: make(map[kvstate.WorkerKey]int),
		resync:     make(map[kvstate.WorkerKey]bool),
		flushKick:  make(chan struct{}, 1),
		genKick:    make(chan struct{}, 1),
		genFate:    make(map[string]bool),
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

// LastID returns the stream id of the last applied entry ("0" before the first).
func (l *Log) LastID() string { return l.lastID.Load().(string) }

// Append makes c durable in the stream. Booking changes apply locally first and publish in the
// background; others return once this replica has applied them from the stream.
func (l *Log) Append(ctx context.Context, c kvstate.Change) (kvstate.Result, error) {
	if err := ctx.Err(); err != nil {
		return kvstate.Result{}, err
	}
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
	start := time.Now()
	if err := l.addEntries(ctx, []outgoing{{seq: seq, data: kvstate.EncodeEntry(nil, c), gen: l.Generation()}})[0]; err != nil {
		l.mu.Lock()
		delete(l.waiters, seq)
		l.mu.Unlock()
		if ctx.Err() != nil {
			return kvstate.Result{}, ctx.Err()
		}
		if !errors.Is(err, errFenced) {
			l.setDegraded(err)
		}
		// Fenced (the log's generation changed) or Redis unreachable: kept here until it can be published.
		return l.appendBuffered(c)
	}
	l.setDegraded(nil)
	if o := l.observers.Load(); o != nil && o.Append != nil {
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

// appendBuffered applies a worker change locally and keeps it for publishing when Redis returns
// (degraded mode). Past the bound it is applied but not kept, and its worker is asked to resync once
// Redis is back, so that every replica gets the worker's whole cache again.
func (l *Log) appendBuffered(c kvstate.Change) (kvstate.Result, error) {
	l.localMu.RLock()
	defer l.localMu.RUnlock()
	res, err := l.state.Apply(c)
	if err != nil {
		return res, err
	}
	res.Buffered = true
	worker, hasWorker := changeWorker(c)
	seq := l.seq.Add(1)
	l.mu.Lock()
	_, isHello := c.(kvstate.WorkerUp)
	if len(l.buffer) >= l.opts.MaxBuffered && !isHello { // a hello is small and others cannot do without it
		if hasWorker {
			l.resync[worker] = true
		}
		l.mu.Unlock()
		l.LostChanges.Add(1)
		return res, nil
	}
	l.buffer = append(l.buffer, buffered{outgoing: outgoing{seq: seq, data: kvstate.EncodeEntry(nil, c), gen: l.Generation()}, worker: worker, hasWorker: hasWorker})
	l.unechoed[seq] = true
	if hasWorker {
		l.bufferedBy[worker]++
	}
	l.mu.Unlock()
	select {
	case l.flushKick <- struct{}{}:
	default:
	}
	return res, nil
}

// probe pings Redis with a short timeout, so an outage shows in health within a second whether or
// not changes are flowing (client retries can hold a failing append for several seconds).
func (l *Log) probe(ctx context.Context) {
	kvstate.Every(ctx, 250*time.Millisecond, func(ctx context.Context) {
		pctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		err := l.rdb.Ping(pctx).Err()
		cancel()
		if ctx.Err() == nil {
			l.setDegraded(err)
		}
	})
}

// setDegraded records whether the last exchange with Redis failed.
func (l *Log) setDegraded(err error) {
	if err != nil {
		if !l.degraded.Swap(true) {
			l.opts.Logger.Error("shared log unreachable: routing from local state, buffering worker changes", "err", err)
		}
		return
	}
	if l.degraded.Swap(false) {
		l.reachableSince.Store(time.Now().UnixNano())
		l.opts.Logger.Info("shared log reachable again")
	}
}

// Degraded reports whether Redis was unreachable at the last attempt, or changes still wait to be
// published.
func (l *Log) Degraded() bool {
	if l.degraded.Load() {
		return true
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.buffer) > 0
}

// BufferedChanges returns how many changes wait to be published.
func (l *Log) BufferedChanges() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.buffer)
}

// Buffered returns how many of the worker's changes wait to be published: while it is not zero,
// the worker's latest events are not durable and must not be acked.
func (l *Log) Buffered(key kvstate.WorkerKey) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := l.bufferedBy[key]
	if l.resync[key] {
		n++ // changes past the bound were not kept: nothing is durable until the worker's dump is
	}
	return n
}

// TakeResync reports, once, that the worker must resend its whole cache: some of its changes were
// applied here during an outage but could not be kept for the other replicas. It answers only once
// Redis is reachable and the buffer is empty, so the dump goes through the log.
func (l *Log) TakeResync(key kvstate.WorkerKey) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.resync[key] || len(l.buffer) > 0 || l.degraded.Load() {
		return false
	}
	delete(l.resync, key)
	return true
}

// flushBuffer publishes buffered changes in order, as many as Redis takes; it reports whether the
// buffer is empty.
func (l *Log) flushBuffer(ctx context.Context) bool {
	for {
		l.mu.Lock()
		batch := append([]buffered(nil), l.buffer[:min(len(l.buffer), 256)]...)
		l.mu.Unlock()
		if len(batch) == 0 {
			return true
		}
		entries := make([]outgoing, len(batch))
		for i, b := range batch {
			entries[i] = b.outgoing
		}
		// Only a prefix that Redis took leaves the buffer, so that the order is kept.
		errs := l.addEntries(ctx, entries)
		took := 0
		for took < len(errs) && errs[took] == nil {
			took++
		}
		l.mu.Lock()
		if len(l.buffer) == 0 || l.buffer[0].seq != batch[0].seq {
			// A generation change replaced the buffer meanwhile.
			l.mu.Unlock()
			continue
		}
		l.buffer = l.buffer[took:]
		for _, b := range batch[:took] {
			if b.hasWorker {
				if l.bufferedBy[b.worker]--; l.bufferedBy[b.worker] <= 0 {
					delete(l.bufferedBy, b.worker)
				}
			}
		}
		empty := len(l.buffer) == 0
		l.mu.Unlock()
		if took < len(batch) {
			if err := errs[took]; !errors.Is(err, errFenced) {
				l.setDegraded(err)
			}
			return false
		}
		if empty {
			l.setDegraded(nil)
			l.opts.Logger.Info("published the changes buffered during the outage")
			return true
		}
	}
}

// appendBookingEnd applies a PrefillDone or Freed. When this replica holds the booking it applies at
// once and is published like a booking. When it does not, the booking may have been made on another
// replica moments ago and still be on its way: the replica catches up with the stream as it is now,
// waits up to BookingArrivalWait for the booking, and catches up once more. A request that is still
// unknown is ErrUnknownRequest, as in the embedded log, and nothing is appended: a request id that
// was never booked never reaches the shared stream. While Redis is unreachable the replica cannot
// tell, and says so (kvstate.ErrLogUnavailable: the caller may retry, or ask another replica).
func (l *Log) appendBookingEnd(ctx context.Context, c kvstate.Change) (kvstate.Result, error) {
	res, err := l.appendLocalFirst(c)
	if !errors.Is(err, kvstate.ErrUnknownRequest) {
		return res, err
	}
	deadline := time.Now().Add(l.opts.BookingArrivalWait)
	for round := 0; ; round++ {
		if l.degraded.Load() {
			return kvstate.Result{}, fmt.Errorf("%w: not booked on this replica, and the shared log is unreachable, so another replica may hold the booking; retry", kvstate.ErrLogUnavailable)
		}
		if err := l.catchUpWithTip(ctx); err != nil {
			return kvstate.Result{}, err
		}
		if res, err = l.appendLocalFirst(c); !errors.Is(err, kvstate.ErrUnknownRequest) || round == 1 {
			return res, err
		}
		// Not in the stream yet: watch what this replica applies until the wait is over.
		for time.Now().Before(deadline) {
			if err := l.waitApplied(ctx, deadline); err != nil {
				return kvstate.Result{}, err
			}
			if res, err = l.appendLocalFirst(c); !errors.Is(err, kvstate.ErrUnknownRequest) {
				return res, err
			}
		}
	}
}

// streamTip returns the id of the stream's last entry ("0-0" when it is empty), without its data.
var streamTip = redis.NewScript(`
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last == 0 then return '0-0' end
return last[1][1]
`)

// catchUpWithTip waits until this replica has applied every entry the stream holds now.
func (l *Log) catchUpWithTip(ctx context.Context) error {
	tip, err := streamTip.Run(ctx, l.rdb, []string{l.opts.Stream()}).Text()
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		l.setDegraded(err)
		return fmt.Errorf("%w: %v", kvstate.ErrLogUnavailable, err)
	}
	deadline := time.Now().Add(catchUpTimeout)
	for compareStreamIDs(l.LastID(), tip) < 0 {
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: this replica did not apply the stream up to %s within %v", kvstate.ErrLogUnavailable, tip, catchUpTimeout)
		}
		if err := l.waitApplied(ctx, deadline); err != nil {
			return err
		}
	}
	return nil
}

// catchUpTimeout bounds how long a call waits for this replica's tailer to reach the stream's tip.
const catchUpTimeout = 5 * time.Second

// waitApplied returns once the tailer applies more entries, at the deadline (zero: none), or with
// ctx's error.
func (l *Log) waitApplied(ctx context.Context, deadline time.Time) error {
	l.appliedMu.Lock()
	if l.appliedCh == nil {
		l.appliedCh = make(chan struct{})
	}
	ch := l.appliedCh
	l.appliedMu.Unlock()
	var timeout <-chan time.Time
	if !deadline.IsZero() {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		timeout = t.C
	}
	select {
	case <-ch:
	case <-timeout:
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
}

// notifyApplied wakes waitApplied callers.
func (l *Log) notifyApplied() {
	l.appliedMu.Lock()
	if l.appliedCh != nil {
		close(l.appliedCh)
		l.appliedCh = nil
	}
	l.appliedMu.Unlock()
}

// appendLocalFirst applies a booking change at once and queues it for publishing. A change that
// fails to apply (ErrUnknownRequest for a request this replica does not hold) is not published.
func (l *Log) appendLocalFirst(c kvstate.Change) (kvstate.Result, error) {
	l.localMu.RLock()
	defer l.localMu.RUnlock()
	res, err := l.state.Apply(c)
	if err != nil {
		return res, err
	}
	seq := l.seq.Add(1)
	l.mu.Lock()
	l.unechoed[seq] = true
	l.mu.Unlock()
	select {
	case l.outbox <- outgoing{seq: seq, data: kvstate.EncodeEntry(nil, c), gen: l.Generation()}:
	default:
		// A long outage filled the outbox. Routing must not wait on Redis: the change stays local
		// (other replicas miss this booking's load until it is freed or expires), and it is counted.
		l.mu.Lock()
		delete(l.unechoed, seq)
		l.mu.Unlock()
		if l.LostChanges.Add(1) == 1 {
			l.opts.Logger.Error("the booking outbox is full: bookings stay local to this replica until Redis returns")
		}
	}
	return res, nil
}

// Run joins the log's generation (loading its snapshot), then tails the stream and publishes queued
// booking changes until ctx ends. Between reads it writes snapshots when its turn comes, reloads the
// snapshot if the stream was trimmed past what it applied, and follows the log's generation.
func (l *Log) Run(ctx context.Context) error {
	// The publisher and the probe are Run's: it returns once they have.
	var helpers sync.WaitGroup
	defer helpers.Wait()
	helpers.Go(func() { l.publish(ctx) })
	helpers.Go(func() { l.probe(ctx) })
	l.lastSnapshot = time.Now()
	for ctx.Err() == nil {
		err := l.joinGeneration(ctx)
		if err == nil {
			break
		}
		if errors.Is(err, kvstate.ErrNewerVersion) {
			l.stall(l.opts.SnapshotKey(), err)
		}
		l.opts.Logger.Warn("joining the shared log failed; retrying", "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
	lastCheck, full, check := time.Now(), false, false
	var lastWarn time.Time
	for ctx.Err() == nil {
		select {
		case <-l.genKick:
			check = true
		default:
		}
		// Before reading on: when the last batch was full this replica may be far behind, and the
		// entries it needs next may have been trimmed; otherwise check once a second. The
		// generation is checked as often, and at once when an append was fenced or an entry of
		// another generation turned up.
		if check || full || time.Since(lastCheck) >= time.Second {
			lastCheck, check = time.Now(), false
			if err := l.checkGeneration(ctx); err != nil && ctx.Err() == nil && time.Since(lastWarn) > 5*time.Second {
				lastWarn = time.Now() // it is retried every 100 ms while the generation is lost
				l.opts.Logger.Warn("checking the shared log's generation failed", "err", err)
			}
			if err := l.catchUp(ctx); err != nil && ctx.Err() == nil {
				l.opts.Logger.Warn("checking the log's trim point failed", "err", err)
			}
		}
		if l.genLost.Load() {
			// Nothing of this stream is ours until the generation is sorted out.
			select {
			case <-ctx.Done():
			case <-l.genKick:
				check = true
			case <-time.After(100 * time.Millisecond):
				check = true
			}
			continue
		}
		if l.stalled.Load() {
			// Stopped before an entry of a newer version: read it again now and then (the log
			// may be rewritten by a reseed), but apply nothing after it.
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
		l.maybeSnapshot(ctx)
		streams, err := l.rdb.XRead(ctx, &redis.XReadArgs{
			Streams: []string{l.opts.Stream(), l.LastID()},
			Count:   l.opts.ReadCount,
			Block:   l.opts.ReadBlock,
		}).Result()
		switch {
		case errors.Is(err, redis.Nil):
			full = false
			l.markReady()
			continue
		case err != nil:
			if ctx.Err() != nil {
				return nil
			}
			l.setDegraded(err)
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		n := 0
	apply:
		for _, st := range streams {
			for _, msg := range st.Messages {
				if !l.applyMessage(msg) {
					check = true // an entry of another generation: stop here and find out
					break apply
				}
				n++
			}
		}
		l.notifyApplied()
		full = n == int(l.opts.ReadCount)
		if !full && !check {
			l.markReady()
		}
	}
	return nil
}

// catchUp reloads the snapshot when the stream no longer holds the entries after what this replica
// applied (they were trimmed behind a newer snapshot).
func (l *Log) catchUp(ctx context.Context) error {
	if n, err := l.rdb.XLen(ctx, l.opts.Stream()).Result(); err == nil {
		l.streamLen.Store(n)
	}
	last := l.LastID()
	first, err := l.rdb.XRangeN(ctx, l.opts.Stream(), "-", "+", 1).Result()
	if err != nil {
		return err
	}
	if len(first) == 0 || compareStreamIDs(first[0].ID, last) <= 0 {
		return nil // the stream still holds everything after last
	}
	// Entries between last and first may have been trimmed; the snapshot covers them.
	data, err := l.rdb.Get(ctx, l.opts.SnapshotKey()).Bytes()
	if errors.Is(err, redis.Nil) {
		return nil // no snapshot: the stream was never trimmed
	}
	if err != nil {
		return err
	}
	h, err := kvstate.ReadSnapshotHeader(data)
	if err != nil {
		return err
	}
	if g := l.Generation(); h.Generation != g && !(h.Generation == "" && strings.HasSuffix(g, "/"+genAdopted)) {
		l.kickGeneration() // another generation's snapshot: the generation check sorts it out
		return nil
	}
	if compareStreamIDs(h.Position, last) <= 0 {
		return nil // the snapshot is not ahead of us: nothing was trimmed that we miss
	}
	start := time.Now()
	l.localMu.Lock()
	h, err = l.state.Restore(data)
	if err == nil {
		// The snapshot may cover entries this replica appended and still waits for: they will not
		// come back through the stream. Their appenders retry (a worker replays, duplicates drop).
		// And the restore replaced what this replica had applied locally first: its entries that
		// come back after the snapshot's position must be applied, not skipped, and those before it
		// never come back.
		l.mu.Lock()
		for seq, w := range l.waiters {
			w <- appliedEntry{err: fmt.Errorf("%w: this replica fell behind and reloaded the snapshot; retry", kvstate.ErrLogUnavailable)}
			delete(l.waiters, seq)
		}
		clear(l.unechoed)
		l.mu.Unlock()
		l.lastID.Store(h.Position)
		l.lastEntry.Store(h.Entry)
	}
	l.localMu.Unlock()
	if err != nil {
		return err
	}
	l.notifyApplied()
	l.SnapshotBytes.Store(int64(len(data)))
	l.SnapshotWritten.Store(time.Now().UnixNano())
	l.SnapshotLoads.Add(1)
	l.opts.Logger.Info("loaded the log snapshot", "position", h.Position, "bytes", len(data), "took", time.Since(start))
	return nil
}

// maybeSnapshot writes a snapshot when enough has been applied since the last one and this replica
// wins the lease. It runs on the tailer goroutine, so the state is at exactly LastID while it
// encodes; local bookings are held off meanwhile, and it writes only when none is in flight, so the
// snapshot holds exactly the log up to LastID.
func (l *Log) maybeSnapshot(ctx context.Context) {
	if l.sinceSnapshot < l.opts.SnapshotEvery && time.Since(l.lastSnapshot) < l.opts.SnapshotInterval {
		return
	}
	if l.Pending() > 0 {
		return // try again after the next read, once this replica's bookings are back
	}
	ttl := (l.opts.SnapshotInterval + time.Minute).Milliseconds()
	held, err := takeLease.Run(ctx, l.rdb, []string{l.opts.SnapshotLeaseKey()}, l.opts.Replica, ttl).Int()
	if err != nil || held != 1 {
		l.sinceSnapshot, l.lastSnapshot = 0, time.Now() // another replica writes snapshots
		return
	}
	prev, err := l.rdb.Get(ctx, l.opts.SnapshotPositionKey()).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		l.opts.Logger.Warn("reading the snapshot position failed", "err", err)
		return
	}
	start := time.Now()
	l.localMu.Lock()
	if l.Pending() > 0 {
		l.localMu.Unlock()
		return
	}
	pos, g := l.LastID(), l.Generation()
	data := l.state.EncodeSnapshot(nil, kvstate.SnapshotHeader{Position: pos, Generation: g, Entry: l.lastEntry.Load()})
	l.localMu.Unlock()
	// One script writes the snapshot and its position, then keeps one snapshot period of history
	// for replicas slightly behind, trimming what is older than the previous snapshot; all only while
	// the log is still this replica's generation.
	keys := []string{l.opts.GenerationKey(), l.opts.SnapshotKey(), l.opts.SnapshotPositionKey(), l.opts.Stream()}
	written, err := fencedSnapshot.Run(ctx, l.rdb, keys, g, data, pos, prev).Int()
	if err != nil {
		l.opts.Logger.Warn("writing the log snapshot failed", "err", err)
		return
	}
	if written != 1 {
		l.kickGeneration()
		return
	}
	l.sinceSnapshot, l.lastSnapshot = 0, time.Now()
	l.SnapshotBytes.Store(int64(len(data)))
	l.SnapshotWritten.Store(time.Now().UnixNano())
	l.opts.Logger.Info("wrote the log snapshot", "position", pos, "bytes", len(data), "took", time.Since(start))
}

// compareStreamIDs orders two Redis stream ids ("ms-seq").
func compareStreamIDs(a, b string) int {
	am, as := splitStreamID(a)
	bm, bs := splitStreamID(b)
	switch {
	case am != bm:
		if am < bm {
			return -1
		}
		return 1
	case as < bs:
		return -1
	case as > bs:
		return 1
	}
	return 0
}

func splitStreamID(id string) (ms, seq uint64) {
	m, s, _ := strings.Cut(id, "-")
	ms, _ = strconv.ParseUint(m, 10, 64)
	seq, _ = strconv.ParseUint(s, 10, 64)
	return ms, seq
}

// publish sends queued booking changes, pipelining whatever has accumulated.
func (l *Log) publish(ctx context.Context) {
	retry := time.NewTicker(200 * time.Millisecond)
	defer retry.Stop()
	for {
		var batch []outgoing
		select {
		case <-ctx.Done():
			return
		case <-l.flushKick:
		case <-retry.C:
		case o := <-l.outbox:
			batch = append(batch, o)
		}
		// Worker changes buffered during an outage go first, in order.
		if !l.flushBuffer(ctx) && len(batch) == 0 {
			continue
		}
		if len(batch) == 0 {
			continue
		}
	drain:
		for len(batch) < 256 {
			select {
			case o := <-l.outbox:
				batch = append(batch, o)
			default:
				break drain
			}
		}
		for len(batch) > 0 {
			errs := l.addEntries(ctx, batch)
			var failed []outgoing
			var lastErr error
			for i, err := range errs {
				if err != nil {
					failed, lastErr = append(failed, batch[i]), err
				}
			}
			batch = failed
			if ctx.Err() != nil {
				return
			}
			if !errors.Is(lastErr, errFenced) {
				l.setDegraded(lastErr) // nil when all went through
			}
			if len(batch) == 0 {
				break
			}
			// Redis unreachable, or the log's generation is being sorted out: retry, keeping the order.
			select {
			case <-ctx.Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
}

// applyMessage applies one stream entry and wakes its appender, if it is this replica's. It applies
// nothing, and reports false, for an entry of another generation than this replica's (entries
// written before generations existed carry none, and are applied).
func (l *Log) applyMessage(msg redis.XMessage) bool {
	if g, ok := msg.Values[fieldGeneration].(string); ok && g != l.Generation() {
		return false
	}
	data, _ := msg.Values[fieldEntry].(string)
	if err := kvstate.CheckEntryVersion([]byte(data)); err != nil {
		// A newer release wrote it. Skipping it would diverge from the replicas that apply it:
		// stop here, before it, until this replica is upgraded.
		l.stall(msg.ID, err)
		return false
	}
	if v, ok := msg.Values[fieldNumber].(string); ok {
		n, _ := strconv.ParseUint(v, 10, 64)
		if n <= l.lastEntry.Load() {
			// The log lost its last entries (and this replica had applied them) and numbers anew.
			l.rewound.Store(true)
			return false
		}
		l.lastEntry.Store(n)
	}
	weight := uint64(1) // toward the next snapshot: one per change, one per block of KV events
	defer func() {
		l.lastID.Store(msg.ID)
		l.position.Add(1)
		l.sinceSnapshot += weight
		if o := l.observers.Load(); o != nil && o.Apply != nil {
			if ms, _ := splitStreamID(msg.ID); ms > 0 {
				o.Apply(time.Since(time.UnixMilli(int64(ms))))
			}
		}
	}()
	own := msg.Values[fieldReplica] == l.opts.Replica
	var seq uint64
	if own {
		seq, _ = strconv.ParseUint(fmt.Sprint(msg.Values[fieldSeq]), 10, 64)
		l.mu.Lock()
		appliedLocally := l.unechoed[seq]
		delete(l.unechoed, seq)
		l.mu.Unlock()
		if appliedLocally {
			return true // applied when it was appended
		}
	}
	changes, err := kvstate.DecodeEntry([]byte(data))
	var out appliedEntry
	if err != nil {
		l.opts.Logger.Error("skipping an undecodable log entry", "id", msg.ID, "err", err)
		out.err = err
	}
	for _, c := range changes {
		out.res, out.err = l.state.ApplyReplicated(c)
		weight += changeWeight(c)
	}
	if own {
		l.mu.Lock()
		w := l.waiters[seq]
		delete(l.waiters, seq)
		l.mu.Unlock()
		if w != nil {
			w <- out
		}
	}
	return true
}
