package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// processMetrics serves this process's Prometheus process collector, as kvrouter serve does on its
// metrics listener, and returns its URL: the router under test runs in this process.
func processMetrics(t *testing.T) string {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)
	return srv.URL + "/metrics"
}

// TestKvloadDrivesRoute seeds an in-process router, drives Route calls at it and checks the report.
// The machine is shared and noisy, so only counts are exact: rates and latencies get loose bounds.
func TestKvloadDrivesRoute(t *testing.T) {
	type summary struct {
		Mode, Loop   string
		Calls        int
		Errors       map[string]int
		Bookings     int // live bookings in the router afterwards
		HasServerCPU bool
	}
	for _, tc := range []struct {
		name string
		args []string
		want summary
		rate float64 // open loop: the rate asked for
	}{
		{
			name: "closed loop, query only",
			args: []string{"--requests", "200", "--concurrency", "4", "--server-pid", fmt.Sprint(os.Getpid())},
			want: summary{Mode: "query_only", Loop: "closed", Calls: 200, Errors: map[string]int{}, HasServerCPU: true},
		},
		{
			name: "closed loop, booking, freed",
			args: []string{"--requests", "200", "--concurrency", "4", "--query-only=false"},
			want: summary{Mode: "booking", Loop: "closed", Calls: 200, Errors: map[string]int{}},
		},
		{
			name: "closed loop, booking, kept",
			args: []string{"--requests", "200", "--concurrency", "4", "--query-only=false", "--free=false"},
			want: summary{Mode: "booking", Loop: "closed", Calls: 200, Errors: map[string]int{}, Bookings: 220}, // warmup calls book too
		},
		{
			name: "open loop, query only",
			args: []string{"--duration", "1s", "--rate", "200", "--server-metrics", "METRICS"},
			want: summary{Mode: "query_only", Loop: "open", Calls: 200, Errors: map[string]int{}, HasServerCPU: true},
			rate: 200,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
			defer cancel()
			addr, state := startRouter(t)
			out := filepath.Join(t.TempDir(), "report.json")
			args := []string{"--addr", addr, "--workers", "4", "--blocks", "2000", "--prompt-blocks", "32", "--roots", "3",
				"--route-tokens", "500", "--prompts", "3", "--conns", "2", "--warmup", "20", "--json", out}
			for _, a := range tc.args {
				args = append(args, strings.ReplaceAll(a, "METRICS", processMetrics(t)))
			}
			r, stderr := runForReport(ctx, t, args, out)
			got := summary{Mode: r.Mode, Loop: r.Loop, Calls: r.Calls, Errors: r.Errors,
				Bookings: state.Load().Bookings(), HasServerCPU: r.ServerCPUUs != nil}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("report (-want +got):\n%s\nstderr:\n%s", diff, stderr)
			}
			l := r.LatencyMs
			if !(0 < l.P50 && l.P50 <= l.P90 && l.P90 <= l.P99 && l.P99 <= l.P999 && l.P999 <= l.Max) {
				t.Errorf("latency percentiles %+v, want positive and ordered", l)
			}
			if r.ClientCPU <= 0 || r.WallSeconds <= 0 {
				t.Errorf("client CPU %v s over %v s, want both positive", r.ClientCPU, r.WallSeconds)
			}
			// Calls start on a fixed schedule, (n-1)/rate apart, so the rate cannot exceed the one
			// asked for by more than a call; a loaded machine may slow it, hence the low bound.
			if tc.rate > 0 && (r.AchievedRate < tc.rate/2 || r.AchievedRate > tc.rate*1.05) {
				t.Errorf("achieved %.0f calls/s, want near %.0f", r.AchievedRate, tc.rate)
			}
		})
	}
}

// TestCodecAddsRequestID checks the bytes kvload sends: the pre-marshaled request with the call's
// request id prepended decodes as that request with that id, and a Free as that id.
func TestCodecAddsRequestID(t *testing.T) {
	req := &kvrouterv1.RouteRequest{Model: "m", TokenIds: make([]uint32, 2000), Explain: true}
	for i := range req.TokenIds {
		req.TokenIds[i] = uint32(i * 97)
	}
	body, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		msg  *outgoing
		into proto.Message
		want proto.Message
	}{
		{"query", &outgoing{body: body}, &kvrouterv1.RouteRequest{}, req},
		{"booking", &outgoing{idField: routeIDField, prefix: "kvload-1-", n: 12345, body: body}, &kvrouterv1.RouteRequest{},
			&kvrouterv1.RouteRequest{RequestId: "kvload-1-12345", Model: "m", TokenIds: req.TokenIds, Explain: true}},
		{"free", &outgoing{idField: freeIDField, prefix: "kvload-1-", n: 0}, &kvrouterv1.FreeRequest{},
			&kvrouterv1.FreeRequest{RequestId: "kvload-1-0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bufs, err := rawCodec{}.Marshal(tc.msg)
			if err != nil {
				t.Fatalf("Marshal() = %v", err)
			}
			defer bufs.Free()
			if err := proto.Unmarshal(bufs.Materialize(), tc.into); err != nil {
				t.Fatalf("proto.Unmarshal(sent bytes) = %v", err)
			}
			if diff := cmp.Diff(tc.want, tc.into, protocmp.Transform()); diff != "" {
				t.Errorf("sent request (-want +got):\n%s", diff)
			}
		})
	}
}

// TestCodecReadsReply checks that the reply keeps a response's mode and booked and skips the rest.
func TestCodecReadsReply(t *testing.T) {
	for _, tc := range []struct {
		name string
		resp proto.Message
		want reply
	}{
		{"decision", &kvrouterv1.RouteResponse{
			Mode: kvrouterv1.RouteMode_ROUTE_MODE_DISAGGREGATED, Booked: true, Annotations: []string{"a"},
			Decode:      &kvrouterv1.WorkerTarget{WorkerId: 7},
			Diagnostics: &kvrouterv1.RouteDiagnostics{PromptTokens: 2048},
		}, reply{mode: kvrouterv1.RouteMode_ROUTE_MODE_DISAGGREGATED, booked: true}},
		{"free", &kvrouterv1.FreeResponse{}, reply{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := proto.Marshal(tc.resp)
			if err != nil {
				t.Fatal(err)
			}
			// Split in two buffers, as a response read in two pieces arrives.
			half := len(b) / 2
			r := reply{mode: 99, booked: true}
			if err := (rawCodec{}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(b[:half]), mem.SliceBuffer(b[half:])}, &r); err != nil {
				t.Fatalf("Unmarshal() = %v", err)
			}
			if r != tc.want {
				t.Errorf("reply = %+v, want %+v", r, tc.want)
			}
		})
	}
}

func TestNearestRank(t *testing.T) {
	ms := func(n int) []time.Duration {
		s := make([]time.Duration, n)
		for i := range s {
			s[i] = time.Duration(i+1) * time.Millisecond
		}
		return s
	}
	for _, tc := range []struct {
		n, permille int
		want        time.Duration
	}{
		{1000, 500, 500 * time.Millisecond},
		{1000, 999, 999 * time.Millisecond},
		{1000, 1000, 1000 * time.Millisecond},
		{10, 999, 10 * time.Millisecond}, // fewer calls than the percentile resolves: the max
		{3, 500, 2 * time.Millisecond},
		{1, 500, time.Millisecond},
		{0, 500, 0},
	} {
		if got := nearestRank(ms(tc.n), tc.permille); got != tc.want {
			t.Errorf("nearestRank(1..%d ms, %d‰) = %v, want %v", tc.n, tc.permille, got, tc.want)
		}
	}
}

// runForReport runs kvload with args, which write the report to out (--json), and returns the
// report and kvload's stderr, failing the test if kvload fails.
func runForReport(ctx context.Context, t *testing.T, args []string, out string) (report, string) {
	t.Helper()
	var stderr strings.Builder
	if code := run(ctx, args, &stderr); code != 0 {
		t.Fatalf("run(%q) = %d, want 0; stderr:\n%s", args, code, stderr.String())
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatalf("reading --json: %v", err)
	}
	var r report
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("json.Unmarshal(--json) = %v", err)
	}
	return r, stderr.String()
}
