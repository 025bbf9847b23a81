package bridge_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvrouter/kvrouter/clients/go/bridge"
	"github.com/kvrouter/kvrouter/clients/go/enginefeed"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/server/servertest"
)

const (
	blockSize   = 4
	testTimeout = 30 * time.Second
	workerID    = 9
)

// engine stands in for a vLLM process: a PUB socket that sends batches with sequence numbers, and
// a ROUTER replay endpoint that answers from the batches it kept, as vLLM's ZmqEventPublisher does.
type engine struct {
	t              *testing.T
	endpoint       string
	replayEndpoint string
	pub            zmq4.Socket
	enc            enginefeed.Encoder
	dp             int64 // the data-parallel rank its batches name

	mu     sync.Mutex
	seq    uint64
	buffer []enginefeed.Message // every batch sent, for replay
}

func freeTCP(t testing.TB) string { return freeTCPRun(t, 1) }

// freeTCPRun returns the endpoint of a loopback port that is free, with the n-1 ports after it (a
// bridge serving n data-parallel ranks subscribes to them): another package's test, running at
// the same time, may hold the port after a free one.
func freeTCPRun(t testing.TB, n int) string {
	t.Helper()
	for range 100 {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := lis.Addr().(*net.TCPAddr).Port
		held := []net.Listener{lis}
		for i := 1; i < n; i++ {
			next, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port+i))
			if err != nil {
				break
			}
			held = append(held, next)
		}
		for _, l := range held {
			l.Close()
		}
		if len(held) == n {
			return fmt.Sprintf("tcp://127.0.0.1:%d", port)
		}
	}
	t.Fatalf("no run of %d free loopback ports found", n)
	return ""
}

func startEngine(t *testing.T, ctx context.Context, endpoint string, withReplay bool) *engine {
	t.Helper()
	e := &engine{t: t, endpoint: endpoint, pub: zmq4.NewPub(ctx)}
	if err := e.pub.Listen(endpoint); err != nil {
		t.Fatalf("engine PUB Listen(%s) = %v", endpoint, err)
	}
	t.Cleanup(func() { e.pub.Close() })
	if withReplay {
		e.replayEndpoint = freeTCP(t)
		router := zmq4.NewRouter(ctx)
		if err := router.Listen(e.replayEndpoint); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { router.Close() })
		go e.serveReplay(router)
	}
	return e
}

// serveReplay answers [identity, "", seq] with every kept batch from seq on, then the end marker.
func (e *engine) serveReplay(router zmq4.Socket) {
	for {
		req, err := router.Recv()
		if err != nil {
			return
		}
		if len(req.Frames) != 3 || len(req.Frames[2]) != 8 {
			continue // vLLM ignores anything else
		}
		id, from := req.Frames[0], binary.BigEndian.Uint64(req.Frames[2])
		e.mu.Lock()
		kept := append([]enginefeed.Message(nil), e.buffer...)
		e.mu.Unlock()
		for _, m := range kept {
			if m.Seq >= from {
				_ = router.SendMulti(zmq4.NewMsgFrom(id, nil, m.Topic, enginefeed.SeqBytes(m.Seq), m.Payload))
			}
		}
		_ = router.SendMulti(zmq4.NewMsgFrom(id, nil, nil, enginefeed.SeqBytes(enginefeed.ReplayEnd), nil))
	}
}

// send publishes a batch of events with the next sequence number; lost batches are kept for the
// replay endpoint but never sent, as if the PUB socket had dropped them.
func (e *engine) send(lost bool, events ...enginefeed.Event) uint64 {
	e.t.Helper()
	b := enginefeed.Batch{TS: float64(time.Now().UnixNano()) / 1e9, HasDPRank: true, DPRank: e.dp, Events: events}
	e.mu.Lock()
	m := enginefeed.Message{Topic: []byte("kv@test@m"), Seq: e.seq, Payload: append([]byte(nil), e.enc.Encode(&b)...)}
	e.seq++
	e.buffer = append(e.buffer, m)
	e.mu.Unlock()
	if !lost {
		if err := e.pub.SendMulti(zmq4.NewMsgFrom(enginefeed.MessageFrames(m)...)); err != nil {
			e.t.Fatalf("engine send: %v", err)
		}
	}
	return m.Seq
}

// stored returns a stored event of blocks first..first+n-1 of one prompt (block i holds tokens
// 4i+1..4i+4), chained to block first-1.
func stored(first, n int) enginefeed.Event {
	ev := enginefeed.Event{Kind: enginefeed.BlockStored, BlockSize: blockSize, Medium: "GPU"}
	if first > 0 {
		ev.ParentHash, ev.HasParent = hashOf(first-1), true
	}
	for i := first; i < first+n; i++ {
		ev.BlockHashes = append(ev.BlockHashes, hashOf(i))
		for k := range blockSize {
			ev.TokenIDs = append(ev.TokenIDs, uint32(i*blockSize+k+1))
		}
	}
	return ev
}

// withKeys gives block i of a stored event the extra keys keys (the other blocks none), as vLLM
// lists them: one entry per block.
func withKeys(ev enginefeed.Event, i int, keys ...enginefeed.ExtraKey) enginefeed.Event {
	ev.ExtraKeys, ev.ExtraKeyEnds = nil, nil
	for b := range ev.BlockHashes {
		if b == i {
			ev.ExtraKeys = append(ev.ExtraKeys, keys...)
		}
		ev.ExtraKeyEnds = append(ev.ExtraKeyEnds, int32(len(ev.ExtraKeys)))
	}
	return ev
}

// fresh returns blocks first..first+n-1 as a chain of their own, without a parent.
func fresh(first, n int) enginefeed.Event {
	ev := stored(first, n)
	ev.HasParent = false
	return ev
}

func removed(blocks ...int) enginefeed.Event {
	ev := enginefeed.Event{Kind: enginefeed.BlockRemoved, Medium: "GPU"}
	for _, i := range blocks {
		ev.BlockHashes = append(ev.BlockHashes, hashOf(i))
	}
	return ev
}

// testLogger shows the bridge's log with -v, and hides it otherwise.
func testLogger() *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	return slog.New(slog.DiscardHandler)
}

// poll waits until cond holds, failing the test after testTimeout.
func poll(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if !kvtest.Poll(testTimeout, 10*time.Millisecond, cond) {
		t.Fatalf("timed out waiting for %s", what)
	}
}

func hashOf(i int) uint64 { return 0xb10c0000 + uint64(i) }

// fixture is a router in this process, a bridge in front of it, and the engine it listens to.
type fixture struct {
	t      *testing.T
	ctx    context.Context
	engine *engine
	bridge *bridge.Bridge
	reg    *prometheus.Registry
	admin  kvrouterv1.AdminServiceClient
	router kvrouterv1.RouterServiceClient
	done   chan error
}

type fixtureOptions struct {
	replay      bool
	dialOptions []grpc.DialOption
	mutate      func(*bridge.Options)
	ports       int // free ports from the engine's endpoint on, one per data-parallel rank (0: 1)
}

func newFixture(t *testing.T, fo fixtureOptions) *fixture {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	state := kvstate.NewState()
	srv, lis, err := servertest.Serve(state, kvstate.NewMemLog(state), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, fo.dialOptions...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	f := &fixture{t: t, ctx: ctx, reg: prometheus.NewRegistry(), admin: kvrouterv1.NewAdminServiceClient(conn),
		router: kvrouterv1.NewRouterServiceClient(conn), done: make(chan error, 1)}
	f.engine = startEngine(t, ctx, freeTCPRun(t, max(1, fo.ports)), fo.replay)
	opts := bridge.Options{
		Hello: &kvrouterv1.WorkerHello{WorkerId: workerID, Model: "m", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED,
			BlockSize: blockSize, TotalKvBlocks: 1 << 20, Endpoint: "10.0.0.9:8000", KvEventsEnabled: true},
		Conns:          []grpc.ClientConnInterface{conn},
		Endpoint:       f.engine.endpoint,
		ReplayEndpoint: f.engine.replayEndpoint,
		Registerer:     f.reg,
		DialRetry:      50 * time.Millisecond,
		Logger:         testLogger(),
	}
	if fo.mutate != nil {
		fo.mutate(&opts)
	}
	if f.bridge, err = bridge.New(opts); err != nil {
		t.Fatal(err)
	}
	bctx, stop := context.WithCancel(ctx)
	go func() { f.done <- f.bridge.Run(bctx, 5*time.Second) }()
	t.Cleanup(func() {
		stop()
		if err := <-f.done; err != nil {
			t.Errorf("Run() = %v", err)
		}
	})
	f.warmUp()
	return f
}

// warmUp sends empty batches until the bridge receives one: a SUB socket misses what is published
// before its subscription reaches the PUB socket.
func (f *fixture) warmUp() {
	f.t.Helper()
	poll(f.t, "the bridge to receive the engine's batches", func() bool {
		f.engine.send(false)
		time.Sleep(10 * time.Millisecond)
		return f.counter("kvrouter_bridge_batches_total", "result", "ok") > 0
	})
}

// counter returns the value of a bridge metric with the given labels (summed over the others).
func (f *fixture) counter(name string, labels ...string) float64 {
	return metricValue(f.t, f.reg, name, labels...)
}

// metricValue sums the series of a counter or gauge of reg whose labels include the given pairs.
func metricValue(t testing.TB, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, fam := range families {
		if fam.GetName() != name {
			continue
		}
	metrics:
		for _, m := range fam.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if have[labels[i]] != labels[i+1] {
					continue metrics
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}

// cached returns the device blocks the router holds for the bridge's worker rank dp.
func (f *fixture) cached(dp uint32) uint64 {
	f.t.Helper()
	resp, err := f.admin.ListWorkers(f.ctx, &kvrouterv1.ListWorkersRequest{Model: "m"})
	if err != nil {
		f.t.Fatal(err)
	}
	for _, w := range resp.GetWorkers() {
		if w.GetWorker().GetWorkerId() == workerID && w.GetWorker().GetDpRank() == dp {
			return w.GetCachedBlocks().GetDevice()
		}
	}
	return 0
}

// waitCached waits until the router holds want device blocks of rank dp.
func (f *fixture) waitCached(dp uint32, want uint64) {
	f.t.Helper()
	poll(f.t, fmt.Sprintf("the router to hold %d blocks of rank %d", want, dp), func() bool { return f.cached(dp) == want })
}

// overlap returns how many leading blocks of the prompt of blocks 0..n-1 the router finds on the worker.
func (f *fixture) overlap(n int) uint64 {
	f.t.Helper()
	tokens := make([]uint32, n*blockSize)
	for i := range tokens {
		tokens[i] = uint32(i + 1)
	}
	resp, err := f.router.Route(f.ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: tokens, QueryOnly: true})
	if err != nil {
		f.t.Fatal(err)
	}
	if resp.GetDecode().GetWorkerId() != workerID {
		return 0
	}
	return resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice()
}

func TestStoresAndRemovesReachTheRouter(t *testing.T) {
	for _, style := range []struct {
		name string
		enc  enginefeed.Encoder
	}{
		{"arrays, April 2025 fields", enginefeed.Encoder{Style: enginefeed.Arrays, StoredFields: 4}},
		{"maps, bytes hashes", enginefeed.Encoder{Style: enginefeed.Maps, BytesHashes: true}},
	} {
		t.Run(style.name, func(t *testing.T) {
			f := newFixture(t, fixtureOptions{})
			f.engine.enc = style.enc
			f.engine.send(false, stored(0, 6))
			f.engine.send(false, stored(6, 2))
			f.waitCached(0, 8)
			if got := f.overlap(8); got != 8 {
				t.Errorf("Route overlap = %d blocks, want 8", got)
			}
			f.engine.send(false, removed(7, 6))
			f.waitCached(0, 6)
			if got := f.overlap(8); got != 6 {
				t.Errorf("Route overlap after removing blocks 6 and 7 = %d, want 6", got)
			}
			poll(t, "the acks of every batch", func() bool {
				return f.counter("kvrouter_bridge_acked_seq") == float64(f.engine.seq-1)
			})
			if got := f.counter("kvrouter_bridge_blocks_forwarded_total"); got != 10 {
				t.Errorf("blocks forwarded = %v, want 10", got)
			}
		})
	}
}

// TestGapFilledFromReplay: a batch the PUB socket dropped is fetched from the replay endpoint, and
// nothing is cleared.
func TestGapFilledFromReplay(t *testing.T) {
	f := newFixture(t, fixtureOptions{replay: true})
	f.engine.send(false, stored(0, 2))
	f.engine.send(true, stored(2, 2)) // dropped on the way
	f.engine.send(false, stored(4, 2))
	f.waitCached(0, 6)
	if got := f.overlap(6); got != 6 {
		t.Errorf("Route overlap = %d, want 6 (the dropped batch replayed)", got)
	}
	if gaps, replays, resets := f.counter("kvrouter_bridge_gaps_total"), f.counter("kvrouter_bridge_replays_total", "result", "complete"),
		f.counter("kvrouter_bridge_resets_total"); gaps != 1 || replays < 1 || resets != 0 {
		t.Errorf("gaps %v, complete replays %v, resets %v; want 1, >= 1, 0", gaps, replays, resets)
	}
}

// TestGapWithoutReplayClears: without a replay endpoint a gap clears the worker's blocks at the
// router (it cannot know what the lost batch removed), and the batches after it are applied.
func TestGapWithoutReplayClears(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	f.engine.send(false, stored(0, 4))
	f.waitCached(0, 4)
	f.engine.send(true, removed(3)) // lost: the router would keep a block the engine evicted
	f.engine.send(false, fresh(10, 2))
	poll(t, "the reset", func() bool { return f.counter("kvrouter_bridge_resets_total", "reason", "gap") == 1 })
	f.waitCached(0, 2)
	if got := f.overlap(4); got != 0 {
		t.Errorf("Route overlap after the clear = %d, want 0: blocks 0..3 are unknown now", got)
	}
}

// TestEngineRestartClears: a sequence that goes back means a new engine process with an empty cache.
func TestEngineRestartClears(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	f.engine.send(false, stored(0, 4))
	f.waitCached(0, 4)
	f.engine.mu.Lock()
	f.engine.seq = 0 // the restarted engine counts from 0 again
	f.engine.mu.Unlock()
	f.engine.send(false, fresh(20, 1))
	poll(t, "the reset", func() bool {
		return f.counter("kvrouter_bridge_resets_total", "reason", "engine_restart") == 1
	})
	f.waitCached(0, 1)
}

// TestBadInputIsCountedAndSkipped: a payload that is not msgpack, an unknown event, a block size
// that is not the worker's and blocks with extra keys the bridge cannot read are dropped by reason;
// the bridge goes on.
func TestBadInputIsCountedAndSkipped(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	f.engine.mu.Lock()
	m := enginefeed.Message{Topic: []byte("kv@test@m"), Seq: f.engine.seq, Payload: []byte{0xc1, 0x00}}
	f.engine.seq++
	f.engine.mu.Unlock()
	if err := f.engine.pub.SendMulti(zmq4.NewMsgFrom(enginefeed.MessageFrames(m)...)); err != nil {
		t.Fatal(err)
	}
	wrongSize := stored(0, 1)
	wrongSize.BlockSize, wrongSize.TokenIDs = 8, append(wrongSize.TokenIDs, 1, 2, 3, 4)
	withImage := withKeys(stored(0, 3), 2, enginefeed.ExtraKey{Kind: enginefeed.ExtraOther})
	f.engine.send(false, wrongSize, withImage, stored(3, 1))
	f.waitCached(0, 2) // blocks 0, 1 of withImage; block 3's parent, block 2, is unknown to the router
	for reason, want := range map[string]float64{bridge.ReasonBlockSize: 1, bridge.ReasonExtraKeys: 1} {
		if got := f.counter("kvrouter_bridge_blocks_dropped_total", "reason", reason); got != want {
			t.Errorf("blocks dropped for %s = %v, want %v", reason, got, want)
		}
	}
	if got := f.counter("kvrouter_bridge_batches_total", "result", "malformed"); got != 1 {
		t.Errorf("malformed batches = %v, want 1", got)
	}
	if got := f.overlap(4); got != 2 {
		t.Errorf("Route overlap = %d, want 2 (the blocks before the unreadable key)", got)
	}
}

// TestResyncRequestIsAnsweredFromTheMirror: an event lost between the bridge and the router makes
// the router ask for a dump; the bridge sends what it forwarded, and the router holds it all.
func TestResyncRequestIsAnsweredFromTheMirror(t *testing.T) {
	drop := &dropOnce{eventID: 2}
	f := newFixture(t, fixtureOptions{dialOptions: []grpc.DialOption{grpc.WithStreamInterceptor(drop.intercept)}})
	for i := range 5 {
		f.engine.send(false, stored(i, 1))
	}
	f.engine.send(false, removed(4))
	f.waitCached(0, 4)
	poll(t, "the resync", func() bool {
		return f.counter("kvrouter_bridge_resets_total", "reason", "resync_request") >= 1
	})
	f.waitCached(0, 4)
	if got := f.overlap(5); got != 4 {
		t.Errorf("Route overlap after the dump = %d, want 4", got)
	}
}

// TestDataParallelRanks: one bridge serves two ranks, on the endpoint's port and the next one.
func TestDataParallelRanks(t *testing.T) {
	var rank1 *engine
	f := newFixture(t, fixtureOptions{ports: 2, mutate: func(o *bridge.Options) {
		o.DPRanks = 2
		ep, err := bridge.RankEndpoint(o.Endpoint, 1)
		if err != nil {
			t.Fatal(err)
		}
		rank1 = startEngine(t, context.Background(), ep, false)
		rank1.dp = 1
	}})
	poll(t, "rank 1's subscription", func() bool {
		rank1.send(false)
		time.Sleep(10 * time.Millisecond)
		return f.counter("kvrouter_bridge_batches_total", "dp_rank", "1", "result", "ok") > 0
	})
	f.engine.send(false, stored(0, 2))
	b := stored(0, 3)
	rank1.send(false, b)
	f.waitCached(0, 2)
	f.waitCached(1, 3)
	// A batch that says it is rank 0's, on rank 1's socket, is dropped.
	wrong := enginefeed.Batch{TS: 1, HasDPRank: true, DPRank: 0, Events: []enginefeed.Event{stored(3, 1)}}
	rank1.mu.Lock()
	m := enginefeed.Message{Seq: rank1.seq, Payload: append([]byte(nil), rank1.enc.Encode(&wrong)...)}
	rank1.seq++
	rank1.mu.Unlock()
	_ = rank1.pub.SendMulti(zmq4.NewMsgFrom(enginefeed.MessageFrames(m)...))
	poll(t, "the mismatch counted", func() bool {
		return f.counter("kvrouter_bridge_batches_total", "dp_rank", "1", "result", bridge.ReasonDPRankMismatch) == 1
	})
	if err := f.bridge.Ready(); err != nil {
		t.Errorf("Ready() = %v", err)
	}
}

// dropOnce is a stream interceptor that loses one event on the way to the router.
type dropOnce struct {
	eventID uint64
	mu      sync.Mutex
	dropped bool
}

func (d *dropOnce) intercept(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	s, err := streamer(ctx, desc, cc, method, opts...)
	return &droppingStream{ClientStream: s, d: d}, err
}

type droppingStream struct {
	grpc.ClientStream
	d *dropOnce
}

func (s *droppingStream) SendMsg(m any) error {
	req, ok := m.(*kvrouterv1.PublishRequest)
	if !ok || req.GetEvents() == nil {
		return s.ClientStream.SendMsg(m)
	}
	s.d.mu.Lock()
	defer s.d.mu.Unlock()
	if s.d.dropped {
		return s.ClientStream.SendMsg(m)
	}
	var kept []*kvrouterv1.KvEvent
	for _, ev := range req.GetEvents().GetEvents() {
		if ev.GetEventId() == s.d.eventID {
			s.d.dropped = true
			continue
		}
		kept = append(kept, ev)
	}
	if len(kept) == 0 {
		return nil
	}
	return s.ClientStream.SendMsg(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: kept}}})
}

// TestResubscribeToTheSameEngine: the link to the engine breaks and comes back while the engine
// process lives on (its numbers and replay buffer go on). The bridge finds the last batch it
// forwarded in the replay buffer, unchanged, and goes on after it without clearing the worker,
// taking what the engine published meanwhile.
func TestResubscribeToTheSameEngine(t *testing.T) {
	f := newFixture(t, fixtureOptions{replay: true})
	f.engine.send(false, stored(0, 4))
	f.waitCached(0, 4)
	f.engine.pub.Close() // the link breaks
	poll(t, "the bridge to notice", func() bool { return f.counter("kvrouter_bridge_subscriber_connected") == 0 })
	f.engine.send(true, stored(4, 2)) // published while no subscriber was there
	f.engine.pub = zmq4.NewPub(f.ctx)
	if err := f.engine.pub.Listen(f.engine.endpoint); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.engine.pub.Close() })
	f.waitCached(0, 6)
	if got := f.overlap(6); got != 6 {
		t.Errorf("Route overlap = %d, want 6", got)
	}
	if got := f.counter("kvrouter_bridge_resets_total"); got != 0 {
		t.Errorf("resets = %v, want 0: the engine is the same process", got)
	}
}

// TestResubscribeToANewEngine: the engine process is replaced on the same endpoint (numbers back
// at 0, a new replay buffer). The bridge does not find its last batch there, clears the worker and
// rebuilds it from the new engine's buffer, before that engine publishes anything more.
func TestResubscribeToANewEngine(t *testing.T) {
	f := newFixture(t, fixtureOptions{replay: true})
	f.engine.send(false, stored(0, 4))
	f.waitCached(0, 4)
	f.engine.pub.Close()
	poll(t, "the bridge to notice", func() bool { return f.counter("kvrouter_bridge_subscriber_connected") == 0 })
	f.engine.mu.Lock()
	f.engine.seq, f.engine.buffer = 0, nil // a new process: an empty cache and history
	f.engine.mu.Unlock()
	f.engine.send(true, fresh(20, 2)) // its first batch, before the bridge is back
	f.engine.pub = zmq4.NewPub(f.ctx)
	if err := f.engine.pub.Listen(f.engine.endpoint); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.engine.pub.Close() })
	poll(t, "the reset", func() bool { return f.counter("kvrouter_bridge_resets_total", "reason", "reconnect") == 1 })
	f.waitCached(0, 2)
}

// TestAckedSeqFollowsBatchesWithoutEvents: a batch that sends the router nothing (no events, or
// every block dropped) counts as acked once what came before it is, so the acked sequence number
// does not stay behind the engine's and show a lag that is not there.
func TestAckedSeqFollowsBatchesWithoutEvents(t *testing.T) {
	f := newFixture(t, fixtureOptions{})
	f.engine.send(false, stored(0, 2))
	embeds := withKeys(stored(2, 1), 0, enginefeed.ExtraKey{Kind: enginefeed.ExtraBytes}) // every block dropped (prompt embeddings)
	f.engine.send(false, embeds)
	last := f.engine.send(false) // no events
	poll(t, "the acked sequence number to reach the last batch", func() bool {
		return f.counter("kvrouter_bridge_acked_seq") == float64(last)
	})
}
