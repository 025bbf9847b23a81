package kvstate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrLogUnavailable: the change could not be made durable in the shared log (Redis unreachable).
var ErrLogUnavailable = errors.New("shared log unavailable")

// RedisOptions configure a RedisLog.
type RedisOptions struct {
	// Prefix starts every key, hash tag included, e.g. "kvr:{prod}". Every key of a deployment
	// shares the tag, so the layout works unchanged on Redis Cluster.
	Prefix string
	// Replica identifies this process in the log (its own entries carry it).
	Replica string
	// SnapshotEvery is how many applied entries trigger an attempt to write a snapshot (one replica
	// at a time writes, under a lease); SnapshotInterval triggers one after that long regardless.
	// The stream is trimmed behind the previous snapshot, so the Redis memory the log holds stays
	// bounded by about two snapshot periods of changes.
	SnapshotEvery    uint64
	SnapshotInterval time.Duration
	// ReadBlock is how long one tail read blocks waiting for new entries.
	ReadBlock time.Duration
	// ReadCount is the most entries one tail read returns.
	ReadCount int64
	Logger    *slog.Logger
}

// Stream returns the name of the log stream.
func (o RedisOptions) Stream() string { return o.Prefix + ":log" }

// SnapshotKey holds the latest snapshot, which names the stream id it covers.
func (o RedisOptions) SnapshotKey() string { return o.Prefix + ":snapshot" }

// SnapshotLeaseKey says which replica writes the next snapshot.
func (o RedisOptions) SnapshotLeaseKey() string { return o.Prefix + ":snapshot-lease" }

// SnapshotPositionKey holds the stream id the latest snapshot covers (without its bulk).
func (o RedisOptions) SnapshotPositionKey() string { return o.Prefix + ":snapshot-position" }

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

// RedisLog is the Log of a deployment with several replicas: a Redis stream that every replica
// appends to and tails, applying every entry in stream order (DESIGN "Redis mode").
//
// Worker changes are appended, then awaited until this replica's tailer has applied them, so their
// result (and the ack a worker gets) reflects log order, and an ack means the events are durable.
// Booking changes are applied locally at once, since routing never waits on Redis, and published in
// the background; the tailer skips them when they come back. Entries from the log are applied with
// State.ApplyReplicated, which makes the two orders converge.
type RedisLog struct {
	rdb   redis.UniversalClient
	state *State
	opts  RedisOptions

	seq      atomic.Uint64 // this replica's entry numbers
	position atomic.Uint64 // entries applied from the stream
	lastID   atomic.Value  // string: stream id of the last applied entry

	// localMu keeps local-first applies out while a snapshot of the state is encoded.
	localMu sync.RWMutex

	mu      sync.Mutex
	waiters map[uint64]chan appliedEntry // own entries awaited by Append
	// unechoed are own entries published in the background and not yet read back from the stream;
	// true if they were applied locally when appended (the tailer then skips them).
	unechoed map[uint64]bool

	outbox chan outgoing // locally applied bookings to publish

	// Snapshot bookkeeping, owned by the tailer goroutine.
	sinceSnapshot uint64
	lastSnapshot  time.Time

	// Stats for metrics.
	SnapshotBytes   atomic.Int64 // size of the last snapshot written or loaded
	SnapshotWritten atomic.Int64 // unix nanoseconds of the last snapshot this replica wrote or loaded
	SnapshotLoads   atomic.Int64 // snapshots loaded (at start, or after falling behind)
	// OnApply, if set, is called for each applied entry with the time since it was appended.
	OnApply func(lag time.Duration)
	// OnAppend, if set, is called with the time each synchronous append took in Redis.
	OnAppend func(took time.Duration)
}

type appliedEntry struct {
	res Result
	err error
}

type outgoing struct {
	seq  uint64
	data []byte
}

const (
	fieldEntry   = "e"
	fieldReplica = "r"
	fieldSeq     = "s"
)

// NewRedisLog returns a log over rdb applying to state. Call Run to tail the stream; until it runs,
// appends of worker changes wait.
func NewRedisLog(rdb redis.UniversalClient, state *State, opts RedisOptions) *RedisLog {
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
		opts.SnapshotEvery = 100_000
	}
	if opts.SnapshotInterval <= 0 {
		opts.SnapshotInterval = 5 * time.Minute
	}
	l := &RedisLog{
		rdb: rdb, state: state, opts: opts,
		waiters:  make(map[uint64]chan appliedEntry),
		unechoed: make(map[uint64]bool),
		outbox:   make(chan outgoing, 4096),
	}
	l.lastID.Store("0")
	return l
}

// Position returns how many stream entries this replica has applied.
func (l *RedisLog) Position() uint64 { return l.position.Load() }

// Pending returns how many of this replica's changes were published in the background and have not
// yet come back through the stream: while it is 0 and the replica has read the whole stream, it has
// applied exactly what every other caught-up replica has.
func (l *RedisLog) Pending() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.unechoed)
}

// LastID returns the stream id of the last applied entry ("0" before the first).
func (l *RedisLog) LastID() string { return l.lastID.Load().(string) }

// Append makes c durable in the stream. Booking changes apply locally first and publish in the
// background; others return once this replica has applied them from the stream.
func (l *RedisLog) Append(ctx context.Context, c Change) (Result, error) {
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	switch c.(type) {
	case Booked, PrefillDone, Freed:
		return l.appendLocalFirst(c)
	}
	seq := l.seq.Add(1)
	done := make(chan appliedEntry, 1)
	l.mu.Lock()
	l.waiters[seq] = done
	l.mu.Unlock()
	start := time.Now()
	if err := l.xadd(ctx, seq, EncodeEntry(nil, c)); err != nil {
		l.mu.Lock()
		delete(l.waiters, seq)
		l.mu.Unlock()
		return Result{}, fmt.Errorf("%w: %v", ErrLogUnavailable, err)
	}
	if l.OnAppend != nil {
		l.OnAppend(time.Since(start))
	}
	select {
	case a := <-done:
		return a.res, a.err
	case <-ctx.Done():
		// The entry is in the stream and will be applied; only the wait is abandoned.
		l.mu.Lock()
		delete(l.waiters, seq)
		l.mu.Unlock()
		return Result{}, ctx.Err()
	}
}

// appendLocalFirst applies a booking change at once and queues it for publishing. A Free or
// PrefillDone this replica does not know is published without local effect: another replica may
// hold the booking, and the log delivers it everywhere.
func (l *RedisLog) appendLocalFirst(c Change) (Result, error) {
	l.localMu.RLock()
	defer l.localMu.RUnlock()
	seq := l.seq.Add(1)
	res, err := l.state.Apply(c)
	switch {
	case err == nil:
	case errors.Is(err, ErrUnknownRequest):
		// Published, and applied from the stream like any remote change.
	default:
		return res, err
	}
	l.mu.Lock()
	l.unechoed[seq] = err == nil
	l.mu.Unlock()
	select {
	case l.outbox <- outgoing{seq: seq, data: EncodeEntry(nil, c)}:
	default:
		// The outbox is full: publish inline rather than lose the change.
		if xerr := l.xadd(context.Background(), seq, EncodeEntry(nil, c)); xerr != nil {
			l.opts.Logger.Error("publishing a booking change failed; replicas will differ until it expires", "err", xerr)
		}
	}
	return res, nil
}

func (l *RedisLog) xadd(ctx context.Context, seq uint64, data []byte) error {
	return l.rdb.XAdd(ctx, l.xaddArgs(seq, data)).Err()
}

func (l *RedisLog) xaddArgs(seq uint64, data []byte) *redis.XAddArgs {
	return &redis.XAddArgs{
		Stream: l.opts.Stream(),
		Values: []any{fieldEntry, data, fieldReplica, l.opts.Replica, fieldSeq, strconv.FormatUint(seq, 10)},
	}
}

// Run loads the latest snapshot, then tails the stream and publishes queued booking changes until
// ctx ends. Between reads it writes snapshots when its turn comes, and reloads the snapshot if the
// stream was trimmed past what it applied.
func (l *RedisLog) Run(ctx context.Context) error {
	go l.publish(ctx)
	l.lastSnapshot = time.Now()
	for ctx.Err() == nil {
		if err := l.catchUp(ctx); err == nil {
			break
		} else {
			l.opts.Logger.Warn("loading the snapshot failed; retrying", "err", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
	for ctx.Err() == nil {
		l.maybeSnapshot(ctx)
		streams, err := l.rdb.XRead(ctx, &redis.XReadArgs{
			Streams: []string{l.opts.Stream(), l.LastID()},
			Count:   l.opts.ReadCount,
			Block:   l.opts.ReadBlock,
		}).Result()
		switch {
		case errors.Is(err, redis.Nil):
			continue
		case err != nil:
			if ctx.Err() != nil {
				return nil
			}
			l.opts.Logger.Warn("reading the log failed; retrying", "err", err)
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		for _, st := range streams {
			for _, msg := range st.Messages {
				l.applyMessage(msg)
			}
		}
		if len(streams) > 0 && len(streams[0].Messages) == int(l.opts.ReadCount) {
			continue // more is waiting; check the trim point below only when caught up
		}
		if err := l.catchUp(ctx); err != nil && ctx.Err() == nil {
			l.opts.Logger.Warn("checking the log's trim point failed", "err", err)
		}
	}
	return nil
}

// catchUp loads the snapshot when this replica has applied nothing yet or the stream no longer holds
// the entries after what it applied (they were trimmed behind a newer snapshot).
func (l *RedisLog) catchUp(ctx context.Context) error {
	last := l.LastID()
	if last != "0" {
		first, err := l.rdb.XRangeN(ctx, l.opts.Stream(), "-", "+", 1).Result()
		if err != nil {
			return err
		}
		if len(first) == 0 || compareStreamIDs(first[0].ID, last) <= 0 {
			return nil // the stream still holds everything after last
		}
		// Entries between last and first may have been trimmed; the snapshot covers them.
	}
	data, err := l.rdb.Get(ctx, l.opts.SnapshotKey()).Bytes()
	if errors.Is(err, redis.Nil) {
		return nil // no snapshot: the stream was never trimmed
	}
	if err != nil {
		return err
	}
	if last != "0" {
		if pos, ok := snapshotPosition(data); ok && compareStreamIDs(pos, last) <= 0 {
			return nil // the snapshot is not ahead of us: nothing was trimmed that we miss
		}
	}
	start := time.Now()
	l.localMu.Lock()
	pos, err := l.state.Restore(data)
	l.localMu.Unlock()
	if err != nil {
		return err
	}
	l.lastID.Store(pos)
	l.SnapshotBytes.Store(int64(len(data)))
	l.SnapshotLoads.Add(1)
	l.opts.Logger.Info("loaded the log snapshot", "position", pos, "bytes", len(data), "took", time.Since(start))
	return nil
}

// maybeSnapshot writes a snapshot when enough has been applied since the last one and this replica
// wins the lease. It runs on the tailer goroutine, so the state is at exactly LastID while it
// encodes; local bookings are held off meanwhile, and it writes only when none is in flight, so the
// snapshot holds exactly the log up to LastID.
func (l *RedisLog) maybeSnapshot(ctx context.Context) {
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
	pos := l.LastID()
	data := l.state.EncodeSnapshot(nil, pos)
	l.localMu.Unlock()
	if err := l.rdb.Set(ctx, l.opts.SnapshotKey(), data, 0).Err(); err != nil {
		l.opts.Logger.Warn("writing the log snapshot failed", "err", err)
		return
	}
	if err := l.rdb.Set(ctx, l.opts.SnapshotPositionKey(), pos, 0).Err(); err != nil {
		l.opts.Logger.Warn("writing the snapshot position failed", "err", err)
	}
	// Keep one snapshot period of history, for replicas slightly behind: trim what is older than the
	// previous snapshot.
	if prev != "" {
		if err := l.rdb.XTrimMinID(ctx, l.opts.Stream(), prev).Err(); err != nil {
			l.opts.Logger.Warn("trimming the log failed", "err", err)
		}
	}
	l.sinceSnapshot, l.lastSnapshot = 0, time.Now()
	l.SnapshotBytes.Store(int64(len(data)))
	l.SnapshotWritten.Store(time.Now().UnixNano())
	l.opts.Logger.Info("wrote the log snapshot", "position", pos, "bytes", len(data), "took", time.Since(start))
}

// snapshotPosition reads the stream id a snapshot covers without decoding the rest.
func snapshotPosition(data []byte) (string, bool) {
	r := &reader{b: data}
	if r.byte() != SnapshotVersion {
		return "", false
	}
	pos := r.string()
	return pos, r.err == nil
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
func (l *RedisLog) publish(ctx context.Context) {
	for {
		var batch []outgoing
		select {
		case <-ctx.Done():
			return
		case o := <-l.outbox:
			batch = append(batch, o)
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
		for {
			_, err := l.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
				for _, o := range batch {
					p.XAdd(ctx, l.xaddArgs(o.seq, o.data))
				}
				return nil
			})
			if err == nil || ctx.Err() != nil {
				break
			}
			l.opts.Logger.Warn("publishing booking changes failed; retrying", "err", err, "changes", len(batch))
			select {
			case <-ctx.Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
}

// applyMessage applies one stream entry and wakes its appender, if it is this replica's.
func (l *RedisLog) applyMessage(msg redis.XMessage) {
	defer func() {
		l.lastID.Store(msg.ID)
		l.position.Add(1)
		l.sinceSnapshot++
		if l.OnApply != nil {
			if ms, _ := splitStreamID(msg.ID); ms > 0 {
				l.OnApply(time.Since(time.UnixMilli(int64(ms))))
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
			return // applied when it was appended
		}
	}
	data, _ := msg.Values[fieldEntry].(string)
	changes, err := DecodeEntry([]byte(data))
	var out appliedEntry
	if err != nil {
		l.opts.Logger.Error("skipping an undecodable log entry", "id", msg.ID, "err", err)
		out.err = err
	}
	for _, c := range changes {
		out.res, out.err = l.state.ApplyReplicated(c)
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
}
