package redislog

// Snapshots: one replica at a time, under a lease, writes the state and trims the stream behind
// the previous snapshot.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
)

// takeLease takes the lease KEYS[1] for ARGV[1] for ARGV[2] milliseconds, or extends it if ARGV[1]
// holds it already. It returns 1 when ARGV[1] holds the lease.
var takeLease = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return 0
`)

// A snapshot is stored in pieces: the snapshot key holds a manifest, "KVRCHUNKS1 <id> <pieces>
// <bytes>", and piece i is the key SnapshotChunkKey(id, i). Writing one 40 MB value (a 1M-block
// state) in a single command held Redis, and every replica's appends and reads, for tens of
// milliseconds; a piece of 1 MiB takes about one. The manifest starts with a byte no snapshot
// version has, so a replica too old to read pieces stops on it as on a newer version.
const manifestPrefix = "KVRCHUNKS1 "

const (
	// pendingChunkTTL bounds how long the pieces of a snapshot that was never committed (its writer
	// died, or lost the generation) stay in Redis.
	pendingChunkTTL = 10 * time.Minute
	// replacedChunkTTL is how long the pieces of a replaced snapshot stay, for replicas still
	// loading it.
	replacedChunkTTL = 2 * time.Minute
)

// snapshotManifest is a parsed manifest.
type snapshotManifest struct {
	id     string
	pieces int
	bytes  int
}

func (m snapshotManifest) String() string {
	return fmt.Sprintf("%s%s %d %d", manifestPrefix, m.id, m.pieces, m.bytes)
}

// parseManifest reads a manifest; ok is false for a snapshot stored whole.
func parseManifest(v []byte) (m snapshotManifest, ok bool, err error) {
	if !strings.HasPrefix(string(v[:min(len(v), len(manifestPrefix))]), manifestPrefix) {
		return m, false, nil
	}
	f := strings.Fields(string(v[len(manifestPrefix):]))
	if len(f) != 3 {
		return m, true, fmt.Errorf("malformed snapshot manifest %q", v)
	}
	m.id = f[0]
	var e1, e2 error
	m.pieces, e1 = strconv.Atoi(f[1])
	m.bytes, e2 = strconv.Atoi(f[2])
	if e1 != nil || e2 != nil || m.pieces < 1 || m.bytes < 0 {
		return m, true, fmt.Errorf("malformed snapshot manifest %q", v)
	}
	return m, true, nil
}

// readSnapshot returns the stored snapshot, from its pieces if it has them, or nil if there is
// none. A piece that is gone (a newer snapshot replaced this one long enough ago) is an error: the
// caller tries again and finds the newer one.
func (l *Log) readSnapshot(ctx context.Context) ([]byte, error) {
	v, err := l.rdb.Get(ctx, l.opts.SnapshotKey()).Bytes()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	m, pieced, err := parseManifest(v)
	if !pieced || err != nil {
		return v, err
	}
	data := make([]byte, 0, m.bytes)
	const perRoundTrip = 8
	for i := 0; i < m.pieces; i += perRoundTrip {
		pipe := l.rdb.Pipeline()
		var gets []*redis.StringCmd
		for j := i; j < min(i+perRoundTrip, m.pieces); j++ {
			gets = append(gets, pipe.Get(ctx, l.opts.SnapshotChunkKey(m.id, j)))
		}
		if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
			return nil, err
		}
		for j, g := range gets {
			b, err := g.Bytes()
			if errors.Is(err, redis.Nil) {
				return nil, fmt.Errorf("piece %d of snapshot %s is missing (replaced since, or deleted); retrying", i+j, m.id)
			}
			if err != nil {
				return nil, err
			}
			data = append(data, b...)
		}
	}
	if len(data) != m.bytes {
		return nil, fmt.Errorf("snapshot %s has %d bytes in its pieces, its manifest says %d", m.id, len(data), m.bytes)
	}
	return data, nil
}

// expireSnapshotPieces gives the pieces of a replaced snapshot (old is the manifest that was
// replaced) replacedChunkTTL to live: committed pieces never expire on their own, so whoever
// replaces a snapshot does this.
func (l *Log) expireSnapshotPieces(ctx context.Context, old []byte) {
	m, pieced, err := parseManifest(old)
	if !pieced || err != nil {
		return
	}
	pipe := l.rdb.Pipeline()
	for i := range m.pieces {
		pipe.PExpire(ctx, l.opts.SnapshotChunkKey(m.id, i), replacedChunkTTL)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		l.opts.Logger.Warn("expiring a replaced snapshot's pieces failed; they stay until removed by hand", "id", m.id, "err", err)
	}
}

// commitSnapshot makes the pieces KEYS[5..] (ARGV[5] of them) the snapshot: if the generation
// KEYS[1] is ARGV[1] and the snapshot key KEYS[2] still holds ARGV[6] (what the writer replaced),
// it keeps every piece (they were written to expire), sets the manifest ARGV[2] and the position
// ARGV[3] (KEYS[3]), and trims the stream KEYS[4] behind ARGV[4] (if not empty). It returns 1 when
// committed, 0 when the generation is another's, -1 when a piece is missing, -2 when another
// snapshot was written meanwhile.
var commitSnapshot = redis.NewScript(`
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local cur = redis.call('GET', KEYS[2])
if (cur or '') ~= ARGV[6] then return -2 end
for i = 5, 4 + tonumber(ARGV[5]) do
  if redis.call('EXISTS', KEYS[i]) == 0 then return -1 end
end
for i = 5, 4 + tonumber(ARGV[5]) do
  redis.call('PERSIST', KEYS[i])
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], ARGV[3])
if ARGV[4] ~= '' then redis.call('XTRIM', KEYS[4], 'MINID', ARGV[4]) end
return 1
`)

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
	ttl := (l.opts.SnapshotInterval + time.Minute).Milliseconds()
	held, err := takeLease.Run(ctx, l.rdb, []string{l.opts.SnapshotLeaseKey()}, l.opts.Replica, ttl).Int()
	if err != nil || held != 1 {
		l.sinceSnapshot, l.lastSnapshot, l.dueSince = 0, time.Now(), time.Time{} // another replica writes snapshots
		l.snapshotFailed.Store(false)
		return
	}
	prev, err := l.rdb.Get(ctx, l.opts.SnapshotPositionKey()).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
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
		streams, err := l.rdb.XRead(ctx, &redis.XReadArgs{
			Streams: []string{l.opts.Stream(), last}, Count: l.opts.ReadCount, Block: 10 * time.Millisecond,
		}).Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			return false
		}
		first, err := l.rdb.XRangeN(ctx, l.opts.Stream(), "-", "+", 1).Result()
		if err != nil || len(first) == 0 || compareStreamIDs(first[0].ID, last) > 0 {
			return false // trimmed past us, perhaps before the read: the tailer reloads
		}
		for _, st := range streams {
			for _, msg := range st.Messages {
				if !l.applyMessage(msg) {
					l.notifyApplied()
					return false // another generation's entry: the tailer sorts it out
				}
			}
		}
		l.notifyApplied()
	}
	return true
}

// writeSnapshot encodes the frozen state and stores it in pieces, then commits it.
func (l *Log) writeSnapshot(ctx context.Context, frozen *kvstate.FrozenState, pos, g, prev string, start time.Time, froze time.Duration) error {
	data := frozen.Encode(nil)
	encoded := time.Since(start)
	old, err := l.rdb.Get(ctx, l.opts.SnapshotKey()).Bytes()
	if err != nil && !errors.Is(err, redis.Nil) {
		return err
	}
	var idb [8]byte
	_, _ = rand.Read(idb[:])
	m := snapshotManifest{id: hex.EncodeToString(idb[:]), bytes: len(data)}
	m.pieces = max(1, (len(data)+l.opts.SnapshotChunkBytes-1)/l.opts.SnapshotChunkBytes)
	keys := []string{l.opts.GenerationKey(), l.opts.SnapshotKey(), l.opts.SnapshotPositionKey(), l.opts.Stream()}
	for i := range m.pieces {
		piece := data[i*l.opts.SnapshotChunkBytes : min(len(data), (i+1)*l.opts.SnapshotChunkBytes)]
		key := l.opts.SnapshotChunkKey(m.id, i)
		if err := l.rdb.Set(ctx, key, piece, pendingChunkTTL).Err(); err != nil {
			return err
		}
		keys = append(keys, key)
	}
	res, err := commitSnapshot.Run(ctx, l.rdb, keys, g, m.String(), pos, prev, m.pieces, string(old)).Int()
	switch {
	case err != nil:
		return err
	case res == 0:
		l.kickGeneration()
		return nil // the generation is another's: its pieces expire
	case res == -1:
		return fmt.Errorf("a piece of snapshot %s expired before it was committed", m.id)
	case res == -2:
		return errors.New("another snapshot was written meanwhile")
	}
	l.expireSnapshotPieces(ctx, old)
	l.SnapshotBytes.Store(int64(len(data)))
	l.SnapshotWritten.Store(time.Now().UnixNano())
	l.SnapshotWrites.Add(1)
	l.opts.Logger.Info("wrote the log snapshot", "position", pos, "bytes", len(data), "pieces", m.pieces,
		"froze", froze, "encoded", encoded-froze, "took", time.Since(start))
	return nil
}
