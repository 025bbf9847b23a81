package redisstore

// Snapshots are stored in pieces: the snapshot key holds a manifest, "KVRCHUNKS1 <id> <pieces>
// <bytes>", and piece i is the key SnapshotChunk(id, i). Writing one 40 MB value (a 1M-block
// state) in a single command held Redis, and every replica's appends and reads, for tens of
// milliseconds; a piece of 1 MiB takes about one. The manifest starts with a byte no snapshot
// version has, so a replica too old to read pieces stops on it as on a newer version.

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

	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

const manifestPrefix = "KVRCHUNKS1 "

const (
	// pendingChunkTTL bounds how long the pieces of a snapshot that was never committed (its writer
	// died, or lost the generation) stay in Redis.
	pendingChunkTTL = 10 * time.Minute
	// replacedChunkTTL is how long the pieces of a replaced snapshot stay, for replicas still
	// loading it.
	replacedChunkTTL = 2 * time.Minute
)

// manifest is a parsed snapshot manifest.
type manifest struct {
	id     string
	pieces int
	bytes  int
}

func (m manifest) String() string {
	return fmt.Sprintf("%s%s %d %d", manifestPrefix, m.id, m.pieces, m.bytes)
}

// parseManifest reads a manifest; ok is false for a snapshot stored whole.
func parseManifest(v []byte) (m manifest, ok bool, err error) {
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

// ReadSnapshot returns the stored snapshot, from its pieces if it has them, or nil if there is
// none. A piece that is gone (a newer snapshot replaced this one long enough ago) is an error: the
// caller tries again and finds the newer one.
func (l *Log) ReadSnapshot(ctx context.Context) ([]byte, error) {
	v, err := l.rdb.Get(ctx, l.keys.Snapshot()).Bytes()
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
			gets = append(gets, pipe.Get(ctx, l.keys.SnapshotChunk(m.id, j)))
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

// SnapshotPosition returns the position the snapshot covers.
func (l *Log) SnapshotPosition(ctx context.Context) (string, error) {
	p, err := l.rdb.Get(ctx, l.keys.SnapshotPosition()).Result()
	if errors.Is(err, redis.Nil) {
		return "", nil
	}
	return p, err
}

// expirePieces gives the pieces of a replaced snapshot (old is the manifest that was replaced)
// replacedChunkTTL to live: committed pieces never expire on their own, so whoever replaces a
// snapshot does this. A failure leaves them until removed by hand; it does not fail the write.
func (l *Log) expirePieces(ctx context.Context, old []byte) {
	m, pieced, err := parseManifest(old)
	if !pieced || err != nil {
		return
	}
	pipe := l.rdb.Pipeline()
	for i := range m.pieces {
		pipe.PExpire(ctx, l.keys.SnapshotChunk(m.id, i), replacedChunkTTL)
	}
	_, _ = pipe.Exec(ctx)
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

// WriteSnapshot stores s.Data in pieces, each written to expire, then commits them in one script
// that checks the generation and that no other snapshot was committed since this write began.
func (l *Log) WriteSnapshot(ctx context.Context, s logstore.Snapshot) error {
	old, err := l.rdb.Get(ctx, l.keys.Snapshot()).Bytes()
	if err != nil && !errors.Is(err, redis.Nil) {
		return err
	}
	var idb [8]byte
	_, _ = rand.Read(idb[:])
	m := manifest{id: hex.EncodeToString(idb[:]), bytes: len(s.Data)}
	m.pieces = max(1, (len(s.Data)+l.chunk-1)/l.chunk)
	keys := []string{l.keys.Generation(), l.keys.Snapshot(), l.keys.SnapshotPosition(), l.keys.Stream()}
	for i := range m.pieces {
		piece := s.Data[i*l.chunk : min(len(s.Data), (i+1)*l.chunk)]
		key := l.keys.SnapshotChunk(m.id, i)
		if err := l.rdb.Set(ctx, key, piece, pendingChunkTTL).Err(); err != nil {
			return err
		}
		keys = append(keys, key)
	}
	res, err := commitSnapshot.Run(ctx, l.rdb, keys, s.Generation, m.String(), s.Position, s.TrimBefore, m.pieces, string(old)).Int()
	switch {
	case err != nil:
		return err
	case res == 0:
		return fmt.Errorf("%w: the snapshot was not committed", logstore.ErrFenced) // its pieces expire
	case res == -1:
		return fmt.Errorf("a piece of snapshot %s expired before it was committed", m.id)
	case res == -2:
		return errors.New("another snapshot was written meanwhile")
	}
	l.expirePieces(ctx, old)
	return nil
}
