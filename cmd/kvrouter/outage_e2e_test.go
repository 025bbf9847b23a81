package main

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/server"
)

func dial(t *testing.T, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	if err != nil {
		t.Fatalf("grpc.NewClient() = %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestRedisOutageUnderLoad freezes Redis for 10 s while a worker streams events into replica A and
// clients route on A and B. No Route call fails; A's health reports the shared state NOT_SERVING
// meanwhile; afterwards both replicas hold every event the worker sent and report the same digest.
func TestRedisOutageUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("a 10 s outage is skipped in -short mode")
	}
	onEveryRedis(t, testRedisOutageUnderLoad)
}

func testRedisOutageUnderLoad(t *testing.T, r redisTarget) {
	bin := buildBinary(t)
	a := startProcess(t, bin, append(r.flags, "--replica-id", "a")...)
	b := startProcess(t, bin, append(r.flags, "--replica-id", "b")...)
	ctx, cancel := context.WithTimeout(context.Background(), 4*defaultTestTimeout)
	defer cancel()

	// The worker publishes a new block every 10 ms without waiting for acks, as a real publisher
	// does; acks are read on the side.
	w := &worker{t: t, id: 1, acked: -1}
	w.connect(ctx, a.addr)
	var lastAck atomic.Int64
	lastAck.Store(-1)
	go func() {
		for {
			resp, err := w.stream.Recv()
			if err != nil {
				return
			}
			if ack := resp.GetAck(); ack != nil {
				lastAck.Store(int64(ack.GetEventId()))
			}
		}
	}()
	stop := make(chan struct{})
	var sent atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for id := uint64(0); ; id++ {
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
			var parent *uint64
			if id > 0 {
				p := 10_000 + id - 1
				parent = &p
			}
			if err := w.send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{{
				EventId: id, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
				Data: &kvrouterv1.KvEvent_Stored{Stored: &kvrouterv1.BlocksStored{ParentHash: parent,
					Blocks: []*kvrouterv1.StoredBlock{{BlockHash: 10_000 + id, TokenIds: []uint32{1, uint32(id), 2, 3}}}}}}}}}}); err != nil {
				t.Errorf("sending event %d = %v", id, err)
				return
			}
			sent.Store(int64(id) + 1)
		}
	}()
	// Clients route on both replicas, all along.
	var routes, failures atomic.Int64
	for _, addr := range []string{a.addr, b.addr} {
		client := kvrouterv1.NewRouterServiceClient(dial(t, addr))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-time.After(5 * time.Millisecond):
				}
				rctx, rcancel := context.WithTimeout(ctx, time.Second)
				_, err := client.Route(rctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: []uint32{1, 5, 2, 3, 1, 6, 2, 3}, QueryOnly: true})
				rcancel()
				routes.Add(1)
				if err != nil {
					failures.Add(1)
					t.Errorf("Route on %s failed: %v", addr, err)
				}
			}
		}()
	}

	time.Sleep(time.Second)
	r.pause()
	health := healthpb.NewHealthClient(dial(t, a.addr))
	sawDegraded := false
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		resp, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: server.SharedStateService})
		sawDegraded = sawDegraded || (err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_NOT_SERVING)
	}
	r.resume()
	time.Sleep(time.Second)
	close(stop)
	wg.Wait()
	if !sawDegraded {
		t.Errorf("health of %s never reported NOT_SERVING during the outage", server.SharedStateService)
	}
	if failures.Load() != 0 || routes.Load() < 100 {
		t.Errorf("Route calls: %d, failed: %d; want many, none failed", routes.Load(), failures.Load())
	}

	// Every event sent is acked, and both replicas converge on it.
	want := sent.Load()
	admin := map[string]kvrouterv1.AdminServiceClient{"A": kvrouterv1.NewAdminServiceClient(dial(t, a.addr)), "B": kvrouterv1.NewAdminServiceClient(dial(t, b.addr))}
	var (
		sa, sb     *kvrouterv1.GetStateResponse
		errA, errB error
		blocks     uint64
	)
	if !kvtest.Poll(2*defaultTestTimeout, 100*time.Millisecond, func() bool {
		sa, errA = admin["A"].GetState(ctx, &kvrouterv1.GetStateRequest{})
		sb, errB = admin["B"].GetState(ctx, &kvrouterv1.GetStateRequest{})
		blocks = listWorkers(t, b.addr)[1].GetCachedBlocks().GetDevice()
		return errA == nil && errB == nil && lastAck.Load() == want-1 && int64(blocks) == want &&
			sa.GetLogLastId() == sb.GetLogLastId() && sa.GetPendingChanges() == 0 && sb.GetPendingChanges() == 0
	}) {
		t.Fatalf("no convergence after the outage: sent %d, acked through %d, B holds %d blocks; A %v %v; B %v %v",
			want, lastAck.Load(), blocks, sa, errA, sb, errB)
	}
	if sa.GetDigest() != sb.GetDigest() {
		t.Errorf("digests after the outage: A %s, B %s; want equal", sa.GetDigest(), sb.GetDigest())
	}
}
