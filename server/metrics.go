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
	events         *prometheus.CounterVec
	resyncs        prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, state *kvstate.State, log kvstate.Log) *metrics {
	m := &metrics{
		routeDecisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_route_decisions_total",
			Help: "Routing decisions, by mode (disaggregated, bypass, aggregated) and model.",
		}, []string{"mode", "model"}),
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
	}
	reg.MustRegister(m.routeDecisions, m.routeDuration, m.events, m.resyncs, &stateCollector{state: state, log: log})
	return m
}

func (m *metrics) observeRoute(model string, d *policy.Decision, took time.Duration) {
	m.routeDecisions.WithLabelValues(d.Mode.String(), model).Inc()
	m.routeDuration.Observe(took.Seconds())
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

// stateCollector reports gauges of the state when scraped.
type stateCollector struct {
	state *kvstate.State
	log   kvstate.Log
}

var (
	workersDesc = prometheus.NewDesc("kvrouter_workers", "Registered worker ranks, by model, role and whether a stream is connected.",
		[]string{"model", "role", "connected"}, nil)
	indexBlocksDesc = prometheus.NewDesc("kvrouter_index_blocks", "Distinct block positions in a model's prefix index.",
		[]string{"model"}, nil)
	bookingsDesc = prometheus.NewDesc("kvrouter_bookings", "Routed requests whose load is booked (not yet freed or expired).",
		nil, nil)
	logPositionDesc = prometheus.NewDesc("kvrouter_log_position", "Changes applied to the local state from the log.",
		nil, nil)
)

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- workersDesc
	ch <- indexBlocksDesc
	ch <- bookingsDesc
	ch <- logPositionDesc
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	for _, m := range c.state.Models() {
		type key struct {
			role      string
			connected bool
		}
		counts := map[key]int{}
		for _, w := range m.Workers() {
			counts[key{w.Info.Role.String(), w.Status().Connected}]++
		}
		for k, n := range counts {
			connected := "false"
			if k.connected {
				connected = "true"
			}
			ch <- prometheus.MustNewConstMetric(workersDesc, prometheus.GaugeValue, float64(n), m.Name, k.role, connected)
		}
		ch <- prometheus.MustNewConstMetric(indexBlocksDesc, prometheus.GaugeValue, float64(m.Index.Len()), m.Name)
	}
	ch <- prometheus.MustNewConstMetric(bookingsDesc, prometheus.GaugeValue, float64(c.state.Load().Bookings()))
	ch <- prometheus.MustNewConstMetric(logPositionDesc, prometheus.GaugeValue, float64(c.log.Position()))
}
