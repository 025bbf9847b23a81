package kvclient_test

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/server"
)

const testBlockSize = 4

func hello(id uint64) *kvrouterv1.WorkerHello {
	return &kvrouterv1.WorkerHello{Endpoint: "10.0.0.1:8000", WorkerId: id, Model: "m", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED,
		BlockSize: testBlockSize, TotalKvBlocks: 1 << 20, MaxNumBatchedTokens: 8192, KvEventsEnabled: true, FreshStart: true}
}

// storedEvent stores block i of one long prompt (tokens 4i+1 .. 4i+4), chained onto block i-1.
func storedEvent(i int) *kvrouterv1.KvEvent {
	st := &kvrouterv1.BlocksStored{Blocks: []*kvrouterv1.StoredBlock{{BlockHash: uint64(1000 + i), TokenIds: promptTokens(i)}}}
	if i > 0 {
		parent := uint64(1000 + i - 1)
		st.ParentHash = &parent
	}
	return &kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}
}

func promptTokens(block int) []uint32 {
	out := make([]uint32, testBlockSize)
	for j := range out {
		out[j] = uint32(block*testBlockSize + j + 1)
	}
	return out
}

// cachedBlocks returns the device blocks the server lists for worker id (0 when it lists none).
func (s *testServer) cachedBlocks(t *testing.T, id uint64) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := s.admin.ListWorkers(ctx, &kvrouterv1.ListWorkersRequest{Model: "m"})
	if err != nil {
		t.Fatalf("ListWorkers() = %v", err)
	}
	for _, w := range resp.GetWorkers() {
		if w.GetWorker().GetWorkerId() == id {
			return w.GetCachedBlocks().GetDevice()
		}
	}
	return 0
}

// lockedWriter serialises writes to w.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

func newPublisher(t *testing.T, opts kvclient.PublisherOptions) *kvclient.Publisher {
	t.Helper()
	p, err := kvclient.NewPublisher(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close(context.Background()) })
	return p
}

func TestPublishAndClose(t *testing.T) {
	for _, hashTokens := range []bool{false, true} {
		t.Run(map[bool]string{false: "token_ids", true: "tokens_hash"}[hashTokens], func(t *testing.T) {
			s := startServer(t, 1<<20)
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			var acks []uint64 // OnAck runs on the stream's goroutine, one call at a time
			var acksMu sync.Mutex
			onAck := func(id uint64) { acksMu.Lock(); acks = append(acks, id); acksMu.Unlock() }
			p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(7), Conns: []grpc.ClientConnInterface{s.conn}, HashTokens: hashTokens, MaxBatchEvents: 16, OnAck: onAck})
			const n = 100
			// Blocks 5 and 6 hold an image and a clip: the router or the client folds their hashes in.
			img, clip := blockhash.MultimodalHash("image.png"), blockhash.MultimodalHash("clip.wav")
			for i := range n {
				ev := storedEvent(i)
				switch i {
				case 5:
					ev.GetStored().Blocks[0].MmHashes = []uint64{img}
				case 6:
					ev.GetStored().Blocks[0].MmHashes = []uint64{img, clip} // in any order
				}
				if err := p.Publish(ctx, ev); err != nil {
					t.Fatalf("Publish(%d) = %v", i, err)
				}
			}
			p.ReportLoad(&kvrouterv1.LoadReport{KvUsedBlocks: n})
			if err := p.Close(ctx); err != nil {
				t.Fatalf("Close() = %v", err)
			}
			if last, ok := p.LastAcked(); !ok || last != n-1 {
				t.Errorf("LastAcked() = %d, %v; want %d", last, ok, n-1)
			}
			acksMu.Lock()
			if len(acks) == 0 || acks[len(acks)-1] != n-1 || !slices.IsSorted(acks) {
				t.Errorf("OnAck saw %v, want ascending ids ending at %d", acks, n-1)
			}
			acksMu.Unlock()
			if got := s.cachedBlocks(t, 7); got != n {
				t.Errorf("the router holds %d blocks of worker 7, want %d", got, n)
			}
			// The router matches the prompt against the published blocks, hashed either way.
			tokens := make([]uint32, 0, n*testBlockSize)
			for i := range n {
				tokens = append(tokens, promptTokens(i)...)
			}
			resp, err := s.raw.Route(ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: tokens, QueryOnly: true,
				MultimodalObjects: []*kvrouterv1.MultimodalObject{
					{MmHash: img, Start: 5*testBlockSize + 1, End: 7*testBlockSize - 1},
					{MmHash: clip, Start: 7*testBlockSize - 1, End: 7 * testBlockSize},
				}})
			if err != nil {
				t.Fatal(err)
			}
			if got := resp.GetDecode().GetWorkerId(); got != 7 || resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice() != n {
				t.Errorf("Route() = worker %d with %v, want worker 7 overlapping all %d blocks", got, resp.GetDiagnostics().GetDecode().GetOverlapBlocks(), n)
			}
		})
	}
}

// TestCloseWithNothingToFlush: a Close whose context has already ended (a drain of 0 s) returns
// nil when the router acked everything: cutting the stream loses nothing.
func TestCloseWithNothingToFlush(t *testing.T) {
	s := startServer(t, 1<<20)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(8), Conns: []grpc.ClientConnInterface{s.conn}})
	if err := p.Publish(ctx, storedEvent(0)); err != nil {
		t.Fatal(err)
	}
	if err := p.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	ended, stop := context.WithCancel(context.Background())
	stop()
	if err := p.Close(ended); err != nil {
		t.Errorf("Close(an ended context) with everything acked = %v, want nil", err)
	}
}

// TestResumeOnAnotherReplica stops the replica a publisher streams to in the middle of its events;
// the publisher goes on through the other replica, and every event is applied exactly once.
func TestResumeOnAnotherReplica(t *testing.T) {
	state := kvstate.NewState()
	log := kvstate.NewMemLog(state)
	a, b := startReplica(t, state, log, 1<<20), startReplica(t, state, log, 1<<20)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	var logs strings.Builder
	var logsMu sync.Mutex
	p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(3), Conns: []grpc.ClientConnInterface{a.conn, b.conn}, MaxBatchEvents: 8,
		Logger: slog.New(slog.NewTextHandler(lockedWriter{&logsMu, &logs}, nil))})
	const n = 2000
	for i := range n {
		if i == n/2 {
			a.srv.Stop() // every stream on A ends at once, some events sent and not acked
		}
		if err := p.Publish(ctx, storedEvent(i)); err != nil {
			t.Fatalf("Publish(%d) = %v", i, err)
		}
	}
	if err := p.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	if got := b.cachedBlocks(t, 3); got != n {
		t.Errorf("replica B holds %d blocks, want %d", got, n)
	}
	logsMu.Lock()
	defer logsMu.Unlock()
	if !strings.Contains(logs.String(), "reconnecting") {
		t.Errorf("the publisher never reconnected; its log:\n%s", logs.String())
	}
	if w := state.Worker(kvstate.WorkerKey{ID: 3}); w == nil || w.Status().LastEventID != n-1 {
		t.Errorf("worker 3's last applied event = %+v, want %d", w, n-1)
	}
}

// TestDumpAfterTheRouterLostEvents: the publisher reconnects to a router that no longer holds the
// worker (its state was lost); it sends its cache through Dump, and goes on after it.
func TestDumpAfterTheRouterLostEvents(t *testing.T) {
	a, b := startServer(t, 1<<20), startServer(t, 1<<20) // two separate states: B never saw A's events
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	published := 0
	dumps := 0
	dump := func(context.Context) ([]*kvrouterv1.KvEvent, error) {
		dumps++
		out := make([]*kvrouterv1.KvEvent, published)
		for i := range out {
			out[i] = storedEvent(i)
		}
		return out, nil
	}
	p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(5), Conns: []grpc.ClientConnInterface{a.conn, b.conn}, Dump: dump, MaxDumpBlocks: 7})
	for ; published < 30; published++ {
		if err := p.Publish(ctx, storedEvent(published)); err != nil {
			t.Fatal(err)
		}
	}
	kvtest.Eventually(t, testTimeout, "A to ack 30 events", func() bool { last, ok := p.LastAcked(); return ok && last == 29 })
	a.srv.Stop()
	kvtest.Eventually(t, testTimeout, "B to hold the dump", func() bool { return b.cachedBlocks(t, 5) == 30 })
	for ; published < 40; published++ {
		if err := p.Publish(ctx, storedEvent(published)); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	if got := b.cachedBlocks(t, 5); got != 40 || dumps != 1 {
		t.Errorf("B holds %d blocks after %d dumps, want 40 after 1", got, dumps)
	}
}

func TestSupersededStops(t *testing.T) {
	s := startServer(t, 1<<20)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	older := newPublisher(t, kvclient.PublisherOptions{Hello: hello(9), Conns: []grpc.ClientConnInterface{s.conn}})
	if err := older.Publish(ctx, storedEvent(0)); err != nil {
		t.Fatal(err)
	}
	kvtest.Eventually(t, testTimeout, "the first ack", func() bool { _, ok := older.LastAcked(); return ok })
	newer := newPublisher(t, kvclient.PublisherOptions{Hello: hello(9), Conns: []grpc.ClientConnInterface{s.conn}})
	if err := newer.Publish(ctx, storedEvent(0)); err != nil {
		t.Fatal(err)
	}
	kvtest.Eventually(t, testTimeout, "the older publisher to stop", func() bool { return older.Err() != nil })
	if err := older.Err(); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "another stream registered this worker rank") {
		t.Errorf("older.Err() = %v, want FAILED_PRECONDITION naming the takeover", err)
	}
	if err := older.Publish(ctx, storedEvent(1)); err == nil {
		t.Error("Publish on a superseded publisher = nil, want its error")
	}
	if err := newer.Close(ctx); err != nil {
		t.Errorf("newer.Close() = %v", err)
	}
}

func TestPublishChecksBlockSize(t *testing.T) {
	s := startServer(t, 1<<20)
	p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(2), Conns: []grpc.ClientConnInterface{s.conn}})
	ev := storedEvent(0)
	ev.GetStored().Blocks[0].TokenIds = []uint32{1, 2, 3}
	err := p.Publish(context.Background(), ev)
	if want := "events[0].stored.blocks[0].token_ids: must hold exactly block_size 4 tokens (got 3)"; status.Code(err) != codes.InvalidArgument || status.Convert(err).Message() != want {
		t.Errorf("Publish() = %v, want INVALID_ARGUMENT %q", err, want)
	}
}

// TestHelloNeedsAnEndpoint: a hello without an endpoint (and without no_endpoint) is refused by
// NewPublisher with the router's own status; one with no_endpoint registers.
func TestHelloNeedsAnEndpoint(t *testing.T) {
	s := startServer(t, 1<<20)
	h := hello(2)
	h.Endpoint = ""
	_, err := kvclient.NewPublisher(kvclient.PublisherOptions{Hello: h, Conns: []grpc.ClientConnInterface{s.conn}})
	stream, serr := kvrouterv1.NewWorkerServiceClient(s.conn).Publish(context.Background())
	if serr != nil {
		t.Fatal(serr)
	}
	if err := stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: h}}); err != nil {
		t.Fatal(err)
	}
	_, routerErr := stream.Recv()
	if status.Code(err) != codes.InvalidArgument || status.Convert(err).Message() != status.Convert(routerErr).Message() {
		t.Errorf("NewPublisher() = %v, want the router's answer %v", err, routerErr)
	}
	h.NoEndpoint = true
	p := newPublisher(t, kvclient.PublisherOptions{Hello: h, Conns: []grpc.ClientConnInterface{s.conn}})
	if _, _, err := p.Registration(t.Context()); err != nil {
		t.Errorf("a hello with no_endpoint: %v", err)
	}
}

// TestPublishRefusesMMHashesWithTokensHash: a block's tokens_hash already holds its multimodal
// hashes; sending both is refused before anything goes out, as the router would refuse it.
func TestPublishRefusesMMHashesWithTokensHash(t *testing.T) {
	s := startServer(t, 1<<20)
	p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(2), Conns: []grpc.ClientConnInterface{s.conn}})
	ev := storedEvent(0)
	h := uint64(9)
	ev.GetStored().Blocks[0].TokenIds, ev.GetStored().Blocks[0].TokensHash, ev.GetStored().Blocks[0].MmHashes = nil, &h, []uint64{7}
	err := p.Publish(context.Background(), ev)
	if want := "events[0].stored.blocks[0].mm_hashes: must be empty with tokens_hash, which already holds them"; status.Code(err) != codes.InvalidArgument || status.Convert(err).Message() != want {
		t.Errorf("Publish() = %v, want INVALID_ARGUMENT %q", err, want)
	}
}

// TestTooLargeMessagesAreSplit: a router that takes at most 16 blocks a message refuses the
// publisher's 64-event messages (RESOURCE_EXHAUSTED); the publisher sends fewer events per message
// and every event arrives once. One event larger than the limit stops it.
func TestTooLargeMessagesAreSplit(t *testing.T) {
	state := kvstate.NewState()
	s := startReplica(t, state, kvstate.NewMemLog(state), 1<<20, func(o *server.Options) { o.MaxBatchBlocks = 16 })
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(4), Conns: []grpc.ClientConnInterface{s.conn}, MaxBatchEvents: 64, FlushInterval: 50 * time.Millisecond})
	const n = 200
	for i := range n {
		if err := p.Publish(ctx, storedEvent(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Flush(ctx); err != nil {
		t.Fatalf("Flush() = %v", err)
	}
	if got := s.cachedBlocks(t, 4); got != n {
		t.Errorf("the router holds %d blocks, want %d", got, n)
	}
	big := &kvrouterv1.BlocksStored{}
	for i := range 17 {
		big.Blocks = append(big.Blocks, &kvrouterv1.StoredBlock{BlockHash: uint64(9000 + i), TokenIds: promptTokens(500 + i)})
	}
	if err := p.Publish(ctx, &kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: big}}); err != nil {
		t.Fatal(err)
	}
	kvtest.Eventually(t, testTimeout, "the publisher to stop on the 17-block event", func() bool { return p.Err() != nil })
	if err := p.Err(); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("Err() = %v, want RESOURCE_EXHAUSTED", err)
	}
}

// dropOneEvent is a client stream that loses the first event of the third event batch it sends,
// as a faulty path between worker and router would. A batch of one event is lost whole: an empty
// batch would be refused as invalid, which is another test's matter (on a busy machine the
// publisher often sends its first events one by one).
type dropOneEvent struct {
	grpc.ClientStream
	batches *atomic.Int32
}

func (s dropOneEvent) SendMsg(m any) error {
	if req, ok := m.(*kvrouterv1.PublishRequest); ok && req.GetEvents() != nil && s.batches.Add(1) == 3 {
		events := req.GetEvents().GetEvents()
		if len(events) == 1 {
			return nil
		}
		m = &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: events[1:]}}}
	}
	return s.ClientStream.SendMsg(m)
}

// TestResyncRequestIsAnsweredWithADump: an event lost on the way makes the router see a gap and ask
// for a resync; the publisher answers with Dump's events, and the router ends up holding every block.
func TestResyncRequestIsAnsweredWithADump(t *testing.T) {
	s := startServer(t, 1<<20)
	var batches atomic.Int32
	conn, err := grpc.NewClient(s.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			cs, err := streamer(ctx, desc, cc, method, opts...)
			return dropOneEvent{cs, &batches}, err
		}))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	const n = 100
	var dumps, published atomic.Int32
	dump := func(context.Context) ([]*kvrouterv1.KvEvent, error) { // the worker's cache as it is now
		dumps.Add(1)
		out := make([]*kvrouterv1.KvEvent, published.Load())
		for i := range out {
			out[i] = storedEvent(i)
		}
		return out, nil
	}
	p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(6), Conns: []grpc.ClientConnInterface{conn}, Dump: dump, MaxBatchEvents: 4})
	for i := range n {
		published.Store(int32(i + 1))
		if err := p.Publish(ctx, storedEvent(i)); err != nil {
			t.Fatal(err)
		}
		if i == 20 {
			// The dump must cover every event published before it: publish the rest after it ran.
			kvtest.Eventually(t, testTimeout, "the resync", func() bool { return dumps.Load() > 0 })
		}
	}
	if err := p.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	if got := s.cachedBlocks(t, 6); got != n || dumps.Load() != 1 {
		t.Errorf("the router holds %d blocks after %d dumps, want %d after 1", got, dumps.Load(), n)
	}
}

// TestRegistration: Registration says what the router held of the rank at the first registration:
// nothing for a fresh start or a rank it does not know, the last event id for a rank resumed
// without fresh_start, which then numbers its events after it.
func TestRegistration(t *testing.T) {
	s := startServer(t, 1<<20)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	registration := func(p *kvclient.Publisher) (uint64, bool) {
		t.Helper()
		last, held, err := p.Registration(ctx)
		if err != nil {
			t.Fatalf("Registration() = %v", err)
		}
		return last, held
	}
	first := newPublisher(t, kvclient.PublisherOptions{Hello: hello(11), Conns: []grpc.ClientConnInterface{s.conn}})
	if last, held := registration(first); held {
		t.Errorf("fresh start: Registration() = %d, held; want nothing held", last)
	}
	for i := range 3 {
		if err := first.Publish(ctx, storedEvent(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := first.Close(ctx); err != nil {
		t.Fatal(err)
	}

	resumed := hello(11)
	resumed.FreshStart = false
	second := newPublisher(t, kvclient.PublisherOptions{Hello: resumed, Conns: []grpc.ClientConnInterface{s.conn}})
	if last, held := registration(second); !held || last != 2 {
		t.Errorf("resumed: Registration() = %d, %v; want 2, held", last, held)
	}
	if err := second.Publish(ctx, storedEvent(3)); err != nil {
		t.Fatal(err)
	}
	if err := second.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if last, _ := second.LastAcked(); last != 3 {
		t.Errorf("LastAcked() = %d after resuming at 2, want 3", last)
	}
	if got := s.cachedBlocks(t, 11); got != 4 {
		t.Errorf("the router holds %d blocks, want 4: the resumed rank kept its blocks", got)
	}

	unknown := hello(12)
	unknown.FreshStart = false
	third := newPublisher(t, kvclient.PublisherOptions{Hello: unknown, Conns: []grpc.ClientConnInterface{s.conn}})
	if last, held := registration(third); held {
		t.Errorf("a rank the router never saw: Registration() = %d, held; want nothing held", last)
	}
}

// TestLeave: a worker that leaves is removed at once, blocks and all, rather than a grace period
// after its stream closed; the publisher is closed after it.
func TestLeave(t *testing.T) {
	s := startServer(t, 1<<20)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(13), Conns: []grpc.ClientConnInterface{s.conn}})
	for i := range 3 {
		if err := p.Publish(ctx, storedEvent(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if got := s.cachedBlocks(t, 13); got != 3 {
		t.Fatalf("the router holds %d blocks before the leave, want 3", got)
	}
	if err := p.Leave(ctx, "engine down"); err != nil {
		t.Fatalf("Leave() = %v", err)
	}
	resp, err := s.admin.ListWorkers(ctx, &kvrouterv1.ListWorkersRequest{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range resp.GetWorkers() {
		if w.GetWorker().GetWorkerId() == 13 {
			t.Errorf("the router still lists worker 13 after its leave: %v", w)
		}
	}
	if err := p.Publish(ctx, storedEvent(3)); err != kvclient.ErrPublisherClosed {
		t.Errorf("Publish() after Leave = %v, want ErrPublisherClosed", err)
	}
	if err := p.Leave(ctx, "again"); err != kvclient.ErrPublisherClosed {
		t.Errorf("a second Leave() = %v, want ErrPublisherClosed", err)
	}
}

// TestLoadReportSurvivesAReconnect: a load report sent on a stream that then breaks reaches the
// router the publisher reconnects to, without a new ReportLoad: an idle worker reports no more,
// and the new replica would go on seeing it with no load report at all (the simulator found this:
// a report lost when a too-large message made the publisher reconnect).
func TestLoadReportSurvivesAReconnect(t *testing.T) {
	stateA, stateB := kvstate.NewState(), kvstate.NewState()
	a := startReplica(t, stateA, kvstate.NewMemLog(stateA), 1<<20)
	b := startReplica(t, stateB, kvstate.NewMemLog(stateB), 1<<20)
	p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(3), Conns: []grpc.ClientConnInterface{a.conn, b.conn}})
	holds := func(state *kvstate.State, used, waiting uint64) func() bool {
		return func() bool {
			w := state.Worker(kvstate.WorkerKey{ID: 3})
			return w != nil && w.Status().KVUsedBlocks == used && w.Status().WaitingRequests == waiting
		}
	}
	p.ReportLoad(&kvrouterv1.LoadReport{KvUsedBlocks: 7, WaitingRequests: 2})
	kvtest.Eventually(t, testTimeout, "replica A to hold the load report", holds(stateA, 7, 2))
	a.srv.Stop()
	kvtest.Eventually(t, testTimeout, "replica B, after the reconnect, to hold the load report", holds(stateB, 7, 2))
}
