package replication

// Outages: while Redis is unreachable worker changes apply locally and wait in a bounded buffer,
// published in order once it answers again.

import (
	"context"
	"errors"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
)

// buffered is a worker change applied locally while Redis was unreachable, waiting to be published.
type buffered struct {
	outgoing
	worker    kvstate.WorkerKey
	hasWorker bool
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

// appendBuffered applies a worker change locally and keeps it for publishing when Redis returns
// (degraded mode). Past the bound it is applied but not kept, and its worker is asked to resync once
// Redis is back, so that every replica gets the worker's whole cache again.
func (l *Log) appendBuffered(c kvstate.Change) (kvstate.Result, error) {
	l.localMu.RLock()
	defer l.localMu.RUnlock()
	l.localOrder.Lock() // applied, numbered and queued in one step (runWatermarks)
	defer l.localOrder.Unlock()
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
	l.buffer = append(l.buffer, buffered{outgoing: l.outgoingOf(seq, kvstate.EncodeEntry(nil, c), c), worker: worker, hasWorker: hasWorker})
	l.unechoed[seq] = true
	l.queued[seq] = struct{}{}
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

// dropConfirmedLocked removes from the buffer the changes this replica read back from the stream
// (an append that got no reply had put them in: resolveUncertain). The caller holds mu.
func (l *Log) dropConfirmedLocked() {
	kept := l.buffer[:0]
	for _, b := range l.buffer {
		if _, ok := l.queued[b.seq]; ok {
			kept = append(kept, b)
			continue
		}
		if b.hasWorker {
			if l.bufferedBy[b.worker]--; l.bufferedBy[b.worker] <= 0 {
				delete(l.bufferedBy, b.worker)
			}
		}
	}
	clear(l.buffer[len(kept):])
	l.buffer = kept
}

// probe pings Redis with a short timeout, so an outage shows in health within a second whether or
// not changes are flowing (client retries can hold a failing append for several seconds).
func (l *Log) probe(ctx context.Context) {
	kvstate.Every(ctx, 250*time.Millisecond, func(ctx context.Context) {
		pctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		err := l.store.Ping(pctx)
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
		if err := l.resolveUncertain(ctx); err != nil {
			return false
		}
		l.mu.Lock()
		l.dropConfirmedLocked()
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
			delete(l.queued, b.seq)
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
