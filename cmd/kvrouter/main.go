// Binary kvrouter is the KV-cache-aware router for disaggregated LLM serving.
//
// Usage:
//
//	kvrouter serve [flags]    serve gRPC on --listen (default 127.0.0.1:50051), /metrics on --metrics-listen
//	kvrouter bridge [flags]   forward an engine's ZMQ KV event feed (vLLM, SGLang, TensorRT-LLM) to routers
//
// Every flag also reads from a KVROUTER_* environment variable and from the YAML file given with
// --config; flags win over the environment, which wins over the file.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/redislog"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server"
	"github.com/kvrouter/kvrouter/server/app"
	"github.com/kvrouter/kvrouter/server/config"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Getenv, os.Stderr))
}

const usage = `kvrouter routes LLM inference requests by KV-cache overlap and load.

Usage:
  kvrouter serve [flags]    start the router (kvrouter serve -h lists the flags)
  kvrouter bridge [flags]   forward an engine's KV event feed to the routers (kvrouter bridge -h)
`

// run executes the command line and returns the process exit code: 0 on a clean stop, 1 when
// serving fails, 2 for a bad command line or configuration.
func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "bridge" {
		return runBridge(ctx, args[1:], getenv, stderr)
	}
	if len(args) == 0 || args[0] != "serve" {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
			fmt.Fprint(stderr, usage)
			return 0
		}
		fmt.Fprint(stderr, usage)
		return 2
	}
	cfg, err := config.Load("kvrouter serve", args[1:], getenv, stderr)
	if errors.Is(err, config.ErrUsage) {
		return 2
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvrouter: invalid configuration: %v\n", err)
		return 2
	}
	if err := serve(ctx, cfg, stderr); err != nil {
		fmt.Fprintf(stderr, "kvrouter: %v\n", err)
		return 1
	}
	return 0
}

// serve runs the router on the embedded (in-process) state until ctx ends, then shuts down.
func serve(ctx context.Context, cfg *config.Options, stderr io.Writer) error {
	var level slog.Level
	if err := level.UnmarshalText([]byte(cfg.LogLevel)); err != nil {
		return err
	}
	logger := slog.New(withTraceIDs(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level})))
	cfg.LogDerived(logger)
	tracerProvider, stopTracing, err := startTracing(ctx, cfg, os.Getenv, logger)
	if err != nil {
		return err
	}
	defer stopTracing() // last: the spans of the server's last calls are flushed

	state := kvstate.NewState()
	state.SetMaxIndexBlocks(cfg.MaxIndexBlocks)
	b, err := openLog(cfg, state, logger)
	if err != nil {
		return err
	}
	mode := b.mode
	// Every long-lived goroutine runs in background; those of the log under runCtx, which ends only
	// after the gRPC server has stopped (so every stream has released its lease before the leases'
	// Run returns); the Redis client closes once they all have returned.
	runCtx, stopRun := context.WithCancel(context.Background())
	var background errgroup.Group
	defer func() {
		stopRun()
		_ = background.Wait()
		b.close()
	}()
	for _, run := range b.run {
		background.Go(func() error { return run(runCtx) })
	}
	var dispatcher app.Router
	if b.shards != nil {
		dispatcher = app.NewSharded(b.shards, cfg.Router, app.Options{Cap: app.CapOver(cfg.MaxBookedBlocks, b.shards)})
	} else {
		one := kvstate.OneShard{Shard: &kvstate.Shard{State: state, Log: b.log}}
		dispatcher = app.New(state, b.log, policy.NewKernel(state, cfg.Router), app.Options{Cap: app.CapOver(cfg.MaxBookedBlocks, one)})
	}
	presence := kvstate.NewPresence() // this replica's streams, for the server and the housekeeper

	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	sec, err := newPortSecurity(cfg, registry, logger)
	if err != nil {
		return err
	}
	for _, watch := range sec.watches {
		background.Go(func() error { return watch(runCtx) })
	}
	srv := server.New(server.Options{
		Shards: b.shards, State: state, Log: b.log, Liveness: b.liveness, Dispatcher: dispatcher,
		Config: cfg.Entries(), Logger: logger, Registry: registry, Presence: presence,
		MaxPromptTokens: cfg.MaxPromptTokens, MaxRecvMsgBytes: cfg.MaxRecvMsgBytes, MaxConcurrentStreams: uint32(cfg.MaxConcurrentStreams),
		MaxPublishMsgBytes: cfg.MaxPublishMsgBytes, MaxBatchBlocks: cfg.MaxBatchBlocks, MaxDumpBlocks: cfg.MaxDumpBlocks,
		MaxDumpBytesInFlight: cfg.MaxDumpBytesInFlight,
		MaxWorkersPerModel:   cfg.MaxWorkersPerModel, MaxRanksPerWorker: cfg.MaxRanksPerWorker, MaxModels: cfg.MaxModels, Creds: sec.creds, Auth: sec.auth,
		MaxConnections: cfg.MaxConnections, HealthMaxConnections: cfg.HealthMaxConnections, MaxHeaderListBytes: cfg.MaxHeaderListBytes,
		MaxRefusedCallsPerConn: cfg.MaxRefusedCallsPerConn,
		KeepaliveMinTime:       cfg.KeepaliveMinTime, MaxConnectionAge: cfg.MaxConnectionAge, MaxConnectionAgeGrace: cfg.MaxConnectionAgeGrace,
		TracerProvider: tracerProvider,
	})

	lis, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("--listen %s: %w", cfg.Listen, err)
	}
	var hlis net.Listener // every listener opens before any serves, so a failure leaves none running
	if cfg.HealthListen != "" {
		if hlis, err = net.Listen("tcp", cfg.HealthListen); err != nil {
			lis.Close()
			return fmt.Errorf("--health-listen %s: %w", cfg.HealthListen, err)
		}
	}
	// The HTTP servers: /metrics, and Go's profiler on a listener of its own (--pprof).
	var httpSrvs []*http.Server
	serveHTTP := func(what, flag, addr string, mux *http.ServeMux) error {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("%s %s: %w", flag, addr, err)
		}
		hs := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		httpSrvs = append(httpSrvs, hs)
		background.Go(func() error {
			if err := hs.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
				logger.Error(what+" server failed", "err", err)
			}
			return nil
		})
		logger.Info("serving "+what, "addr", l.Addr().String())
		return nil
	}
	closeHTTP := func() {
		for _, hs := range httpSrvs {
			_ = hs.Close()
		}
	}
	if cfg.MetricsListen != "" {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{Registry: registry}))
		if err := serveHTTP("metrics", "--metrics-listen", cfg.MetricsListen, mux); err != nil {
			lis.Close()
			if hlis != nil {
				hlis.Close()
			}
			return err
		}
	}
	if cfg.Pprof {
		mux := http.NewServeMux()
		servePprof(mux)
		if err := serveHTTP("pprof", "--pprof-listen", cfg.PprofListen, mux); err != nil {
			lis.Close()
			if hlis != nil {
				hlis.Close()
			}
			closeHTTP()
			return err
		}
	}

	if hlis != nil {
		background.Go(func() error {
			if err := srv.ServeHealth(hlis); err != nil {
				logger.Error("health server failed", "err", err)
			}
			return nil
		})
		logger.Info("serving health", "addr", hlis.Addr().String())
	}

	housekeeper := &kvstate.Housekeeper{
		Shards: b.shards, State: state, Log: b.log, Presence: presence, Grace: cfg.WorkerGracePeriod, BookingExpiry: cfg.BookingExpiry, Logger: logger,
	}
	background.Go(func() error {
		housekeeper.Run(runCtx, min(time.Second, cfg.WorkerGracePeriod/4+time.Millisecond))
		return nil
	})

	serveErr := make(chan error, 1)
	background.Go(func() error {
		serveErr <- srv.Serve(lis)
		return nil
	})
	logger.Info("serving gRPC", "addr", lis.Addr().String(), "state", mode, "tls", sec.creds != nil, "mutual_tls", cfg.TLSClientCAFile != "",
		"credentials_file", cfg.CredentialsFile)
	if cfg.CredentialsFile == "" && !config.IsLoopback(cfg.Listen) {
		logger.Warn("no credentials_file: every caller that reaches the port may publish events, route and read the fleet; see docs/security.md")
	}
	for _, w := range cleartextSecrets(cfg, addrsOfRedis(cfg)) {
		logger.Warn(w)
	}

	select {
	case err := <-serveErr:
		srv.Stop()
		closeHTTP()
		return fmt.Errorf("gRPC server stopped: %w", err)
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownDrain+cfg.ShutdownTimeout)
	defer cancel()
	srv.Shutdown(shutdownCtx, cfg.ShutdownDrain)
	for _, hs := range httpSrvs {
		_ = hs.Shutdown(shutdownCtx)
	}
	logger.Info("stopped")
	return <-serveErr
}

// logBackend is the state's log and what comes with it: the liveness of workers, the goroutines
// that keep it (run until their context ends), and what to close once they have returned. A log
// sharded by model has shards (each with its state, log and liveness) in place of log and liveness.
type logBackend struct {
	log      kvstate.Log
	liveness kvstate.Liveness
	shards   kvstate.ShardSource
	mode     string
	run      []func(context.Context) error
	close    func()
}

// addrsOfRedis returns the Redis addresses the configuration names (none in embedded mode).
func addrsOfRedis(cfg *config.Options) []string {
	switch {
	case cfg.RedisAddr != "":
		return []string{cfg.RedisAddr}
	case cfg.RedisClusterAddrs != "":
		return strings.Split(cfg.RedisClusterAddrs, ",")
	}
	return nil
}

// cleartextSecrets returns a warning for each secret the configuration sends over the network
// unencrypted: bearer tokens to a port without TLS that other hosts reach, and the Redis password
// to a Redis without TLS on another host. Either may be deliberate (a mesh's sidecar encrypts),
// so the router says so and serves.
func cleartextSecrets(cfg *config.Options, redisAddrs []string) []string {
	var out []string
	if cfg.CredentialsFile != "" && cfg.TLSCertFile == "" && !config.IsLoopback(cfg.Listen) {
		out = append(out, "bearer tokens reach this router unencrypted: the gRPC port serves plaintext (--plaintext) to other hosts; serve TLS, or make sure a mesh encrypts the hop (docs/security.md)")
	}
	if (cfg.RedisPassword != "" || cfg.RedisPasswordFile != "") && !cfg.RedisTLS {
		for _, addr := range redisAddrs {
			if !config.IsLoopback(strings.TrimSpace(addr)) {
				out = append(out, "the Redis password travels unencrypted to "+strings.TrimSpace(addr)+": set --redis-tls, or make sure a mesh encrypts the hop (docs/operations.md)")
				break
			}
		}
	}
	return out
}

// openLog returns the state's log: in-process by default, or a Redis stream shared with the other
// replicas.
func openLog(cfg *config.Options, state *kvstate.State, logger *slog.Logger) (logBackend, error) {
	var addrs []string
	cluster := false
	switch {
	case cfg.RedisAddr != "":
		addrs = []string{cfg.RedisAddr}
	case cfg.RedisClusterAddrs != "":
		addrs, cluster = strings.Split(cfg.RedisClusterAddrs, ","), true
	default:
		return logBackend{log: kvstate.NewMemLog(state), liveness: kvstate.LocalLiveness{}, mode: "embedded", close: func() {}}, nil
	}
	redis.SetLogger(redisLogger{logger})
	rdb, err := openRedis(cfg, addrs, cluster, logger)
	if err != nil {
		return logBackend{}, err
	}
	replica := cfg.ReplicaID
	if replica == "" {
		host, _ := os.Hostname()
		replica = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	opts := redislog.Options{
		Prefix: cfg.RedisPrefix, Replica: replica, Logger: logger, MaxBuffered: cfg.RedisMaxBuffered,
		SnapshotEvery: uint64(cfg.SnapshotEvery), SnapshotInterval: max(cfg.SnapshotInterval, time.Second), SnapshotChunkBytes: cfg.SnapshotChunkBytes,
		ReseedWindow: cfg.RedisReseedWindow,
		// A replica silent for longer than the booking expiry holds nothing another replica must
		// wait for: a booking it made before is past the expiry when it arrives, and is expired by
		// the first housekeeper that sees it.
		ReplicaTimeout: cfg.BookingExpiry,
	}
	if cfg.RedisShardByModel {
		shards := redislog.NewShards(rdb, redislog.ShardsOptions{
			Models: cfg.Models(), Log: opts, WorkerGracePeriod: cfg.WorkerGracePeriod,
			NewState: func() *kvstate.State {
				st := kvstate.NewState()
				st.SetMaxIndexBlocks(cfg.MaxIndexBlocks)
				return st
			},
		})
		served := "all"
		if m := cfg.Models(); m != nil {
			served = strings.Join(m, ",")
		}
		logger.Info("sharing state through Redis, a log per model", "addrs", addrs, "cluster", cluster, "prefix", cfg.RedisPrefix,
			"registry", shards.RegistryKey(), "models", served, "replica", replica, "tls", cfg.RedisTLS, "user", cfg.RedisUsername)
		return logBackend{shards: shards, mode: "redis sharded by model " + strings.Join(addrs, ","), run: []func(context.Context) error{shards.Run},
			close: func() { rdb.Close() }}, nil
	}
	l := redislog.New(rdb, state, opts)
	// Workers whose replica died are removed by whichever replica sees their lease run out.
	leases := redislog.NewLeases(rdb, cfg.RedisPrefix, l, cfg.WorkerGracePeriod, logger)
	leases.AfterOutages(l)
	logger.Info("sharing state through Redis", "addrs", addrs, "cluster", cluster, "prefix", cfg.RedisPrefix, "replica", replica,
		"tls", cfg.RedisTLS, "user", cfg.RedisUsername)
	return logBackend{
		log: l, liveness: leases, mode: "redis " + strings.Join(addrs, ","),
		run: []func(context.Context) error{
			l.Run,
			func(ctx context.Context) error {
				leases.Run(ctx, min(time.Second, cfg.WorkerGracePeriod/3+time.Millisecond))
				return nil
			},
		},
		close: func() { rdb.Close() },
	}, nil
}

// redisLogger sends go-redis's own log lines to slog.
type redisLogger struct{ l *slog.Logger }

func (r redisLogger) Printf(ctx context.Context, format string, v ...any) {
	r.l.WarnContext(ctx, "redis client: "+fmt.Sprintf(format, v...))
}
