package redislog

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

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
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

// GenerationKey holds the log's generation.
func (o Options) GenerationKey() string { return o.Prefix + ":generation" }

// SeqKey counts the entries appended in the current generation; each entry carries its number.
func (o Options) SeqKey() string { return o.Prefix + ":seq" }

// ReseedLeaseKey says which replica reseeds a lost log.
func (o Options) ReseedLeaseKey() string { return o.Prefix + ":reseed-lease" }

// errFenced: an append was refused because the log's generation is not this replica's.
var errFenced = errors.New("the shared log's generation changed")

// fencedAdd appends one entry (ARGV[2], appender ARGV[3], the sequence numbers of its changes
// ARGV[4], and the traceparents ARGV[5] of the calls that append them, "" when none is traced; both
// comma-separated lists when the entry joins several changes) to the stream KEYS[2] if the
// generation KEYS[1] is ARGV[1], tagging it with the generation and with its number, counted in
// KEYS[3]. The counter and the stream change together, so a Redis that comes back from an AOF
// missing its last writes has both rolled back alike: a replica that applied entry N and finds the
// counter below N knows the log lost entries it holds. ARGV[6..], three at a time, change the
// booking index KEYS[4] (bookingindex.go) with the entry: "b" id score adds a booking, "f" id
// removes one, "e" _ score removes those scored below score.
var fencedAdd = redis.NewScript(`
local g = redis.call('GET', KEYS[1])
if g ~= ARGV[1] then
  return redis.error_reply('KVRFENCED ' .. (g or 'none'))
end
local n = redis.call('INCR', KEYS[3])
local id
if ARGV[5] ~= '' then
  id = redis.call('XADD', KEYS[2], '*', 'e', ARGV[2], 'r', ARGV[3], 's', ARGV[4], 'g', ARGV[1], 'n', n, 't', ARGV[5])
else
  id = redis.call('XADD', KEYS[2], '*', 'e', ARGV[2], 'r', ARGV[3], 's', ARGV[4], 'g', ARGV[1], 'n', n)
end
for i = 6, #ARGV - 2, 3 do
  local op = ARGV[i]
  if op == 'b' then
    redis.call('ZADD', KEYS[4], ARGV[i + 2], ARGV[i + 1])
  elseif op == 'f' then
    redis.call('ZREM', KEYS[4], ARGV[i + 1])
  elseif op == 'e' then
    redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. ARGV[i + 2])
  end
end
return id
`)

// bootstrapGeneration returns the generation KEYS[1], creating it if missing: "adopted" when a
// stream KEYS[2] or snapshot KEYS[3] exists already (written before generations), else "fresh" with
// Redis's time. ARGV[1] is the new id.
var bootstrapGeneration = redis.NewScript(`
local g = redis.call('GET', KEYS[1])
if g then return g end
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then
  g = ARGV[1] .. '/adopted'
else
  local t = redis.call('TIME')
  g = ARGV[1] .. '/fresh/' .. (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
redis.call('SET', KEYS[1], g)
return g
`)

// reseedGeneration replaces the generation KEYS[1] by ARGV[2] with the snapshot ARGV[3] (KEYS[3],
// position "0-0" in KEYS[4]), an empty stream KEYS[2] and entry counter KEYS[5], if the generation
// is still ARGV[1] ("": missing) and either: ARGV[5] is not 0 and the counter is below it (the log
// rewound behind entry ARGV[5], which the reseeding replica applied), or the generation is missing,
// or fresh and at most ARGV[4] ms old by Redis's clock. The booking index KEYS[6] becomes the
// bookings of the snapshot: ARGV[6..], an id and its score at a time. Returns 1 if done.
var reseedGeneration = redis.NewScript(`
local g = redis.call('GET', KEYS[1])
if ARGV[5] ~= '0' then
  if g ~= ARGV[1] then return 0 end
  if tonumber(redis.call('GET', KEYS[5]) or '0') >= tonumber(ARGV[5]) then return 0 end
elseif g then
  if g ~= ARGV[1] then return 0 end
  local created = string.match(g, '^[^/]+/fresh/(%d+)$')
  if not created then return 0 end
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(created) > tonumber(ARGV[4]) then return 0 end
elseif ARGV[1] ~= '' then
  return 0
end
redis.call('DEL', KEYS[2], KEYS[5], KEYS[6])
for i = 6, #ARGV - 1, 2 do
  redis.call('ZADD', KEYS[6], ARGV[i + 1], ARGV[i])
end
redis.call('SET', KEYS[3], ARGV[3])
redis.call('SET', KEYS[4], '0-0')
redis.call('SET', KEYS[1], ARGV[2])
return 1
`)

// fencedSnapshot writes the snapshot ARGV[2] (KEYS[2]) and its position ARGV[3] (KEYS[3]), then
// trims the stream KEYS[4] behind ARGV[4] (if not empty), if the generation KEYS[1] is ARGV[1].
var fencedSnapshot = redis.NewScript(`
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], ARGV[3])
if ARGV[4] ~= '' then redis.call('XTRIM', KEYS[4], 'MINID', ARGV[4]) end
return 1
`)

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

func isFenced(err error) bool { return err != nil && strings.HasPrefix(err.Error(), "KVRFENCED") }

// joinGeneration runs at start: it creates the generation if there is none (after ReseedWindow has
// let a replica with state reseed a lost log, if the log has neither stream nor snapshot), then
// loads it.
func (l *Log) joinGeneration(ctx context.Context) error {
	g, err := l.rdb.Get(ctx, l.opts.GenerationKey()).Result()
	if errors.Is(err, redis.Nil) {
		g, err = bootstrapGeneration.Run(ctx, l.rdb, []string{l.opts.GenerationKey(), l.opts.Stream(), l.opts.SnapshotKey()}, newGenerationID()).Text()
		if err == nil {
			l.opts.Logger.Info("created the shared log's generation", "generation", g)
		}
	}
	if err != nil {
		return err
	}
	return l.loadGeneration(ctx, g)
}

// checkGeneration compares the log's generation with this replica's, and reseeds or reloads when
// they differ. It runs on the tailer goroutine.
func (l *Log) checkGeneration(ctx context.Context) error {
	vals, err := l.rdb.MGet(ctx, l.opts.GenerationKey(), l.opts.SeqKey()).Result()
	if err != nil {
		return err
	}
	g, _ := vals[0].(string)
	count, _ := strconv.ParseUint(fmt.Sprint(vals[1]), 10, 64) // "<nil>" parses to 0
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
	won, err := l.rdb.SetNX(ctx, l.opts.ReseedLeaseKey(), l.opts.Replica, l.opts.ReseedWindow/3).Result()
	if err != nil || !won {
		return false, err
	}
	defer l.rdb.Del(context.WithoutCancel(ctx), l.opts.ReseedLeaseKey())
	start := time.Now()
	now, err := l.rdb.Time(ctx).Result()
	if err != nil {
		return false, err
	}
	g := fmt.Sprintf("%s/%s/%d", newGenerationID(), genSeeded, now.UnixMilli())
	// Local bookings wait until the new generation is in place: they must be in the snapshot, or be
	// published under the new generation, never both and never neither.
	l.localMu.Lock()
	defer l.localMu.Unlock()
	data := l.state.EncodeSnapshot(nil, kvstate.SnapshotHeader{Position: "0-0", Generation: g})
	// A reseed is rare (the log was lost) and writes its snapshot whole, in the script that replaces
	// the generation; the pieces of a snapshot it replaces are expired after.
	old, err := l.rdb.Get(ctx, l.opts.SnapshotKey()).Bytes()
	if err != nil && !errors.Is(err, redis.Nil) {
		return false, err
	}
	keys := []string{l.opts.GenerationKey(), l.opts.Stream(), l.opts.SnapshotKey(), l.opts.SnapshotPositionKey(), l.opts.SeqKey(), l.opts.BookingsKey()}
	args := []any{expected, g, data, l.opts.ReseedWindow.Milliseconds(), rewoundBehind}
	if l.opts.IndexBookings {
		for id, at := range l.state.Load().BookingTimes() {
			args = append(args, id, at/int64(time.Millisecond))
		}
	}
	ok, err := reseedGeneration.Run(ctx, l.rdb, keys, args...).Int()
	if err != nil || ok != 1 {
		return false, err
	}
	l.expireSnapshotPieces(ctx, old)
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
	data, err := l.readSnapshot(ctx)
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
		if t, err := l.rdb.Time(ctx).Result(); err == nil {
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
	keys := []string{l.opts.GenerationKey(), l.opts.Stream(), l.opts.SeqKey(), l.opts.BookingsKey()}
	for attempt := 0; attempt < 2; attempt++ {
		g := l.Generation()
		var send []int // the entries this attempt sends, in order
		for i, e := range entries {
			if attempt > 0 && errs[i] == nil {
				continue // appended in the first attempt
			}
			if !l.fateOf(e.gen) {
				if attempt == 0 {
					errs[i] = nil
				}
				continue
			}
			send = append(send, i)
		}
		groups := joinGroups(entries, send)
		cmds := make([]*redis.Cmd, len(groups))
		_, _ = l.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for gi, members := range groups {
				args, err := l.joinedArgs(g, entries, members)
				if err != nil {
					// Only entries this release encoded are appended, so this is a bug: say so,
					// and fail the group rather than publish what other replicas could not read.
					l.opts.Logger.Error("joining log entries failed", "err", err)
					for _, i := range members {
						errs[i] = err
					}
					continue
				}
				cmds[gi] = fencedAdd.EvalSha(ctx, p, keys, args...)
			}
			return nil
		})
		noScript := false
		for gi, c := range cmds {
			var err error
			switch {
			case c == nil:
				continue
			case c.Err() == nil:
			case redis.HasErrorPrefix(c.Err(), "NOSCRIPT"):
				err, noScript = c.Err(), true
			case isFenced(c.Err()):
				err = fmt.Errorf("%w (%v)", errFenced, c.Err())
			default:
				err = c.Err() // a transport error fails every command of the pipeline with it
			}
			for _, i := range groups[gi] {
				errs[i] = err
			}
		}
		if !noScript {
			break
		}
		// Redis lost its script cache (a restart): load the script and send those again.
		if err := fencedAdd.Load(ctx, l.rdb).Err(); err != nil {
			break
		}
	}
	for _, err := range errs {
		if errors.Is(err, errFenced) {
			l.kickGeneration()
			break
		}
	}
	for _, err := range errs {
		var reply redis.Error
		if err != nil && !errors.Is(err, errFenced) && !errors.As(err, &reply) {
			// No reply: the script may have run, and the entry be in the stream (resolveUncertain).
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

// joinedArgs returns fencedAdd's arguments for one stream entry, in generation g, holding the
// members' changes: the joined data, this replica, the members' sequence numbers (comma-separated),
// their traceparents (comma-separated, "" when none was traced) and their booking index changes.
func (l *Log) joinedArgs(g string, entries []outgoing, members []int) ([]any, error) {
	first := entries[members[0]]
	if len(members) == 1 {
		return indexArgs([]any{g, first.data, l.opts.Replica, strconv.FormatUint(first.seq, 10), first.traceParent}, first.index), nil
	}
	parts := make([][]byte, len(members))
	seqs := make([]byte, 0, 8*len(members))
	var traces []string
	for k, i := range members {
		parts[k] = entries[i].data
		if k > 0 {
			seqs = append(seqs, ',')
		}
		seqs = strconv.AppendUint(seqs, entries[i].seq, 10)
		if entries[i].traceParent != "" {
			traces = append(traces, entries[i].traceParent)
		}
	}
	data, err := kvstate.JoinEntries(nil, parts...)
	if err != nil {
		return nil, err
	}
	args := []any{g, data, l.opts.Replica, string(seqs), strings.Join(traces, ",")}
	for _, i := range members {
		args = indexArgs(args, entries[i].index)
	}
	return args, nil
}
