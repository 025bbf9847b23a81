package redislog

// Bookings: applied locally first (routing never waits on Redis) and published in the background;
// ending a booking made elsewhere waits for it to arrive.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
)

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

// appendLocalFirst applies a booking change at once and queues it for publishing. A change that
// fails to apply (ErrUnknownRequest for a request this replica does not hold) is not published.
//
// The apply and the place in the outbox are one step (localOrder), so changes are published in the
// order they applied here: a Free that finds a booking applied a moment before by a Route racing it
// is never published ahead of that booking. Other replicas rely on it: a request's end never
// precedes its booking in the log (kvstate.ApplyReplicated).
func (l *Log) appendLocalFirst(c kvstate.Change) (kvstate.Result, error) {
	data := kvstate.EncodeEntry(nil, c)
	l.localMu.RLock()
	defer l.localMu.RUnlock()
	l.localOrder.Lock()
	defer l.localOrder.Unlock()
	res, err := l.state.Apply(c)
	if err != nil {
		return res, err
	}
	seq := l.seq.Add(1)
	l.mu.Lock()
	l.unechoed[seq] = true
	l.queued[seq] = struct{}{}
	l.mu.Unlock()
	select {
	case l.outbox <- outgoing{seq: seq, data: data, gen: l.Generation()}:
	default:
		// A long outage filled the outbox. Routing must not wait on Redis: the change stays local
		// (other replicas miss this booking's load until it is freed or expires), and it is counted.
		l.mu.Lock()
		delete(l.unechoed, seq)
		delete(l.queued, seq)
		l.mu.Unlock()
		if l.LostChanges.Add(1) == 1 {
			l.opts.Logger.Error("the booking outbox is full: bookings stay local to this replica until Redis returns")
		}
	}
	return res, nil
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
			l.mu.Lock()
			for i, err := range errs {
				if err != nil {
					failed, lastErr = append(failed, batch[i]), err
				} else {
					delete(l.queued, batch[i].seq)
				}
			}
			l.mu.Unlock()
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
