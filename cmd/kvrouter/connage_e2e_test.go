package main

import (
	"context"
	"google.golang.org/grpc"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// TestMaxConnectionAge runs a publisher and a frontend for several connection ages against a router
// that sends every connection away after 300 ms (GOAWAY), cutting what still runs 300 ms later: the
// publisher's streams are cut again and again and it resumes each time on a new connection, every
// event applied once; the frontend's Route calls all succeed, each on a current connection. This is
// how clients spread over replicas after a scale-out.
func TestMaxConnectionAge(t *testing.T) {
	p := startProcess(t, buildBinary(t), "--max-connection-age", "300ms", "--max-connection-age-grace", "300ms", "--worker-grace-period", "30s")
	ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout)
	defer cancel()
	hello := &kvrouterv1.WorkerHello{Endpoint: "10.0.0.1:8000", WorkerId: 1, Model: "m", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED,
		BlockSize: 4, TotalKvBlocks: 1 << 20, MaxNumBatchedTokens: 8192, KvEventsEnabled: true, FreshStart: true}
	pub, err := kvclient.NewPublisher(kvclient.PublisherOptions{Hello: hello, Conns: []grpc.ClientConnInterface{dial(t, p.addr)}, MaxBatchEvents: 8})
	if err != nil {
		t.Fatal(err)
	}
	router := kvrouterv1.NewRouterServiceClient(dial(t, p.addr))
	const events = 400
	deadline := time.Now().Add(2 * time.Second) // several connection ages and graces
	for i := 0; i < events; i++ {
		if err := pub.Publish(ctx, fleetEvent(i)); err != nil {
			t.Fatalf("Publish(%d) = %v\n%s", i, err, p.logs)
		}
		time.Sleep(time.Until(deadline) / time.Duration(events-i))
		if i > 0 && i%10 == 0 {
			if _, err := router.Route(ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: []uint32{1, 2, 3, 4}, QueryOnly: true}); err != nil {
				t.Fatalf("Route at event %d = %v", i, err)
			}
		}
	}
	if err := pub.Close(ctx); err != nil {
		t.Fatalf("Close() = %v\n%s", err, p.logs)
	}
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
		w := listWorkers(t, p.addr)[1]
		return w.GetLastEventId() == events-1 && w.GetCachedBlocks().GetDevice() == events
	}) {
		t.Fatalf("the router holds %v, want events 0..%d each applied once\n%s", listWorkers(t, p.addr)[1], events-1, p.logs)
	}
	// (How soon the client reconnects after a cut is gRPC's business: a second registration is the
	// proof that the stream was cut and resumed.)
	p.logs.waitFor(t, `second "worker connected" line (connection ages of 300 ms over 2 s)`, func(out string) bool {
		return strings.Count(out, `"msg":"worker connected"`) >= 2
	})
}
