package replication

// The booking index: a replica that does not serve a model (ShardsOptions.Models) holds no state of
// its shard, yet a Free or MarkPrefillComplete for one of its bookings may reach it (a request names
// no model). So a shard's log keeps, beside its stream, the ids of the bookings it holds: a sorted
// set of request ids, score the booking's time in unix milliseconds, changed in the same atomic
// step that appends the entry (so a booking is in the index exactly when its
// entry is in the stream). Such a replica finds the shard whose index names the request and
// appends the end to that shard's stream (endElsewhere), where every replica serving the model
// applies it. Only a log sharded by model keeps one (Options.IndexBookings).

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

// indexOps returns what appending c changes in the booking index.
func indexOps(c kvstate.Change) []logstore.IndexOp {
	switch c := c.(type) {
	case kvstate.Booked:
		return []logstore.IndexOp{{Op: logstore.OpBook, ID: c.Booking.RequestID, Score: c.Booking.At / int64(time.Millisecond)}}
	case kvstate.Freed:
		return []logstore.IndexOp{{Op: logstore.OpFree, ID: c.RequestID}}
	case kvstate.BookingsExpired:
		return []logstore.IndexOp{{Op: logstore.OpExpire, Score: c.Before / int64(time.Millisecond)}}
	}
	return nil
}

// endElsewhere appends c, a PrefillDone or Freed, to the log under prefix (a shard this replica
// does not serve) if its booking index names the request, once every replica of that shard has
// published what it booked before the call. It reports whether it found the booking; ErrLogUnavailable
// when it cannot tell (Redis unreachable, or a replica of the shard behind for WatermarkWait).
func endElsewhere(ctx context.Context, store logstore.LogStore, opts Options, c kvstate.Change) (bool, error) {
	var id string
	switch c := c.(type) {
	case kvstate.PrefillDone:
		id = c.RequestID
	case kvstate.Freed:
		id = c.RequestID
	default:
		return false, fmt.Errorf("replication: endElsewhere(%T)", c)
	}
	var since int64
	deadline := time.Now().Add(opts.WatermarkWait)
	for {
		r, err := store.ReadMarks(ctx, id)
		if err != nil {
			return false, fmt.Errorf("%w: %v", kvstate.ErrLogUnavailable, err)
		}
		if since == 0 {
			since = r.Now // the call's time: every booking made before it is in the stream once
			continue      // every replica's watermark is past it
		}
		var behind error
		for replica, v := range r.Marks {
			m := parseWatermark(v)
			if !m.gone && r.Now-m.at <= opts.ReplicaTimeout.Microseconds() {
				if behind = behindMark(replica, m, since, r.Now); behind != nil {
					break
				}
			}
		}
		if behind == nil {
			if !r.Indexed {
				return false, nil // no booking of this id in the shard
			}
			return true, appendForeign(ctx, store, opts, c)
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
func appendForeign(ctx context.Context, store logstore.LogStore, opts Options, c kvstate.Change) error {
	e := logstore.Entry{Data: kvstate.EncodeEntry(nil, c), Replica: opts.Replica, Seqs: "0", Index: indexOps(c)}
	for attempt := 0; attempt < 3; attempt++ {
		head, err := store.Head(ctx)
		if err != nil {
			return fmt.Errorf("%w: reading the generation of %s: %v", kvstate.ErrLogUnavailable, opts.Prefix, err)
		}
		err = store.Append(ctx, head.Generation, []logstore.Entry{e})[0]
		if !errors.Is(err, logstore.ErrFenced) {
			if err != nil {
				return fmt.Errorf("%w: %v", kvstate.ErrLogUnavailable, err)
			}
			return nil
		}
		// The generation changed between the read and the append (a reseed): read it again.
	}
	return fmt.Errorf("%w: the log of %s keeps changing generation; retry", kvstate.ErrLogUnavailable, opts.Prefix)
}
