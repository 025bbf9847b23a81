package main

import (
	"context"
	"testing"
	"time"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/redistest"
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
