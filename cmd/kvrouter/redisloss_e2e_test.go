package main

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
)

// TestRedisRestartedEmpty restarts Redis without its data under Publish and Route load on replicas A
// and B, then starts replica C. Within 10 s of the loss every replica follows one reseeded log and
// reports the same digest, every event any worker had acked is held by every replica, no Route call
// failed, and Route on C finds every worker.
func TestRedisRestartedEmpty(t *testing.T) {
	srv := redistest.Start(t)
	bin := buildBinary(t)
	flags := []string{"--redis-addr", srv.Addr}
	a := startProcess(t, bin, append(flags, "--replica-id", "a")...)
	b := startProcess(t, bin, append(flags, "--replica-id", "b")...)
	f := startFleet(t, 4, 20*time.Millisecond, a.addr, b.addr)
	time.Sleep(1500 * time.Millisecond)

	srv.Restart() // empty: persistence is off
	lost := time.Now()
	c := startProcess(t, bin, append(flags, "--replica-id", "c")...)
	t.Logf("C serving %v after the loss", time.Since(lost).Round(time.Millisecond))
	f.routeOn(c.addr)
	time.Sleep(2 * time.Second) // publishing goes on across the loss
	f.pause()
	if err := f.waitAllAcked(10*time.Second - time.Since(lost)); err != nil {
		t.Fatalf("%v\nA:\n%s\nB:\n%s", err, a.logs, b.logs)
	}
	t.Logf("every event acked %v after the loss", time.Since(lost).Round(time.Millisecond))
	_, states, err := f.waitConverged(10*time.Second-time.Since(lost), a.addr, b.addr, c.addr)
	took := time.Since(lost)
	if err != nil {
		t.Fatalf("%v (%v after the loss)\nA:\n%s\nB:\n%s\nC:\n%s", err, took, a.logs, b.logs, c.logs)
	}
	t.Logf("converged %v after the loss on generation %s, digest %s", took.Round(time.Millisecond), states[0].state.GetLogGeneration(), states[0].state.GetDigest())
	if n, last := f.routeFailures(); n != 0 {
		t.Errorf("%d of %d Route calls failed; last: %s", n, f.routes.Load(), last)
	}
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	router := kvrouterv1.NewRouterServiceClient(dial(t, c.addr))
	for _, w := range f.workers {
		resp, err := router.Route(ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: w.prompt(), QueryOnly: true})
		if err != nil {
			t.Fatalf("Route on C for worker %d's prompt = %v", w.id, err)
		}
		if resp.GetDecode().GetWorkerId() != w.id || resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice() != 2 {
			t.Errorf("Route on C for worker %d's prompt went to worker %d with overlap %d, want worker %d with 2 blocks",
				w.id, resp.GetDecode().GetWorkerId(), resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice(), w.id)
		}
	}
	for _, w := range f.workers {
		produced, acked, reconnects, dumps, _ := w.status()
		t.Logf("worker %d: %d events, acked through %d, %d reconnects, %d dumps", w.id, produced, acked, reconnects, dumps)
	}
}

// TestIncompleteStateAnswersUnavailable: Redis restarts empty while the replica holding the
// deployment's state (A) is cut off from it, and replica C starts on the empty Redis: C's state is
// empty, and A may still reseed the log with its own (within the reseed window). Meanwhile C says
// so: its RouterService health is NOT_SERVING, and Route for the model and Free for a booking that
// exist on A are UNAVAILABLE (LOG_UNAVAILABLE, with RetryInfo), never NOT_FOUND. Once A is back
// and has reseeded the log, C routes to A's worker and frees A's booking. Before, C reported ready
// and answered NOT_FOUND to both.
func TestIncompleteStateAnswersUnavailable(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t, srv.Addr)
	bin := buildBinary(t)
	window := []string{"--redis-reseed-window", "8s"}
	a := startProcess(t, bin, append([]string{"--redis-addr", proxy.Addr, "--replica-id", "a"}, window...)...)
	w := newFleetWorker(t, 1, a.addr)
	f := startFleetWith(t, []*fleetWorker{w}, 20*time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	onA := kvrouterv1.NewRouterServiceClient(dial(t, a.addr))
	if !kvtest.Poll(defaultTestTimeout, 50*time.Millisecond, func() bool {
		_, err := onA.Route(ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: w.prompt(), RequestId: "held-by-a"})
		return err == nil
	}) {
		t.Fatal("A never booked a request for its worker")
	}
	f.pause()
	if err := f.waitAllAcked(10 * time.Second); err != nil {
		t.Fatal(err)
	}

	proxy.Cut()
	srv.Restart() // empty: A holds the only copy of the state
	c := startProcess(t, bin, append([]string{"--redis-addr", srv.Addr, "--replica-id", "c"}, window...)...)
	conn := dial(t, c.addr)
	onC := kvrouterv1.NewRouterServiceClient(conn)
	if st, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "kvrouter.v1.RouterService"}); err != nil || st.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Errorf("C's RouterService health on an empty log A may still reseed = %v, %v; want NOT_SERVING", st.GetStatus(), err)
	}
	wantUnavailable := func(what string, err error) {
		t.Helper()
		st := status.Convert(err)
		if st.Code() != codes.Unavailable || retryDelayOf(err, 0) == 0 {
			t.Errorf("%s on C while its state may be incomplete = %v, want UNAVAILABLE with RetryInfo (never NOT_FOUND)", what, err)
		}
	}
	_, err := onC.Route(ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: w.prompt(), QueryOnly: true})
	wantUnavailable("Route for A's model", err)
	_, err = onC.Free(ctx, &kvrouterv1.FreeRequest{RequestId: "held-by-a"})
	wantUnavailable("Free of A's booking", err)

	proxy.Heal()
	if !kvtest.Poll(defaultTestTimeout, 50*time.Millisecond, func() bool {
		resp, err := onC.Route(ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: w.prompt(), QueryOnly: true})
		return err == nil && resp.GetDecode().GetWorkerId() == w.id
	}) {
		t.Fatalf("C never routed to A's worker after A came back\nA:\n%s\nC:\n%s", a.logs, c.logs)
	}
	if _, err := onC.Free(ctx, &kvrouterv1.FreeRequest{RequestId: "held-by-a"}); err != nil {
		t.Errorf("Free of A's booking on C once A reseeded the log = %v, want it freed", err)
	}
}
