package main

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// worker is a minimal publisher: one Publish stream, events with consecutive ids, acks tracked.
type worker struct {
	t      *testing.T
	id     uint64
	stream grpc.BidiStreamingClient[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse]
	conn   *grpc.ClientConn
	next   uint64 // next event id
	acked  int64  // highest acked event id, -1 before the first
}

func (w *worker) connect(ctx context.Context, addr string) *kvrouterv1.Registered {
	w.t.Helper()
	if w.conn != nil {
		w.conn.Close()
	}
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		w.t.Fatalf("grpc.NewClient() = %v", err)
	}
	w.conn = conn
	w.t.Cleanup(func() { conn.Close() })
	if w.stream, err = kvrouterv1.NewWorkerServiceClient(conn).Publish(ctx); err != nil {
		w.t.Fatalf("Publish() = %v", err)
	}
	w.send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
		WorkerId: w.id, Model: "m", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 4,
		TotalKvBlocks: 1000, KvEventsEnabled: true, Endpoint: "w"}}})
	resp, err := w.stream.Recv()
	if err != nil || resp.GetRegistered() == nil {
		w.t.Fatalf("registration = %v, %v", resp, err)
	}
	return resp.GetRegistered()
}

func (w *worker) send(m *kvrouterv1.PublishRequest) error { return w.stream.Send(m) }

// publish stores one block (tokens derived from the event id) as the next event and waits for its
// ack; it returns false when the stream broke.
func (w *worker) publish() bool {
	id := w.next
	parent := (*uint64)(nil)
	if id > 0 {
		p := 10_000*w.id + id - 1
		parent = &p
	}
	toks := []uint32{uint32(w.id), uint32(id), 1, 2}
	err := w.send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{{
		EventId: id, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
		Data: &kvrouterv1.KvEvent_Stored{Stored: &kvrouterv1.BlocksStored{ParentHash: parent,
			Blocks: []*kvrouterv1.StoredBlock{{BlockHash: 10_000*w.id + id, TokenIds: toks}}}}}}}}})
	if err != nil {
		return false
	}
	resp, err := w.stream.Recv()
	if err != nil {
		return false
	}
	w.next++
	w.acked = int64(resp.GetAck().GetEventId())
	return true
}

func listWorkers(t *testing.T, addr string) map[uint64]*kvrouterv1.WorkerStatus {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("grpc.NewClient() = %v", err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	resp, err := kvrouterv1.NewAdminServiceClient(conn).ListWorkers(ctx, &kvrouterv1.ListWorkersRequest{})
	if err != nil {
		t.Fatalf("ListWorkers() = %v", err)
	}
	out := map[uint64]*kvrouterv1.WorkerStatus{}
	for _, ws := range resp.GetWorkers() {
		out[ws.GetWorker().GetWorkerId()] = ws
	}
	return out
}

// TestReplicaCrash kills replica A (SIGKILL) while two workers stream to it. Worker 1 reconnects to B:
// B has every event A acked, and the worker resumes after B's last event id. Worker 2 never comes
// back: when its lease runs out, B removes it with its blocks.
func TestReplicaCrash(t *testing.T) { onEveryRedis(t, testReplicaCrash) }

func testReplicaCrash(t *testing.T, r redisTarget) {
	bin := buildBinary(t)
	a := startProcess(t, bin, append(r.flags, "--replica-id", "a", "--worker-grace-period", "1s")...)
	b := startProcess(t, bin, append(r.flags, "--replica-id", "b", "--worker-grace-period", "1s")...)
	ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout)
	defer cancel()

	w1 := &worker{t: t, id: 1, acked: -1}
	w2 := &worker{t: t, id: 2, acked: -1}
	w1.connect(ctx, a.addr)
	w2.connect(ctx, a.addr)
	for range 50 {
		if !w1.publish() || !w2.publish() {
			t.Fatal("publishing to A failed before the crash")
		}
	}
	// A dies mid-stream: w1 has an event in flight.
	_ = w1.send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Load{Load: &kvrouterv1.LoadReport{KvUsedBlocks: 1}}})
	a.kill()
	for w1.publish() {
	}

	reg := w1.connect(ctx, b.addr)
	if reg.LastEventId == nil || int64(reg.GetLastEventId()) < w1.acked {
		t.Fatalf("B's last event id for worker 1 = %v, want at least the last acked %d: an acked event was lost", reg.LastEventId, w1.acked)
	}
	w1.next = reg.GetLastEventId() + 1 // resume after what the router holds
	for range 10 {
		if !w1.publish() {
			t.Fatal("publishing to B after the failover failed")
		}
	}
	var ws map[uint64]*kvrouterv1.WorkerStatus
	if !kvtest.Poll(defaultTestTimeout, 50*time.Millisecond, func() bool {
		ws = listWorkers(t, b.addr)
		return ws[2] == nil && ws[1] != nil
	}) {
		t.Fatalf("worker 2 was not removed from B after its lease ran out: %v\n%s", ws, b.logs)
	}
	if got := ws[1].GetCachedBlocks().GetDevice(); got != w1.next {
		t.Errorf("worker 1 holds %d blocks on B, want %d (every acked event, before and after the failover)", got, w1.next)
	}
}
