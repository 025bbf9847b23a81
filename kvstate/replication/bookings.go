package replication

// Bookings: applied locally first (routing never waits on Redis) and published in the background;
// ending a booking made elsewhere waits for it to arrive.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

// appendBookingEnd applies a PrefillDone or Freed. When this replica holds the booking it applies at
// once and is published like a booking. When it does not, the booking may have been made on another
// replica moments ago and still be on its way, or be held by a replica that has not been able to
// publish it (watermark.go): the replica reads Redis's clock, waits until every other replica has
// published what it applied before then, catches up with the stream, and looks again. A request
// that is still unknown is ErrUnknownRequest, as in the embedded log, and nothing is appended: a
// request id that was never booked never reaches the shared stream. When the replica cannot tell
// (Redis unreachable, its state incomplete, or a replica that may hold the booking has not
// published for a while) it says so: kvstate.ErrLogUnavailable, for the caller to retry, here or
// on another replica.
func (l *Log) appendBookingEnd(ctx context.Context, c kvstate.Change) (kvstate.Result, error) {
	res, err := l.appendLocalFirst(c)
	if !errors.Is(err, kvstate.ErrUnknownRequest) {
		return res, err
	}
	if l.degraded.Load() {
		return kvstate.Result{}, fmt.Errorf("%w: not booked on this replica, and the shared log is unreachable, so another replica may hold the booking; retry", kvstate.ErrLogUnavailable)
	}
	since, tip, err := l.clock(ctx)
	if err != nil {
		return kvstate.Result{}, l.unreachable(ctx, err)
	}
	deadline := time.Now().Add(l.opts.WatermarkWait)
	for {
		if err := l.catchUpTo(ctx, tip); err != nil {
			return kvstate.Result{}, err
		}
		if res, err = l.appendLocalFirst(c); !errors.Is(err, kvstate.ErrUnknownRequest) {
			return res, err
		}
		var now int64
		var marks map[string]string
		now, tip, marks, err = l.watermarks(ctx)
		if err != nil {
			return kvstate.Result{}, l.unreachable(ctx, err)
		}
		behind := l.behind(since, now, marks)
		if behind == nil {
			// Every replica has published what it applied before the call: once this replica
			// has read that far, a booking it does not hold does not exist, unless the shared
			// state itself may be incomplete (the log was lost, and a replica holding what it
			// held may still reseed it).
			if err := l.catchUpTo(ctx, tip); err != nil {
				return kvstate.Result{}, err
			}
			res, err = l.appendLocalFirst(c)
			switch {
			case !errors.Is(err, kvstate.ErrUnknownRequest):
			case l.Incomplete():
				return kvstate.Result{}, fmt.Errorf("%w: not booked on this replica, whose shared state may be incomplete (the shared log was lost and is being re-established, or may still be), so the booking may exist; retry", kvstate.ErrLogUnavailable)
			case l.justReseeded(now):
				return kvstate.Result{}, fmt.Errorf("%w: not booked on this replica, and the shared log was reseeded moments ago (Redis lost its data): a replica holding the booking may not have rejoined it yet; retry", kvstate.ErrLogUnavailable)
			}
			return res, err
		}
		if time.Now().After(deadline) {
			return kvstate.Result{}, fmt.Errorf("%w: not booked on this replica, and %v: it may hold the booking; retry", kvstate.ErrLogUnavailable, behind)
		}
		if err := l.waitApplied(ctx, time.Now().Add(l.opts.WatermarkInterval/2)); err != nil {
			return kvstate.Result{}, err
		}
	}
}

// resolveUncertain returns at once unless an append's outcome is unknown (uncertain); then it
// reads the stream's tip and waits until this replica has applied the stream up to it: each of its
// own entries read meanwhile is confirmed (no longer queued), so what is still queued was not
// appended. An error when the stream cannot be read yet (retry later).
func (l *Log) resolveUncertain(ctx context.Context) error {
	if !l.uncertain.Load() {
		return nil
	}
	head, err := l.store.Head(ctx)
	if err != nil {
		return err
	}
	if err := l.catchUpTo(ctx, head.Last); err != nil {
		return err
	}
	l.uncertain.Store(false)
	return nil
}

// stillQueued returns the entries of batch that are still to be appended: not confirmed by this
// replica reading them back from the stream (resolveUncertain).
func (l *Log) stillQueued(batch []outgoing) []outgoing {
	l.mu.Lock()
	defer l.mu.Unlock()
	kept := batch[:0]
	for _, o := range batch {
		if _, ok := l.queued[o.seq]; ok {
			kept = append(kept, o)
		}
	}
	return kept
}

// justReseeded reports whether the log this replica follows was reseeded less than rejoinTimeout
// before now (Redis microseconds). Redis lost every replica's watermark with its data, and a
// replica that has not rejoined yet writes none: one that never saw it (started since) cannot know
// it may hold a booking not published yet. Those that rejoin write theirs again within moments.
func (l *Log) justReseeded(now int64) bool {
	kind, created := generationKind(l.Generation())
	return kind == genSeeded && !created.IsZero() && now/1000-created.UnixMilli() < rejoinTimeout.Milliseconds()
}

// unreachable is the error of a call that could not ask Redis.
func (l *Log) unreachable(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return fmt.Errorf("%w: %v", kvstate.ErrLogUnavailable, err)
}

// catchUpTo waits until this replica has applied the stream up to the entry tip.
func (l *Log) catchUpTo(ctx context.Context, tip string) error {
	deadline := time.Now().Add(catchUpTimeout)
	for logstore.ComparePositions(l.LastID(), tip) < 0 {
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
	case l.outbox <- l.outgoingOf(seq, data, c):
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
			if err := l.resolveUncertain(ctx); err != nil {
				select {
				case <-ctx.Done():
					return
				case <-time.After(100 * time.Millisecond):
				}
				continue
			}
			batch = l.stillQueued(batch)
			if len(batch) == 0 {
				break
			}
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
