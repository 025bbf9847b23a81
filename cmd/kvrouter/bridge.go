package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	"github.com/kvrouter/kvrouter/clients/go/bridge"
	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/server/config/layered"
)

// bridgeOptions is kvrouter bridge's configuration: the engine to listen to, the worker it is,
// and the routers to tell.
type bridgeOptions struct {
	RouterAddrs          string
	RouterCAFile         string
	RouterCertFile       string
	RouterKeyFile        string
	RouterServerName     string
	RouterTokenFile      string
	RouterPlaintext      bool
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
	EngineHealthURL      string
	EngineCheckInterval  time.Duration
	EngineDownAfter      time.Duration
	MaxUnacked           int
	StateDir             string
	MetricsListen        string
	LogLevel             string
	ShutdownDrain        time.Duration
}

// bridgeSettings lists every key of kvrouter bridge, in the order --help shows them.
var bridgeSettings = []layered.Setting[bridgeOptions]{
	layered.String("router_addrs", "kvrouter replicas to publish to: host:port list, comma-separated, or one dns:/// target (required)", func(o *bridgeOptions) *string { return &o.RouterAddrs }),
	layered.String("router_ca_file", "PEM file of the CA that signs the routers' certificates: the routers are dialled with TLS, verified against it", func(o *bridgeOptions) *string { return &o.RouterCAFile }),
	layered.String("router_cert_file", "client certificate (PEM) presented to the routers (mutual TLS), with router_key_file; read again when it changes", func(o *bridgeOptions) *string { return &o.RouterCertFile }),
	layered.String("router_key_file", "the key (PEM) of router_cert_file; read again when it changes", func(o *bridgeOptions) *string { return &o.RouterKeyFile }),
	layered.String("router_server_name", "the name the routers' certificates must carry, when it is not the host of router_addrs (TLS; alone: TLS verified against the system's roots)", func(o *bridgeOptions) *string { return &o.RouterServerName }),
	layered.String("router_token_file", "file holding the bearer token sent to the routers with every call, read again when it changes; without TLS only to loopback addresses", func(o *bridgeOptions) *string { return &o.RouterTokenFile }),
	layered.Bool("router_plaintext", "dial the routers without TLS; needed for routers that are not on loopback when no TLS setting is given", func(o *bridgeOptions) *bool { return &o.RouterPlaintext }),
	layered.String("engine_endpoint", "the engine's ZMQ PUB endpoint of its first data-parallel rank (vLLM --kv-events-config endpoint, with the engine's host)", func(o *bridgeOptions) *string { return &o.EngineEndpoint }),
	layered.String("engine_replay_endpoint", "the engine's ZMQ ROUTER replay endpoint (vLLM replay_endpoint); empty: a gap clears the worker's blocks", func(o *bridgeOptions) *string { return &o.EngineReplayEndpoint }),
	layered.String("engine_topic", "ZMQ topic prefix to subscribe to (empty: every topic)", func(o *bridgeOptions) *string { return &o.EngineTopic }),
	layered.Int("dp_ranks", "data-parallel ranks of the engine this bridge serves; rank r's endpoints are the given ports plus r", func(o *bridgeOptions) *int { return &o.DPRanks }, 1),
	layered.Int("first_dp_rank", "the first data-parallel rank served", func(o *bridgeOptions) *int { return &o.FirstDPRank }, 0),
	layered.Uint64("worker_id", "the engine's worker id at the router, unique in the fleet (required)", func(o *bridgeOptions) *uint64 { return &o.WorkerID }, 0),
	layered.String("model", "the model the engine serves (required)", func(o *bridgeOptions) *string { return &o.Model }),
	layered.String("role", "the engine's role: prefill, decode or aggregated", func(o *bridgeOptions) *string { return &o.Role }),
	layered.Int("block_size", "the engine's KV block size in tokens (vLLM --block-size); every model's workers must agree (required)", func(o *bridgeOptions) *int { return &o.BlockSize }, 0),
	layered.Uint64("total_kv_blocks", "the engine's KV cache capacity in blocks: vLLM logs 'GPU KV cache size: N tokens', which is N / block_size blocks (required)", func(o *bridgeOptions) *uint64 { return &o.TotalKVBlocks }, 0),
	layered.Uint64("max_num_batched_tokens", "the engine's max_num_batched_tokens (0: unknown)", func(o *bridgeOptions) *uint64 { return &o.MaxNumBatchedTokens }, 0),
	layered.String("worker_endpoint", "where frontends send the engine's requests, as Route returns it (host:port; required)", func(o *bridgeOptions) *string { return &o.WorkerEndpoint }),
	layered.Bool("supports_bypass", "the engine (a decode worker) may prefill a request itself (conditional disaggregation)", func(o *bridgeOptions) *bool { return &o.SupportsBypass }),
	layered.Int("kv_group", "the KV-cache group whose events are forwarded, for hybrid models (vLLM group_idx)", func(o *bridgeOptions) *int { return &o.KVGroup }, 0),
	layered.String("extra_keys", "stored blocks with extra hash keys (LoRA names, multimodal inputs, cache salts): hash (key them as Route does), skip (forward none of them) or ignore (forward them as plain text)", func(o *bridgeOptions) *string { return &o.ExtraKeys }),
	layered.Duration("replay_timeout", "longest wait for one answer of the engine's replay endpoint", func(o *bridgeOptions) *time.Duration { return &o.ReplayTimeout }),
	layered.String("engine_health_url", "the engine's HTTP health endpoint, checked with the replay endpoint (vLLM, SGLang, TensorRT-LLM: http://127.0.0.1:8000/health); empty: not checked", func(o *bridgeOptions) *string { return &o.EngineHealthURL }),
	layered.Duration("engine_check_interval", "how often the engine's health endpoint and replay endpoint are checked", func(o *bridgeOptions) *time.Duration { return &o.EngineCheckInterval }),
	layered.Duration("engine_down_after", "how long the engine's checks may fail, or the bridge be unsubscribed, before the engine counts as down and the worker leaves the router", func(o *bridgeOptions) *time.Duration { return &o.EngineDownAfter }),
	layered.Int("max_unacked", "events per rank kept until the router acks them; reading from the engine pauses past it", func(o *bridgeOptions) *int { return &o.MaxUnacked }, 1),
	layered.String("state_dir", "directory of the bridge's checkpoints (a small file per rank), so that a bridge restarted within the worker's grace period resumes where it stopped (needs engine_replay_endpoint; on Kubernetes an emptyDir volume); empty: a restart starts afresh", func(o *bridgeOptions) *string { return &o.StateDir }),
	layered.String("metrics_listen", "HTTP address of /metrics, /healthz and /readyz (empty turns it off); on loopback by default: set :9091 for a Kubernetes probe", func(o *bridgeOptions) *string { return &o.MetricsListen }),
	layered.String("log_level", "log level: debug, info, warn or error", func(o *bridgeOptions) *string { return &o.LogLevel }),
	layered.Duration("shutdown_drain", "on SIGTERM, how long to wait for the router's acks of what was forwarded", func(o *bridgeOptions) *time.Duration { return &o.ShutdownDrain }),
}

func defaultBridgeOptions() *bridgeOptions {
	return &bridgeOptions{
		EngineEndpoint: "tcp://127.0.0.1:5557", DPRanks: 1, Role: "aggregated", ExtraKeys: "hash",
		ReplayTimeout: 10 * time.Second, EngineCheckInterval: time.Second, EngineDownAfter: 5 * time.Second, MaxUnacked: 65_536, MetricsListen: "127.0.0.1:9091", LogLevel: "info", ShutdownDrain: 10 * time.Second,
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
	case o.WorkerEndpoint == "":
		return fmt.Errorf("%s: must be set to where frontends send the engine's requests (host:port); the router refuses a worker without one", layered.FlagOf("worker_endpoint"))
	case o.ExtraKeys != "hash" && o.ExtraKeys != "skip" && o.ExtraKeys != "ignore":
		return fmt.Errorf("%s: must be hash, skip or ignore (got %q)", l.Describe("extra_keys"), o.ExtraKeys)
	case !strings.Contains(o.EngineEndpoint, "://"):
		return fmt.Errorf("%s: must be a ZMQ endpoint such as tcp://127.0.0.1:5557 (got %q)", l.Describe("engine_endpoint"), o.EngineEndpoint)
	case o.EngineReplayEndpoint != "" && !strings.Contains(o.EngineReplayEndpoint, "://"):
		return fmt.Errorf("%s: must be a ZMQ endpoint such as tcp://127.0.0.1:5657 (got %q)", l.Describe("engine_replay_endpoint"), o.EngineReplayEndpoint)
	case o.EngineHealthURL != "" && !strings.HasPrefix(o.EngineHealthURL, "http://") && !strings.HasPrefix(o.EngineHealthURL, "https://"):
		return fmt.Errorf("%s: must be an http:// or https:// URL such as http://127.0.0.1:8000/health (got %q)", l.Describe("engine_health_url"), o.EngineHealthURL)
	case o.EngineCheckInterval <= 0:
		return fmt.Errorf("%s: must be > 0", l.Describe("engine_check_interval"))
	case o.EngineDownAfter < o.EngineCheckInterval:
		return fmt.Errorf("%s: must be at least %s (%v), or one failed check would count as down", l.Describe("engine_down_after"), layered.FlagOf("engine_check_interval"), o.EngineCheckInterval)
	case o.StateDir != "" && o.EngineReplayEndpoint == "":
		return fmt.Errorf("%s: a checkpoint is resumed from the engine's replay buffer: set %s too, or leave the state directory out", l.Describe("state_dir"), layered.FlagOf("engine_replay_endpoint"))
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.LogLevel)); err != nil {
		return fmt.Errorf("%s: must be debug, info, warn or error (got %q)", l.Describe("log_level"), o.LogLevel)
	}
	if err := o.validateRouterCredentials(l); err != nil {
		return err
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

// routerTLS reports whether a TLS setting is given: the routers are then dialled with TLS.
func (o *bridgeOptions) routerTLS() bool {
	return o.RouterCAFile != "" || o.RouterCertFile != "" || o.RouterKeyFile != "" || o.RouterServerName != ""
}

// routersOnLoopback reports whether every router address is on this host, where traffic without
// TLS is out of other hosts' reach.
func (o *bridgeOptions) routersOnLoopback() bool {
	for _, addr := range strings.Split(o.RouterAddrs, ",") {
		if !kvclient.LoopbackTarget(addr) {
			return false
		}
	}
	return true
}

// validateRouterCredentials checks how the routers are dialled. Plaintext is chosen, never
// assumed: it takes router_plaintext, or routers that are all on loopback and no TLS setting; a
// bearer token goes over plaintext to loopback only, since anyone on the path could read it.
func (o *bridgeOptions) validateRouterCredentials(l *layered.Layers[bridgeOptions]) error {
	name := func(key string) string { // as the user gave it, or as the flag when unset
		if l.Source(key) == layered.SourceDefault {
			return layered.FlagOf(key)
		}
		return l.Describe(key)
	}
	switch {
	case (o.RouterCertFile == "") != (o.RouterKeyFile == ""):
		return fmt.Errorf("%s and %s: set both (the client certificate and its key) or neither", name("router_cert_file"), name("router_key_file"))
	case o.RouterPlaintext && o.routerTLS():
		return fmt.Errorf("%s turns TLS off, so %s, %s, %s and %s cannot apply: drop one or the other",
			l.Describe("router_plaintext"), layered.FlagOf("router_ca_file"), layered.FlagOf("router_cert_file"), layered.FlagOf("router_key_file"), layered.FlagOf("router_server_name"))
	case o.routerTLS():
		return nil
	case !o.RouterPlaintext && !o.routersOnLoopback():
		return fmt.Errorf("%s: routers that are not on loopback (%s) are dialled with TLS or with an explicit choice of plaintext: set %s (TLS, verified against the routers' CA) or %s (a private network)",
			layered.FlagOf("router_addrs"), o.RouterAddrs, layered.FlagOf("router_ca_file"), layered.FlagOf("router_plaintext"))
	case o.RouterTokenFile != "" && !o.routersOnLoopback():
		return fmt.Errorf("%s: a bearer token sent without TLS can be read off the wire, so it goes over plaintext to loopback addresses only (router_addrs %s): set %s to dial the routers with TLS",
			l.Describe("router_token_file"), o.RouterAddrs, layered.FlagOf("router_ca_file"))
	}
	return nil
}

// routerDialOptions are the credentials of the connections to the routers, as validated.
func (o *bridgeOptions) routerDialOptions() ([]grpc.DialOption, error) {
	plaintext := !o.routerTLS()
	opts, err := kvclient.DialCredentials(kvclient.CredentialOptions{
		CAFile: o.RouterCAFile, CertFile: o.RouterCertFile, KeyFile: o.RouterKeyFile, ServerName: o.RouterServerName,
		TokenFile: o.RouterTokenFile, Plaintext: plaintext, AllowTokenWithoutTLS: plaintext && o.routersOnLoopback(),
	})
	if err != nil {
		return nil, fmt.Errorf("the routers' credentials (%s, %s, %s, %s): %w", layered.FlagOf("router_ca_file"),
			layered.FlagOf("router_cert_file"), layered.FlagOf("router_key_file"), layered.FlagOf("router_token_file"), err)
	}
	return opts, nil
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
	creds, err := o.routerDialOptions()
	if err != nil {
		fmt.Fprintf(stderr, "kvrouter bridge: invalid configuration: %v\n", err)
		return 2
	}
	if err := serveBridge(ctx, o, creds, stderr); err != nil {
		fmt.Fprintf(stderr, "kvrouter bridge: %v\n", err)
		return 1
	}
	return 0
}

// serveBridge runs the bridge, dialling the routers with creds, until ctx ends.
func serveBridge(ctx context.Context, o *bridgeOptions, creds []grpc.DialOption, stderr io.Writer) error {
	var level slog.Level
	_ = level.UnmarshalText([]byte(o.LogLevel))
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level}))

	var conns []grpc.ClientConnInterface
	for _, addr := range strings.Split(o.RouterAddrs, ",") {
		conn, err := grpc.NewClient(strings.TrimSpace(addr), append(slices.Clip(creds), kvclient.WithKeepalive())...)
		if err != nil {
			return fmt.Errorf("--router-addrs %s: %w", addr, err)
		}
		defer conn.Close()
		conns = append(conns, conn)
	}
	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	extra := bridge.ExtraKeysHash
	switch o.ExtraKeys {
	case "skip":
		extra = bridge.ExtraKeysSkip
	case "ignore":
		extra = bridge.ExtraKeysIgnore
	}
	b, err := bridge.New(bridge.Options{
		Hello: &kvrouterv1.WorkerHello{
			WorkerId: o.WorkerID, Model: o.Model, Role: roles[o.Role], BlockSize: uint32(o.BlockSize), TotalKvBlocks: o.TotalKVBlocks,
			MaxNumBatchedTokens: o.MaxNumBatchedTokens, Endpoint: o.WorkerEndpoint, SupportsBypass: o.SupportsBypass, KvEventsEnabled: true,
		},
		Conns: conns, Endpoint: o.EngineEndpoint, ReplayEndpoint: o.EngineReplayEndpoint, Topic: o.EngineTopic,
		FirstDPRank: o.FirstDPRank, DPRanks: o.DPRanks, KVGroup: int64(o.KVGroup), ExtraKeys: extra,
		ReplayTimeout: o.ReplayTimeout, MaxUnacked: o.MaxUnacked, StateDir: o.StateDir,
		HealthURL: o.EngineHealthURL, CheckInterval: o.EngineCheckInterval, DownAfter: o.EngineDownAfter, Registerer: registry, Logger: logger,
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
		"dp_ranks", o.DPRanks, "worker_id", o.WorkerID, "model", o.Model, "routers", o.RouterAddrs,
		"router_tls", o.routerTLS(), "router_client_cert", o.RouterCertFile != "", "router_token", o.RouterTokenFile != "")
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
