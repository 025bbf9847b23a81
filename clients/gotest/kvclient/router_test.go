package kvclient_test

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
	"github.com/kvrouter/kvrouter/kvstate/replication"
	"github.com/kvrouter/kvrouter/server"
	"github.com/kvrouter/kvrouter/server/servertest"
)

const testTimeout = 30 * time.Second

// testServer is kvrouter's gRPC server on a loopback TCP port, in this process, with two aggregated
// workers of model "m" (block size 4) registered.
type testServer struct {
	addr  string
	srv   *server.Server
	conn  *grpc.ClientConn
	admin kvrouterv1.AdminServiceClient
	raw   kvrouterv1.RouterServiceClient
}

func startServer(t testing.TB, maxPromptTokens int) *testServer {
	t.Helper()
	state := kvstate.NewState()
	log := kvstate.NewMemLog(state)
	for id := range uint64(2) {
		info := kvstate.WorkerInfo{Key: kvstate.WorkerKey{ID: id + 1}, Model: "m", Role: kvstate.RoleAggregated, BlockSize: 4,
			TotalKVBlocks: 1024, MaxNumBatchedTokens: 8192, KVEventsEnabled: true}
		if _, err := log.Append(context.Background(), kvstate.WorkerUp{Info: info}); err != nil {
			t.Fatal(err)
		}
	}
	return startReplica(t, state, log, maxPromptTokens)
}

// startReplica serves state and log on a loopback port: replicas started on one state and log share
// it, as replicas sharing a Redis log do.
func startReplica(t testing.TB, state *kvstate.State, log kvstate.Log, maxPromptTokens int, mutate ...func(*server.Options)) *testServer {
	t.Helper()
	srv, lis, err := servertest.Serve(state, log, maxPromptTokens, mutate...)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
	})
	return &testServer{addr: lis.Addr().String(), srv: srv, conn: conn, admin: kvrouterv1.NewAdminServiceClient(conn), raw: kvrouterv1.NewRouterServiceClient(conn)}
}

// activeRequests returns the booked requests the server counts over all workers.
func (s *testServer) activeRequests(t *testing.T) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := s.admin.ListWorkers(ctx, &kvrouterv1.ListWorkersRequest{Model: "m"})
	if err != nil {
		t.Fatalf("ListWorkers() = %v", err)
	}
	var n uint64
	for _, w := range resp.GetWorkers() {
		n += w.GetLoad().GetActiveRequests()
	}
	return n
}

func prompt(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(i + 1)
	}
	return out
}

func TestBookingEndsOnce(t *testing.T) {
	s := startServer(t, 1000)
	r := kvclient.NewRouter(s.conn, kvclient.RouterOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	req := &kvrouterv1.RouteRequest{Model: "m", TokenIds: prompt(16)}
	b, err := r.Route(ctx, req)
	if err != nil {
		t.Fatalf("Route() = %v", err)
	}
	if b.RequestID == "" || req.GetRequestId() != b.RequestID {
		t.Errorf("request id %q (request %q), want a generated one written into the request", b.RequestID, req.GetRequestId())
	}
	if n := s.activeRequests(t); n != 1 {
		t.Fatalf("active requests after Route = %d, want 1", n)
	}
	for range 3 {
		if err := b.PrefillComplete(ctx); err != nil {
			t.Errorf("PrefillComplete() = %v, want nil every time", err)
		}
	}
	for range 3 {
		if err := b.Free(ctx); err != nil {
			t.Errorf("Free() = %v, want nil every time", err)
		}
	}
	if n := s.activeRequests(t); n != 0 {
		t.Errorf("active requests after Free = %d, want 0", n)
	}
	// The server holds nothing more for the request: a raw Free is NOT_FOUND.
	if _, err := s.raw.Free(ctx, &kvrouterv1.FreeRequest{RequestId: b.RequestID}); status.Code(err) != codes.NotFound {
		t.Errorf("raw Free after Booking.Free = %v, want NOT_FOUND", err)
	}
	// Query-only requests book nothing; their Free has nothing to do.
	q, err := r.Route(ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: prompt(16), QueryOnly: true})
	if err != nil {
		t.Fatalf("Route(query only) = %v", err)
	}
	if err := q.Free(ctx); err != nil {
		t.Errorf("Free of a query-only answer = %v, want nil", err)
	}
}

func TestDoFrees(t *testing.T) {
	s := startServer(t, 1000)
	r := kvclient.NewRouter(s.conn, kvclient.RouterOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	errWork := errors.New("the work failed")
	if err := r.Do(ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: prompt(8)}, func(context.Context, *kvclient.Booking) error {
		return errWork
	}); !errors.Is(err, errWork) {
		t.Errorf("Do() = %v, want the work's error", err)
	}
	func() {
		defer func() { _ = recover() }()
		_ = r.Do(ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: prompt(8)}, func(context.Context, *kvclient.Booking) error {
			panic("the work panicked")
		})
	}()
	// The caller's context ends while the work runs: the booking is freed all the same.
	workCtx, stop := context.WithCancel(ctx)
	_ = r.Do(workCtx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: prompt(8)}, func(context.Context, *kvclient.Booking) error {
		stop()
		return nil
	})
	if n := s.activeRequests(t); n != 0 {
		t.Errorf("active requests after three Do calls = %d, want 0", n)
	}
}

// TestCheckedBeforeSending: what the server would refuse fails before it is sent, with the status
// and message the server gives for it.
func TestCheckedBeforeSending(t *testing.T) {
	s := startServer(t, 64)
	r := kvclient.NewRouter(s.conn, kvclient.RouterOptions{MaxPromptTokens: 64})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	long := string(make([]byte, 513))
	for _, tt := range []struct {
		name string
		req  *kvrouterv1.RouteRequest
	}{
		{"no model", &kvrouterv1.RouteRequest{RequestId: "r", TokenIds: prompt(4)}},
		{"no tokens", &kvrouterv1.RouteRequest{RequestId: "r", Model: "m"}},
		{"too many tokens", &kvrouterv1.RouteRequest{RequestId: "r", Model: "m", TokenIds: prompt(65)}},
		{"too many hashed tokens", &kvrouterv1.RouteRequest{RequestId: "r", Model: "m", BlockSize: 4, PromptTokens: 65, BlockHashes: make([]uint64, 16)}},
		{"long request id", &kvrouterv1.RouteRequest{RequestId: long, Model: "m", TokenIds: prompt(4)}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, serverErr := s.raw.Route(ctx, tt.req)
			_, clientErr := r.Route(ctx, tt.req)
			if status.Code(serverErr) != codes.InvalidArgument || status.Code(clientErr) != codes.InvalidArgument ||
				status.Convert(clientErr).Message() != status.Convert(serverErr).Message() {
				t.Errorf("client says %v; server says %v; want the same INVALID_ARGUMENT", clientErr, serverErr)
			}
		})
	}
}

// TestCancelledRoutesLeaveNoBooking routes 10,000 requests, 8 at a time, and cancels half of them
// at a random moment of their call: no booking is left behind.
func TestCancelledRoutesLeaveNoBooking(t *testing.T) {
	s := startServer(t, 1000)
	r := kvclient.NewRouter(s.conn, kvclient.RouterOptions{})
	const requests, workers = 10_000, 8
	var next, cancelled, routed atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		rng := rand.New(rand.NewPCG(uint64(w), 1))
		wg.Go(func() {
			for next.Add(1) <= requests {
				ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
				if rng.IntN(2) == 0 {
					time.AfterFunc(time.Duration(rng.IntN(300))*time.Microsecond, cancel)
				}
				b, err := r.Route(ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: prompt(64)})
				switch {
				case err == nil:
					routed.Add(1)
					if err := b.Free(context.WithoutCancel(ctx)); err != nil {
						t.Errorf("Free() = %v", err)
					}
				case status.Code(err) == codes.Canceled:
					cancelled.Add(1)
				default:
					t.Errorf("Route() = %v", err)
				}
				cancel()
			}
		})
	}
	wg.Wait()
	t.Logf("%d routed and freed, %d cancelled in flight", routed.Load(), cancelled.Load())
	if cancelled.Load() == 0 {
		t.Error("no Route was cancelled in flight: the test did not test cancellation")
	}
	if n := s.activeRequests(t); n != 0 {
		t.Errorf("%d bookings left after every request was freed or cancelled, want 0", n)
	}
}

// TestFreeRetriedUntilTheBookingIsFound: two replicas share a Redis log; replica A books a request
// and is then cut off from Redis before it can publish the booking. A Free sent to replica B cannot
// find the booking and B says so (UNAVAILABLE, retry): Booking.Free retries until its context ends,
// returns the error, and goes on in the background; once A is back and has published the booking,
// the retried Free frees it on every replica. Before, the Free was NOT_FOUND, taken as done, and
// the booking stayed until it expired.
func TestFreeRetriedUntilTheBookingIsFound(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t, srv.Addr)
	replica := func(name, addr string) (*kvstate.State, *replication.Log, *testServer) {
		rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{addr}, DialTimeout: 200 * time.Millisecond,
			ReadTimeout: 300 * time.Millisecond, WriteTimeout: 300 * time.Millisecond, MaxRetries: -1, ContextTimeoutEnabled: true})
		t.Cleanup(func() { rdb.Close() })
		state := kvstate.NewState()
		l := replication.New(redisstore.New(rdb, redisstore.Options{}).Log("kvr:{"+t.Name()+"}"), state, replication.Options{Prefix: "kvr:{" + t.Name() + "}", Replica: name, ReadBlock: 100 * time.Millisecond,
			ReseedWindow: 300 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = l.Run(ctx); close(done) }()
		t.Cleanup(func() { cancel(); <-done })
		kvtest.Eventually(t, testTimeout, name+" to join the log", func() bool { return !l.Incomplete() })
		return state, l, startReplica(t, state, l, 1000)
	}
	stateA, logA, a := replica("a", proxy.Addr)
	stateB, _, b := replica("b", srv.Addr)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	info := kvstate.WorkerInfo{Key: kvstate.WorkerKey{ID: 1}, Model: "m", Role: kvstate.RoleAggregated, BlockSize: 4,
		TotalKVBlocks: 1024, MaxNumBatchedTokens: 8192, KVEventsEnabled: true}
	if _, err := logA.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatal(err)
	}
	kvtest.Eventually(t, testTimeout, "B to see the worker", func() bool { return stateB.Worker(info.Key) != nil })

	onA := kvclient.NewRouter(a.conn, kvclient.RouterOptions{})
	onB := kvclient.NewRouter(b.conn, kvclient.RouterOptions{})
	defer onB.Close()
	proxy.Cut()
	booking, err := onA.Route(ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: []uint32{1, 2, 3, 4, 5, 6, 7, 8}})
	if err != nil {
		t.Fatalf("Route on A while it is cut off = %v, want a booking (routing goes on from local state)", err)
	}
	freeOnB := onB.Existing(booking.RequestID) // a frontend whose Free reaches another replica
	short, cancelShort := context.WithTimeout(ctx, 700*time.Millisecond)
	err = freeOnB.Free(short)
	cancelShort()
	// B waits for A's watermark, then answers UNAVAILABLE; the short context may end first.
	if c := status.Code(err); c != codes.Unavailable && c != codes.DeadlineExceeded {
		t.Fatalf("Free on B of A's unpublished booking = %v, want UNAVAILABLE (B cannot tell) or the context's end", err)
	}
	if n := onB.PendingEnds(); n != 1 {
		t.Fatalf("PendingEnds() = %d after the Free gave up in the foreground, want 1 (retried in the background)", n)
	}
	proxy.Heal()
	kvtest.Eventually(t, testTimeout, "the Free retried in the background to free the booking everywhere", func() bool {
		return onB.PendingEnds() == 0 && stateA.Load().Bookings() == 0 && stateB.Load().Bookings() == 0
	})
}

// TestHashPrompt routes one prompt with a LoRA adapter, a cache namespace and an image as token ids
// and keyed by HashPrompt: the router finds the same cached blocks on the same worker either way,
// and a prompt hashed with another block size than the model's is refused. HashPrompt refuses what
// the router refuses in the token ids, with the router's words, and leaves the request as it was.
func TestHashPrompt(t *testing.T) {
	state := kvstate.NewState()
	log := kvstate.NewMemLog(state)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	img := blockhash.MultimodalHash("cat.png")
	tokens := prompt(18) // four blocks of 4, and two tokens more
	for id := range uint64(2) {
		info := kvstate.WorkerInfo{Key: kvstate.WorkerKey{ID: id + 1}, Model: "m", Role: kvstate.RoleAggregated, BlockSize: 4,
			TotalKVBlocks: 1024, MaxNumBatchedTokens: 8192, KVEventsEnabled: true}
		if _, err := log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
			t.Fatal(err)
		}
	}
	// Worker 2 caches the prompt's blocks as its engine would report them.
	locals := blockhash.LocalsMultimodal(nil, tokens, 4, blockhash.Salt("l", "tenant"), []blockhash.MultimodalObject{{Hash: img, Start: 5, End: 9}})
	ev := kvstate.Event{Kind: kvstate.EventStored}
	for i, h := range locals {
		ev.Blocks = append(ev.Blocks, kvstate.Block{Hash: uint64(100 + i), Local: h})
	}
	if _, err := log.Append(ctx, kvstate.KVEvents{Worker: kvstate.WorkerKey{ID: 2}, Events: []kvstate.Event{ev}}); err != nil {
		t.Fatal(err)
	}
	s := startReplica(t, state, log, 1000)
	r := kvclient.NewRouter(s.conn, kvclient.RouterOptions{})
	query := func() *kvrouterv1.RouteRequest {
		return &kvrouterv1.RouteRequest{Model: "m", TokenIds: tokens, QueryOnly: true, LoraName: "l", CacheNamespace: "tenant",
			MultimodalObjects: []*kvrouterv1.MultimodalObject{{MmHash: img, Start: 5, End: 9}}}
	}
	where := func(req *kvrouterv1.RouteRequest) (uint64, uint64) {
		t.Helper()
		b, err := r.Route(ctx, req)
		if err != nil {
			t.Fatalf("Route(%v) = %v", req, err)
		}
		return b.GetDecode().GetWorkerId(), b.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice()
	}
	wantWorker, wantOverlap := where(query())
	if wantWorker != 2 || wantOverlap != 4 {
		t.Fatalf("the token ids went to worker %d with %d blocks cached, want 2 with 4", wantWorker, wantOverlap)
	}
	hashed := query()
	if err := kvclient.HashPrompt(hashed, 4); err != nil {
		t.Fatalf("HashPrompt() = %v", err)
	}
	if hashed.GetTokenIds() != nil || hashed.GetLoraName() != "" || hashed.GetCacheNamespace() != "" || hashed.GetMultimodalObjects() != nil ||
		hashed.GetBlockSize() != 4 || hashed.GetPromptTokens() != 18 || len(hashed.GetBlockHashes()) != 4 {
		t.Errorf("HashPrompt() made %v, want 4 block hashes of block size 4 for 18 tokens and nothing else of the prompt", hashed)
	}
	if w, o := where(hashed); w != wantWorker || o != wantOverlap {
		t.Errorf("the hashed prompt went to worker %d with %d blocks cached, want %d with %d", w, o, wantWorker, wantOverlap)
	}
	other := query()
	if err := kvclient.HashPrompt(other, 8); err != nil {
		t.Fatalf("HashPrompt(8) = %v", err)
	}
	if _, err := r.Route(ctx, other); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("a prompt hashed for blocks of 8 = %v, want FAILED_PRECONDITION (the model's blocks are of 4)", err)
	}

	for _, tt := range []struct {
		name   string
		mutate func(*kvrouterv1.RouteRequest)
	}{
		{"no tokens", func(req *kvrouterv1.RouteRequest) { req.TokenIds, req.MultimodalObjects = nil, nil }},
		{"an image past the prompt", func(req *kvrouterv1.RouteRequest) { req.MultimodalObjects[0].End = 19 }},
		{"an empty image", func(req *kvrouterv1.RouteRequest) { req.MultimodalObjects[0].End = 5 }},
		{"too many images", func(req *kvrouterv1.RouteRequest) {
			for i := range 256 {
				req.MultimodalObjects = append(req.MultimodalObjects, &kvrouterv1.MultimodalObject{MmHash: uint64(i), Start: 0, End: 1})
			}
		}},
		{"overlapping images", func(req *kvrouterv1.RouteRequest) {
			req.MultimodalObjects = append(req.MultimodalObjects, &kvrouterv1.MultimodalObject{MmHash: 1, Start: 2, End: 6})
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			req := query()
			tt.mutate(req)
			before := proto.Clone(req)
			_, serverErr := s.raw.Route(ctx, req)
			clientErr := kvclient.HashPrompt(req, 4)
			if status.Code(serverErr) != codes.InvalidArgument || status.Convert(clientErr).Message() != status.Convert(serverErr).Message() {
				t.Errorf("HashPrompt says %v; the router says %v; want the same INVALID_ARGUMENT", clientErr, serverErr)
			}
			if !proto.Equal(before, req) {
				t.Errorf("a refused HashPrompt changed the request: %v, was %v", req, before)
			}
		})
	}
}
