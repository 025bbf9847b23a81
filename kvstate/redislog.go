package kvstate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
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
	// MaxLen bounds the stream (approximate trimming on append).
	MaxLen int64
	// ReadBlock is how long one tail read blocks waiting for new entries.
	ReadBlock time.Duration
	// ReadCount is the most entries one tail read returns.
	ReadCount int64
	Logger    *slog.Logger
}

// Stream returns the name of the log stream.
func (o RedisOptions) Stream() string { return o.Prefix + ":log" }

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

	mu      sync.Mutex
	waiters map[uint64]chan appliedEntry // own entries awaited by Append
	// unechoed are own entries published in the background and not yet read back from the stream;
	// true if they were applied locally when appended (the tailer then skips them).
	unechoed map[uint64]bool

	outbox chan outgoing // locally applied bookings to publish
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
	l := &RedisLog{
		rdb: rdb, state: state, opts: opts,
		waiters:  make(map[uint64]chan appliedEntry),
		unechoed: make(map[uint64]bool),
		outbox:    make(chan outgoing, 4096),
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
	if err := l.xadd(ctx, seq, EncodeEntry(nil, c)); err != nil {
		l.mu.Lock()
		delete(l.waiters, seq)
		l.mu.Unlock()
		return Result{}, fmt.Errorf("%w: %v", ErrLogUnavailable, err)
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
	args := &redis.XAddArgs{
		Stream: l.opts.Stream(),
		Values: []any{fieldEntry, data, fieldReplica, l.opts.Replica, fieldSeq, strconv.FormatUint(seq, 10)},
	}
	if l.opts.MaxLen > 0 {
		args.MaxLen, args.Approx = l.opts.MaxLen, true
	}
	return l.rdb.XAdd(ctx, args).Err()
}

// Run tails the stream and publishes queued booking changes until ctx ends.
func (l *RedisLog) Run(ctx context.Context) error {
	go l.publish(ctx)
	for ctx.Err() == nil {
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
	}
	return nil
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
					args := &redis.XAddArgs{Stream: l.opts.Stream(),
						Values: []any{fieldEntry, o.data, fieldReplica, l.opts.Replica, fieldSeq, strconv.FormatUint(o.seq, 10)}}
					if l.opts.MaxLen > 0 {
						args.MaxLen, args.Approx = l.opts.MaxLen, true
					}
					p.XAdd(ctx, args)
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
