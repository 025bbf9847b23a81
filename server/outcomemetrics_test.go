package server

import (
	"context"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/server/app"
)

// TestRouteOutcomes: prefill-complete times and booking lives are observed by where the request
// was prefilled (two hops: remote), only for bookings this replica saw, and a life only when its
// caller freed it.
func TestRouteOutcomes(t *testing.T) {
	o := NewRouteOutcomes()
	reg := prometheus.NewRegistry()
	reg.MustRegister(o)
	ctx := context.Background()
	ended := func(hops int, since time.Duration, seen bool, cause app.FreeCause) app.EndedOutcome {
		return app.EndedOutcome{RequestID: "r", SinceBooked: since, BookingSeen: seen, Hops: hops, Cause: cause}
	}
	o.PrefillDone(ctx, ended(2, 300*time.Millisecond, true, 0))
	o.PrefillDone(ctx, ended(2, 500*time.Millisecond, true, 0))
	o.PrefillDone(ctx, ended(1, 100*time.Millisecond, true, 0))
	o.PrefillDone(ctx, ended(0, 0, false, 0)) // not seen here: no figure
	o.Freed(ctx, ended(2, 4*time.Second, true, app.FreedByCaller))
	o.Freed(ctx, ended(1, 2*time.Second, true, app.FreedCallerGone)) // undone, not a life
	o.Freed(ctx, ended(0, 0, false, app.FreedByCaller))

	type sums struct {
		Count uint64
		Sum   float64
	}
	got := map[string]sums{}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			got[f.GetName()+"/"+m.GetLabel()[0].GetValue()] = sums{m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()}
		}
	}
	want := map[string]sums{
		"kvrouter_booking_prefill_seconds/remote": {2, 0.8},
		"kvrouter_booking_prefill_seconds/local":  {1, 0.1},
		"kvrouter_booking_life_seconds/remote":    {1, 4},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("observations (-want +got):\n%s", diff)
	}
}
