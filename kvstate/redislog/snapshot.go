package redislog

// Snapshots: one replica at a time, under a lease, writes the state and trims the stream behind
// the previous snapshot.

import (
	"context"
	"errors"
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

// maybeSnapshot writes a snapshot when enough has been applied since the last one and this replica
// wins the lease. It runs on the tailer goroutine, so the state is at exactly LastID while it
// encodes; local bookings are held off meanwhile, and it writes only when none is in flight, so the
// snapshot holds exactly the log up to LastID.
func (l *Log) maybeSnapshot(ctx context.Context) {
	if l.sinceSnapshot < l.opts.SnapshotEvery && time.Since(l.lastSnapshot) < l.opts.SnapshotInterval {
		return
	}
	if l.Pending() > 0 {
		return // try again after the next read, once this replica's bookings are back
	}
	ttl := (l.opts.SnapshotInterval + time.Minute).Milliseconds()
	held, err := takeLease.Run(ctx, l.rdb, []string{l.opts.SnapshotLeaseKey()}, l.opts.Replica, ttl).Int()
	if err != nil || held != 1 {
		l.sinceSnapshot, l.lastSnapshot = 0, time.Now() // another replica writes snapshots
		return
	}
	prev, err := l.rdb.Get(ctx, l.opts.SnapshotPositionKey()).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		l.opts.Logger.Warn("reading the snapshot position failed", "err", err)
		return
	}
	start := time.Now()
	l.localMu.Lock()
	if l.Pending() > 0 {
		l.localMu.Unlock()
		return
	}
	pos, g := l.LastID(), l.Generation()
	data := l.state.EncodeSnapshot(nil, kvstate.SnapshotHeader{Position: pos, Generation: g, Entry: l.lastEntry.Load()})
	l.localMu.Unlock()
	// One script writes the snapshot and its position, then keeps one snapshot period of history
	// for replicas slightly behind, trimming what is older than the previous snapshot; all only while
	// the log is still this replica's generation.
	keys := []string{l.opts.GenerationKey(), l.opts.SnapshotKey(), l.opts.SnapshotPositionKey(), l.opts.Stream()}
	written, err := fencedSnapshot.Run(ctx, l.rdb, keys, g, data, pos, prev).Int()
	if err != nil {
		l.opts.Logger.Warn("writing the log snapshot failed", "err", err)
		return
	}
	if written != 1 {
		l.kickGeneration()
		return
	}
	l.sinceSnapshot, l.lastSnapshot = 0, time.Now()
	l.SnapshotBytes.Store(int64(len(data)))
	l.SnapshotWritten.Store(time.Now().UnixNano())
	l.opts.Logger.Info("wrote the log snapshot", "position", pos, "bytes", len(data), "took", time.Since(start))
}
