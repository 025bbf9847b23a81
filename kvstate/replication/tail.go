package replication

// Tailing: every replica reads the stream in order and applies each entry; catching up after a
// trim reloads the snapshot.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

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

// Run joins the log's generation (loading its snapshot), then tails the stream and publishes queued
// booking changes until ctx ends. Between reads it writes snapshots when its turn comes, reloads the
// snapshot if the stream was trimmed past what it applied, and follows the log's generation.
func (l *Log) Run(ctx context.Context) error {
	// The publisher and the probe are Run's: it returns once they have.
	var helpers sync.WaitGroup
	defer helpers.Wait()
	defer l.snapshots.Wait() // a snapshot being written ends with ctx
	helpers.Go(func() { l.publish(ctx) })
	helpers.Go(func() { l.runCommitter(ctx) })
	helpers.Go(func() { l.probe(ctx) })
	helpers.Go(func() { l.runWatermarks(ctx) })
	l.lastSnapshot = time.Now()
	for ctx.Err() == nil {
		// Announced before it joins, so before it can book anything: from then on, a replica
		// that does not hold a booking waits for this one's watermark (watermark.go).
		err := l.announce(ctx)
		if err == nil {
			err = l.joinGeneration(ctx)
		}
		if err == nil {
			break
		}
		retry := 100 * time.Millisecond
		if errors.Is(err, kvstate.ErrNewerVersion) {
			// Said once at ERROR (stall); only an upgrade helps, so look again now and then.
			l.stall("the snapshot of "+l.opts.Prefix, err)
			retry = time.Second
		} else {
			l.opts.Logger.Warn("joining the shared log failed; retrying", "err", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(retry):
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
		block := l.opts.ReadBlock
		select {
		case <-l.ready:
		default:
			// Not caught up yet: read without blocking, so that a replica starting on an idle log
			// is ready as soon as it has read it, not a ReadBlock later.
			block = -1
		}
		records, err := l.store.Read(ctx, l.LastID(), int(l.opts.ReadCount), block)
		switch {
		case err == nil && len(records) == 0:
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
		for _, rec := range records {
			if !l.applyRecord(rec) {
				check = true // an entry of another generation: stop here and find out
				break
			}
			n++
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
	head, err := l.store.Head(ctx)
	if err != nil {
		return err
	}
	l.streamLen.Store(head.Length)
	last := l.LastID()
	if head.First == "" || logstore.ComparePositions(head.First, last) <= 0 {
		return nil // the stream still holds everything after last
	}
	// Entries between last and first may have been trimmed; the snapshot covers them.
	data, err := l.store.ReadSnapshot(ctx)
	if err != nil {
		return err
	}
	if data == nil {
		return nil // no snapshot: the stream was never trimmed
	}
	h, err := kvstate.ReadSnapshotHeader(data)
	if err != nil {
		return err
	}
	if g := l.Generation(); h.Generation != g && !(h.Generation == "" && strings.HasSuffix(g, "/"+genAdopted)) {
		l.kickGeneration() // another generation's snapshot: the generation check sorts it out
		return nil
	}
	if logstore.ComparePositions(h.Position, last) <= 0 {
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
		l.stateReplacedLocked()
		l.mu.Unlock()
		// Counted before the new position is visible: whoever sees this replica caught up sees the load.
		l.SnapshotBytes.Store(int64(len(data)))
		l.SnapshotWritten.Store(time.Now().UnixNano())
		l.SnapshotLoads.Add(1)
		l.lastID.Store(h.Position)
		l.lastEntry.Store(h.Entry)
	}
	l.localMu.Unlock()
	if err != nil {
		return err
	}
	l.notifyApplied()
	l.opts.Logger.Info("loaded the log snapshot", "position", h.Position, "bytes", len(data), "took", time.Since(start))
	return nil
}

// wake hands the result of applying this replica's change seq to its appender, if one waits.
func (l *Log) wake(seq uint64, out appliedEntry) {
	l.mu.Lock()
	w := l.waiters[seq]
	delete(l.waiters, seq)
	l.mu.Unlock()
	if w != nil {
		w <- out
	}
}

// parseSeqs reads an entry's sequence numbers: one, or a comma-separated list for an entry that
// joins several changes. Malformed numbers read as 0, which no change has.
func parseSeqs(s string) []uint64 {
	out := make([]uint64, 0, strings.Count(s, ",")+1)
	for part := range strings.SplitSeq(s, ",") {
		n, _ := strconv.ParseUint(part, 10, 64)
		out = append(out, n)
	}
	return out
}

// applyRecord applies one entry of the log and wakes its appender, if it is this replica's. It applies
// nothing, and reports false, for an entry of another generation than this replica's (entries
// written before generations existed carry none, and are applied).
func (l *Log) applyRecord(msg logstore.Record) bool {
	if msg.HasGeneration && msg.Generation != l.Generation() {
		return false
	}
	data := msg.Data
	if err := kvstate.CheckEntryVersion(data); err != nil {
		// A newer release wrote it. Skipping it would diverge from the replicas that apply it:
		// stop here, before it, until this replica is upgraded.
		l.stall(msg.ID, err)
		return false
	}
	if msg.HasNumber {
		if msg.Number <= l.lastEntry.Load() {
			// The log lost its last entries (and this replica had applied them) and numbers anew.
			l.rewound.Store(true)
			return false
		}
		l.lastEntry.Store(msg.Number)
	}
	weight := uint64(1) // toward the next snapshot: one per change, one per block of KV events
	defer func() {
		l.lastID.Store(msg.ID)
		l.position.Add(1)
		l.sinceSnapshot += weight
		if o := l.observers.Load(); o != nil && o.Apply != nil {
			if ms, _ := logstore.SplitPosition(msg.ID); ms > 0 {
				o.Apply(time.Since(time.UnixMilli(int64(ms))))
			}
		}
	}()
	// An entry of this replica's lists the sequence numbers of its changes: a change applied
	// locally when it was appended is skipped, and the appender of each other one is woken with
	// its result.
	var seqs []uint64
	var local []bool
	if msg.Replica == l.opts.Replica {
		seqs = parseSeqs(msg.Seqs)
		local = make([]bool, len(seqs))
		allLocal := len(seqs) > 0
		l.mu.Lock()
		for i, seq := range seqs {
			local[i] = l.unechoed[seq]
			delete(l.unechoed, seq)
			delete(l.queued, seq) // appended, whatever its appender was told (resolveUncertain)
			allLocal = allLocal && local[i]
		}
		l.mu.Unlock()
		if allLocal {
			return true // applied when it was appended
		}
	}
	if tp := msg.TraceParent; tp != "" {
		if o := l.observers.Load(); o != nil && o.ApplyTraced != nil {
			defer o.ApplyTraced(tp, msg.ID)()
		}
	}
	changes, err := kvstate.DecodeEntry(data)
	if err != nil {
		l.opts.Logger.Error("skipping an undecodable log entry", "id", msg.ID, "err", err)
		for _, seq := range seqs {
			l.wake(seq, appliedEntry{err: err})
		}
		return true
	}
	for i, c := range changes {
		weight += changeWeight(c)
		if i < len(local) && local[i] {
			continue
		}
		var out appliedEntry
		out.res, out.err = l.state.ApplyReplicated(c)
		if i < len(seqs) {
			l.wake(seqs[i], out)
		}
	}
	return true
}
