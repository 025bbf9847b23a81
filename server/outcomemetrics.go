package server

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/server/app"
)

// RouteOutcomes turns what became of routed requests (app.Outcomes) into histograms: how long after
// its booking a request's prefill completed (MarkPrefillComplete: the router's proxy for time to
// first token), and how long its booking lived (until Free). Each is split by where the request
// was prefilled, "remote" (a prefill worker, then the KV transfer) or "local" (the decode or
// aggregated worker itself: a bypass, or no prefill pool), which is what conditional
// disaggregation decides between.
//
// What they leave out, and why the figures lean: they are observed on the replica that receives the
// MarkPrefillComplete or Free, from the booking's own time, so clocks that differ between replicas
// shift them; an end whose booking this replica has not seen yet (still on its way through the
// shared log, or in another model's shard) is not observed; a frontend that calls
// MarkPrefillComplete only after a remote prefill (as the clients document) gives local prefills no
// TTFT figure, while the endpoint picker marks every request at its first response byte; the time
// includes the frontend's own delay in calling, and the KV transfer for remote prefills; bookings
// undone because their caller left, and bookings that expired, are not lives.
type RouteOutcomes struct {
	prefill, life *prometheus.HistogramVec
}

// NewRouteOutcomes returns RouteOutcomes to give the replica's dispatcher (replica.Options.Outcomes)
// and to register as a collector.
func NewRouteOutcomes() *RouteOutcomes {
	return &RouteOutcomes{
		prefill: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrouter_booking_prefill_seconds",
			Help: "From a request's booking to its MarkPrefillComplete (the router's proxy for time to first token), by where it was prefilled (remote, local).",
			// 10 ms to 82 s.
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 14),
		}, []string{"prefill"}),
		life: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrouter_booking_life_seconds",
			Help: "From a request's booking to its Free, by where it was prefilled (remote, local).",
			// 50 ms to 410 s.
			Buckets: prometheus.ExponentialBuckets(0.05, 2, 14),
		}, []string{"prefill"}),
	}
}

// Describe implements prometheus.Collector.
func (o *RouteOutcomes) Describe(ch chan<- *prometheus.Desc) {
	o.prefill.Describe(ch)
	o.life.Describe(ch)
}

// Collect implements prometheus.Collector.
func (o *RouteOutcomes) Collect(ch chan<- prometheus.Metric) {
	o.prefill.Collect(ch)
	o.life.Collect(ch)
}

// Booked does nothing: the decision itself is in kvrouter_route_decisions_total.
func (o *RouteOutcomes) Booked(context.Context, app.BookedOutcome) {}

// PrefillDone observes the time from booking to prefill complete.
func (o *RouteOutcomes) PrefillDone(_ context.Context, e app.EndedOutcome) {
	if e.BookingSeen {
		o.prefill.WithLabelValues(prefillSite(e)).Observe(e.SinceBooked.Seconds())
	}
}

// Freed observes a booking's life, when its caller freed it.
func (o *RouteOutcomes) Freed(_ context.Context, e app.EndedOutcome) {
	if e.BookingSeen && e.Cause == app.FreedByCaller {
		o.life.WithLabelValues(prefillSite(e)).Observe(e.SinceBooked.Seconds())
	}
}

func prefillSite(e app.EndedOutcome) string {
	if e.RemotePrefill() {
		return "remote"
	}
	return "local"
}
