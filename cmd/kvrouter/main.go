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
	"maps"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"

	"github.com/kvrouter/kvrouter/server"
	"github.com/kvrouter/kvrouter/server/config"
	"github.com/kvrouter/kvrouter/server/frontdoor"
	"github.com/kvrouter/kvrouter/server/replica"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

const usage = `kvrouter routes LLM inference requests by KV-cache overlap and load.

Usage:
  kvrouter serve [flags]    start the router (kvrouter serve -h lists the flags)
  kvrouter bridge [flags]   forward an engine's KV event feed to the routers (kvrouter bridge -h)
  kvrouter --version        print the release, the commit and the Go release it was built with
`

// run executes the command line and returns the process exit code: 0 on a clean stop, 1 when
// serving fails, 2 for a bad command line or configuration. Only --version writes to stdout.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 1 && (args[0] == "--version" || args[0] == "-version" || args[0] == "version") {
		fmt.Fprintln(stdout, versionLine())
		return 0
	}
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

	// The picker's models load first: a tokenizer that cannot load stops the start before any
	// state or port opens.
	models, err := loadPickerModels(cfg, logger)
	if err != nil {
		return err
	}
	outcomes := server.NewRouteOutcomes()
	rep, err := replica.Build(replica.Options{Config: cfg, Logger: logger, Outcomes: outcomes})
	if err != nil {
		return err
	}
	// Every long-lived goroutine runs in background; the replica's (its logs, leases and
	// housekeeper) under runCtx, which ends only after the gRPC server has stopped (so every stream
	// has released its lease before the leases' Run returns); the Redis client closes once they
	// all have returned.
	runCtx, stopRun := context.WithCancel(context.Background())
	var background errgroup.Group
	defer func() {
		stopRun()
		_ = background.Wait()
		rep.Close()
	}()

	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), outcomes)
	sec, err := newPortSecurity(cfg, registry, logger)
	if err != nil {
		return err
	}
	for _, watch := range sec.watches {
		background.Go(func() error { return watch(runCtx) })
	}
	opts := rep.ServerOptions()
	opts.Registry, opts.Creds, opts.Auth, opts.TracerProvider = registry, sec.creds, sec.auth, tracerProvider
	if cfg.PickerListen != "" {
		opts.Picker = &server.PickerOptions{
			Headers: server.PickerHeaders{Destination: cfg.PickerDestinationHeader, Prefill: cfg.PickerPrefillHeader,
				Session: cfg.PickerSessionHeader, Model: cfg.PickerModelHeader},
			MaxBodyBytes: cfg.PickerMaxBodyBytes,
			Models:       models,
		}
	}
	srv := server.New(opts)

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
	var plis net.Listener
	if cfg.PickerListen != "" {
		if plis, err = net.Listen("tcp", cfg.PickerListen); err != nil {
			lis.Close()
			if hlis != nil {
				hlis.Close()
			}
			return fmt.Errorf("--picker-listen %s: %w", cfg.PickerListen, err)
		}
	}
	closeListeners := func() {
		lis.Close()
		for _, l := range []net.Listener{hlis, plis} {
			if l != nil {
				l.Close()
			}
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
			closeListeners()
			return err
		}
	}
	if cfg.Pprof {
		mux := http.NewServeMux()
		servePprof(mux)
		if err := serveHTTP("pprof", "--pprof-listen", cfg.PprofListen, mux); err != nil {
			closeListeners()
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

	if plis != nil {
		background.Go(func() error {
			if err := srv.ServePicker(plis); err != nil {
				logger.Error("endpoint picker failed", "err", err)
			}
			return nil
		})
		logger.Info("serving the endpoint picker (ext_proc)", "addr", plis.Addr().String())
	}

	background.Go(func() error { return rep.Run(runCtx) })

	serveErr := make(chan error, 1)
	background.Go(func() error {
		serveErr <- srv.Serve(lis)
		return nil
	})
	logger.Info("serving gRPC", "addr", lis.Addr().String(), "state", rep.Mode, "tls", sec.creds != nil, "mutual_tls", cfg.TLSClientCAFile != "",
		"credentials_file", cfg.CredentialsFile, "version", versionLine())
	if cfg.CredentialsFile == "" && !config.IsLoopback(cfg.Listen) {
		logger.Warn("no credentials_file: every caller that reaches the port may publish events, route and read the fleet; see docs/security.md")
	}
	for _, w := range cleartextSecrets(cfg, redisAddrs(cfg)) {
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

// redisAddrs returns the Redis addresses the configuration names (none in embedded mode).
func redisAddrs(cfg *config.Options) []string {
	addrs, _ := replica.RedisAddrs(cfg)
	return addrs
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

// loadPickerModels loads picker_models' tokenizers and chat templates; nil without any.
func loadPickerModels(cfg *config.Options, logger *slog.Logger) (*frontdoor.Models, error) {
	dirs, err := cfg.PickerModelDirs()
	if err != nil || len(dirs) == 0 {
		return nil, err
	}
	start := time.Now()
	models, err := frontdoor.LoadModels(dirs)
	if err != nil {
		return nil, fmt.Errorf("picker_models: %w", err)
	}
	for _, name := range slices.Sorted(maps.Keys(dirs)) {
		m, _ := models.Lookup(name)
		logger.Info("endpoint picker model loaded", "model", name, "dir", dirs[name], "chat_template", m.Template != nil)
	}
	logger.Info("endpoint picker models loaded", "models", len(dirs), "took", time.Since(start).Round(time.Millisecond).String())
	return models, nil
}
