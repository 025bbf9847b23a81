package main

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// TestTwoStreamsOneWorker: while a worker's stream is live on replica A, a second stream for the same
// worker_id registers on replica B (or on A itself in embedded mode). The newer one takes over: the
// older ends with FAILED_PRECONDITION WORKER_SUPERSEDED, an event it sends after the takeover is
// never acked nor applied anywhere, the newer resumes after the last applied event, and every
// replica ends with the same blocks and digest.
func TestTwoStreamsOneWorker(t *testing.T) {
	t.Run("embedded", func(t *testing.T) {
		a := startProcess(t, buildBinary(t))
		testTwoStreamsOneWorker(t, a, a)
	})
	onEveryRedis(t, func(t *testing.T, r redisTarget) {
		bin := buildBinary(t)
		a := startProcess(t, bin, append(r.flags, "--replica-id", "a")...)
		b := startProcess(t, bin, append(r.flags, "--replica-id", "b")...)
		testTwoStreamsOneWorker(t, a, b)
	})
}

func testTwoStreamsOneWorker(t *testing.T, a, b *serverProcess) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout)
	defer cancel()
	older := &worker{t: t, id: 1, acked: -1}
	older.connect(ctx, a.addr)
	for range 10 {
		if !older.publish() {
			t.Fatal("publishing on the first stream failed")
		}
	}

	newer := &worker{t: t, id: 1, acked: -1}
	reg := newer.connect(ctx, b.addr)
	if reg.LastEventId == nil || reg.GetLastEventId() != 9 {
		t.Fatalf("the second stream's Registered.last_event_id = %v, want 9", reg.LastEventId)
	}
	newer.next = 10

	// The older stream sends event 10 with other content (a block at the root of a prompt, which
	// would show in Route's overlap if it applied); it must end superseded, without an ack.
	_ = older.send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{{
		EventId: 10, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
		Data: &kvrouterv1.KvEvent_Stored{Stored: &kvrouterv1.BlocksStored{
			Blocks: []*kvrouterv1.StoredBlock{{BlockHash: 77_777, TokenIds: []uint32{9, 9, 9, 9}}}}}}}}}})
	for {
		resp, err := older.stream.Recv()
		if err == nil {
			if resp.GetAck() != nil && resp.GetAck().GetEventId() >= 10 {
				t.Fatalf("the superseded stream got %v, want no ack beyond 9", resp)
			}
			continue
		}
		st, _ := status.FromError(err)
		if st.Code() != codes.FailedPrecondition {
			t.Fatalf("the older stream ended with %v, want FAILED_PRECONDITION", err)
		}
		break
	}

	for range 5 {
		if !newer.publish() {
			t.Fatal("publishing on the newer stream failed")
		}
	}
	// Every replica holds the ten events of the first stream and the five of the second: 15 blocks,
	// none of them the superseded stream's event 10, and the same digest.
	admins := []kvrouterv1.AdminServiceClient{kvrouterv1.NewAdminServiceClient(dial(t, a.addr)), kvrouterv1.NewAdminServiceClient(dial(t, b.addr))}
	var (
		wa, wb     *kvrouterv1.WorkerStatus
		sa, sb     *kvrouterv1.GetStateResponse
		errA, errB error
	)
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
		wa, wb = listWorkers(t, a.addr)[1], listWorkers(t, b.addr)[1]
		sa, errA = admins[0].GetState(ctx, &kvrouterv1.GetStateRequest{})
		sb, errB = admins[1].GetState(ctx, &kvrouterv1.GetStateRequest{})
		return wa.GetCachedBlocks().GetDevice() == 15 && wb.GetCachedBlocks().GetDevice() == 15 && errA == nil && errB == nil &&
			sa.GetLogLastId() == sb.GetLogLastId() && sa.GetPendingChanges() == 0 && sb.GetPendingChanges() == 0
	}) {
		t.Fatalf("replicas never agreed on 15 blocks: A %v, B %v; states %v %v", wa, wb, sa, sb)
	}
	if sa.GetDigest() != sb.GetDigest() {
		t.Errorf("digests differ: A %s, B %s", sa.GetDigest(), sb.GetDigest())
	}
	if wa.GetLastEventId() != 14 {
		t.Errorf("last event id = %d, want 14", wa.GetLastEventId())
	}
	// The superseded stream's block is in no replica's index.
	for _, addr := range []string{a.addr, b.addr} {
		resp, err := kvrouterv1.NewRouterServiceClient(dial(t, addr)).Route(ctx, &kvrouterv1.RouteRequest{
			Model: "m", TokenIds: []uint32{9, 9, 9, 9, 1}, QueryOnly: true})
		if err != nil {
			t.Fatalf("Route = %v", err)
		}
		if got := resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice(); got != 0 {
			t.Errorf("overlap with the superseded stream's block on %s = %d, want 0", addr, got)
		}
	}
}
