package redislog

// The booking index: a replica that does not serve a model (ShardsOptions.Models) holds no state of
// its shard, yet a Free or MarkPrefillComplete for one of its bookings may reach it (a request names
// no model). So a shard's log keeps, beside its stream, the ids of the bookings it holds: a sorted
// set <prefix>:bookings, member the request id, score the booking's time in unix milliseconds,
// changed in the same script that appends the entry (so a booking is in the index exactly when its
// entry is in the stream). Such a replica finds the shard whose index names the request and
// appends the end to that shard's stream (endElsewhere), where every replica serving the model
// applies it. Only a log sharded by model keeps one (Options.IndexBookings).

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
)

// BookingsKey holds the ids of the bookings in the log (Options.IndexBookings).
func (o Options) BookingsKey() string { return o.Prefix + ":bookings" }

// indexOp is one change to the booking index: add (b) a booking at a score, remove (f) one, or
// expire (e) those scored below a cutoff. It travels with its entry to the append script.
type indexOp struct {
	op    byte
	id    string
	score int64
}

// indexOps returns what appending c changes in the booking index.
func indexOps(c kvstate.Change) []indexOp {
	switch c := c.(type) {
	case kvstate.Booked:
		return []indexOp{{op: 'b', id: c.Booking.RequestID, score: c.Booking.At / int64(time.Millisecond)}}
	case kvstate.Freed:
		return []indexOp{{op: 'f', id: c.RequestID}}
	case kvstate.BookingsExpired:
		return []indexOp{{op: 'e', score: c.Before / int64(time.Millisecond)}}
	}
	return nil
}

// indexArgs appends the ops as fencedAdd's trailing arguments: three per op.
func indexArgs(args []any, ops []indexOp) []any {
	for _, o := range ops {
		args = append(args, string(o.op), o.id, strconv.FormatInt(o.score, 10))
	}
	return args
}

// endElsewhere appends c, a PrefillDone or Freed, to the log under prefix (a shard this replica
// does not serve) if its booking index names the request, once every replica of that shard has
// published what it booked before the call. It reports whether it found the booking; ErrLogUnavailable
// when it cannot tell (Redis unreachable, or a replica of the shard behind for WatermarkWait).
func endElsewhere(ctx context.Context, rdb redis.UniversalClient, opts Options, c kvstate.Change) (bool, error) {
	var id string
	switch c := c.(type) {
	case kvstate.PrefillDone:
		id = c.RequestID
	case kvstate.Freed:
		id = c.RequestID
	default:
		return false, fmt.Errorf("redislog: endElsewhere(%T)", c)
	}
	var since int64
	deadline := time.Now().Add(opts.WatermarkWait)
	for {
		r, err := readMarks(ctx, rdb, opts, id)
		if err != nil {
			return false, fmt.Errorf("%w: %v", kvstate.ErrLogUnavailable, err)
		}
		if since == 0 {
			since = r.now // the call's time: every booking made before it is in the stream once
			continue      // every replica's watermark is past it
		}
		var behind error
		for replica, v := range r.marks {
			m := parseWatermark(v)
			if !m.gone && r.now-m.at <= opts.ReplicaTimeout.Microseconds() {
				if behind = behindMark(replica, m, since, r.now); behind != nil {
					break
				}
			}
		}
		if behind == nil {
			if !r.indexed {
				return false, nil // no booking of this id in the shard
			}
			return true, appendForeign(ctx, rdb, opts, c)
		}
		if time.Now().After(deadline) {
			return false, fmt.Errorf("%w: %v: it may hold the booking; retry", kvstate.ErrLogUnavailable, behind)
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-time.After(opts.WatermarkInterval / 2):
		}
	}
}

// appendForeign appends c to the log under opts.Prefix as a replica that does not apply that log:
// fenced by its generation, numbered, with its booking index changes, and sequence number 0 (no
// replica waits for it).
func appendForeign(ctx context.Context, rdb redis.UniversalClient, opts Options, c kvstate.Change) error {
	for attempt := 0; attempt < 3; attempt++ {
		g, err := rdb.Get(ctx, opts.GenerationKey()).Result()
		if err != nil {
			return fmt.Errorf("%w: reading the generation of %s: %v", kvstate.ErrLogUnavailable, opts.Prefix, err)
		}
		args := indexArgs([]any{g, kvstate.EncodeEntry(nil, c), opts.Replica, "0", ""}, indexOps(c))
		err = fencedAdd.Run(ctx, rdb, []string{opts.GenerationKey(), opts.Stream(), opts.SeqKey(), opts.BookingsKey()}, args...).Err()
		if !isFenced(err) {
			if err != nil {
				return fmt.Errorf("%w: %v", kvstate.ErrLogUnavailable, err)
			}
			return nil
		}
		// The generation changed between the read and the append (a reseed): read it again.
	}
	return fmt.Errorf("%w: the log of %s keeps changing generation; retry", kvstate.ErrLogUnavailable, opts.Prefix)
}
