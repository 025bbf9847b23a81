// Package replica is kvrouter's composition root: from a configuration it builds one replica (the
// shards it holds, their logs and stores, routing over them, the housekeeper) and hands the gRPC
// server what it serves. `kvrouter serve`, the in-process test server (server/servertest) and the
// simulator's fleet (cmd/kvsim/fleet) all build their replicas here, so every layout is wired
// once, and "sharded or not" is decided once: a replica always holds a kvstate.ShardSource, one
// shard for every model unless the log is sharded by model.
//
// It is the only package besides the Redis store (kvstate/logstore/redisstore) that imports the
// Redis client: it dials Redis with the configured addresses, TLS and credentials (redis.go).
package replica

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore"
	"github.com/kvrouter/kvrouter/kvstate/replication"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server"
	"github.com/kvrouter/kvrouter/server/app"
	"github.com/kvrouter/kvrouter/server/config"
)

// Options are what a replica is built from beyond its configuration.
type Options struct {
	Config *config.Options
	Logger *slog.Logger // nil: slog.Default()
	// Clock reads booking, session and housekeeping times; nil: the wall clock. The simulator
	// runs its replicas on its virtual clock.
	Clock kvstate.Clock
	// Rand draws the routing decisions' tie-breaks and samples; nil: the global source. The
	// simulator seeds it (policy.NewSeededRand).
	Rand policy.Rand
	// Redis, when set, is the client of the shared log's Redis instead of one dialed from the
	// configuration's addresses (the simulator's, and tests'); Prefix and ReplicaID still come
	// from the configuration.
	Redis redis.UniversalClient
	// Shard, when set, is the one shard to serve instead of an embedded one (tests that hold the
	// state and log they publish to and inspect). Ignored when the configuration names a Redis.
	Shard *kvstate.Shard
	// Outcomes hears what became of the requests the replica routes (server.RouteOutcomes for the
	// metrics); nil: nothing does.
	Outcomes app.Outcomes
}

// Replica is one kvrouter replica: what it holds and the goroutines that keep it.
type Replica struct {
	// Shards are the shards the replica holds; never nil.
	Shards kvstate.ShardSource
	// Sharded says the log is sharded by model (GetState then reports each shard).
	Sharded bool
	// Dispatcher routes over Shards.
	Dispatcher *app.Sharded
	// Presence is the replica's streams, shared by the server and the housekeeper.
	Presence *kvstate.Presence
	// Housekeeper removes expired workers and bookings of every shard.
	Housekeeper *kvstate.Housekeeper
	// Mode says where the state lives, for the start-up log line ("embedded", "redis <addrs>",
	// "redis sharded by model <addrs>").
	Mode string

	cfg    *config.Options
	logger *slog.Logger
	run    []func(context.Context) error
	close  func()
}

// Build builds a replica. Nothing runs until Run.
func Build(o Options) (*Replica, error) {
	cfg := o.Config
	logger := o.Logger
	if logger == nil {
		logger = slog.Default()
	}
	r := &Replica{cfg: cfg, logger: logger, Presence: kvstate.NewPresence(), close: func() {}}
	if err := r.openShards(o); err != nil {
		return nil, err
	}
	r.Dispatcher = app.NewSharded(r.Shards, cfg.Routing, app.Options{Clock: o.Clock, Rand: o.Rand, Cap: app.CapOver(cfg.MaxBookedBlocks, r.Shards), Outcomes: o.Outcomes})
	r.Housekeeper = &kvstate.Housekeeper{
		Shards: r.Shards, Presence: r.Presence, Grace: cfg.WorkerGracePeriod, BookingExpiry: cfg.BookingExpiry,
		Clock: o.Clock, Logger: logger,
	}
	return r, nil
}

// newState returns an empty state with the configured bounds.
func (r *Replica) newState() *kvstate.State {
	st := kvstate.NewState()
	st.SetMaxIndexBlocks(r.cfg.MaxIndexBlocks)
	return st
}

// openShards makes the replica's shards: one embedded shard, or the shared log in Redis (one log,
// or one per model).
func (r *Replica) openShards(o Options) error {
	cfg := r.cfg
	addrs, cluster := RedisAddrs(cfg)
	if len(addrs) == 0 && o.Redis == nil {
		sh := o.Shard
		if sh == nil {
			st := r.newState()
			sh = &kvstate.Shard{State: st, Log: kvstate.NewMemLog(st)}
		}
		if sh.Liveness == nil {
			sh.Liveness = kvstate.LocalLiveness{}
		}
		r.Shards, r.Mode = kvstate.OneShard{Shard: sh}, "embedded"
		return nil
	}
	rdb := o.Redis
	if rdb == nil {
		redis.SetLogger(redisLogger{r.logger})
		var err error
		if rdb, err = openRedis(cfg, addrs, cluster, r.logger); err != nil {
			return err
		}
		r.close = func() { rdb.Close() }
	}
	store := redisstore.New(rdb, redisstore.Options{SnapshotChunkBytes: cfg.SnapshotChunkBytes})
	opts := r.logOptions()
	if cfg.RedisShardByModel {
		shards := replication.NewShards(store, replication.ShardsOptions{
			Models: cfg.Models(), Log: opts, WorkerGracePeriod: cfg.WorkerGracePeriod, NewState: r.newState,
		})
		served := "all"
		if m := cfg.Models(); m != nil {
			served = strings.Join(m, ",")
		}
		r.logger.Info("sharing state through Redis, a log per model", "addrs", addrs, "cluster", cluster, "prefix", cfg.RedisPrefix,
			"models", served, "replica", opts.Replica, "tls", cfg.RedisTLS, "user", cfg.RedisUsername)
		r.Shards, r.Sharded, r.Mode = shards, true, "redis sharded by model "+strings.Join(addrs, ",")
		r.run = append(r.run, shards.Run)
		return nil
	}
	state := r.newState()
	logStore := store.Log(cfg.RedisPrefix)
	l := replication.New(logStore, state, opts)
	// Workers whose replica died are removed by whichever replica sees their lease run out.
	leases := replication.NewLeases(logStore, l, cfg.WorkerGracePeriod, r.logger)
	leases.AfterOutages(l)
	r.logger.Info("sharing state through Redis", "addrs", addrs, "cluster", cluster, "prefix", cfg.RedisPrefix, "replica", opts.Replica,
		"tls", cfg.RedisTLS, "user", cfg.RedisUsername)
	r.Shards = kvstate.OneShard{Shard: &kvstate.Shard{State: state, Log: l, Liveness: leases}}
	r.Mode = "redis " + strings.Join(addrs, ",")
	r.run = append(r.run, l.Run, func(ctx context.Context) error {
		leases.Run(ctx, min(time.Second, cfg.WorkerGracePeriod/3+time.Millisecond))
		return nil
	})
	return nil
}

// logOptions returns the options of the replica's shared logs.
func (r *Replica) logOptions() replication.Options {
	cfg := r.cfg
	replica := cfg.ReplicaID
	if replica == "" {
		host, _ := os.Hostname()
		replica = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	return replication.Options{
		Prefix: cfg.RedisPrefix, Replica: replica, Logger: r.logger, MaxBuffered: cfg.RedisMaxBuffered,
		SnapshotEvery: uint64(cfg.SnapshotEvery), SnapshotInterval: max(cfg.SnapshotInterval, time.Second),
		ReseedWindow: cfg.RedisReseedWindow,
		// A replica silent for longer than the booking expiry holds nothing another replica must
		// wait for: a booking it made before is past the expiry when it arrives, and is expired by
		// the first housekeeper that sees it.
		ReplicaTimeout: cfg.BookingExpiry,
	}
}

// ServerOptions returns the gRPC server's options for this replica: what it serves and every limit
// of the configuration. The caller adds what is its own (listeners' security, metrics registry,
// tracing).
func (r *Replica) ServerOptions() server.Options {
	cfg := r.cfg
	return server.Options{
		Shards: r.Shards, Dispatcher: r.Dispatcher, Presence: r.Presence,
		Config: cfg.Entries(), Logger: r.logger,
		MaxPromptTokens: cfg.MaxPromptTokens, MaxRecvMsgBytes: cfg.MaxRecvMsgBytes, MaxConcurrentStreams: uint32(cfg.MaxConcurrentStreams),
		MaxPublishMsgBytes: cfg.MaxPublishMsgBytes, MaxBatchBlocks: cfg.MaxBatchBlocks, MaxDumpBlocks: cfg.MaxDumpBlocks,
		MaxDumpBytesInFlight: cfg.MaxDumpBytesInFlight,
		MaxWorkersPerModel:   cfg.MaxWorkersPerModel, MaxRanksPerWorker: cfg.MaxRanksPerWorker, MaxModels: cfg.MaxModels,
		MaxConnections: cfg.MaxConnections, HealthMaxConnections: cfg.HealthMaxConnections, MaxHeaderListBytes: cfg.MaxHeaderListBytes,
		MaxRefusedCallsPerConn: cfg.MaxRefusedCallsPerConn,
		KeepaliveMinTime:       cfg.KeepaliveMinTime, MaxConnectionAge: cfg.MaxConnectionAge, MaxConnectionAgeGrace: cfg.MaxConnectionAgeGrace,
	}
}

// Run runs the replica's logs, leases and housekeeper until ctx ends, and returns once they all
// have. Run it under a context that ends only after the gRPC server has stopped, so that every
// stream has released its lease first.
func (r *Replica) Run(ctx context.Context) error {
	return r.runAll(ctx, append(r.run, func(ctx context.Context) error {
		r.Housekeeper.Run(ctx, min(time.Second, r.cfg.WorkerGracePeriod/4+time.Millisecond))
		return nil
	}))
}

// RunLogs runs the replica's shared logs and their leases only, not the housekeeper: for the
// simulator, which expires nothing on its own.
func (r *Replica) RunLogs(ctx context.Context) error { return r.runAll(ctx, r.run) }

// runAll runs each of runs until ctx ends, and returns the first error once they all returned.
func (r *Replica) runAll(ctx context.Context, runs []func(context.Context) error) error {
	errs := make(chan error, len(runs))
	for _, run := range runs {
		go func() { errs <- run(ctx) }()
	}
	var first error
	for range runs {
		if err := <-errs; err != nil && first == nil && !errors.Is(err, context.Canceled) {
			first = err
		}
	}
	return first
}

// Ready is closed once the replica has caught up with its shared logs (nil in embedded mode:
// nothing to catch up with).
func (r *Replica) Ready() <-chan struct{} { return r.Shards.Ready() }

// State returns the state of the replica's one shard, or nil when its log is sharded by model.
func (r *Replica) State() *kvstate.State {
	if one, ok := r.Shards.(kvstate.OneShard); ok {
		return one.Shard.State
	}
	return nil
}

// Log returns the log of the replica's one shard, or nil when its log is sharded by model.
func (r *Replica) Log() kvstate.Log {
	if one, ok := r.Shards.(kvstate.OneShard); ok {
		return one.Shard.Log
	}
	return nil
}

// Close lets go of what Build opened (the Redis client it dialed). Call it after Run returned.
func (r *Replica) Close() { r.close() }

// RedisAddrs returns the Redis addresses the configuration names (none in embedded mode), and
// whether they are a cluster's.
func RedisAddrs(cfg *config.Options) (addrs []string, cluster bool) {
	switch {
	case cfg.RedisAddr != "":
		return []string{cfg.RedisAddr}, false
	case cfg.RedisClusterAddrs != "":
		return strings.Split(cfg.RedisClusterAddrs, ","), true
	}
	return nil, false
}

// redisLogger sends go-redis's own log lines to slog.
type redisLogger struct{ l *slog.Logger }

func (r redisLogger) Printf(ctx context.Context, format string, v ...any) {
	r.l.WarnContext(ctx, "redis client: "+fmt.Sprintf(format, v...))
}
