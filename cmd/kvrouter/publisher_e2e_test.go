package main

import (
	"context"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
)

// TestPublisherSurvivesReplicaKill runs the Go client's Publisher against two kvrouter processes on
// one private Redis and SIGKILLs the replica it streams to in the middle of its events. The
// publisher goes on through the other replica, which ends in exactly the state of a fault-free run:
// every event applied once, none lost, none twice (the same blocks, the same last event, no resync
// pending). In the fault-free run the worker moves to the other replica by closing its publisher
// and resuming with a new one, so that both runs register the worker twice. (The runs' digests
// differ: each registration's epoch is an incarnation stamped from the clock.)
func TestPublisherSurvivesReplicaKill(t *testing.T) {
	bin := buildBinary(t)
	const events = 3000
	run := func(t *testing.T, crash bool) *kvrouterv1.WorkerStatus {
		s := redistest.Start(t)
		flags := []string{"--redis-addr", s.Addr, "--worker-grace-period", "30s"}
		a := startProcess(t, bin, append(flags, "--replica-id", "a")...)
		b := startProcess(t, bin, append(flags, "--replica-id", "b")...)
		ctx, cancel := context.WithTimeout(context.Background(), 4*defaultTestTimeout)
		defer cancel()
		hello := &kvrouterv1.WorkerHello{Endpoint: "10.0.0.1:8000", WorkerId: 1, Model: "m", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED,
			BlockSize: 4, TotalKvBlocks: 1 << 20, MaxNumBatchedTokens: 8192, KvEventsEnabled: true, FreshStart: true}
		newPublisher := func(conns ...grpc.ClientConnInterface) *kvclient.Publisher {
			p, err := kvclient.NewPublisher(kvclient.PublisherOptions{Hello: hello, Conns: conns, MaxBatchEvents: 8})
			if err != nil {
				t.Fatal(err)
			}
			return p
		}
		p := newPublisher(dial(t, a.addr), dial(t, b.addr))
		for i := range events {
			if i == events/2 {
				// Publish only queues: wait until A acked a good part, so that A dies mid-stream.
				if !kvtest.Poll(defaultTestTimeout, time.Millisecond, func() bool { last, ok := p.LastAcked(); return ok && last >= events/4 }) {
					t.Fatalf("A acked nothing in %v: %v\n%s", defaultTestTimeout, p.Err(), a.logs)
				}
				if crash {
					a.kill() // events in flight, some appended and not acked
				} else {
					if err := p.Close(ctx); err != nil {
						t.Fatalf("Close() on A = %v", err)
					}
					hello.FreshStart = false // the same worker, resuming
					p = newPublisher(dial(t, b.addr))
				}
			}
			if err := p.Publish(ctx, fleetEvent(i)); err != nil {
				t.Fatalf("Publish(%d) = %v\nA:\n%s", i, err, a.logs)
			}
		}
		if err := p.Close(ctx); err != nil {
			t.Fatalf("Close() = %v\nB:\n%s", err, b.logs)
		}
		admin := kvrouterv1.NewAdminServiceClient(dial(t, b.addr))
		var st *kvrouterv1.GetStateResponse
		if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
			var err error
			st, err = admin.GetState(ctx, &kvrouterv1.GetStateRequest{})
			return err == nil && st.GetPendingChanges() == 0 && listWorkers(t, b.addr)[1].GetLastEventId() == events-1
		}) {
			t.Fatalf("B never applied the last event: %v\n%s", st, b.logs)
		}
		if st.GetIndexBlocks() != events {
			t.Errorf("B's index holds %d blocks, want %d", st.GetIndexBlocks(), events)
		}
		return listWorkers(t, b.addr)[1]
	}
	var want, got *kvrouterv1.WorkerStatus
	t.Run("fault-free", func(t *testing.T) { want = run(t, false) })
	t.Run("replica killed", func(t *testing.T) { got = run(t, true) })
	if got.GetCachedBlocks().GetDevice() != events {
		t.Errorf("after the kill B holds %d blocks of the worker, want %d", got.GetCachedBlocks().GetDevice(), events)
	}
	if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
		t.Errorf("the worker after the kill differs from the fault-free run (-fault-free +killed):\n%s", diff)
	}
}

// fleetEvent stores block i of one long prompt of worker 1, chained onto block i-1.
func fleetEvent(i int) *kvrouterv1.KvEvent {
	st := &kvrouterv1.BlocksStored{Blocks: []*kvrouterv1.StoredBlock{{BlockHash: uint64(5000 + i),
		TokenIds: []uint32{uint32(4*i + 1), uint32(4*i + 2), uint32(4*i + 3), uint32(4*i + 4)}}}}
	if i > 0 {
		parent := uint64(5000 + i - 1)
		st.ParentHash = &parent
	}
	return &kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}
}
