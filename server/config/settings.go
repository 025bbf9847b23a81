package config

import (
	"crypto/tls"
	"fmt"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/config/layered"
)

// setting is one configuration key of kvrouter serve (server/config/layered says how each is named,
// parsed and layered).
type setting = layered.Setting[Options]

// scorerSetting names a registered scorer (policy.RegisterScorer).
func scorerSetting(key, help string) setting {
	return setting{Key: key, Help: help,
		Set: func(o *Options, v string) error {
			s, err := policy.ParseScorer(strings.TrimSpace(v))
			if err != nil {
				return fmt.Errorf("must be one of %s (got %q)", strings.Join(policy.ScorerNames(), ", "), v)
			}
			o.Routing.Scorer = s
			return nil
		},
		Get: func(o *Options) string {
			if o.Routing.Scorer == nil {
				return policy.DynamoCost.String()
			}
			return o.Routing.Scorer.String()
		}}
}

// tlsVersionSetting is a TLS version written 1.2 or 1.3.
func tlsVersionSetting(key, help string) setting {
	return setting{Key: key, Help: help,
		Set: func(o *Options, v string) error {
			switch strings.TrimSpace(v) {
			case "1.2":
				o.TLSMinVersion = tls.VersionTLS12
			case "1.3":
				o.TLSMinVersion = tls.VersionTLS13
			default:
				return fmt.Errorf("must be 1.2 or 1.3 (got %q)", v)
			}
			return nil
		},
		Get: func(o *Options) string {
			if o.TLSMinVersion == tls.VersionTLS13 {
				return "1.3"
			}
			return "1.2"
		}}
}

// mapping lets a setting be written as a YAML mapping in the file (it receives it as JSON).
func mapping(s setting) setting {
	s.Mapping = true
	return s
}

// settings lists every configuration key, in the order --help shows them.
var settings = []setting{
	layered.String("listen", "gRPC listen address", func(o *Options) *string { return &o.Listen }),
	layered.String("metrics_listen", "HTTP listen address for /metrics (empty turns it off)", func(o *Options) *string { return &o.MetricsListen }),
	layered.String("health_listen", "a second gRPC address, always plaintext and without credentials, serving only the health service (grpc.health.v1), for probes that cannot use the main port's TLS or tokens, such as Kubernetes' gRPC probes; empty turns it off", func(o *Options) *string { return &o.HealthListen }),
	layered.String("picker_listen", "gRPC address of the ext_proc endpoint picker for Envoy-based gateways (the Gateway API Inference Extension's protocol; docs/gateway.md), served with the main port's TLS, credentials (the frontend role) and limits; empty turns it off", func(o *Options) *string { return &o.PickerListen }),
	layered.String("picker_destination_header", "the request header in which the endpoint picker names the picked (decode or aggregated) worker, beside the protocol's dynamic metadata", func(o *Options) *string { return &o.PickerDestinationHeader }),
	layered.String("picker_prefill_header", "the request header in which the endpoint picker names a disaggregated request's prefill worker, for the decode worker's P/D sidecar (llm-d's reads x-prefiller-host-port); removed from every other request", func(o *Options) *string { return &o.PickerPrefillHeader }),
	layered.String("picker_session_header", "the request header whose value binds a conversation to its decode worker for session_affinity_ttl; empty turns session affinity off for the picker", func(o *Options) *string { return &o.PickerSessionHeader }),
	layered.String("picker_model_header", "a request header naming the model, which then wins over the body's \"model\" (the one a gateway sets after rewriting the model); empty reads the body only", func(o *Options) *string { return &o.PickerModelHeader }),
	layered.String("picker_models", "the models whose text prompts the endpoint picker tokenizes, comma-separated as name=directory (the name the request's \"model\" carries; a Hugging Face model directory with tokenizer.json and tokenizer_config.json, loaded at start); without it the picker routes completions of token ids only", func(o *Options) *string { return &o.PickerModels }),
	layered.Int("picker_max_body_bytes", "largest request body the endpoint picker buffers; a larger one is answered 413", func(o *Options) *int { return &o.PickerMaxBodyBytes }, 1024),
	layered.Bool("pprof", "also serve Go's profiler at /debug/pprof/ on pprof_listen (CPU, heap, allocations, mutex and block profiles, goroutines); off by default: a profile costs CPU and shows internals", func(o *Options) *bool { return &o.Pprof }),
	layered.String("pprof_listen", "the loopback HTTP address of the profiler (pprof): it answers without authentication, so it must be a loopback address (reach it with kubectl port-forward or ssh)", func(o *Options) *string { return &o.PprofListen }),
	layered.String("log_level", "log level: debug, info, warn or error", func(o *Options) *string { return &o.LogLevel }),
	layered.Int("max_prompt_tokens", "longest prompt Route accepts, in tokens", func(o *Options) *int { return &o.MaxPromptTokens }, 1),
	layered.Int("max_recv_msg_bytes", "largest gRPC message accepted, in bytes", func(o *Options) *int { return &o.MaxRecvMsgBytes }, 1024),
	layered.Int("max_concurrent_streams", "concurrent gRPC streams per connection", func(o *Options) *int { return &o.MaxConcurrentStreams }, 1),
	layered.Int("max_connections", "connections the gRPC port holds at once; one accepted past it is closed at once (counted in kvrouter_connections_refused_total): each costs about 64 KiB of buffers and a file descriptor", func(o *Options) *int { return &o.MaxConnections }, 1),
	layered.Int("health_max_connections", "connections the health port holds at once (each serves at most 4 streams); one accepted past it is closed at once", func(o *Options) *int { return &o.HealthMaxConnections }, 1),
	layered.Int("max_refused_calls_per_conn", "calls a connection may have refused for their credentials (UNAUTHENTICATED, PERMISSION_DENIED) within a second; past it the connection is closed (a flood without credentials, or HTTP/2 rapid reset), counted in kvrouter_connections_cut_total", func(o *Options) *int { return &o.MaxRefusedCallsPerConn }, 1),
	layered.Int("max_header_list_bytes", "largest header list (metadata, the authorization token included) a call may send, on both ports; a larger one is refused before it is read", func(o *Options) *int { return &o.MaxHeaderListBytes }, 1024),
	layered.Int("max_publish_msg_bytes", "largest Publish message (event batch, dump part, hello, load report), in bytes; at most max_recv_msg_bytes", func(o *Options) *int { return &o.MaxPublishMsgBytes }, 1024),
	layered.Int("max_batch_blocks", "most events, and most blocks (stored blocks plus removed hashes), one Publish message may carry", func(o *Options) *int { return &o.MaxBatchBlocks }, 1),
	layered.Int("max_dump_blocks", "most blocks one dump may hold over all its parts", func(o *Options) *int { return &o.MaxDumpBlocks }, 1),
	layered.Int("max_dump_bytes_in_flight", "most bytes the dumps in parts of all Publish streams may hold between their parts, together (16 bytes a block); past it a part is refused with RESOURCE_EXHAUSTED and a retry delay", func(o *Options) *int { return &o.MaxDumpBytesInFlight }, 1<<20),
	layered.Duration("worker_grace_period", "how long a worker whose stream closed keeps its blocks before it is removed", func(o *Options) *time.Duration { return &o.WorkerGracePeriod }),
	layered.Duration("booking_expiry", "how long a booking nobody frees lives", func(o *Options) *time.Duration { return &o.BookingExpiry }),
	layered.Duration("shutdown_drain", "how long health reports NOT_SERVING before the server stops", func(o *Options) *time.Duration { return &o.ShutdownDrain }),
	layered.Duration("shutdown_timeout", "deadline for in-flight calls to finish on shutdown", func(o *Options) *time.Duration { return &o.ShutdownTimeout }),

	layered.Bool("plaintext", "serve gRPC without TLS on a non-loopback listen address (a loopback one never needs it): anyone who reaches the port can then read and forge traffic", func(o *Options) *bool { return &o.Plaintext }),
	layered.String("tls_cert_file", "server certificate chain (PEM); with tls_key_file it turns TLS on; both are reloaded when they change", func(o *Options) *string { return &o.TLSCertFile }),
	layered.String("tls_key_file", "server private key (PEM)", func(o *Options) *string { return &o.TLSKeyFile }),
	layered.String("tls_client_ca_file", "CA certificates (PEM) of client certificates: when set, every client must present one they sign (mutual TLS); reloaded when it changes", func(o *Options) *string { return &o.TLSClientCAFile }),
	layered.String("tls_client_auth", "with tls_client_ca_file: require (every client presents a certificate the CAs sign) or optional (a certificate, when presented, must verify; clients without one authenticate with a bearer token)", func(o *Options) *string { return &o.TLSClientAuth }),
	tlsVersionSetting("tls_min_version", "oldest TLS version accepted: 1.2 or 1.3"),
	layered.String("credentials_file", "YAML file of the callers let in: bearer-token SHA-256 hashes and mTLS identities, each with its roles (worker, frontend, admin), the worker ids and models a worker may publish for, and its limits; reloaded when it changes; empty: every caller may call everything", func(o *Options) *string { return &o.CredentialsFile }),
	layered.Bool("auth_open_health", "with credentials_file: the health service answers callers without credentials (load balancer and kubelet probes); false: any valid credential", func(o *Options) *bool { return &o.AuthOpenHealth }),
	layered.Bool("auth_open_reflection", "with credentials_file: server reflection answers callers without credentials (it describes the public API, which grpcurl needs to call even health); false: only valid credentials may use it", func(o *Options) *bool { return &o.AuthOpenReflection }),
	layered.Duration("file_reload_interval", "how often the TLS files and the credentials file are checked for changes", func(o *Options) *time.Duration { return &o.FileReloadInterval }),
	layered.Float("route_rate_limit", "Route calls per second one credential may make, after a burst of one second's worth; beyond, RESOURCE_EXHAUSTED with RetryInfo; 0: no limit (the credentials file may set one per credential)", func(o *Options) *float64 { return &o.RouteRateLimit }),
	layered.Float("route_token_rate_limit", "prompt tokens of booked Routes a second one credential may send, after a burst of max_prompt_tokens or one second's worth; beyond, RESOURCE_EXHAUSTED with RetryInfo; 0: no limit (the credentials file may set one per credential). Bookings pin their prompt's blocks until freed, so this bounds what one caller pins (with booking_expiry)", func(o *Options) *float64 { return &o.RouteTokenRateLimit }),
	layered.Float("event_rate_limit", "KV event blocks (stored plus removed, in batches and dumps) per second one credential may publish; a stream over it is slowed for up to 1s, then ended with RESOURCE_EXHAUSTED and RetryInfo; 0: no limit", func(o *Options) *float64 { return &o.EventRateLimit }),
	layered.Int("max_publish_streams_per_credential", "concurrent Publish streams one credential may hold; more are refused with RESOURCE_EXHAUSTED", func(o *Options) *int { return &o.MaxPublishStreams }, 1),
	layered.Int("max_workers_per_model", "worker ranks one model may register; more are refused with RESOURCE_EXHAUSTED", func(o *Options) *int { return &o.MaxWorkersPerModel }, 1),
	layered.Int("max_booked_blocks", "block keys the bookings of a replica may hold together (a prompt's blocks, on each hop; 8 bytes each, pinned on every replica and in the shared log until freed or expired); a Route whose booking would pass it is refused with RESOURCE_EXHAUSTED (BOOKINGS_FULL) and a retry delay", func(o *Options) *int { return &o.MaxBookedBlocks }, 1),
	layered.Int("max_booked_blocks_per_credential", "block keys the bookings of one credential may hold together, counted as max_booked_blocks counts them (the credentials file may set one per credential); a Route whose booking would pass it is refused with RESOURCE_EXHAUSTED (CREDENTIAL_BOOKINGS_FULL) and a retry delay, so no caller can take all of max_booked_blocks; 0: no bound", func(o *Options) *int { return &o.MaxBookedBlocksPerCredential }, 0),
	layered.Int("max_models", "models workers may register; a hello naming a new model past it is refused with RESOURCE_EXHAUSTED (each model lives on, and adds series to /metrics)", func(o *Options) *int { return &o.MaxModels }, 1),
	layered.Int("max_ranks_per_worker", "data-parallel ranks one worker id may register in a model; more are refused with RESOURCE_EXHAUSTED, so that one worker's credential cannot fill max_workers_per_model", func(o *Options) *int { return &o.MaxRanksPerWorker }, 1),
	layered.Int("max_index_blocks", "distinct blocks all models' prefix indexes hold together; past it newly stored blocks are not indexed (kvrouter_index_blocks_refused_total counts them) until evictions make room; 0: no cap; equal on every replica; with redis_shard_by_model it bounds each model's index", func(o *Options) *int { return &o.MaxIndexBlocks }, 0),
	layered.Duration("keepalive_min_time", "clients that ping more often than this are disconnected (GOAWAY too_many_pings)", func(o *Options) *time.Duration { return &o.KeepaliveMinTime }),
	layered.Duration("max_connection_age", "connections are asked to go away (GOAWAY) after this long, so clients spread over the replicas after a scale-out; 0: never", func(o *Options) *time.Duration { return &o.MaxConnectionAge }),
	layered.Duration("max_connection_age_grace", "how long calls and streams on a connection past max_connection_age may go on before it closes (publishers then resume on a new one)", func(o *Options) *time.Duration { return &o.MaxConnectionAgeGrace }),

	layered.String("redis_addr", "share state with other replicas through this Redis server (host:port); empty: embedded state", func(o *Options) *string { return &o.RedisAddr }),
	layered.String("redis_cluster_addrs", "share state through this Redis Cluster (comma-separated seed host:port list)", func(o *Options) *string { return &o.RedisClusterAddrs }),
	layered.String("redis_prefix", "prefix of every Redis key, with the hash tag that keeps them on one cluster slot", func(o *Options) *string { return &o.RedisPrefix }),
	layered.Int("redis_max_buffered", "worker changes a replica keeps while Redis is unreachable; past it, workers are asked to resync when Redis returns", func(o *Options) *int { return &o.RedisMaxBuffered }, 1),
	layered.Int("snapshot_every", "changes (one per block event of KV batches) applied between two snapshots of the shared state; one replica at a time writes them", func(o *Options) *int { return &o.SnapshotEvery }, 1),
	layered.Int("snapshot_chunk_bytes", "size of the pieces (one Redis key each) a snapshot of the shared state is stored in; smaller pieces hold Redis for less time per command", func(o *Options) *int { return &o.SnapshotChunkBytes }, 64<<10),
	layered.Duration("snapshot_interval", "longest time between two snapshots of the shared state", func(o *Options) *time.Duration { return &o.SnapshotInterval }),
	layered.Duration("redis_reseed_window", "after Redis lost its data, how long a fresh shared log started by a replica without state may still be replaced by a running replica's state (its SharedState health is NOT_SERVING meanwhile)", func(o *Options) *time.Duration { return &o.RedisReseedWindow }),
	layered.String("redis_username", "Redis ACL user (empty: the default user)", func(o *Options) *string { return &o.RedisUsername }),
	layered.Secret("redis_password", "Redis password; only from KVROUTER_REDIS_PASSWORD or the config file, never a flag (prefer redis_password_file)", func(o *Options) *string { return &o.RedisPassword }),
	layered.String("redis_password_file", "file whose content (without a trailing newline) is the Redis password", func(o *Options) *string { return &o.RedisPasswordFile }),
	layered.Bool("redis_tls", "connect to Redis over TLS", func(o *Options) *bool { return &o.RedisTLS }),
	layered.String("redis_tls_ca_file", "CA certificates (PEM) of Redis's certificate (empty: the system's)", func(o *Options) *string { return &o.RedisTLSCAFile }),
	layered.String("redis_tls_cert_file", "client certificate (PEM) for a Redis that requires one", func(o *Options) *string { return &o.RedisTLSCertFile }),
	layered.String("redis_tls_key_file", "its private key (PEM)", func(o *Options) *string { return &o.RedisTLSKeyFile }),
	layered.String("redis_tls_server_name", "name Redis's certificate must carry (empty: the address's host)", func(o *Options) *string { return &o.RedisTLSServerName }),
	layered.Bool("redis_shard_by_model", "split the shared log by model: one stream, snapshot and worker leases per model, each under a hash tag of its own, so a Redis Cluster spreads the models over its masters; replicas apply the models in parallel (docs/operations.md, \"Sharding the shared log by model\")", func(o *Options) *bool { return &o.RedisShardByModel }),
	layered.String("redis_models", "with redis_shard_by_model: the models this replica serves, comma-separated (it tails their shards only and refuses workers of others with FAILED_PRECONDITION); empty: every model", func(o *Options) *string { return &o.RedisModels }),
	layered.String("replica_id", "this replica's name in the shared log (default: hostname-pid)", func(o *Options) *string { return &o.ReplicaID }),
	scorerSetting("scorer", "how each hop's candidate workers are costed: a registered scorer's name (dynamo is Dynamo's KV-router cost)"),
	layered.Float("overlap_score_credit", "credit per cached device block in the cost (Dynamo overlap_score_credit)", func(o *Options) *float64 { return &o.Routing.OverlapScoreCredit }),
	layered.Float("overlap_score_credit_decay", "shrinks the credit of workers with more prefill load than the least loaded", func(o *Options) *float64 { return &o.Routing.OverlapScoreCreditDecay }),
	layered.Float("prefill_load_scale", "weight of the prefill term of the cost", func(o *Options) *float64 { return &o.Routing.PrefillLoadScale }),
	layered.OptionalFloat("overlap_score_weight", "deprecated: sets prefill_load_scale (and the credit to 0 when 0)", func(o *Options) **float64 { return &o.Routing.OverlapScoreWeight }),
	layered.Float("decode_active_request_weight", "cost per active request on a worker", func(o *Options) *float64 { return &o.Routing.DecodeActiveRequestWeight }),
	layered.Float("host_cache_hit_weight", "credit per host-memory block beyond the device prefix, in [0, 1]", func(o *Options) *float64 { return &o.Routing.HostCacheHitWeight }),
	layered.Float("disk_cache_hit_weight", "credit per disk block beyond the host prefix, in [0, 1]", func(o *Options) *float64 { return &o.Routing.DiskCacheHitWeight }),
	layered.Float("shared_cache_multiplier", "credit per external-tier block beyond the disk prefix, in [0, 1]", func(o *Options) *float64 { return &o.Routing.SharedCacheMultiplier }),
	layered.Float("router_temperature", "softmax temperature of worker selection (0 picks the cheapest)", func(o *Options) *float64 { return &o.Routing.RouterTemperature }),
	layered.Bool("use_kv_events", "score cache overlap from workers' KV events", func(o *Options) *bool { return &o.Routing.UseKVEvents }),
	layered.Bool("router_assume_kv_reuse", "count blocks shared by active requests once", func(o *Options) *bool { return &o.Routing.AssumeKVReuse }),
	layered.Bool("router_track_prefill_tokens", "charge prefill tokens in the cost and bookings", func(o *Options) *bool { return &o.Routing.TrackPrefillTokens }),
	layered.OptionalFloat("router_queue_threshold", "a worker is overloaded when its prefill tokens exceed this times its max_num_batched_tokens (unset: never)", func(o *Options) **float64 { return &o.Routing.QueueThreshold }),
	layered.String("router_queue_policy", "order of queued requests: fcfs or wspt", func(o *Options) *string { return &o.Routing.QueuePolicy }),
	layered.Int("router_queue_max_depth", "requests the router queue holds; more are refused with RESOURCE_EXHAUSTED", func(o *Options) *int { return &o.Routing.QueueMaxDepth }, 1),
	layered.Duration("session_affinity_ttl", "how long a session (RouteRequest.session_id) keeps its decode worker; 0 turns session affinity off", func(o *Options) *time.Duration { return &o.Routing.SessionAffinityTTL }),
	layered.Bool("conditional_disagg", "conditional disaggregation: a decode worker that caches most of a prompt prefills it itself (bypass)", func(o *Options) *bool { return &o.ConditionalDisagg }),
	mapping(layered.String("conditional_disagg_config", `conditional disaggregation settings as a JSON object, e.g. {"policy":"isl_bounding","eff_isl_threshold":2048,"eff_isl_ratio_threshold":0.7,"prefill_busy_threshold":null,"decode_busy_threshold":null}`, func(o *Options) *string { return &o.ConditionalDisaggConfig })),
	layered.Bool("enforce_disagg", "fail requests for models without prefill workers instead of routing them aggregated", func(o *Options) *bool { return &o.Routing.EnforceDisagg }),
}
