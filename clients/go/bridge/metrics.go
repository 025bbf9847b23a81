package bridge

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the bridge's Prometheus metrics, every one labelled by the engine's data-parallel
// rank. docs/engines.md lists them.
type metrics struct {
	batches       *prometheus.CounterVec   // dp_rank, result: ok, malformed, dp_rank_mismatch
	blocksIn      *prometheus.CounterVec   // dp_rank: blocks named by decoded events
	blocksOut     *prometheus.CounterVec   // dp_rank: blocks forwarded to the router
	eventsOut     *prometheus.CounterVec   // dp_rank: kvrouter events published
	dropped       *prometheus.CounterVec   // dp_rank, reason: events not forwarded
	droppedBlocks *prometheus.CounterVec   // dp_rank, reason: blocks not forwarded
	gaps          *prometheus.CounterVec   // dp_rank
	replays       *prometheus.CounterVec   // dp_rank, result: complete, incomplete, failed
	resets        *prometheus.CounterVec   // dp_rank, reason: gap, engine_restart, reconnect, router_state_lost, resync_request
	ackLag        *prometheus.HistogramVec // dp_rank: engine timestamp to the router's ack
	engineSeq     *prometheus.GaugeVec     // dp_rank: last sequence number received
	ackedSeq      *prometheus.GaugeVec     // dp_rank: last sequence number the router acked whole
	connected     *prometheus.GaugeVec     // dp_rank: 1 while subscribed to the engine
	mirrored      *prometheus.GaugeVec     // dp_rank: blocks the bridge holds for dumps
	engineUp      *prometheus.GaugeVec     // dp_rank: 1 while the engine's checks pass
	leaves        *prometheus.CounterVec   // dp_rank: times the worker left the router, its engine down
}

func newMetrics(reg prometheus.Registerer) *metrics {
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "kvrouter", Subsystem: "bridge", Name: name, Help: help}, append([]string{"dp_rank"}, labels...))
	}
	gauge := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "kvrouter", Subsystem: "bridge", Name: name, Help: help}, []string{"dp_rank"})
	}
	m := &metrics{
		batches:       counter("batches_total", "Engine batches received, by result (ok, malformed, dp_rank_mismatch).", "result"),
		blocksIn:      counter("blocks_received_total", "Blocks named by the engine events decoded."),
		blocksOut:     counter("blocks_forwarded_total", "Blocks forwarded to the router (stored and removed)."),
		eventsOut:     counter("events_forwarded_total", "KV events published to the router."),
		dropped:       counter("events_dropped_total", "Engine events not forwarded, by reason.", "reason"),
		droppedBlocks: counter("blocks_dropped_total", "Blocks not forwarded, by reason.", "reason"),
		gaps:          counter("gaps_total", "Gaps in the engine's sequence numbers."),
		replays:       counter("replays_total", "Requests to the engine's replay endpoint, by result (complete, incomplete, failed).", "result"),
		resets:        counter("resets_total", "Times the worker's blocks were cleared at the router because events were lost or the engine restarted, by reason.", "reason"),
		ackLag: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "kvrouter", Subsystem: "bridge", Name: "ack_lag_seconds",
			Help:    "Time from the engine's batch timestamp to the router's ack of its last event.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}, []string{"dp_rank"}),
		engineSeq: gauge("engine_seq", "The last sequence number received from the engine."),
		ackedSeq:  gauge("acked_seq", "The last engine sequence number whose every event the router acked."),
		connected: gauge("subscriber_connected", "1 while the bridge is subscribed to the engine's endpoint."),
		mirrored:  gauge("mirrored_blocks", "Blocks the bridge keeps to answer the router's resync requests."),
		engineUp:  gauge("engine_up", "1 while the engine is up (its checks pass), 0 once it is down and the worker left the router."),
		leaves:    counter("leaves_total", "Times the worker left the router because its engine was down."),
	}
	if reg != nil {
		reg.MustRegister(m.batches, m.blocksIn, m.blocksOut, m.eventsOut, m.dropped, m.droppedBlocks, m.gaps, m.replays,
			m.resets, m.ackLag, m.engineSeq, m.ackedSeq, m.connected, m.mirrored, m.engineUp, m.leaves)
	}
	return m
}
