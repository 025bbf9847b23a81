package replication

// Snapshots: one replica at a time, under a lease, writes the state and trims the log behind the
// previous snapshot.

import (
	"context"
	"errors"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

const (
	// snapshotQuietWait is how long a due snapshot waits for a moment when none of this replica's
	// bookings is in flight. Under steady booking traffic that moment may never come; then the
	// replica holds new bookings off and reads the stream until its own are back (drainOwn).
	snapshotQuietWait = time.Second
	// drainTimeout bounds how long bookings are held off for that.
	drainTimeout = time.Second
)

// maybeSnapshot starts writing a snapshot when enough has been applied since the last one and this
// replica wins the lease. It runs on the tailer goroutine, so the state is at exactly LastID while
// it is frozen; local bookings are held off only for the copy (State.Freeze), and it freezes only
// when none of this replica's bookings is in flight, so the snapshot holds exactly the log up to
// LastID. Encoding and writing run on a goroutine of their own: the tailer goes on reading.
func (l *Log) maybeSnapshot(ctx context.Context) {
	if l.writing.Load() {
		return
	}
	if !l.snapshotFailed.Load() && l.sinceSnapshot < l.opts.SnapshotEvery && time.Since(l.lastSnapshot) < l.opts.SnapshotInterval {
		l.dueSince = time.Time{}
		return
	}
	if l.dueSince.IsZero() {
		l.dueSince = time.Now()
	}
	if l.Pending() > 0 && time.Since(l.dueSince) < snapshotQuietWait {
		return // try again after the next read, once this replica's bookings are back
	}
	held, err := l.store.TakeLease(ctx, snapshotLease, l.opts.Replica, l.opts.SnapshotInterval+time.Minute)
	if err != nil || !held {
		l.sinceSnapshot, l.lastSnapshot, l.dueSince = 0, time.Now(), time.Time{} // another replica writes snapshots
		l.snapshotFailed.Store(false)
		return
	}
	prev, err := l.store.SnapshotPosition(ctx)
	if err != nil {
		l.opts.Logger.Warn("reading the snapshot position failed", "err", err)
		return
	}
	start := time.Now()
	l.localMu.Lock()
	if !l.drainOwn(ctx) {
		l.localMu.Unlock()
		return
	}
	pos, g := l.LastID(), l.Generation()
	frozen := l.state.Freeze(kvstate.SnapshotHeader{Position: pos, Generation: g, Entry: l.lastEntry.Load()})
	l.localMu.Unlock()
	froze := time.Since(start)
	l.sinceSnapshot, l.lastSnapshot, l.dueSince = 0, time.Now(), time.Time{}
	l.snapshotFailed.Store(false)
	l.writing.Store(true)
	l.snapshots.Go(func() {
		defer l.writing.Store(false)
		if err := l.writeSnapshot(ctx, frozen, pos, g, prev, start, froze); err != nil {
			l.snapshotFailed.Store(true)
			if ctx.Err() == nil {
				l.opts.Logger.Warn("writing the log snapshot failed; trying again after the next read", "err", err)
			}
		}
	})
}

// drainOwn reads and applies the stream until none of this replica's changes is in flight, for at
// most drainTimeout; it reports whether it got there. The caller holds localMu, so no new booking
// is applied meanwhile; those in flight are still published and come back.
//
// Unlike the tailer it cannot reload a snapshot (that takes localMu), so it gives up when the entries
// after what it applied may have been trimmed: it checks after each read that the stream still
// starts at or before the position the read started from, so the batch has no gap.
func (l *Log) drainOwn(ctx context.Context) bool {
	deadline := time.Now().Add(drainTimeout)
	for l.Pending() > 0 {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		last := l.LastID()
		records, err := l.store.Read(ctx, last, int(l.opts.ReadCount), 10*time.Millisecond)
		if err != nil {
			return false
		}
		if len(records) == 0 {
			continue
		}
		head, err := l.store.Head(ctx)
		if err != nil || head.First == "" || logstore.ComparePositions(head.First, last) > 0 {
			return false // trimmed past us, perhaps before the read: the tailer reloads
		}
		for _, rec := range records {
			if !l.applyRecord(rec) {
				l.notifyApplied()
				return false // another generation's entry: the tailer sorts it out
			}
		}
		l.notifyApplied()
	}
	return true
}

// writeSnapshot encodes the frozen state and commits it, trimming the log behind prev (the
// position of the snapshot it replaces).
func (l *Log) writeSnapshot(ctx context.Context, frozen *kvstate.FrozenState, pos, g, prev string, start time.Time, froze time.Duration) error {
	data := frozen.Encode(nil)
	encoded := time.Since(start)
	err := l.store.WriteSnapshot(ctx, logstore.Snapshot{Generation: g, Data: data, Position: pos, TrimBefore: prev})
	if errors.Is(err, logstore.ErrFenced) {
		l.kickGeneration()
		return nil // the generation is another's
	}
	if err != nil {
		return err
	}
	l.SnapshotBytes.Store(int64(len(data)))
	l.SnapshotWritten.Store(time.Now().UnixNano())
	l.SnapshotWrites.Add(1)
	l.opts.Logger.Info("wrote the log snapshot", "position", pos, "bytes", len(data),
		"froze", froze, "encoded", encoded-froze, "took", time.Since(start))
	return nil
}
