package config

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/policy"
)

// setting is one configuration key: its YAML key, its flag (--key with dashes), its environment
// variable (KVROUTER_KEY), and how to parse and print it. A set function checks how a value is
// written and its own range; rules that relate settings are Validate's.
type setting struct {
	key    string
	help   string
	isBool bool
	set    func(o *Options, v string) error
	get    func(o *Options) string
}

func (s setting) flagName() string { return strings.ReplaceAll(s.key, "_", "-") }
func (s setting) envName() string  { return "KVROUTER_" + strings.ToUpper(s.key) }

// flagOf names a key as its flag, the way Dynamo's messages name settings.
func flagOf(key string) string { return "--" + strings.ReplaceAll(key, "_", "-") }

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
		get: func(o *Options) string { return formatFloat(*p(o)) }}
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
		get: func(o *Options) string { return formatOptional(*p(o)) }}
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

// scorerSetting names a registered scorer (policy.RegisterScorer).
func scorerSetting(key, help string) setting {
	return setting{key: key, help: help,
		set: func(o *Options, v string) error {
			s, err := policy.ParseScorer(strings.TrimSpace(v))
			if err != nil {
				return fmt.Errorf("must be one of %s (got %q)", strings.Join(policy.ScorerNames(), ", "), v)
			}
			o.Router.Scorer = s
			return nil
		},
		get: func(o *Options) string {
			if o.Router.Scorer == nil {
				return policy.DynamoCost.String()
			}
			return o.Router.Scorer.String()
		}}
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
	scorerSetting("scorer", "how each hop's candidate workers are costed: a registered scorer's name (dynamo is Dynamo's KV-router cost)"),
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
