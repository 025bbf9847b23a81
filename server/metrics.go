package server

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
)

// metrics are the router's domain metrics. Gauges of state (workers, blocks, bookings) are read from
// the state at scrape time by stateCollector, so the hot paths never update them.
type metrics struct {
	routeDecisions *prometheus.CounterVec
	routeDuration  prometheus.Histogram
	gate           *prometheus.CounterVec
	effectiveISL   prometheus.Histogram
	events         *prometheus.CounterVec
	resyncs        prometheus.Counter
	superseded     prometheus.Counter
	// logObservers time a shared log's appends and applies; the server installs them (with its
	// tracing hooks, when tracing is on). Zero without a shared log.
	logObservers kvstate.Observers
}

func newMetrics(reg prometheus.Registerer, shards kvstate.ShardSource, presence *kvstate.Presence, queue queueDepther) *metrics {
	m := &metrics{
		routeDecisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_route_decisions_total",
			Help: "Routing decisions (booked or previewed), by mode (disaggregated, bypass, aggregated), reason (why that mode: bypass, policy_declined, decode_busy, conditional_disagg_off, no_prefill_workers, ...) and model.",
		}, []string{"mode", "reason", "model"}),
		gate: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_conditional_disagg_gate_total",
			Help: "Conditional disaggregation decisions by decode gate label (bypass_declined_by_policy, bypass_allowed_decode_gate_disabled, bypass_denied_decode_busy_unknown, bypass_denied_decode_busy, bypass_allowed_decode_not_busy) and policy.",
		}, []string{"decision", "policy"}),
		effectiveISL: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrouter_conditional_disagg_effective_isl_tokens",
			Help:    "Effective ISL (prompt tokens minus tier-weighted cached tokens on the advisory decode pick) of requests conditional disaggregation evaluated. Tune eff_isl_threshold from its quantiles.",
			Buckets: prometheus.ExponentialBuckets(64, 2, 12), // 64 .. 131072 tokens
		}),
		routeDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrouter_route_decision_seconds",
			Help:    "Time to decide and book one Route request inside the router (hashing, overlap, scoring, booking).",
			Buckets: []float64{10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3},
		}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_kv_events_total",
			Help: "KV events received from workers, by outcome: applied, duplicate (id already applied), ignored (awaiting a dump), parent_not_found and invalid_sequence (stored events dropped), unknown_removed (removed hashes the worker did not hold).",
		}, []string{"outcome"}),
		resyncs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrouter_resync_requests_total",
			Help: "Dumps requested from workers after a gap in their event ids.",
		}),
		superseded: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrouter_publish_streams_superseded_total",
			Help: "Publish streams ended on this replica because a newer stream registered the same worker_id and dp_rank. A steady rate means two processes share a worker id.",
		}),
	}
	reg.MustRegister(m.routeDecisions, m.routeDuration, m.gate, m.effectiveISL, m.events, m.resyncs, m.superseded,
		&stateCollector{shards: shards, presence: presence, queue: queue})
	if shards.Ready() != nil { // a shared log
		appendLatency := prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrouter_shared_log_append_seconds",
			Help:    "Time to append a worker change to the shared log (the ack to the worker waits for it).",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 14),
		})
		applyLag := prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrouter_shared_log_apply_lag_seconds",
			Help:    "Time from a change's append to the stream to its apply on this replica: how stale this replica's view is.",
			Buckets: prometheus.ExponentialBuckets(100e-6, 2, 16),
		})
		reg.MustRegister(appendLatency, applyLag, sharedLogCollector{shards})
		m.logObservers = kvstate.Observers{
			Append: func(d time.Duration) { appendLatency.Observe(d.Seconds()) },
			Apply:  func(d time.Duration) { applyLag.Observe(max(0, d.Seconds())) },
		}
	}
	return m
}

// sharedLogCollector reports the shared log's gauges at scrape time: over every shard of a log
// sharded by model, a flag is set when it is set in any shard, a count is summed, and the snapshot
// age is the oldest shard's.
type sharedLogCollector struct{ shards kvstate.ShardSource }

// sharedLogStats sums the stats of every shard's shared log.
func sharedLogStats(shards kvstate.ShardSource) kvstate.SharedLogStats {
	var sum kvstate.SharedLogStats
	for _, sh := range shards.Shards() {
		sl, ok := sh.Log.(kvstate.SharedLog)
		if !ok {
			continue
		}
		st := sl.Stats()
		sum.Degraded = sum.Degraded || st.Degraded
		sum.Incomplete = sum.Incomplete || st.Incomplete
		sum.NewerVersion = sum.NewerVersion || st.NewerVersion
		sum.BufferedChanges += st.BufferedChanges
		sum.LostChanges += st.LostChanges
		sum.Length += st.Length
		sum.SnapshotBytes += st.SnapshotBytes
		sum.GenerationChanges += st.GenerationChanges
		if !st.SnapshotAt.IsZero() && (sum.SnapshotAt.IsZero() || st.SnapshotAt.Before(sum.SnapshotAt)) {
			sum.SnapshotAt = st.SnapshotAt
		}
	}
	return sum
}

var (
	degradedDesc = prometheus.NewDesc("kvrouter_shared_log_degraded",
		"1 while Redis is unreachable or changes made during an outage still wait to be published; routing goes on from local state.", nil, nil)
	bufferedDesc = prometheus.NewDesc("kvrouter_shared_log_buffered_changes",
		"Worker changes applied locally during a Redis outage and waiting to be published.", nil, nil)
	lostDesc = prometheus.NewDesc("kvrouter_shared_log_lost_changes_total",
		"Changes applied locally that could not be kept for the other replicas (buffer bound exceeded); their workers are asked to resync.", nil, nil)
	streamLenDesc = prometheus.NewDesc("kvrouter_shared_log_stream_length",
		"Entries in the Redis stream (trimmed behind snapshots).", nil, nil)
	snapshotBytesDesc = prometheus.NewDesc("kvrouter_shared_log_snapshot_bytes",
		"Size of the last snapshot this replica wrote or loaded.", nil, nil)
	snapshotAgeDesc = prometheus.NewDesc("kvrouter_shared_log_snapshot_age_seconds",
		"Time since the last snapshot this replica wrote or loaded.", nil, nil)
	incompleteDesc = prometheus.NewDesc("kvrouter_shared_log_incomplete",
		"1 while this replica knows its state may not be the shared one: Redis lost the log and it is not reseeded yet, or the replica follows a fresh log that a replica with state may still reseed.", nil, nil)
	newerVersionDesc = prometheus.NewDesc("kvrouter_shared_log_newer_version",
		"1 once the shared log holds an entry or snapshot of a newer version than this replica reads: it stopped applying the log there. Upgrade this replica.", nil, nil)
	generationChangesDesc = prometheus.NewDesc("kvrouter_shared_log_generation_changes_total",
		"Times this replica moved to another generation of the shared log: it reseeded a lost log from its state, or reloaded one reseeded elsewhere.", nil, nil)
)

func (c sharedLogCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{degradedDesc, bufferedDesc, lostDesc, streamLenDesc, snapshotBytesDesc, snapshotAgeDesc, incompleteDesc, newerVersionDesc, generationChangesDesc} {
		ch <- d
	}
}

func (c sharedLogCollector) Collect(ch chan<- prometheus.Metric) {
	st := sharedLogStats(c.shards)
	degraded := 0.0
	if st.Degraded {
		degraded = 1
	}
	ch <- prometheus.MustNewConstMetric(degradedDesc, prometheus.GaugeValue, degraded)
	ch <- prometheus.MustNewConstMetric(bufferedDesc, prometheus.GaugeValue, float64(st.BufferedChanges))
	ch <- prometheus.MustNewConstMetric(lostDesc, prometheus.CounterValue, float64(st.LostChanges))
	ch <- prometheus.MustNewConstMetric(streamLenDesc, prometheus.GaugeValue, float64(st.Length))
	ch <- prometheus.MustNewConstMetric(snapshotBytesDesc, prometheus.GaugeValue, float64(st.SnapshotBytes))
	incomplete := 0.0
	if st.Incomplete {
		incomplete = 1
	}
	ch <- prometheus.MustNewConstMetric(incompleteDesc, prometheus.GaugeValue, incomplete)
	newer := 0.0
	if st.NewerVersion {
		newer = 1
	}
	ch <- prometheus.MustNewConstMetric(newerVersionDesc, prometheus.GaugeValue, newer)
	ch <- prometheus.MustNewConstMetric(generationChangesDesc, prometheus.CounterValue, float64(st.GenerationChanges))
	if !st.SnapshotAt.IsZero() {
		ch <- prometheus.MustNewConstMetric(snapshotAgeDesc, prometheus.GaugeValue, time.Since(st.SnapshotAt).Seconds())
	}
}

func (m *metrics) observeRoute(model string, d *policy.Decision, took time.Duration) {
	m.routeDecisions.WithLabelValues(d.Mode.String(), d.Reason.String(), model).Inc()
	m.routeDuration.Observe(took.Seconds())
	if cd := d.CD; cd != nil {
		if cd.Gate != "" {
			m.gate.WithLabelValues(string(cd.Gate), cd.Policy.String()).Inc()
		}
		m.effectiveISL.Observe(cd.EffectiveISL)
	}
}

func (m *metrics) observeEvents(r kvstate.Result) {
	for _, c := range []struct {
		outcome string
		n       int
	}{
		{"applied", r.Applied}, {"duplicate", r.Duplicates}, {"ignored", r.Ignored},
		{"parent_not_found", r.ParentNotFound}, {"invalid_sequence", r.InvalidSequence}, {"unknown_removed", r.UnknownRemoved},
		{"invalid", r.Invalid},
	} {
		if c.n > 0 {
			m.events.WithLabelValues(c.outcome).Add(float64(c.n))
		}
	}
}

// queueDepther reports how many Route requests wait for capacity (app.Dispatcher).
type queueDepther interface{ QueueDepth() int }

// stateCollector reports gauges of the state when scraped: of every shard's, for a log sharded by
// model (each model is in one shard, so no series repeats).
type stateCollector struct {
	shards   kvstate.ShardSource
	presence *kvstate.Presence
	queue    queueDepther
}

var (
	workersDesc = prometheus.NewDesc("kvrouter_workers", "Registered worker ranks, by model, role and whether a stream is connected.",
		[]string{"model", "role", "connected"}, nil)
	indexBlocksDesc = prometheus.NewDesc("kvrouter_index_blocks", "Distinct block positions in a model's prefix index.",
		[]string{"model"}, nil)
	bookingsDesc = prometheus.NewDesc("kvrouter_bookings", "Routed requests whose load is booked (not yet freed or expired).",
		nil, nil)
	bookedBlocksDesc = prometheus.NewDesc("kvrouter_booked_blocks",
		"Block keys the bookings hold, every hop's (8 bytes each, pinned until freed or expired); at max_booked_blocks a Route is refused (BOOKINGS_FULL).",
		nil, nil)
	logPositionDesc = prometheus.NewDesc("kvrouter_log_position", "Changes applied to the local state from the log.",
		nil, nil)
	silentDecodeDesc = prometheus.NewDesc("kvrouter_decode_workers_without_kv_events",
		"Decode workers that registered without KV events. Their cache is invisible to the router, so conditional disaggregation never bypasses to them.",
		[]string{"model"}, nil)
	queueDepthDesc = prometheus.NewDesc("kvrouter_route_queue_depth",
		"Route requests waiting because every eligible worker is over router_queue_threshold.", nil, nil)
	// Per worker rank (worker is "id/rank"): one series each, so the dashboard can show which
	// workers carry the load and the cache. Bounded by max_workers_per_model.
	workerActiveBlocksDesc = prometheus.NewDesc("kvrouter_worker_active_blocks",
		"KV blocks the router's bookings hold on a worker rank (active requests' prompt blocks).", []string{"model", "worker"}, nil)
	workerPrefillTokensDesc = prometheus.NewDesc("kvrouter_worker_active_prefill_tokens",
		"Prompt tokens booked on a worker rank that are not yet prefilled.", []string{"model", "worker"}, nil)
	workerActiveRequestsDesc = prometheus.NewDesc("kvrouter_worker_active_requests",
		"Requests booked on a worker rank and not yet freed.", []string{"model", "worker"}, nil)
	workerCachedBlocksDesc = prometheus.NewDesc("kvrouter_worker_cached_blocks",
		"KV blocks a worker rank holds, per storage tier, as its events told the router.", []string{"model", "worker", "tier"}, nil)
	bookingsExpiredDesc = prometheus.NewDesc("kvrouter_bookings_expired_total",
		"Bookings ended by booking_expiry because nobody freed them (a caller, proxy or replica died before its Free). Every replica counts the same expiries.", nil, nil)
	indexRefusedDesc = prometheus.NewDesc("kvrouter_index_blocks_refused_total",
		"Stored blocks not indexed because all models' indexes together held max_index_blocks: alert on any increase, and raise the cap.", nil, nil)
)

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- workersDesc
	ch <- indexBlocksDesc
	ch <- bookingsDesc
	ch <- bookedBlocksDesc
	ch <- logPositionDesc
	ch <- silentDecodeDesc
	ch <- queueDepthDesc
	ch <- indexRefusedDesc
	ch <- bookingsExpiredDesc
	ch <- workerActiveBlocksDesc
	ch <- workerPrefillTokensDesc
	ch <- workerActiveRequestsDesc
	ch <- workerCachedBlocksDesc
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	var bookings, held, position, refused, expired uint64
	for _, sh := range c.shards.Shards() {
		c.collectShard(ch, sh.State)
		bookings += uint64(sh.State.Load().Bookings())
		held += uint64(sh.State.Load().HeldBlocks())
		position += sh.Log.Position()
		refused += sh.State.IndexBlocksRefused()
		expired += sh.State.ExpiredBookings()
	}
	ch <- prometheus.MustNewConstMetric(bookingsDesc, prometheus.GaugeValue, float64(bookings))
	ch <- prometheus.MustNewConstMetric(bookedBlocksDesc, prometheus.GaugeValue, float64(held))
	ch <- prometheus.MustNewConstMetric(logPositionDesc, prometheus.GaugeValue, float64(position))
	ch <- prometheus.MustNewConstMetric(queueDepthDesc, prometheus.GaugeValue, float64(c.queue.QueueDepth()))
	ch <- prometheus.MustNewConstMetric(indexRefusedDesc, prometheus.CounterValue, float64(refused))
	ch <- prometheus.MustNewConstMetric(bookingsExpiredDesc, prometheus.CounterValue, float64(expired))
}

// collectShard reports the per-model and per-worker gauges of one shard's state.
func (c *stateCollector) collectShard(ch chan<- prometheus.Metric, state *kvstate.State) {
	for _, m := range state.Models() {
		type key struct {
			role      string
			connected bool
		}
		counts := map[key]int{}
		silent := 0
		load := state.Load()
		for _, w := range m.Workers() {
			counts[key{w.Info.Role.String(), c.presence.IsConnected(w.Info.Key)}]++
			name := w.Info.Key.String()
			l := load.Slot(w.Slot)
			ch <- prometheus.MustNewConstMetric(workerActiveBlocksDesc, prometheus.GaugeValue, float64(l.ActiveBlocks), m.Name, name)
			ch <- prometheus.MustNewConstMetric(workerPrefillTokensDesc, prometheus.GaugeValue, float64(l.ActivePrefillTokens), m.Name, name)
			ch <- prometheus.MustNewConstMetric(workerActiveRequestsDesc, prometheus.GaugeValue, float64(l.ActiveRequests), m.Name, name)
			for tier, n := range m.Index.BlockCounts(w.Slot) {
				ch <- prometheus.MustNewConstMetric(workerCachedBlocksDesc, prometheus.GaugeValue, float64(n), m.Name, name, kvstate.Tier(tier).String())
			}
			if w.Info.Role == kvstate.RoleDecode && !w.Info.KVEventsEnabled {
				silent++
			}
		}
		ch <- prometheus.MustNewConstMetric(silentDecodeDesc, prometheus.GaugeValue, float64(silent), m.Name)
		for k, n := range counts {
			connected := "false"
			if k.connected {
				connected = "true"
			}
			ch <- prometheus.MustNewConstMetric(workersDesc, prometheus.GaugeValue, float64(n), m.Name, k.role, connected)
		}
		ch <- prometheus.MustNewConstMetric(indexBlocksDesc, prometheus.GaugeValue, float64(m.Index.Len()), m.Name)
	}
}
