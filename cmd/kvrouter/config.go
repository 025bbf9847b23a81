package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/kvrouter/kvrouter/kvstate/redislog"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server"
)

// Options is the service's whole configuration.
type Options struct {
	// Serving.
	Listen               string        // gRPC address
	MetricsListen        string        // HTTP address of /metrics ("" = off)
	LogLevel             string        // debug, info, warn, error
	MaxPromptTokens      int           // longest accepted prompt
	MaxRecvMsgBytes      int           // largest accepted gRPC message
	MaxConcurrentStreams int           // per connection
	MaxPublishMsgBytes   int           // largest Publish message
	MaxBatchBlocks       int           // events, and blocks, in one Publish message
	MaxDumpBlocks        int           // blocks of one dump, over its parts
	WorkerGracePeriod    time.Duration // how long a disconnected worker keeps its blocks
	BookingExpiry        time.Duration // how long an unfreed booking lives
	ShutdownDrain        time.Duration // NOT_SERVING before stopping
	ShutdownTimeout      time.Duration // graceful stop deadline

	// Shared state (Redis mode); both empty means the embedded, in-process log.
	RedisAddr         string // one Redis server
	RedisClusterAddrs string // comma-separated Redis Cluster seed nodes
	RedisPrefix       string // key prefix; its hash tag keeps the layout on one cluster slot
	ReplicaID         string // this replica's name in the log (default: hostname-pid)
	RedisMaxBuffered  int    // worker changes kept locally during a Redis outage
	SnapshotEvery     int    // applied changes between snapshot attempts
	SnapshotInterval  time.Duration
	RedisReseedWindow time.Duration // how long a fresh shared log may be reseeded by a replica with state

	// Routing.
	Router                  policy.Config
	ConditionalDisagg       bool   // --conditional-disagg
	ConditionalDisaggConfig string // --conditional-disagg-config (JSON object)
}

// setting is one configuration key: its YAML key, its flag (--key with dashes), its environment
// variable (KVROUTER_KEY), and how to parse and print it.
type setting struct {
	key    string
	help   string
	isBool bool
	set    func(o *Options, v string) error
	get    func(o *Options) string
}

func (s setting) flagName() string { return strings.ReplaceAll(s.key, "_", "-") }
func (s setting) envName() string  { return "KVROUTER_" + strings.ToUpper(s.key) }

func stringSetting(key, help string, p func(*Options) *string) setting {
	return setting{key: key, help: help,
		set: func(o *Options, v string) error { *p(o) = v; return nil },
		get: func(o *Options) string { return *p(o) }}
}

func intSetting(key, help string, p func(*Options) *int, min int) setting {
	return setting{key: key, help: help,
		set: func(o *Options, v string) error {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil {
				return fmt.Errorf("must be an integer (got %q)", v)
			}
			if n < min {
				return fmt.Errorf("must be >= %d (got %d)", min, n)
			}
			*p(o) = n
			return nil
		},
		get: func(o *Options) string { return strconv.Itoa(*p(o)) }}
}

func durationSetting(key, help string, p func(*Options) *time.Duration) setting {
	return setting{key: key, help: help,
		set: func(o *Options, v string) error {
			d, err := time.ParseDuration(strings.TrimSpace(v))
			if err != nil || d < 0 {
				return fmt.Errorf("must be a non-negative duration such as 30s or 5m (got %q)", v)
			}
			*p(o) = d
			return nil
		},
		get: func(o *Options) string { return p(o).String() }}
}

func floatSetting(key, help string, p func(*Options) *float64) setting {
	return setting{key: key, help: help,
		set: func(o *Options, v string) error {
			f, err := parseFloat(v)
			if err != nil {
				return err
			}
			*p(o) = f
			return nil
		},
		get: func(o *Options) string { return strconv.FormatFloat(*p(o), 'g', -1, 64) }}
}

// optionalFloatSetting is a number that may be unset ("" or "null" unsets it).
func optionalFloatSetting(key, help string, p func(*Options) **float64) setting {
	return setting{key: key, help: help,
		set: func(o *Options, v string) error {
			if s := strings.TrimSpace(v); s == "" || s == "null" {
				*p(o) = nil
				return nil
			}
			f, err := parseFloat(v)
			if err != nil {
				return err
			}
			*p(o) = &f
			return nil
		},
		get: func(o *Options) string {
			if *p(o) == nil {
				return ""
			}
			return strconv.FormatFloat(**p(o), 'g', -1, 64)
		}}
}

func boolSetting(key, help string, p func(*Options) *bool) setting {
	return setting{key: key, help: help, isBool: true,
		set: func(o *Options, v string) error {
			b, err := strconv.ParseBool(strings.TrimSpace(v))
			if err != nil {
				return fmt.Errorf("must be true or false (got %q)", v)
			}
			*p(o) = b
			return nil
		},
		get: func(o *Options) string { return strconv.FormatBool(*p(o)) }}
}

func parseFloat(v string) (float64, error) {
	f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, fmt.Errorf("must be a finite number (got %q)", v)
	}
	return f, nil
}

// settings lists every configuration key, in the order --help shows them.
var settings = []setting{
	stringSetting("listen", "gRPC listen address", func(o *Options) *string { return &o.Listen }),
	stringSetting("metrics_listen", "HTTP listen address for /metrics (empty turns it off)", func(o *Options) *string { return &o.MetricsListen }),
	stringSetting("log_level", "log level: debug, info, warn or error", func(o *Options) *string { return &o.LogLevel }),
	intSetting("max_prompt_tokens", "longest prompt Route accepts, in tokens", func(o *Options) *int { return &o.MaxPromptTokens }, 1),
	intSetting("max_recv_msg_bytes", "largest gRPC message accepted, in bytes", func(o *Options) *int { return &o.MaxRecvMsgBytes }, 1024),
	intSetting("max_concurrent_streams", "concurrent gRPC streams per connection", func(o *Options) *int { return &o.MaxConcurrentStreams }, 1),
	intSetting("max_publish_msg_bytes", "largest Publish message (event batch, dump part, hello, load report), in bytes; at most max_recv_msg_bytes", func(o *Options) *int { return &o.MaxPublishMsgBytes }, 1024),
	intSetting("max_batch_blocks", "most events, and most blocks (stored blocks plus removed hashes), one Publish message may carry", func(o *Options) *int { return &o.MaxBatchBlocks }, 1),
	intSetting("max_dump_blocks", "most blocks one dump may hold over all its parts", func(o *Options) *int { return &o.MaxDumpBlocks }, 1),
	durationSetting("worker_grace_period", "how long a worker whose stream closed keeps its blocks before it is removed", func(o *Options) *time.Duration { return &o.WorkerGracePeriod }),
	durationSetting("booking_expiry", "how long a booking nobody frees lives", func(o *Options) *time.Duration { return &o.BookingExpiry }),
	durationSetting("shutdown_drain", "how long health reports NOT_SERVING before the server stops", func(o *Options) *time.Duration { return &o.ShutdownDrain }),
	durationSetting("shutdown_timeout", "deadline for in-flight calls to finish on shutdown", func(o *Options) *time.Duration { return &o.ShutdownTimeout }),

	stringSetting("redis_addr", "share state with other replicas through this Redis server (host:port); empty: embedded state", func(o *Options) *string { return &o.RedisAddr }),
	stringSetting("redis_cluster_addrs", "share state through this Redis Cluster (comma-separated seed host:port list)", func(o *Options) *string { return &o.RedisClusterAddrs }),
	stringSetting("redis_prefix", "prefix of every Redis key, with the hash tag that keeps them on one cluster slot", func(o *Options) *string { return &o.RedisPrefix }),
	intSetting("redis_max_buffered", "worker changes a replica keeps while Redis is unreachable; past it, workers are asked to resync when Redis returns", func(o *Options) *int { return &o.RedisMaxBuffered }, 1),
	intSetting("snapshot_every", "changes (one per block event of KV batches) applied between two snapshots of the shared state; one replica at a time writes them", func(o *Options) *int { return &o.SnapshotEvery }, 1),
	durationSetting("snapshot_interval", "longest time between two snapshots of the shared state", func(o *Options) *time.Duration { return &o.SnapshotInterval }),
	durationSetting("redis_reseed_window", "after Redis lost its data, how long a fresh shared log started by a replica without state may still be replaced by a running replica's state (its SharedState health is NOT_SERVING meanwhile)", func(o *Options) *time.Duration { return &o.RedisReseedWindow }),
	stringSetting("replica_id", "this replica's name in the shared log (default: hostname-pid)", func(o *Options) *string { return &o.ReplicaID }),
	floatSetting("overlap_score_credit", "credit per cached device block in the cost (Dynamo overlap_score_credit)", func(o *Options) *float64 { return &o.Router.OverlapScoreCredit }),
	floatSetting("overlap_score_credit_decay", "shrinks the credit of workers with more prefill load than the least loaded", func(o *Options) *float64 { return &o.Router.OverlapScoreCreditDecay }),
	floatSetting("prefill_load_scale", "weight of the prefill term of the cost", func(o *Options) *float64 { return &o.Router.PrefillLoadScale }),
	optionalFloatSetting("overlap_score_weight", "deprecated: sets prefill_load_scale (and the credit to 0 when 0)", func(o *Options) **float64 { return &o.Router.OverlapScoreWeight }),
	floatSetting("decode_active_request_weight", "cost per active request on a worker", func(o *Options) *float64 { return &o.Router.DecodeActiveRequestWeight }),
	floatSetting("host_cache_hit_weight", "credit per host-memory block beyond the device prefix, in [0, 1]", func(o *Options) *float64 { return &o.Router.HostCacheHitWeight }),
	floatSetting("disk_cache_hit_weight", "credit per disk block beyond the host prefix, in [0, 1]", func(o *Options) *float64 { return &o.Router.DiskCacheHitWeight }),
	floatSetting("shared_cache_multiplier", "credit per external-tier block beyond the disk prefix, in [0, 1]", func(o *Options) *float64 { return &o.Router.SharedCacheMultiplier }),
	floatSetting("router_temperature", "softmax temperature of worker selection (0 picks the cheapest)", func(o *Options) *float64 { return &o.Router.RouterTemperature }),
	boolSetting("use_kv_events", "score cache overlap from workers' KV events", func(o *Options) *bool { return &o.Router.UseKVEvents }),
	boolSetting("router_assume_kv_reuse", "count blocks shared by active requests once", func(o *Options) *bool { return &o.Router.AssumeKVReuse }),
	boolSetting("router_track_prefill_tokens", "charge prefill tokens in the cost and bookings", func(o *Options) *bool { return &o.Router.TrackPrefillTokens }),
	optionalFloatSetting("router_queue_threshold", "a worker is overloaded when its prefill tokens exceed this times its max_num_batched_tokens (unset: never)", func(o *Options) **float64 { return &o.Router.QueueThreshold }),
	stringSetting("router_queue_policy", "order of queued requests: fcfs or wspt", func(o *Options) *string { return &o.Router.QueuePolicy }),
	intSetting("router_queue_max_depth", "requests the router queue holds; more are refused with RESOURCE_EXHAUSTED", func(o *Options) *int { return &o.Router.QueueMaxDepth }, 1),
	durationSetting("session_affinity_ttl", "how long a session (RouteRequest.session_id) keeps its decode worker; 0 turns session affinity off", func(o *Options) *time.Duration { return &o.Router.SessionAffinityTTL }),
	boolSetting("conditional_disagg", "conditional disaggregation: a decode worker that caches most of a prompt prefills it itself (bypass)", func(o *Options) *bool { return &o.ConditionalDisagg }),
	stringSetting("conditional_disagg_config", `conditional disaggregation settings as a JSON object, e.g. {"policy":"isl_bounding","eff_isl_threshold":2048,"eff_isl_ratio_threshold":0.7,"prefill_busy_threshold":null,"decode_busy_threshold":null}`, func(o *Options) *string { return &o.ConditionalDisaggConfig }),
	boolSetting("enforce_disagg", "fail requests for models without prefill workers instead of routing them aggregated", func(o *Options) *bool { return &o.Router.EnforceDisagg }),
}

// defaultOptions returns the built-in defaults.
func defaultOptions() Options {
	return Options{
		Listen:               ":50051",
		MetricsListen:        ":9090",
		LogLevel:             "info",
		MaxPromptTokens:      1 << 20,
		MaxRecvMsgBytes:      16 << 20,
		MaxConcurrentStreams: 1000,
		MaxPublishMsgBytes:   server.DefaultMaxPublishMsgBytes,
		MaxBatchBlocks:       server.DefaultMaxBatchBlocks,
		MaxDumpBlocks:        server.DefaultMaxDumpBlocks,
		WorkerGracePeriod:    30 * time.Second,
		BookingExpiry:        300 * time.Second,
		ShutdownDrain:        2 * time.Second,
		ShutdownTimeout:      15 * time.Second,
		RedisPrefix:          "kvr:{default}",
		RedisMaxBuffered:     100_000,
		SnapshotEvery:        redislog.DefaultSnapshotEvery,
		SnapshotInterval:     5 * time.Minute,
		RedisReseedWindow:    10 * time.Second,
		Router:               policy.DefaultConfig(),
	}
}

// loadedConfig is the effective configuration and where each value came from.
type loadedConfig struct {
	Options
	sources map[string]server.ConfigSource
}

// entries lists the effective settings for GetConfig, sorted by key.
func (c *loadedConfig) entries() []server.ConfigEntry {
	out := make([]server.ConfigEntry, 0, len(settings))
	for _, s := range settings {
		out = append(out, server.ConfigEntry{Key: s.key, Value: s.get(&c.Options), Source: c.sources[s.key]})
	}
	out = append(out, c.cdEntries()...)
	slices.SortFunc(out, func(a, b server.ConfigEntry) int { return strings.Compare(a.Key, b.Key) })
	return out
}

var sourceNames = map[server.ConfigSource]string{
	server.SourceDefault: "default", server.SourceFile: "file", server.SourceEnv: "env", server.SourceFlag: "flag",
}

// describe names a key as the user set it, for error messages.
func (c *loadedConfig) describe(key string) string {
	for _, s := range settings {
		if s.key != key {
			continue
		}
		switch c.sources[key] {
		case server.SourceFlag:
			return "--" + s.flagName()
		case server.SourceEnv:
			return s.envName()
		case server.SourceFile:
			return key + " (config file)"
		}
		return key + " (default)"
	}
	return key
}

// errUsage means the command line itself was malformed; flag has printed why.
var errUsage = errors.New("usage")

// loadConfig builds the configuration from flags > KVROUTER_* environment > YAML file (--config or
// KVROUTER_CONFIG) > defaults, and validates it. Errors name the setting as the user gave it.
func loadConfig(args []string, getenv func(string) string, stderr io.Writer) (*loadedConfig, error) {
	logger := slog.New(slog.NewJSONHandler(stderr, nil))
	cfg := &loadedConfig{Options: defaultOptions(), sources: make(map[string]server.ConfigSource)}
	for _, s := range settings {
		cfg.sources[s.key] = server.SourceDefault
	}

	// Flags are parsed first (they win), but applied last.
	fs := flag.NewFlagSet("kvrouter serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	configFile := fs.String("config", getenv("KVROUTER_CONFIG"), "YAML configuration file (keys as the flags, with underscores)")
	type flagValue struct {
		s setting
		v string
	}
	var fromFlags []flagValue
	for _, s := range settings {
		s := s
		def := s.get(&cfg.Options)
		if s.isBool {
			fs.BoolFunc(s.flagName(), fmt.Sprintf("%s (default %s, env %s)", s.help, def, s.envName()), func(v string) error {
				fromFlags = append(fromFlags, flagValue{s, v})
				return nil
			})
			continue
		}
		fs.Func(s.flagName(), fmt.Sprintf("%s (default %q, env %s)", s.help, def, s.envName()), func(v string) error {
			fromFlags = append(fromFlags, flagValue{s, v})
			return nil
		})
	}
	if err := fs.Parse(args); err != nil {
		return nil, errUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvrouter serve: unexpected argument %q\n", fs.Arg(0))
		fs.Usage()
		return nil, errUsage
	}

	if *configFile != "" {
		if err := cfg.applyFile(*configFile); err != nil {
			return nil, err
		}
	}
	for _, s := range settings {
		if v, ok := lookupEnv(getenv, s.envName()); ok {
			if err := s.set(&cfg.Options, v); err != nil {
				return nil, fmt.Errorf("%s: %w", s.envName(), err)
			}
			cfg.sources[s.key] = server.SourceEnv
		}
	}
	for _, f := range fromFlags {
		if err := f.s.set(&cfg.Options, f.v); err != nil {
			return nil, fmt.Errorf("--%s: %w", f.s.flagName(), err)
		}
		cfg.sources[f.s.key] = server.SourceFlag
	}
	if err := cfg.validate(logger); err != nil {
		return nil, err
	}
	return cfg, nil
}

// lookupEnv treats an empty variable as unset, so KVROUTER_X= does not override a file.
func lookupEnv(getenv func(string) string, name string) (string, bool) {
	v := getenv(name)
	return v, v != ""
}

// applyFile reads a YAML file of settings. Unknown keys are errors, so a typo never goes unnoticed.
func (c *loadedConfig) applyFile(path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("--config: %w", err)
	}
	var doc map[string]yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("config file %s: %w", path, err)
	}
	known := make(map[string]setting, len(settings))
	for _, s := range settings {
		known[s.key] = s
	}
	var unknown []string
	for key := range doc {
		if _, ok := known[key]; !ok {
			unknown = append(unknown, key)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		return fmt.Errorf("config file %s has unknown key(s): %s", path, strings.Join(unknown, ", "))
	}
	for _, s := range settings {
		node, ok := doc[s.key]
		if !ok {
			continue
		}
		v := node.Value
		switch {
		case s.key == "conditional_disagg_config" && node.Kind == yaml.MappingNode:
			// The same keys as the flag's JSON, written as a YAML mapping: each scalar keeps its
			// written form, so 2048.0 is a float here as in the JSON, and is refused where an
			// integer is required.
			js, err := yamlMappingToJSON(&node)
			if err != nil {
				return fmt.Errorf("config file %s: %s: %w", path, s.key, err)
			}
			v = js
		case node.Kind != yaml.ScalarNode:
			return fmt.Errorf("config file %s: %s must be a single value", path, s.key)
		}
		if node.Tag == "!!null" {
			v = ""
		}
		if err := s.set(&c.Options, v); err != nil {
			return fmt.Errorf("config file %s: %s %w", path, s.key, err)
		}
		c.sources[s.key] = server.SourceFile
	}
	return nil
}

// validate checks rules that span settings or need the domain's rules.
func (c *loadedConfig) validate(logger *slog.Logger) error {
	if err := c.resolveConditionalDisagg(logger); err != nil {
		return err
	}
	if err := c.Router.Validate(); err != nil {
		var fe *policy.FieldError
		if errors.As(err, &fe) {
			return fmt.Errorf("%s: %s", c.describe(fe.Field), fe.Rule)
		}
		return err
	}
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		return fmt.Errorf("%s: must be debug, info, warn or error (got %q)", c.describe("log_level"), c.LogLevel)
	}
	if c.sources["max_publish_msg_bytes"] == server.SourceDefault {
		c.MaxPublishMsgBytes = min(c.MaxPublishMsgBytes, c.MaxRecvMsgBytes) // the default follows a lower receive limit
	}
	if c.MaxPublishMsgBytes > c.MaxRecvMsgBytes {
		return fmt.Errorf("%s: must be at most %s %d (got %d)", c.describe("max_publish_msg_bytes"), c.describe("max_recv_msg_bytes"), c.MaxRecvMsgBytes, c.MaxPublishMsgBytes)
	}
	if c.Listen == "" {
		return fmt.Errorf("%s: must not be empty", c.describe("listen"))
	}
	if c.RedisAddr != "" && c.RedisClusterAddrs != "" {
		return fmt.Errorf("%s and %s: set one, not both", c.describe("redis_addr"), c.describe("redis_cluster_addrs"))
	}
	if open, close := strings.Index(c.RedisPrefix, "{"), strings.Index(c.RedisPrefix, "}"); open < 0 || close < open+2 {
		return fmt.Errorf("%s: must contain a non-empty hash tag such as {default} (got %q)", c.describe("redis_prefix"), c.RedisPrefix)
	}
	if c.WorkerGracePeriod == 0 {
		return fmt.Errorf("%s: must be > 0", c.describe("worker_grace_period"))
	}
	if c.RedisReseedWindow < time.Second {
		return fmt.Errorf("%s: must be at least 1s (got %v)", c.describe("redis_reseed_window"), c.RedisReseedWindow)
	}
	if c.BookingExpiry == 0 {
		return fmt.Errorf("%s: must be > 0", c.describe("booking_expiry"))
	}
	return nil
}

// yamlMappingToJSON converts a flat YAML mapping of scalars to a JSON object, keeping each number as
// written.
func yamlMappingToJSON(node *yaml.Node) (string, error) {
	obj := make(map[string]json.RawMessage, len(node.Content)/2)
	for i := 0; i+1 < len(node.Content); i += 2 {
		k, v := node.Content[i], node.Content[i+1]
		if v.Kind != yaml.ScalarNode {
			return "", fmt.Errorf("%s must be a single value", k.Value)
		}
		switch v.Tag {
		case "!!int", "!!float":
			if _, err := strconv.ParseFloat(v.Value, 64); err != nil {
				return "", fmt.Errorf("%s: %q is not a number", k.Value, v.Value)
			}
			obj[k.Value] = json.RawMessage(v.Value)
		case "!!bool", "!!null":
			var x any
			if err := v.Decode(&x); err != nil {
				return "", err
			}
			b, _ := json.Marshal(x)
			obj[k.Value] = b
		default:
			b, _ := json.Marshal(v.Value)
			obj[k.Value] = b
		}
	}
	out, err := json.Marshal(obj)
	return string(out), err
}
