package server

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/policy"
)

// PickerMetrics are the endpoint picker's metrics (docs/metrics.md). Their labels take values from
// short fixed lists only (modes, HTTP statuses, causes): a request's model or path never becomes a
// label, since any client could grow the set.
type PickerMetrics struct {
	requests *prometheus.CounterVec
	tokenize prometheus.Histogram
	pick     prometheus.Histogram
	freed    *prometheus.CounterVec
}

// NewPickerMetrics registers the picker's metrics with reg.
func NewPickerMetrics(reg prometheus.Registerer) *PickerMetrics {
	m := &PickerMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_picker_requests_total",
			Help: "Requests the endpoint picker answered, by outcome: the mode it routed them in, or the HTTP status it refused them with.",
		}, []string{"outcome"}),
		tokenize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrouter_picker_tokenize_seconds",
			Help:    "Time to parse a request body and tokenize its prompt (chat template included).",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 14), // 50 µs .. 0.4 s
		}),
		pick: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrouter_picker_pick_seconds",
			Help:    "Time to route a tokenized request and book it (queueing for capacity included).",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 14),
		}),
		freed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_picker_bookings_freed_total",
			Help: "Bookings the endpoint picker freed, by cause: completed, failed (an HTTP error response), cancelled (the stream ended before the response), error (the Free failed: the booking expires).",
		}, []string{"cause"}),
	}
	reg.MustRegister(m.requests, m.tokenize, m.pick, m.freed)
	return m
}

func (m *PickerMetrics) observeTokenize(d time.Duration) {
	if m != nil {
		m.tokenize.Observe(d.Seconds())
	}
}

func (m *PickerMetrics) observePick(dec *policy.Decision, d time.Duration) {
	if m != nil {
		m.pick.Observe(d.Seconds())
		m.requests.WithLabelValues(dec.Mode.String()).Inc()
	}
}

func (m *PickerMetrics) observeRefused(httpStatus int) {
	if m != nil {
		m.requests.WithLabelValues("http_" + strconv.Itoa(httpStatus)).Inc()
	}
}

func (m *PickerMetrics) observeFreed(cause string) {
	if m != nil {
		m.freed.WithLabelValues(cause).Inc()
	}
}
