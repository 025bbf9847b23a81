package replication

// Watermarks: how a replica that does not hold a booking tells "no replica holds it" (NOT_FOUND)
// from "a replica may hold it and not have published it yet" (UNAVAILABLE, retry).
//
// A replica applies its own bookings (and, during an outage, its worker changes) at once and
// publishes them in the background. A Free sent to another replica for a booking made a moment ago,
// or made by a replica that is cut off from Redis, finds nothing in the stream. So every replica
// writes a watermark: in the log's store, its entry holds a time T (the store's clock, microseconds)
// such that everything it applied locally before T is in the stream. A replica that finds no
// booking for a Free reads Redis's clock (T_f) first; a booking made anywhere before the Free was
// sent was applied before T_f; once every other replica's watermark is past T_f (strictly: its clock reading came after) and this
// replica has read the stream up to the tip it read after those watermarks, a booking it still does
// not hold does not exist. A replica whose watermark stays behind (unreachable, paused, stuck)
// makes the answer UNAVAILABLE, for as long as it stays behind and at most ReplicaTimeout: a replica
// silent for longer is taken for dead (a booking it made before is past the booking expiry when it
// arrives, and the first housekeeper to see it expires it).

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// A replica's watermark value is the watermark in unix microseconds of the store's clock; "new
// <µs>" for a replica that joined at that time and promises nothing yet; "gone <µs>" for one that
// stopped cleanly at that time.

// Marks of watermark values that are not a watermark.
const (
	newMark  = "new "
	goneMark = "gone "
)

// behindMark returns an errBehind when the watermark m of replica id, read at now, does not promise
// everything applied before since (microseconds of Redis's clock), or nil. A watermark equal to
// since says nothing: the clock may have been read in the same microsecond for the watermark and
// for the call, the watermark's before a change it does not cover.
func behindMark(id string, m watermark, since, now int64) error {
	if m.promise > since {
		return nil
	}
	return errBehind{replica: id, silent: time.Duration(now-m.promise) * time.Microsecond, fresh: m.promise == 0}
}

// runWatermarks writes this replica's watermark every WatermarkInterval until ctx ends, then marks
// it gone (what it had not published by then is lost with it). Every second it reads the others'
// (sweepReplicas).
func (l *Log) runWatermarks(ctx context.Context) {
	var pending string // the time whose changes are all published, to write next
	var lastSweep time.Time
	t := time.NewTicker(l.opts.WatermarkInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			if l.joinedGeneration() {
				sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
				_ = l.store.SetMark(sctx, l.opts.Replica, fmt.Sprintf("%s%d", goneMark, time.Now().UnixMicro()))
				cancel()
			}
			return
		case <-t.C:
		}
		if !l.joinedGeneration() {
			continue
		}
		now, err := l.store.WriteMark(ctx, l.opts.Replica, pending)
		pending = ""
		if err != nil {
			continue // the probe reports the outage
		}
		// Everything applied before now has a sequence number up to seq (a change is applied,
		// numbered and queued in one step under localOrder, so one applied before now is
		// numbered once the lock is had): once those are in the stream, now is this replica's
		// watermark.
		l.localOrder.Lock()
		seq := l.seq.Load()
		l.localOrder.Unlock()
		if l.publishedThrough(ctx, seq, l.opts.WatermarkInterval) {
			pending = strconv.FormatInt(now, 10)
		}
		if time.Since(lastSweep) > time.Second {
			lastSweep = time.Now()
			l.sweepReplicas(ctx, now)
		}
	}
}

// announce gives this replica a watermark entry that promises nothing yet (newMark), so that other
// replicas wait for its first real one.
func (l *Log) announce(ctx context.Context) error {
	_, err := l.store.WriteMark(ctx, l.opts.Replica, "new")
	return err
}

// joinedGeneration reports whether this replica follows a generation (its appends can go through).
func (l *Log) joinedGeneration() bool {
	select {
	case <-l.joined:
		return !l.genLost.Load()
	default:
		return false
	}
}

// publishedThrough waits up to wait until none of this replica's changes numbered up to seq waits
// to be published, and reports whether that happened.
func (l *Log) publishedThrough(ctx context.Context, seq uint64, wait time.Duration) bool {
	deadline := time.Now().Add(wait)
	for {
		l.mu.Lock()
		waiting := false
		for s := range l.queued {
			if s <= seq {
				waiting = true
				break
			}
		}
		l.mu.Unlock()
		if !waiting {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// sweepReplicas reads every replica's watermark, to know the replicas there are (should Redis lose
// the hash, those still count: behind), and removes those silent for longer than ReplicaTimeout
// (now is Redis's time, in microseconds).
func (l *Log) sweepReplicas(ctx context.Context, now int64) {
	r, err := l.store.ReadMarks(ctx, "")
	if err != nil {
		return
	}
	all := r.Marks
	l.noteReplicas(now, all)
	for id, v := range all {
		if m := parseWatermark(v); now-m.at > l.opts.ReplicaTimeout.Microseconds() {
			_ = l.store.DeleteMark(ctx, id)
		}
	}
}

// watermark is a parsed watermark value.
type watermark struct {
	at      int64 // when it was written (Redis microseconds)
	promise int64 // everything applied before it is published (0: nothing yet)
	gone    bool  // the replica stopped cleanly
}

// parseWatermark reads a watermark value; a malformed one promises nothing.
func parseWatermark(v string) watermark {
	num := func(s string) int64 {
		n, _ := strconv.ParseInt(s, 10, 64)
		return n
	}
	if rest, ok := strings.CutPrefix(v, goneMark); ok {
		return watermark{at: num(rest), gone: true}
	}
	if rest, ok := strings.CutPrefix(v, newMark); ok {
		return watermark{at: num(rest)}
	}
	us := num(v)
	return watermark{at: us, promise: us}
}

// errBehind says which replica's watermark is not at the time asked for yet.
type errBehind struct {
	replica string
	missing bool          // its entry is gone from Redis (Redis lost the hash), though it was seen
	fresh   bool          // it joined and has not written a watermark yet
	silent  time.Duration // how long ago its watermark was (for a missing one: since it was seen)
}

func (e errBehind) Error() string {
	if e.fresh {
		return fmt.Sprintf("replica %s has just started and not published what it applied yet", e.replica)
	}
	if e.missing {
		return fmt.Sprintf("replica %s, seen %v ago, has no watermark in Redis (Redis lost its data?)", e.replica, e.silent.Round(time.Millisecond))
	}
	return fmt.Sprintf("replica %s has not published what it applied for %v (cut off from Redis, paused, or stopping)", e.replica, e.silent.Round(time.Millisecond))
}

// clock returns Redis's time in microseconds and the stream's last entry id.
func (l *Log) clock(ctx context.Context) (now int64, tip string, err error) {
	now, tip, _, err = l.watermarks(ctx)
	return now, tip, err
}

// watermarks returns Redis's time, the stream's tip and every replica's watermark, read at once.
func (l *Log) watermarks(ctx context.Context) (now int64, tip string, marks map[string]string, err error) {
	r, err := l.store.ReadMarks(ctx, "")
	if err != nil {
		if ctx.Err() == nil {
			l.setDegraded(err)
		}
		return 0, "", nil, err
	}
	return r.Now, r.Tip, r.Marks, nil
}

// rejoinTimeout bounds how long a replica seen before, whose watermark Redis no longer holds (it
// lost its data), counts as behind: a live one rejoins the log and writes its watermark again
// within about a second.
const rejoinTimeout = 10 * time.Second

// noteReplicas remembers the replicas whose live watermarks marks holds (read at now, Redis
// microseconds), with when each was last written, and forgets those that stopped cleanly or were
// silent for longer than ReplicaTimeout.
func (l *Log) noteReplicas(now int64, marks map[string]string) {
	l.knownMu.Lock()
	defer l.knownMu.Unlock()
	timeout := l.opts.ReplicaTimeout.Microseconds()
	for id, v := range marks {
		switch m := parseWatermark(v); {
		case m.gone:
			delete(l.known, id)
		case id != l.opts.Replica && now-m.at <= timeout:
			l.known[id] = max(l.known[id], m.at)
		}
	}
	for id, seen := range l.known {
		if now-seen > timeout {
			delete(l.known, id) // silent for longer than ReplicaTimeout: taken for dead
		}
	}
}

// behind returns an errBehind for a replica other than this one whose changes applied before since
// (Redis microseconds) may not all be in the stream yet, given marks read at now (behindMark), or
// nil when there is none. A replica seen before whose entry is missing counts as behind for a
// while: Redis lost the hash, and the replica may hold changes it has not published since.
func (l *Log) behind(since, now int64, marks map[string]string) error {
	l.noteReplicas(now, marks)
	l.knownMu.Lock()
	defer l.knownMu.Unlock()
	for id, seen := range l.known {
		v, ok := marks[id]
		m := parseWatermark(v)
		switch {
		case !ok && now-seen > rejoinTimeout.Microseconds():
			// A live replica writes its watermark again within moments of Redis coming back; one
			// that does not is gone (killed meanwhile), with whatever it had not published.
			delete(l.known, id)
		case !ok:
			return errBehind{replica: id, missing: true, silent: time.Duration(now-seen) * time.Microsecond}
		default:
			if err := behindMark(id, m, since, now); err != nil {
				return err
			}
		}
	}
	return nil
}
