package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvrouter/kvrouter/clients/go/bridge"
	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/server/config/layered"
)

// bridgeOptions is kvrouter bridge's configuration: the engine to listen to, the worker it is,
// and the routers to tell.
type bridgeOptions struct {
	RouterAddrs          string
	EngineEndpoint       string
	EngineReplayEndpoint string
	EngineTopic          string
	DPRanks, FirstDPRank int
	WorkerID             uint64
	Model                string
	Role                 string
	BlockSize            int
	TotalKVBlocks        uint64
	MaxNumBatchedTokens  uint64
	WorkerEndpoint       string
	SupportsBypass       bool
	KVGroup              int
	ExtraKeys            string
	ReplayTimeout        time.Duration
	MaxUnacked           int
	MetricsListen        string
	LogLevel             string
	ShutdownDrain        time.Duration
}

// bridgeSettings lists every key of kvrouter bridge, in the order --help shows them.
var bridgeSettings = []layered.Setting[bridgeOptions]{
	layered.String("router_addrs", "kvrouter replicas to publish to: host:port list, comma-separated, or one dns:/// target (required)", func(o *bridgeOptions) *string { return &o.RouterAddrs }),
	layered.String("engine_endpoint", "the engine's ZMQ PUB endpoint of its first data-parallel rank (vLLM --kv-events-config endpoint, with the engine's host)", func(o *bridgeOptions) *string { return &o.EngineEndpoint }),
	layered.String("engine_replay_endpoint", "the engine's ZMQ ROUTER replay endpoint (vLLM replay_endpoint); empty: a gap clears the worker's blocks", func(o *bridgeOptions) *string { return &o.EngineReplayEndpoint }),
	layered.String("engine_topic", "ZMQ topic prefix to subscribe to (empty: every topic)", func(o *bridgeOptions) *string { return &o.EngineTopic }),
	layered.Int("dp_ranks", "data-parallel ranks of the engine this bridge serves; rank r's endpoints are the given ports plus r", func(o *bridgeOptions) *int { return &o.DPRanks }, 1),
	layered.Int("first_dp_rank", "the first data-parallel rank served", func(o *bridgeOptions) *int { return &o.FirstDPRank }, 0),
	layered.Uint64("worker_id", "the engine's worker id at the router, unique in the fleet (required)", func(o *bridgeOptions) *uint64 { return &o.WorkerID }, 0),
	layered.String("model", "the model the engine serves (required)", func(o *bridgeOptions) *string { return &o.Model }),
	layered.String("role", "the engine's role: prefill, decode or aggregated", func(o *bridgeOptions) *string { return &o.Role }),
	layered.Int("block_size", "the engine's KV block size in tokens (vLLM --block-size); every model's workers must agree (required)", func(o *bridgeOptions) *int { return &o.BlockSize }, 0),
	layered.Uint64("total_kv_blocks", "the engine's KV cache capacity in blocks (vLLM logs it as 'GPU KV cache size') (required)", func(o *bridgeOptions) *uint64 { return &o.TotalKVBlocks }, 0),
	layered.Uint64("max_num_batched_tokens", "the engine's max_num_batched_tokens (0: unknown)", func(o *bridgeOptions) *uint64 { return &o.MaxNumBatchedTokens }, 0),
	layered.String("worker_endpoint", "where frontends send the engine's requests, as Route returns it (host:port)", func(o *bridgeOptions) *string { return &o.WorkerEndpoint }),
	layered.Bool("supports_bypass", "the engine (a decode worker) may prefill a request itself (conditional disaggregation)", func(o *bridgeOptions) *bool { return &o.SupportsBypass }),
	layered.Int("kv_group", "the KV-cache group whose events are forwarded, for hybrid models (vLLM group_idx)", func(o *bridgeOptions) *int { return &o.KVGroup }, 0),
	layered.String("extra_keys", "stored blocks with extra hash keys (multimodal inputs, cache salts): skip (no false hits) or ignore (text-only models)", func(o *bridgeOptions) *string { return &o.ExtraKeys }),
	layered.Duration("replay_timeout", "longest wait for one answer of the engine's replay endpoint", func(o *bridgeOptions) *time.Duration { return &o.ReplayTimeout }),
	layered.Int("max_unacked", "events per rank kept until the router acks them; reading from the engine pauses past it", func(o *bridgeOptions) *int { return &o.MaxUnacked }, 1),
	layered.String("metrics_listen", "HTTP address of /metrics, /healthz and /readyz (empty turns it off)", func(o *bridgeOptions) *string { return &o.MetricsListen }),
	layered.String("log_level", "log level: debug, info, warn or error", func(o *bridgeOptions) *string { return &o.LogLevel }),
	layered.Duration("shutdown_drain", "on SIGTERM, how long to wait for the router's acks of what was forwarded", func(o *bridgeOptions) *time.Duration { return &o.ShutdownDrain }),
}

func defaultBridgeOptions() *bridgeOptions {
	return &bridgeOptions{
		EngineEndpoint: "tcp://127.0.0.1:5557", DPRanks: 1, Role: "aggregated", ExtraKeys: "skip",
		ReplayTimeout: 10 * time.Second, MaxUnacked: 65_536, MetricsListen: ":9091", LogLevel: "info", ShutdownDrain: 10 * time.Second,
	}
}

var roles = map[string]kvrouterv1.WorkerRole{
	"prefill": kvrouterv1.WorkerRole_WORKER_ROLE_PREFILL, "decode": kvrouterv1.WorkerRole_WORKER_ROLE_DECODE,
	"aggregated": kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED,
}

// validate checks the rules that relate settings or need more than a setting's own parse.
func (o *bridgeOptions) validate(l *layered.Layers[bridgeOptions]) error {
	switch {
	case strings.TrimSpace(o.RouterAddrs) == "":
		return fmt.Errorf("%s: must name at least one router", layered.FlagOf("router_addrs"))
	case o.WorkerID == 0:
		return fmt.Errorf("%s: must be set, and not 0", layered.FlagOf("worker_id"))
	case o.Model == "":
		return fmt.Errorf("%s: must not be empty", layered.FlagOf("model"))
	case roles[o.Role] == 0:
		return fmt.Errorf("%s: must be prefill, decode or aggregated (got %q)", l.Describe("role"), o.Role)
	case o.BlockSize <= 0:
		return fmt.Errorf("%s: must be set to the engine's block size (> 0)", layered.FlagOf("block_size"))
	case o.TotalKVBlocks == 0:
		return fmt.Errorf("%s: must be set to the engine's cache capacity (> 0)", layered.FlagOf("total_kv_blocks"))
	case o.ExtraKeys != "skip" && o.ExtraKeys != "ignore":
		return fmt.Errorf("%s: must be skip or ignore (got %q)", l.Describe("extra_keys"), o.ExtraKeys)
	case !strings.Contains(o.EngineEndpoint, "://"):
		return fmt.Errorf("%s: must be a ZMQ endpoint such as tcp://127.0.0.1:5557 (got %q)", l.Describe("engine_endpoint"), o.EngineEndpoint)
	case o.EngineReplayEndpoint != "" && !strings.Contains(o.EngineReplayEndpoint, "://"):
		return fmt.Errorf("%s: must be a ZMQ endpoint such as tcp://127.0.0.1:5657 (got %q)", l.Describe("engine_replay_endpoint"), o.EngineReplayEndpoint)
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.LogLevel)); err != nil {
		return fmt.Errorf("%s: must be debug, info, warn or error (got %q)", l.Describe("log_level"), o.LogLevel)
	}
	for dp := o.FirstDPRank; dp < o.FirstDPRank+o.DPRanks; dp++ {
		if _, err := bridge.RankEndpoint(o.EngineEndpoint, dp); err != nil {
			return fmt.Errorf("%s: %w", l.Describe("engine_endpoint"), err)
		}
		if o.EngineReplayEndpoint != "" {
			if _, err := bridge.RankEndpoint(o.EngineReplayEndpoint, dp); err != nil {
				return fmt.Errorf("%s: %w", l.Describe("engine_replay_endpoint"), err)
			}
		}
	}
	return nil
}

// runBridge is `kvrouter bridge`: it loads the configuration and forwards until ctx ends.
func runBridge(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) int {
	o := defaultBridgeOptions()
	layers := layered.New(bridgeSettings)
	if err := layers.Parse(o, "kvrouter bridge", args, getenv, stderr); err != nil {
		if errors.Is(err, layered.ErrUsage) {
			return 2
		}
		fmt.Fprintf(stderr, "kvrouter bridge: invalid configuration: %v\n", err)
		return 2
	}
	if err := o.validate(layers); err != nil {
		fmt.Fprintf(stderr, "kvrouter bridge: invalid configuration: %v\n", err)
		return 2
	}
	if err := serveBridge(ctx, o, stderr); err != nil {
		fmt.Fprintf(stderr, "kvrouter bridge: %v\n", err)
		return 1
	}
	return 0
}

func serveBridge(ctx context.Context, o *bridgeOptions, stderr io.Writer) error {
	var level slog.Level
	_ = level.UnmarshalText([]byte(o.LogLevel))
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level}))

	var conns []grpc.ClientConnInterface
	for _, addr := range strings.Split(o.RouterAddrs, ",") {
		conn, err := grpc.NewClient(strings.TrimSpace(addr), grpc.WithTransportCredentials(insecure.NewCredentials()), kvclient.WithKeepalive())
		if err != nil {
			return fmt.Errorf("--router-addrs %s: %w", addr, err)
		}
		defer conn.Close()
		conns = append(conns, conn)
	}
	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	extra := bridge.ExtraKeysSkip
	if o.ExtraKeys == "ignore" {
		extra = bridge.ExtraKeysIgnore
	}
	b, err := bridge.New(bridge.Options{
		Hello: &kvrouterv1.WorkerHello{
			WorkerId: o.WorkerID, Model: o.Model, Role: roles[o.Role], BlockSize: uint32(o.BlockSize), TotalKvBlocks: o.TotalKVBlocks,
			MaxNumBatchedTokens: o.MaxNumBatchedTokens, Endpoint: o.WorkerEndpoint, SupportsBypass: o.SupportsBypass, KvEventsEnabled: true,
		},
		Conns: conns, Endpoint: o.EngineEndpoint, ReplayEndpoint: o.EngineReplayEndpoint, Topic: o.EngineTopic,
		FirstDPRank: o.FirstDPRank, DPRanks: o.DPRanks, KVGroup: int64(o.KVGroup), ExtraKeys: extra,
		ReplayTimeout: o.ReplayTimeout, MaxUnacked: o.MaxUnacked, Registerer: registry, Logger: logger,
	})
	if err != nil {
		return err
	}
	if o.MetricsListen != "" {
		lis, err := net.Listen("tcp", o.MetricsListen)
		if err != nil {
			return fmt.Errorf("--metrics-listen %s: %w", o.MetricsListen, err)
		}
		srv := &http.Server{Handler: bridgeMux(registry, b), ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
				logger.Error("metrics server failed", "err", err)
			}
		}()
		defer srv.Close()
		logger.Info("serving metrics and health", "addr", lis.Addr().String())
	}
	logger.Info("bridge started", "engine_endpoint", o.EngineEndpoint, "replay_endpoint", o.EngineReplayEndpoint,
		"dp_ranks", o.DPRanks, "worker_id", o.WorkerID, "model", o.Model, "routers", o.RouterAddrs)
	err = b.Run(ctx, o.ShutdownDrain)
	logger.Info("bridge stopped", "err", err)
	return err
}

// bridgeMux serves /metrics, /healthz (the process runs: 200) and /readyz (200 when every rank is
// subscribed to the engine and its publisher runs; 503 with the reason otherwise).
func bridgeMux(registry *prometheus.Registry, b *bridge.Bridge) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{Registry: registry}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := b.Ready(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	return mux
}
