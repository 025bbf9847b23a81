// Package redisstore is the Redis store of the shared log (kvstate/logstore): a log is a Redis
// stream beside a handful of keys, all under the log's prefix, and every step that must be atomic
// (a fenced append, a reseed, a snapshot's commit, claiming an expired lease) is one Lua script.
//
// Every key of a log shares the prefix's hash tag ("kvr:{prod}"), so a log lives on one node of a
// Redis Cluster and its scripts run there; a deployment sharded by model gives each shard a tag
// of its own (PlaceShard), which spreads the shards over the cluster's masters.
//
// The keys, under a log's prefix P: P:log (the stream; fields e entry, r replica, s sequence
// numbers, g generation, n number, t traceparents), P:generation, P:seq (entries appended in the
// generation), P:snapshot (a manifest naming pieces P:snapshot:<id>:<i>, or a whole snapshot of
// an older release), P:snapshot-position, P:snapshot-lease, P:reseed-lease, P:replicas (the
// watermarks), P:bookings (the booking index), P:leases (worker leases). Under a deployment's
// prefix D: D:shards (the registry) and D:lineage.
package redisstore

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

// Options configure a Store.
type Options struct {
	// SnapshotChunkBytes is the size of the pieces a snapshot is written in (one key each), so
	// that no single command holds Redis for long; zero means 1 MiB.
	SnapshotChunkBytes int
}

// Store is a deployment's shared logs in Redis (a server, a Sentinel group or a Cluster).
type Store struct {
	rdb  redis.UniversalClient
	opts Options
}

// New returns the store over rdb.
func New(rdb redis.UniversalClient, opts Options) *Store {
	if opts.SnapshotChunkBytes <= 0 {
		opts.SnapshotChunkBytes = 1 << 20
	}
	return &Store{rdb: rdb, opts: opts}
}

// Dial returns the store on the Redis server at addr, without TLS or credentials: for tools and
// tests on a private server. kvrouter serve dials with its settings (server/replica).
func Dial(addr string) *Store { return New(redis.NewClient(&redis.Options{Addr: addr}), Options{}) }

// Forget deletes every key under prefix (a log's, or a deployment's and its shards'): for tools
// and tests that clean up after themselves. It scans, so it is no tool for a busy production Redis.
func (s *Store) Forget(ctx context.Context, prefix string) error {
	iter := s.rdb.Scan(ctx, 0, globEscape(prefix)+"*", 1000).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	if err := iter.Err(); err != nil {
		return err
	}
	for len(keys) > 0 {
		n := min(len(keys), 1000)
		if err := s.rdb.Del(ctx, keys[:n]...).Err(); err != nil {
			return err
		}
		keys = keys[n:]
	}
	return nil
}

// Close closes the store's client.
func (s *Store) Close() error { return s.rdb.Close() }

// Name names the store.
func (s *Store) Name() string { return "redis" }

// Ping checks that Redis answers.
func (s *Store) Ping(ctx context.Context) error { return s.rdb.Ping(ctx).Err() }

// Log returns the log under prefix.
func (s *Store) Log(prefix string) logstore.LogStore {
	return &Log{rdb: s.rdb, keys: Keys{Prefix: prefix}, chunk: s.opts.SnapshotChunkBytes}
}

// Deployment returns the registry of the deployment under prefix.
func (s *Store) Deployment(prefix string) logstore.Deployment {
	return &Deployment{rdb: s.rdb, prefix: prefix}
}

var _ logstore.Store = (*Store)(nil)

// Keys names the keys of the log under Prefix.
type Keys struct{ Prefix string }

// Stream is the log's stream.
func (k Keys) Stream() string { return k.Prefix + ":log" }

// Generation holds the log's generation.
func (k Keys) Generation() string { return k.Prefix + ":generation" }

// Seq counts the entries appended in the current generation; each entry carries its number.
func (k Keys) Seq() string { return k.Prefix + ":seq" }

// Snapshot holds the snapshot's manifest (or, written by an older release, the snapshot whole).
func (k Keys) Snapshot() string { return k.Prefix + ":snapshot" }

// SnapshotChunk holds piece i of the snapshot written under id.
func (k Keys) SnapshotChunk(id string, i int) string {
	return fmt.Sprintf("%s:snapshot:%s:%d", k.Prefix, id, i)
}

// SnapshotPosition holds the position the snapshot covers.
func (k Keys) SnapshotPosition() string { return k.Prefix + ":snapshot-position" }

// Lease holds the lease name ("snapshot-lease", "reseed-lease").
func (k Keys) Lease(name string) string { return k.Prefix + ":" + name }

// Replicas holds each replica's watermark.
func (k Keys) Replicas() string { return k.Prefix + ":replicas" }

// Bookings is the booking index.
func (k Keys) Bookings() string { return k.Prefix + ":bookings" }

// Leases holds the worker leases.
func (k Keys) Leases() string { return k.Prefix + ":leases" }

// Deployment is the registry of a deployment's shards in Redis.
type Deployment struct {
	rdb    redis.UniversalClient
	prefix string
}

// RegistryKey is the hash of the deployment's shards: model -> the shard's prefix.
func (d *Deployment) RegistryKey() string { return d.prefix + ":shards" }

// LineageKey names the deployment's data: Redis losing its data loses it with the logs.
func (d *Deployment) LineageKey() string { return d.prefix + ":lineage" }

// Shards returns the registry.
func (d *Deployment) Shards(ctx context.Context) (map[string]string, error) {
	return d.rdb.HGetAll(ctx, d.RegistryKey()).Result()
}

// Shard returns the prefix registered for model.
func (d *Deployment) Shard(ctx context.Context, model string) (string, bool, error) {
	p, err := d.rdb.HGet(ctx, d.RegistryKey(), model).Result()
	if errors.Is(err, redis.Nil) {
		return "", false, nil
	}
	return p, err == nil, err
}

// Register registers prefix for model unless one is registered.
func (d *Deployment) Register(ctx context.Context, model, prefix string) (string, bool, error) {
	set, err := d.rdb.HSetNX(ctx, d.RegistryKey(), model, prefix).Result()
	if err != nil {
		return "", false, err
	}
	if set {
		return prefix, true, nil
	}
	got, err := d.rdb.HGet(ctx, d.RegistryKey(), model).Result()
	return got, false, err
}

// ensureLineage returns the lineage KEYS[1], creating it ("ARGV[1]/<Redis ms>") if it is missing,
// and Redis's time in milliseconds.
var ensureLineage = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local v = redis.call('GET', KEYS[1])
if not v then
  v = ARGV[1] .. '/' .. string.format('%.0f', now)
  redis.call('SET', KEYS[1], v)
end
return {v, now}
`)

// Lineage returns (or makes) the deployment's lineage and Redis's time.
func (d *Deployment) Lineage(ctx context.Context, newID string) (string, int64, error) {
	v, err := ensureLineage.Run(ctx, d.rdb, []string{d.LineageKey()}, newID).Slice()
	if err != nil {
		return "", 0, err
	}
	if len(v) != 2 {
		return "", 0, errors.New("unexpected reply to the lineage script")
	}
	lineage, _ := v[0].(string)
	now, _ := v[1].(int64)
	return lineage, now, nil
}

// shardPrefix returns the prefix of model's shard, the model (and n, to tell it apart on a
// cluster) added to the deployment's hash tag: "kvr:{prod/<model, query-escaped>[#n]}".
func (d *Deployment) shardPrefix(model string, n int) string {
	p := d.prefix
	tag := "/" + url.QueryEscape(model)
	if n > 0 {
		tag += fmt.Sprintf("#%d", n)
	}
	if i := strings.Index(p, "}"); i > strings.Index(p, "{") && strings.Contains(p, "{") {
		return p[:i] + tag + p[i:]
	}
	return p + "{" + tag[1:] + "}" // a prefix without a tag: the model's becomes the tag
}

// PlaceShard returns a prefix for a new shard of model. On a Redis Cluster the hash tag is chosen
// so that the shard's keys land on a master holding the fewest shards of the registry; elsewhere
// it is the model's plain tag.
func (d *Deployment) PlaceShard(ctx context.Context, model string) (string, error) {
	cluster, ok := d.rdb.(*redis.ClusterClient)
	if !ok {
		return d.shardPrefix(model, 0), nil
	}
	slots, err := cluster.ClusterSlots(ctx).Result()
	if err != nil {
		return "", err
	}
	masterOf := func(slot int64) string {
		for _, r := range slots {
			if int64(r.Start) <= slot && slot <= int64(r.End) && len(r.Nodes) > 0 {
				return r.Nodes[0].ID
			}
		}
		return ""
	}
	keySlot := func(prefix string) (int64, error) {
		return cluster.ClusterKeySlot(ctx, Keys{prefix}.Stream()).Result()
	}
	load := map[string]int{} // shards per master
	for _, r := range slots {
		if len(r.Nodes) > 0 {
			load[r.Nodes[0].ID] += 0
		}
	}
	registry, err := d.Shards(ctx)
	if err != nil {
		return "", err
	}
	for _, prefix := range registry {
		slot, err := keySlot(prefix)
		if err != nil {
			return "", err
		}
		load[masterOf(slot)]++
	}
	least := -1
	for _, n := range load {
		if least < 0 || n < least {
			least = n
		}
	}
	// Each candidate tag lands on a master at random; 64 tries miss the least loaded of three
	// masters with a chance of (2/3)^64.
	for n := range 64 {
		prefix := d.shardPrefix(model, n)
		slot, err := keySlot(prefix)
		if err != nil {
			return "", err
		}
		if load[masterOf(slot)] == least {
			return prefix, nil
		}
	}
	return d.shardPrefix(model, 0), nil
}

var _ logstore.Deployment = (*Deployment)(nil)
