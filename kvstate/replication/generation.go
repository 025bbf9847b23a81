package replication

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

// The shared log's generation.
//
// Redis may lose everything (a restart without persistence, a flush, a failover to an empty
// replica). The replicas that were running keep their state, but a replica started afterwards would
// find an empty stream and serve an empty state, and nothing would tell anyone. So the log has a
// generation: a key, <prefix>:generation, that names the lineage of the stream and its snapshots.
//
//   - Every append is fenced by it: a script appends only while the key holds the appender's
//     generation, and tags the entry with it. After a loss nothing can be appended until the shared
//     state is re-established (appends wait in the outage buffer meanwhile, as when Redis is down).
//   - A replica with state that finds the key missing (the loss) reseeds: under a lease, it writes
//     its own state as the snapshot of a new generation, deletes whatever stream there is, and sets
//     the key, in one script. The others see a generation that is not theirs and reload that
//     snapshot; their pending changes are published again in the new generation.
//   - A replica without state that finds no generation and no log creates a fresh one. If the log
//     was lost and a replica with state is still running, that one replaces a fresh generation
//     younger than ReseedWindow (measured on Redis's clock) with its state. After the window a fresh
//     generation is the deployment's, so a replica back from a long partition reloads it rather than
//     wiping what the others built since.
//   - Each stream compares its last ack with the reloaded state and asks its worker for a dump when
//     acked events were lost with Redis.
//
// The value is "<id>/<kind>/<created unix ms>" or "<id>/adopted"; kinds are seeded (reseeded from a
// replica's state), fresh (created on an empty Redis) and adopted (a log written before generations
// existed, taken over as it is).

const (
	genSeeded  = "seeded"
	genFresh   = "fresh"
	genAdopted = "adopted"
)

// errFenced: an append was refused because the log's generation is not this replica's.
var errFenced = logstore.ErrFenced

// Lease names in the store: who writes the next snapshot, and who reseeds a lost log.
const (
	snapshotLease = "snapshot-lease"
	reseedLease   = "reseed-lease"
)

func newGenerationID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// generationKind returns a generation's kind and, for a fresh or a seeded one, when it was created
// (Redis's clock; zero for a seeded one of a release before it was written down).
func generationKind(g string) (kind string, created time.Time) {
	parts := strings.Split(g, "/")
	if len(parts) < 2 {
		return "", time.Time{}
	}
	if (parts[1] == genFresh || parts[1] == genSeeded) && len(parts) == 3 {
		if ms, err := strconv.ParseInt(parts[2], 10, 64); err == nil {
			created = time.UnixMilli(ms)
		}
	}
	return parts[1], created
}

// Generation returns the log generation this replica follows ("" before it joined one).
func (l *Log) Generation() string {
	g, _ := l.gen.Load().(string)
	return g
}

// GenerationChanges returns how many times this replica moved to another generation (a reseed or a
// reload after the log was lost), besides joining one at start.
func (l *Log) GenerationChanges() uint64 { return l.genChanges.Load() }

// Incomplete reports whether this replica knows its state may not be the shared one: it has not
// joined the log yet, the log's generation is not its own (lost, or reseeded elsewhere and not
// reloaded yet), or it follows a fresh generation that a replica with state may still replace.
func (l *Log) Incomplete() bool {
	select {
	case <-l.joined:
	default:
		return true // it has not loaded the shared state yet
	}
	if l.genLost.Load() || l.stalled.Load() {
		return true
	}
	return time.Now().UnixNano() < l.freshUntil.Load()
}

// kickGeneration asks the tailer to check the generation soon (an append was fenced).
func (l *Log) kickGeneration() {
	l.genLost.Store(true)
	select {
	case l.genKick <- struct{}{}:
	default:
	}
}

// joinGeneration runs at start: it creates the generation if there is none (after ReseedWindow has
// let a replica with state reseed a lost log, if the log has neither stream nor snapshot), then
// loads it.
func (l *Log) joinGeneration(ctx context.Context) error {
	head, err := l.store.Head(ctx)
	if err != nil {
		return err
	}
	g := head.Generation
	if g == "" {
		if g, err = l.store.Bootstrap(ctx, newGenerationID()); err != nil {
			return err
		}
		l.opts.Logger.Info("created the shared log's generation", "generation", g)
	}
	return l.loadGeneration(ctx, g)
}

// checkGeneration compares the log's generation with this replica's, and reseeds or reloads when
// they differ. It runs on the tailer goroutine.
func (l *Log) checkGeneration(ctx context.Context) error {
	head, err := l.store.Head(ctx)
	if err != nil {
		return err
	}
	g, count := head.Generation, head.Count
	mine := l.Generation()
	if g == mine {
		if applied := l.lastEntry.Load(); l.rewound.Load() || (applied > 0 && count < applied) {
			// The log is ours, but lost entries this replica applied: Redis came back from a
			// persistence file that missed its last writes. This state is ahead of the log.
			l.genLost.Store(true)
			l.opts.Logger.Error("the shared log rewound: Redis lost entries this replica applied; reseeding it from this replica's state",
				"applied", applied, "log_holds", count)
			// The script checks the rewind again: the counter below what this replica applied. An
			// entry numbered at or below it was proof already; the counter may have grown since.
			behind := applied
			if l.rewound.Load() {
				behind = math.MaxInt64
			}
			_, err := l.reseedRewound(ctx, g, behind)
			return err
		}
		l.genLost.Store(false)
		return nil
	}
	l.genLost.Store(true)
	if !l.genReported.Swap(true) {
		l.opts.Logger.Error("the shared log's generation changed: Redis lost its data, or another replica reseeded it; shared state NOT_SERVING until this replica follows",
			"mine", mine, "redis", g)
	}
	kind, created := generationKind(g)
	// A fresh generation's age is checked again, on Redis's clock, by the reseed script.
	if g == "" || (kind == genFresh && time.Since(created) < l.opts.ReseedWindow+2*time.Second) {
		// Lost, or replaced by a fresh log that this state may still take over. If another
		// replica holds the reseed lease, wait for its generation: loading the fresh one now would
		// throw this state away while the reseed may still fail. (The 2 s absorb clock skew; the
		// reseed script decides on Redis's clock.)
		_, err := l.reseed(ctx, g)
		return err
	}
	return l.loadGeneration(ctx, g)
}

// reseed makes this replica's state the snapshot of a new generation replacing expected ("": none),
// if it wins the reseed lease. It reports whether it did.
func (l *Log) reseed(ctx context.Context, expected string) (bool, error) {
	return l.reseedRewound(ctx, expected, 0)
}

// reseedRewound is reseed; with rewoundBehind > 0 it replaces this replica's own generation, whose
// log holds fewer entries than that.
func (l *Log) reseedRewound(ctx context.Context, expected string, rewoundBehind uint64) (bool, error) {
	// The lease runs out well within the window, so that a reseeder that dies leaves the others
	// time to take over.
	won, err := l.store.TakeLease(ctx, reseedLease, l.opts.Replica, l.opts.ReseedWindow/3)
	if err != nil || !won {
		return false, err
	}
	defer l.store.ReleaseLease(context.WithoutCancel(ctx), reseedLease)
	start := time.Now()
	now, err := l.store.Now(ctx)
	if err != nil {
		return false, err
	}
	g := fmt.Sprintf("%s/%s/%d", newGenerationID(), genSeeded, now.UnixMilli())
	// Local bookings wait until the new generation is in place: they must be in the snapshot, or be
	// published under the new generation, never both and never neither.
	l.localMu.Lock()
	defer l.localMu.Unlock()
	data := l.state.EncodeSnapshot(nil, kvstate.SnapshotHeader{Position: "0-0", Generation: g})
	r := logstore.Reseed{Expected: expected, New: g, Snapshot: data, Window: l.opts.ReseedWindow, RewoundBehind: rewoundBehind}
	if l.opts.IndexBookings {
		r.Bookings = make(map[string]int64)
		for id, at := range l.state.Load().BookingTimes() {
			r.Bookings[id] = at / int64(time.Millisecond)
		}
	}
	ok, err := l.store.Reseed(ctx, r)
	if err != nil || !ok {
		return false, err
	}
	l.switchGeneration(g, "0-0", 0, false, 0)
	l.SnapshotBytes.Store(int64(len(data)))
	l.SnapshotWritten.Store(time.Now().UnixNano())
	l.opts.Logger.Warn("reseeded the lost shared log from this replica's state", "generation", g, "replaced", expected,
		"bytes", len(data), "took", time.Since(start))
	return true, nil
}

// loadGeneration makes generation g this replica's: it loads g's snapshot (or starts empty when g
// has none yet) and replays g's stream from the snapshot's position.
func (l *Log) loadGeneration(ctx context.Context, g string) error {
	if gate := l.opts.LoadGate; gate != nil {
		select {
		case gate <- struct{}{}:
			defer func() { <-gate }()
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	data, err := l.store.ReadSnapshot(ctx)
	if err != nil {
		return err
	}
	kind, created := generationKind(g)
	var h kvstate.SnapshotHeader
	if data != nil {
		if h, err = kvstate.ReadSnapshotHeader(data); err != nil {
			return err
		}
	}
	switch {
	case data != nil && (h.Generation == g || (h.Generation == "" && kind == genAdopted)):
	case kind == genFresh || kind == genAdopted:
		// No snapshot of this generation yet: its stream holds everything since it began.
		data = kvstate.NewState().EncodeSnapshot(nil, kvstate.SnapshotHeader{Position: "0-0", Generation: g})
	default:
		return fmt.Errorf("the snapshot belongs to generation %q, not to the log's %q; retrying", h.Generation, g)
	}
	var freshUntil int64
	if kind == genFresh && !l.opts.NoFreshWindow {
		// The window ends on Redis's clock; translate it to this replica's. Known before the
		// switch, so that this replica never reports its state complete inside the window.
		freshUntil = time.Now().Add(l.opts.ReseedWindow).UnixNano() // Redis's clock unknown: all of it
		if t, err := l.store.Now(ctx); err == nil {
			freshUntil = time.Now().Add(created.Add(l.opts.ReseedWindow).Sub(t)).UnixNano()
		}
	}
	start := time.Now()
	l.localMu.Lock()
	h, err = l.state.Restore(data)
	if err == nil {
		// Counted before the new position is visible: whoever sees this replica caught up sees the load.
		l.SnapshotBytes.Store(int64(len(data)))
		l.SnapshotWritten.Store(time.Now().UnixNano())
		l.SnapshotLoads.Add(1)
		l.switchGeneration(g, h.Position, h.Entry, true, freshUntil)
	}
	l.localMu.Unlock()
	if err != nil {
		return err
	}
	l.opts.Logger.Info("loaded the shared log's snapshot", "generation", g, "position", h.Position, "bytes", len(data), "took", time.Since(start))
	return nil
}

// switchGeneration makes g this replica's generation, at stream position pos (entry number entry),
// incomplete until freshUntil (unix ns; 0: complete) for a fresh one, after its state was
// replaced (a reload: carry) or written as g's snapshot (a reseed: !carry). The caller holds localMu
// and runs on the tailer goroutine.
//
// Changes this replica applied locally and had not published yet (bookings in the outbox, worker
// changes in the outage buffer) are in the state. On a reseed they are in the snapshot: they are
// dropped. On a reload they are not: they are published in g and applied when they come back.
// Appends still waiting for their entry fail with kvstate.ErrLogUnavailable (their callers retry).
func (l *Log) switchGeneration(g, pos string, entry uint64, carry bool, freshUntil int64) {
	old := l.Generation()
	l.mu.Lock()
	l.genFate[old] = carry
	if old != "" {
		l.genChanges.Add(1)
	}
	if !carry {
		for _, b := range l.buffer {
			delete(l.queued, b.seq)
		}
		l.buffer, l.bufferedBy, l.resync = nil, make(map[kvstate.WorkerKey]int), make(map[kvstate.WorkerKey]bool)
	}
	for seq, w := range l.waiters {
		w <- appliedEntry{err: fmt.Errorf("%w: the shared log moved to another generation; retry", kvstate.ErrLogUnavailable)}
		delete(l.waiters, seq)
	}
	if carry {
		l.stateReplacedLocked()
	} else {
		clear(l.unechoed) // in the snapshot; the outbox's entries of the old generation are dropped
	}
	l.gen.Store(g)
	l.mu.Unlock()
	l.lastID.Store(pos)
	l.lastEntry.Store(entry)
	l.rewound.Store(false)
	l.freshUntil.Store(freshUntil)
	l.genLost.Store(false)
	l.genReported.Store(false)
	l.joinedOnce.Do(func() { close(l.joined) })
	l.notifyApplied()
}

// fateOf says what becomes of a pending change tagged with generation g: published now (ok), or
// dropped (its generation was replaced by a reseed that holds it).
func (l *Log) fateOf(g string) (publish bool) {
	if g == l.Generation() {
		return true
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.genFate[g]
}

// Limits of one stream entry joining several changes (addEntries): a reader applies an entry as a
// whole, so these bound what one XREAD reply and one apply step hold.
const (
	maxJoinedChanges = 256
	maxJoinedBytes   = 1 << 20
)

// addEntries appends entries to the stream in one round trip, fenced by this replica's generation,
// and returns each one's error (nil: appended). Consecutive entries are joined into one stream
// entry (up to maxJoinedChanges changes and maxJoinedBytes), whose seq field lists their sequence
// numbers in order: the store's cost per command and each replica's cost per entry read are then
// paid once for many changes. A joined entry succeeds or fails as a whole. Entries whose
// generation was replaced by a reseed are dropped (reported appended: they are in the snapshot).
func (l *Log) addEntries(ctx context.Context, entries []outgoing) []error {
	errs := make([]error, len(entries))
	var send []int // the entries to send, in order
	for i, e := range entries {
		if l.fateOf(e.gen) {
			send = append(send, i)
		}
	}
	groups := joinGroups(entries, send)
	joined := make([]logstore.Entry, 0, len(groups))
	sent := make([][]int, 0, len(groups))
	for _, members := range groups {
		e, err := l.joinedEntry(entries, members)
		if err != nil {
			// Only entries this release encoded are appended, so this is a bug: say so, and fail
			// the group rather than publish what other replicas could not read.
			l.opts.Logger.Error("joining log entries failed", "err", err)
			for _, i := range members {
				errs[i] = err
			}
			continue
		}
		joined, sent = append(joined, e), append(sent, members)
	}
	if len(joined) > 0 {
		for gi, err := range l.store.Append(ctx, l.Generation(), joined) {
			for _, i := range sent[gi] {
				errs[i] = err
			}
		}
	}
	for _, err := range errs {
		if errors.Is(err, errFenced) {
			l.kickGeneration()
			break
		}
	}
	for _, err := range errs {
		if errors.Is(err, logstore.ErrUnknownOutcome) {
			// No reply: the entry may be in the log all the same (resolveUncertain).
			l.uncertain.Store(true)
			break
		}
	}
	return errs
}

// joinGroups splits the entries at indexes send into groups of consecutive ones that join into
// one stream entry each, within the limits of a joined entry.
func joinGroups(entries []outgoing, send []int) [][]int {
	var groups [][]int
	size := 0
	for _, i := range send {
		n := len(groups)
		if n == 0 || len(groups[n-1]) == maxJoinedChanges || size+len(entries[i].data) > maxJoinedBytes {
			groups = append(groups, nil)
			n++
			size = 0
		}
		groups[n-1] = append(groups[n-1], i)
		size += len(entries[i].data)
	}
	return groups
}

// joinedEntry returns one entry of the log holding the members' changes: the joined data, this
// replica, the members' sequence numbers (comma-separated), their traceparents (comma-separated,
// "" when none was traced) and their booking index changes.
func (l *Log) joinedEntry(entries []outgoing, members []int) (logstore.Entry, error) {
	first := entries[members[0]]
	if len(members) == 1 {
		return logstore.Entry{Data: first.data, Replica: l.opts.Replica, Seqs: strconv.FormatUint(first.seq, 10),
			TraceParents: first.traceParent, Index: first.index}, nil
	}
	parts := make([][]byte, len(members))
	seqs := make([]byte, 0, 8*len(members))
	var traces []string
	var index []logstore.IndexOp
	for k, i := range members {
		parts[k] = entries[i].data
		if k > 0 {
			seqs = append(seqs, ',')
		}
		seqs = strconv.AppendUint(seqs, entries[i].seq, 10)
		if entries[i].traceParent != "" {
			traces = append(traces, entries[i].traceParent)
		}
		index = append(index, entries[i].index...)
	}
	data, err := kvstate.JoinEntries(nil, parts...)
	if err != nil {
		return logstore.Entry{}, err
	}
	return logstore.Entry{Data: data, Replica: l.opts.Replica, Seqs: string(seqs), TraceParents: strings.Join(traces, ","), Index: index}, nil
}
