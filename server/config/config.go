// Package config is kvrouter serve's configuration: every setting with its default, its flag, its
// environment variable and its YAML key, loaded in layers (flags over KVROUTER_* variables over the
// --config file over the defaults), checked once at start, and reported with where each value came
// from (AdminService/GetConfig).
//
// The shape is llm-d's options.go: New returns the defaults, AddFlags registers the flags, Complete
// applies the layers, Validate checks every rule. Load does the four for a command line. The rules of
// the routing settings themselves live in policy (Config.Validate, and policy/cdrules.go for
// conditional disaggregation); this package says how a broken one is named to the user.
package config

import (
	"crypto/tls"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/config/layered"
)

// Default Publish limits (docs/operations.md, "Sizing", has what each costs).
const (
	DefaultMaxPublishMsgBytes = 4 << 20
	DefaultMaxBatchBlocks     = 16_384
	DefaultMaxDumpBlocks      = 1 << 20
	// DefaultMaxDumpBytesInFlight bounds what the dumps in parts of all of a replica's streams
	// hold between their parts: four dumps of a million blocks each, in the log's encoding.
	DefaultMaxDumpBytesInFlight = 256 << 20
	// DefaultMaxConnections bounds the gRPC port's connections: about 256 MiB of buffers, well
	// within a container's file descriptors.
	DefaultMaxConnections = 4096
	// DefaultHealthMaxConnections bounds the health port's: probes open one at a time.
	DefaultHealthMaxConnections = 64
	// DefaultMaxHeaderListBytes bounds a call's metadata: a token, a traceparent and a few
	// application headers take well under 1 KiB.
	DefaultMaxHeaderListBytes = 16 << 10
	// DefaultMaxRefusedCallsPerConn: a client refused for its credentials this often within a
	// second is not misconfigured but flooding, or resetting its streams as it opens them.
	DefaultMaxRefusedCallsPerConn = 20
)

// Default caps against runaway or hostile callers (docs/security.md, "Limits").
const (
	DefaultMaxPublishStreams  = 1024
	DefaultMaxWorkersPerModel = 10_000
	// DefaultMaxRanksPerWorker bounds one worker id's data-parallel ranks in a model: wider than
	// any data-parallel deployment in use, far below max_workers_per_model.
	DefaultMaxRanksPerWorker = 256
	// DefaultMaxModels bounds the models workers register: each lives on (a shard on every
	// replica, sharded by model) and adds series to /metrics.
	DefaultMaxModels = 1000
	// DefaultMaxBookedBlocks bounds what a replica's bookings hold: 16M block keys, e.g. 4,096
	// requests of 64k tokens (block size 16) on two hops each. A key holds about 45 B live (its
	// booking's 8 and the load's table), so about 750 MiB at the cap.
	DefaultMaxBookedBlocks = 1 << 24
	// DefaultMaxBookedBlocksPerCredential is half of DefaultMaxBookedBlocks: one credential, buggy
	// or hostile, can hold at most half of what all bookings may, and every other caller keeps room.
	DefaultMaxBookedBlocksPerCredential = DefaultMaxBookedBlocks / 2
	// DefaultMaxIndexBlocks is about 10 GB of index at the per-block cost docs/BENCHMARKS.md measures.
	DefaultMaxIndexBlocks = 100_000_000
)

// Options is the service's whole configuration. Build it with New (or Load), never as a literal:
// it also records where each value came from.
type Options struct {
	// Serving.
	Listen                 string        // gRPC address
	MetricsListen          string        // HTTP address of /metrics ("" = off)
	HealthListen           string        // plaintext gRPC address serving only health ("" = off)
	Pprof                  bool          // serve /debug/pprof/ on PprofListen
	PprofListen            string        // loopback HTTP address of /debug/pprof/
	LogLevel               string        // debug, info, warn, error
	MaxPromptTokens        int           // longest accepted prompt
	MaxRecvMsgBytes        int           // largest accepted gRPC message
	MaxConcurrentStreams   int           // per connection
	MaxConnections         int           // connections the gRPC port holds at once
	HealthMaxConnections   int           // connections the health port holds at once
	MaxHeaderListBytes     int           // largest header list of a call (both ports)
	MaxRefusedCallsPerConn int           // refused calls a second before a connection is closed
	MaxPublishMsgBytes     int           // largest Publish message
	MaxBatchBlocks         int           // events, and blocks, in one Publish message
	MaxDumpBlocks          int           // blocks of one dump, over its parts
	MaxDumpBytesInFlight   int           // bytes the streams' dumps in parts hold between parts, together
	WorkerGracePeriod      time.Duration // how long a disconnected worker keeps its blocks
	BookingExpiry          time.Duration // how long an unfreed booking lives
	ShutdownDrain          time.Duration // NOT_SERVING before stopping
	ShutdownTimeout        time.Duration // graceful stop deadline

	// The ext_proc endpoint picker for gateways (docs/gateway.md); PickerListen "" turns it off.
	PickerListen            string // gRPC address of the picker, with the main port's TLS and credentials
	PickerDestinationHeader string // header naming the picked worker
	PickerPrefillHeader     string // header naming a disaggregated request's prefill worker
	PickerSessionHeader     string // header binding a conversation to its decode worker ("" = none)
	PickerModelHeader       string // header naming the model instead of the body ("" = the body only)
	PickerMaxBodyBytes      int    // largest request body the picker buffers
	PickerModels            string // comma-separated model=directory pairs: each model's tokenizer files

	// Security (docs/security.md): TLS, credentials and per-credential limits.
	Plaintext                    bool          // serve without TLS on a non-loopback address
	TLSCertFile                  string        // server certificate chain (PEM); with TLSKeyFile turns TLS on
	TLSKeyFile                   string        // server private key (PEM)
	TLSClientCAFile              string        // CAs of client certificates: set, clients must present one (mTLS)
	TLSClientAuth                string        // with TLSClientCAFile: require or optional
	TLSMinVersion                uint16        // tls.VersionTLS12 or tls.VersionTLS13
	CredentialsFile              string        // who may call what ("" = everyone everything)
	AuthOpenHealth               bool          // health answers callers without credentials
	AuthOpenReflection           bool          // reflection answers callers without credentials
	FileReloadInterval           time.Duration // how often TLS and credentials files are checked for changes
	RouteRateLimit               float64       // Route calls per second per credential (0 = none)
	RouteTokenRateLimit          float64       // prompt tokens of booked Routes per second per credential (0 = none)
	MaxBookedBlocks              int           // block keys the bookings of a replica hold, together
	MaxBookedBlocksPerCredential int           // block keys one credential's bookings hold (0 = no bound)
	EventRateLimit               float64       // event blocks per second per credential (0 = none)
	MaxPublishStreams            int           // concurrent Publish streams per credential
	MaxWorkersPerModel           int           // worker ranks per model
	MaxRanksPerWorker            int           // ranks of one worker id per model
	MaxModels                    int           // models workers may register
	MaxIndexBlocks               int           // distinct blocks over all indexes (0 = no cap)
	KeepaliveMinTime             time.Duration // clients pinging more often are disconnected
	MaxConnectionAge             time.Duration // connections are asked to go away after this long (0 = never)
	MaxConnectionAgeGrace        time.Duration // calls' time to finish after that

	// Shared state (Redis mode); both addresses empty means the embedded, in-process log.
	RedisAddr          string        // one Redis server
	RedisClusterAddrs  string        // comma-separated Redis Cluster seed nodes
	RedisPrefix        string        // key prefix; its hash tag keeps the layout on one cluster slot
	ReplicaID          string        // this replica's name in the log (default: hostname-pid)
	RedisMaxBuffered   int           // worker changes kept locally during a Redis outage
	SnapshotEvery      int           // applied changes between snapshot attempts
	SnapshotInterval   time.Duration // longest time between snapshots
	SnapshotChunkBytes int           // size of the pieces a snapshot is stored in
	RedisReseedWindow  time.Duration // how long a fresh shared log may be reseeded by a replica with state
	RedisUsername      string        // ACL user ("" = default)
	RedisPassword      string        // from KVROUTER_REDIS_PASSWORD or the file only; never a flag
	RedisPasswordFile  string        // file holding the password
	RedisTLS           bool          // connect over TLS
	RedisTLSCAFile     string        // CAs of Redis's certificate ("" = the system's)
	RedisTLSCertFile   string        // client certificate for Redis
	RedisTLSKeyFile    string        // its key
	RedisTLSServerName string        // name checked in Redis's certificate ("" = the address's host)
	RedisShardByModel  bool          // one log (stream, snapshots, leases) per model, each under its own hash tag
	RedisModels        string        // comma-separated models this replica serves ("" = every model)

	// Routing. Routing.ConditionalDisagg is derived by Validate from the two settings below it.
	Routing                 policy.Config
	ConditionalDisagg       bool   // --conditional-disagg
	ConditionalDisaggConfig string // --conditional-disagg-config (JSON object, or a YAML mapping in the file)

	// ConfigFile is the YAML file of settings (--config, or KVROUTER_CONFIG); "" reads none.
	ConfigFile string

	layers *layered.Layers[Options] // the settings' layers, and where each value came from
	cdSet  []string                 // the keys conditional_disagg_config set, for provenance

	// prefillBusyInherited: Routing.ConditionalDisagg's prefill busy threshold is router_queue_threshold's.
	prefillBusyInherited bool
}

// New returns the built-in defaults, each from SourceDefault.
func New() *Options {
	o := &Options{
		Listen:                       "127.0.0.1:50051",
		MetricsListen:                "127.0.0.1:9090",
		PprofListen:                  "127.0.0.1:6060",
		LogLevel:                     "info",
		MaxPromptTokens:              1 << 20,
		MaxRecvMsgBytes:              16 << 20,
		MaxConcurrentStreams:         1000,
		MaxConnections:               DefaultMaxConnections,
		HealthMaxConnections:         DefaultHealthMaxConnections,
		MaxHeaderListBytes:           DefaultMaxHeaderListBytes,
		MaxRefusedCallsPerConn:       DefaultMaxRefusedCallsPerConn,
		MaxPublishMsgBytes:           DefaultMaxPublishMsgBytes,
		MaxBatchBlocks:               DefaultMaxBatchBlocks,
		MaxDumpBlocks:                DefaultMaxDumpBlocks,
		MaxDumpBytesInFlight:         DefaultMaxDumpBytesInFlight,
		WorkerGracePeriod:            30 * time.Second,
		BookingExpiry:                300 * time.Second,
		ShutdownDrain:                2 * time.Second,
		ShutdownTimeout:              15 * time.Second,
		PickerDestinationHeader:      "x-gateway-destination-endpoint",
		PickerPrefillHeader:          "x-prefiller-host-port",
		PickerMaxBodyBytes:           32 << 20,
		TLSClientAuth:                "require",
		TLSMinVersion:                tls.VersionTLS12,
		AuthOpenHealth:               true,
		AuthOpenReflection:           true,
		FileReloadInterval:           5 * time.Second,
		MaxPublishStreams:            DefaultMaxPublishStreams,
		MaxWorkersPerModel:           DefaultMaxWorkersPerModel,
		MaxRanksPerWorker:            DefaultMaxRanksPerWorker,
		MaxModels:                    DefaultMaxModels,
		MaxBookedBlocks:              DefaultMaxBookedBlocks,
		MaxBookedBlocksPerCredential: DefaultMaxBookedBlocksPerCredential,
		MaxIndexBlocks:               DefaultMaxIndexBlocks,
		KeepaliveMinTime:             10 * time.Second,
		MaxConnectionAge:             30 * time.Minute,
		MaxConnectionAgeGrace:        30 * time.Second,
		RedisPrefix:                  "kvr:{default}",
		RedisMaxBuffered:             100_000,
		SnapshotEvery:                kvstate.DefaultSnapshotEvery,
		SnapshotInterval:             5 * time.Minute,
		SnapshotChunkBytes:           1 << 20,
		RedisReseedWindow:            10 * time.Second,
		Routing:                      policy.DefaultConfig(),
		layers:                       layered.New(settings),
	}
	return o
}

// Source says where a setting's value came from.
type Source = layered.Source

// Configuration sources, lowest precedence first.
const (
	SourceDefault = layered.SourceDefault
	SourceFile    = layered.SourceFile
	SourceEnv     = layered.SourceEnv
	SourceFlag    = layered.SourceFlag
)

// Entry is one effective setting, as GetConfig reports it.
type Entry = layered.Entry

// Source returns where the setting key's value came from (SourceDefault for a key it does not know).
func (o *Options) Source(key string) Source { return o.layers.Source(key) }

// Entries lists the effective settings, sorted by key: every setting as given, and the derived
// conditional-disaggregation values (conditional_disagg.<key>), each with its source: the
// conditional_disagg_config's for a key it set, router_queue_threshold's for an inherited prefill
// busy threshold, the default otherwise.
func (o *Options) Entries() []Entry {
	out := o.layers.Entries(o)
	cd := o.Routing.ConditionalDisagg
	source := func(key string) Source {
		if slices.Contains(o.cdSet, key) {
			return o.Source("conditional_disagg_config")
		}
		return SourceDefault
	}
	prefillSource := source("prefill_busy_threshold")
	if o.prefillBusyInherited {
		prefillSource = o.Source("router_queue_threshold")
	}
	policyName := ""
	if cd.Policy != nil {
		policyName = cd.Policy.String()
	}
	out = append(out,
		Entry{Key: "conditional_disagg.policy", Value: policyName, Source: source("policy")},
		Entry{Key: "conditional_disagg.eff_isl_threshold", Value: strconv.FormatUint(cd.EffISLThreshold, 10), Source: source("eff_isl_threshold")},
		Entry{Key: "conditional_disagg.eff_isl_ratio_threshold", Value: layered.FormatFloat(cd.EffISLRatioThreshold), Source: source("eff_isl_ratio_threshold")},
		Entry{Key: "conditional_disagg.prefill_busy_threshold", Value: layered.FormatOptional(cd.PrefillBusyThreshold), Source: prefillSource},
		Entry{Key: "conditional_disagg.decode_busy_threshold", Value: layered.FormatOptional(cd.DecodeBusyThreshold), Source: source("decode_busy_threshold")},
	)
	slices.SortFunc(out, func(a, b Entry) int { return strings.Compare(a.Key, b.Key) })
	return out
}
