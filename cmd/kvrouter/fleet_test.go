package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// fleetWorker is a worker publisher that behaves as a real one must: it numbers its events, keeps
// those not acked yet, and when its stream breaks it reconnects to the next replica and resumes after
// Registered.last_event_id. When the router holds less than it acked (its shared state lost events)
// or asks for a resync, it sends a dump of its whole cache, in parts. Its cache is a chain of
// one-block events: event i stores block i (tokens id, i, 1, 2; block size 4).
type fleetWorker struct {
	t     *testing.T
	id    uint64
	addrs []string

	paused atomic.Bool // no new events; the stream goes on (acks, dumps, reconnects)
	// fresh: the first hello says fresh_start (a new process taking the worker id over).
	fresh bool
	// modelName is the model the worker serves; "" means fleetModels decides.
	modelName string

	mu         sync.Mutex
	produced   uint64 // events 0..produced-1 exist
	acked      int64  // highest acked event id, -1 before the first
	superseded error  // set when the router said another stream took over
	reconnects int
	dumps      int
}

func newFleetWorker(t *testing.T, id uint64, addrs ...string) *fleetWorker {
	return &fleetWorker{t: t, id: id, addrs: addrs, acked: -1}
}

// fleetModels is how many models the fleet's workers serve: worker id is of model "m" when it is
// 1, else of "m<id mod fleetModels>" (the fault suite's sharded layout spreads them over shards).
var fleetModels = 1

// model returns the model the worker serves.
func (w *fleetWorker) model() string {
	if w.modelName != "" {
		return w.modelName
	}
	if fleetModels <= 1 {
		return "m"
	}
	return fmt.Sprintf("m%d", w.id%uint64(fleetModels))
}

func (w *fleetWorker) blockHash(i uint64) uint64 { return 10_000*w.id + i }

func (w *fleetWorker) storedEvent(i uint64) *kvrouterv1.KvEvent {
	var parent *uint64
	if i > 0 {
		p := w.blockHash(i - 1)
		parent = &p
	}
	return &kvrouterv1.KvEvent{EventId: i, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
		Data: &kvrouterv1.KvEvent_Stored{Stored: &kvrouterv1.BlocksStored{ParentHash: parent,
			Blocks: []*kvrouterv1.StoredBlock{{BlockHash: w.blockHash(i), TokenIds: []uint32{uint32(w.id), uint32(i), 1, 2}}}}}}
}

// prompt is a request prompt that starts with the worker's first two blocks.
func (w *fleetWorker) prompt() []uint32 {
	return []uint32{uint32(w.id), 0, 1, 2, uint32(w.id), 1, 1, 2, 99}
}

// dumpMessages is the worker's whole cache, through event through, as dump parts of at most 1,000
// blocks.
func (w *fleetWorker) dumpMessages(through uint64) []*kvrouterv1.PublishRequest {
	var out []*kvrouterv1.PublishRequest
	for start := uint64(0); start <= through; start += 1000 {
		st := &kvrouterv1.BlocksStored{}
		if start > 0 {
			p := w.blockHash(start - 1)
			st.ParentHash = &p
		}
		for i := start; i <= through && i < start+1000; i++ {
			st.Blocks = append(st.Blocks, &kvrouterv1.StoredBlock{BlockHash: w.blockHash(i), TokenIds: []uint32{uint32(w.id), uint32(i), 1, 2}})
		}
		out = append(out, &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Dump{Dump: &kvrouterv1.KvDump{
			ThroughEventId: through, MoreFollows: start+1000 <= through,
			Events: []*kvrouterv1.KvEvent{{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}}}}})
	}
	return out
}

// run publishes one new event every interval until ctx ends, reconnecting as needed.
func (w *fleetWorker) run(ctx context.Context, interval time.Duration) {
	for attempt := 0; ctx.Err() == nil; attempt++ {
		err := w.session(ctx, w.addrs[attempt%len(w.addrs)], interval)
		if st, _ := status.FromError(err); st.Code() == codes.FailedPrecondition {
			w.mu.Lock()
			w.superseded = err
			w.mu.Unlock()
			return // never reconnect on a refusal: that would flap
		}
		w.mu.Lock()
		w.reconnects++
		w.mu.Unlock()
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// session is one Publish stream: register, resume or dump, then publish until it breaks.
func (w *fleetWorker) session(ctx context.Context, addr string, interval time.Duration) error {
	conn := dial(w.t, addr)
	defer conn.Close()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := kvrouterv1.NewWorkerServiceClient(conn).Publish(sctx)
	if err != nil {
		return err
	}
	if err := stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
		WorkerId: w.id, Model: w.model(), Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 4,
		TotalKvBlocks: 100_000, KvEventsEnabled: true, Endpoint: fmt.Sprintf("w%d", w.id), FreshStart: w.fresh && w.firstSession()}}}); err != nil {
		return err
	}
	resp, err := stream.Recv()
	if err != nil {
		return err
	}
	reg := resp.GetRegistered()
	if reg == nil {
		return fmt.Errorf("first answer %v, want a registration", resp)
	}
	w.mu.Lock()
	produced, acked := w.produced, w.acked
	w.mu.Unlock()
	// What to send first: a dump when the router holds less than was acked (or knows nothing of
	// events that were), else every event after what it holds.
	var first []*kvrouterv1.PublishRequest
	switch {
	case produced == 0:
	case reg.LastEventId == nil && acked >= 0, reg.LastEventId != nil && int64(reg.GetLastEventId()) < acked:
		first = w.dumpMessages(produced - 1)
	default:
		from := uint64(0)
		if reg.LastEventId != nil {
			from = reg.GetLastEventId() + 1
		}
		for i := from; i < produced; i++ {
			first = append(first, &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{w.storedEvent(i)}}}})
		}
	}
	dumpsWanted := make(chan struct{}, 1)
	recvErr := make(chan error, 1)
	go func() {
		for {
			resp, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			switch m := resp.GetMessage().(type) {
			case *kvrouterv1.PublishResponse_Ack:
				w.mu.Lock()
				w.acked = max(w.acked, int64(m.Ack.GetEventId()))
				w.mu.Unlock()
			case *kvrouterv1.PublishResponse_Resync:
				select {
				case dumpsWanted <- struct{}{}:
				default:
				}
			}
		}
	}()
	send := func(msgs []*kvrouterv1.PublishRequest) error {
		for _, m := range msgs {
			if m.GetDump() != nil && !m.GetDump().GetMoreFollows() {
				w.mu.Lock()
				w.dumps++
				w.mu.Unlock()
			}
			if err := stream.Send(m); err != nil {
				return err
			}
		}
		return nil
	}
	if err := send(first); err != nil {
		return <-recvErr
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case err := <-recvErr:
			return err
		case <-ctx.Done():
			return ctx.Err() // the connection closes under the stream: a cut, not a goodbye
		case <-dumpsWanted:
			w.mu.Lock()
			produced := w.produced
			w.mu.Unlock()
			if produced > 0 {
				if err := send(w.dumpMessages(produced - 1)); err != nil {
					return <-recvErr
				}
			}
		case <-tick.C:
			if w.paused.Load() {
				continue
			}
			w.mu.Lock()
			i := w.produced
			w.produced++
			w.mu.Unlock()
			if err := send([]*kvrouterv1.PublishRequest{{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{w.storedEvent(i)}}}}}); err != nil {
				return <-recvErr
			}
		}
	}
}

// firstSession reports whether no stream of this worker registered yet.
func (w *fleetWorker) firstSession() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.reconnects == 0 && w.produced == 0
}

// status returns what the worker produced and had acked.
func (w *fleetWorker) status() (produced uint64, acked int64, reconnects, dumps int, superseded error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.produced, w.acked, w.reconnects, w.dumps, w.superseded
}

// fleet drives workers and Route load against a set of replicas, and checks what they converge to.
type fleet struct {
	t        *testing.T
	workers  []*fleetWorker
	ctx      context.Context
	stop     context.CancelFunc
	interval time.Duration
	wg       sync.WaitGroup
	routes   atomic.Int64
	failures atomic.Int64
	lastErr  atomic.Value
	// mu guards workers against the Route goroutines (registered); the test goroutine changes it.
	mu sync.Mutex
	// Booking load (bookOn): the routers that free, each ending its bookings in the background
	// while the replica it asks cannot accept them yet; bookingWG tracks the loops.
	bookers       []*kvclient.Router
	bookingPaused atomic.Bool
	bookingWG     sync.WaitGroup
	booked        atomic.Int64
	freeChecks    []*freeCheck
}

// startFleet starts n workers, worker i publishing to addrs[i%len] first (then the others, in turn,
// after a drop), one event every interval, and query-only Route calls on every replica.
func startFleet(t *testing.T, n int, interval time.Duration, addrs ...string) *fleet {
	return startFleetOn(t, n, interval, addrs, addrs)
}

// startFleetOn is startFleet with Route calls on routeAddrs only.
func startFleetOn(t *testing.T, n int, interval time.Duration, addrs, routeAddrs []string) *fleet {
	var workers []*fleetWorker
	for i := range n {
		order := append(append([]string(nil), addrs[i%len(addrs):]...), addrs[:i%len(addrs)]...)
		workers = append(workers, newFleetWorker(t, uint64(1+i), order...))
	}
	return startFleetWith(t, workers, interval, routeAddrs...)
}

// startFleetWith runs workers, publishing one event each every interval, and query-only Route calls
// on routeAddrs, until the test ends.
func startFleetWith(t *testing.T, workers []*fleetWorker, interval time.Duration, routeAddrs ...string) *fleet {
	ctx, cancel := context.WithCancel(context.Background())
	f := &fleet{t: t, ctx: ctx, stop: cancel, interval: interval}
	for _, w := range workers {
		f.add(w)
	}
	for _, addr := range routeAddrs {
		f.routeOn(addr)
	}
	t.Cleanup(f.halt)
	return f
}

// add starts w with the fleet and checks its events with the others'.
func (f *fleet) add(w *fleetWorker) {
	f.mu.Lock()
	f.workers = append(f.workers, w)
	f.mu.Unlock()
	f.wg.Add(1)
	go func() { defer f.wg.Done(); w.run(f.ctx, f.interval) }()
}

// forget leaves the worker with id out of the checks (it was superseded, or left for good).
func (f *fleet) forget(w *fleetWorker) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, x := range f.workers {
		if x == w {
			f.workers = append(f.workers[:i:i], f.workers[i+1:]...)
			return
		}
	}
}

// routeOn sends query-only Route calls to addr every 5 ms until the fleet stops.
func (f *fleet) routeOn(addr string) {
	ctx := f.ctx
	client := kvrouterv1.NewRouterServiceClient(dial(f.t, addr))
	workers := append([]*fleetWorker(nil), f.workers...) // those started so far
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		for i := 0; ctx.Err() == nil; i++ {
			w := workers[i%len(workers)]
			err := routeRetrying(ctx, client, &kvrouterv1.RouteRequest{Model: w.model(), TokenIds: w.prompt(), QueryOnly: true})
			if ctx.Err() != nil {
				return
			}
			f.routes.Add(1)
			// NOT_FOUND before any worker of the model registered is an answer, not a failure;
			// once one has (its events are acked), the model exists and NOT_FOUND is wrong.
			if err != nil && (status.Code(err) != codes.NotFound || f.registered(w.model())) {
				f.failures.Add(1)
				f.lastErr.Store(fmt.Sprintf("%s: %v", addr, err))
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
}

// bookOn adds booking load: for each addr, requests are routed (and booked) on it, every 10 ms,
// and each is freed at once on the next addr, as a frontend behind a load balancer may end a
// request on another replica than the one that routed it. Both go through kvclient.Router, which
// frees in the background what a replica cannot accept yet; settle waits until every request is.
func (f *fleet) bookOn(addrs ...string) {
	f.mu.Lock()
	workers := append([]*fleetWorker(nil), f.workers...)
	f.mu.Unlock()
	for i, addr := range addrs {
		onRoute := kvclient.NewRouter(dial(f.t, addr), kvclient.RouterOptions{EndTimeout: 2 * time.Second})
		check := &freeCheck{addr: addrs[(i+1)%len(addrs)]}
		onFree := kvclient.NewRouter(dial(f.t, check.addr, grpc.WithChainUnaryInterceptor(check.interceptor)), kvclient.RouterOptions{EndTimeout: 2 * time.Second})
		f.bookers = append(f.bookers, onRoute, onFree)
		f.freeChecks = append(f.freeChecks, check)
		f.t.Cleanup(func() { onRoute.Close(); onFree.Close() })
		f.bookingWG.Add(1)
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			defer f.bookingWG.Done()
			for n := 0; f.ctx.Err() == nil && !f.bookingPaused.Load(); n++ {
				w := workers[n%len(workers)]
				rctx, cancel := context.WithTimeout(f.ctx, 2*time.Second)
				b, err := onRoute.Route(rctx, &kvrouterv1.RouteRequest{Model: w.model(), TokenIds: w.prompt()})
				cancel()
				if f.ctx.Err() != nil {
					return
				}
				f.routes.Add(1)
				switch {
				case err != nil && (status.Code(err) != codes.NotFound || f.registered(w.model())):
					f.failures.Add(1)
					f.lastErr.Store(fmt.Sprintf("%s (booking): %v", addr, err))
				case err == nil:
					f.booked.Add(1)
					fctx, cancel := context.WithTimeout(f.ctx, time.Second)
					_ = onFree.Existing(b.RequestID).Free(fctx) // retried in the background until accepted
					cancel()
				}
				time.Sleep(10 * time.Millisecond)
			}
		}()
	}
}

// endBookings stops the booking load and waits, up to timeout, until every request it booked was
// freed (no Free left to retry); it reports how many still wait.
func (f *fleet) endBookings(timeout time.Duration) int {
	f.bookingPaused.Store(true)
	f.bookingWG.Wait()
	pending := 0
	kvtest.Poll(timeout, 50*time.Millisecond, func() bool {
		pending = 0
		for _, r := range f.bookers {
			pending += r.PendingEnds()
		}
		return pending == 0
	})
	return pending
}

// routeRetrying calls Route as a frontend does: UNAVAILABLE (a replica whose shared state is being
// re-established, or still loading) is retried after the delay the router suggests, within a 2 s
// budget; the last answer is returned.
func routeRetrying(ctx context.Context, client kvrouterv1.RouterServiceClient, req *kvrouterv1.RouteRequest) error {
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	for {
		_, err := client.Route(rctx, req)
		if status.Code(err) != codes.Unavailable {
			return err
		}
		select {
		case <-rctx.Done():
			return err
		case <-time.After(retryDelayOf(err, 50*time.Millisecond)):
		}
	}
}

// retryDelayOf returns the delay a status's RetryInfo suggests, or def.
func retryDelayOf(err error, def time.Duration) time.Duration {
	for _, d := range status.Convert(err).Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			return ri.GetRetryDelay().AsDuration()
		}
	}
	return def
}

// registered reports whether some worker of model has had an event acked: the model exists.
func (f *fleet) registered(model string) bool {
	f.mu.Lock()
	workers := append([]*fleetWorker(nil), f.workers...)
	f.mu.Unlock()
	for _, w := range workers {
		if _, acked, _, _, _ := w.status(); w.model() == model && acked >= 0 {
			return true
		}
	}
	return false
}

// pause stops producing events; streams go on, so what is in flight gets acked.
func (f *fleet) pause() {
	for _, w := range f.workers {
		w.paused.Store(true)
	}
}

// halt stops the workers and the Route load.
func (f *fleet) halt() {
	f.stop()
	f.wg.Wait()
}

// routeFailures returns how many Route calls failed, and the last failure.
// wrongFrees returns how many Free calls were answered NOT_FOUND for a request the fleet booked
// (freeCheck), and the first few.
func (f *fleet) wrongFrees() (int, []string) {
	n, first := 0, []string(nil)
	for _, c := range f.freeChecks {
		m, w := c.report()
		n, first = n+m, append(first, w...)
	}
	return n, first
}

func (f *fleet) routeFailures() (int64, string) {
	s, _ := f.lastErr.Load().(string)
	return f.failures.Load(), s
}

// replicaState is what one replica reports: GetState and each worker's blocks and last event.
type replicaState struct {
	state  *kvrouterv1.GetStateResponse
	blocks map[uint64]uint64
}

func readReplica(ctx context.Context, t *testing.T, addr string) (replicaState, error) {
	conn := dial(t, addr)
	defer conn.Close()
	admin := kvrouterv1.NewAdminServiceClient(conn)
	st, err := admin.GetState(ctx, &kvrouterv1.GetStateRequest{})
	if err != nil {
		return replicaState{}, err
	}
	ws, err := admin.ListWorkers(ctx, &kvrouterv1.ListWorkersRequest{})
	if err != nil {
		return replicaState{}, err
	}
	out := replicaState{state: st, blocks: map[uint64]uint64{}}
	for _, w := range ws.GetWorkers() {
		out.blocks[w.GetWorker().GetWorkerId()] = w.GetCachedBlocks().GetDevice()
	}
	return out, nil
}

// waitConverged waits (up to timeout) until every replica reports the same log generation, stream
// position and digest, nothing pending, its shared state complete, and every worker of the fleet
// with all the blocks it had acked: no acked event lost. The fleet must be paused. It returns how
// long that took and the last reading.
func (f *fleet) waitConverged(timeout time.Duration, addrs ...string) (time.Duration, []replicaState, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var last []replicaState
	var why error
	for {
		last, why = last[:0], nil
		for _, addr := range addrs {
			rs, err := readReplica(ctx, f.t, addr)
			if err != nil {
				why = err
				break
			}
			last = append(last, rs)
		}
		if why == nil {
			why = f.agree(last)
		}
		if debugConverge && why != nil {
			f.t.Logf("%v: %v", time.Since(start).Round(time.Millisecond), why)
		}
		if why == nil {
			return time.Since(start), last, nil
		}
		select {
		case <-ctx.Done():
			return time.Since(start), last, fmt.Errorf("no convergence within %v: %w", timeout, why)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// agree says why the readings do not (yet) show converged replicas holding every acked event.
func (f *fleet) agree(rs []replicaState) error {
	first := rs[0].state
	for i, r := range rs {
		s := r.state
		switch {
		case s.GetLogGeneration() != first.GetLogGeneration() || s.GetLogLastId() != first.GetLogLastId():
			return fmt.Errorf("replica %d at %s %s, replica 0 at %s %s", i, s.GetLogGeneration(), s.GetLogLastId(), first.GetLogGeneration(), first.GetLogLastId())
		case s.GetPendingChanges() != 0:
			return fmt.Errorf("replica %d has %d pending changes", i, s.GetPendingChanges())
		case !s.GetSharedStateComplete():
			return fmt.Errorf("replica %d reports its shared state incomplete", i)
		case s.GetDigest() != first.GetDigest():
			return fmt.Errorf("replica %d digest %s, replica 0 %s", i, s.GetDigest(), first.GetDigest())
		}
		for _, w := range f.workers {
			_, acked, _, _, _ := w.status()
			if got := int64(r.blocks[w.id]); got < acked+1 {
				return fmt.Errorf("replica %d holds %d blocks of worker %d, which had %d acked: %w", i, got, w.id, acked+1, errAckedLost)
			}
		}
	}
	return nil
}

const debugConverge = false

// errAckedLost marks a reading where a replica lacks events a worker had acked.
var errAckedLost = errors.New("acked events missing")

// ackedLost returns, per worker, how many acked events the reading lacks (0 for all: none lost).
func (f *fleet) ackedLost(rs []replicaState) int64 {
	var lost int64
	for _, w := range f.workers {
		_, acked, _, _, _ := w.status()
		for _, r := range rs {
			if miss := acked + 1 - int64(r.blocks[w.id]); miss > lost {
				lost = miss
			}
		}
	}
	return lost
}

// waitAllAcked waits until every worker's events are all acked (after the fleet paused, its last
// ones may still be in flight or wait for a dump).
func (f *fleet) waitAllAcked(timeout time.Duration) error {
	var pending string
	var refused error
	kvtest.Poll(timeout, 50*time.Millisecond, func() bool {
		pending = ""
		for _, w := range f.workers {
			produced, acked, _, _, sup := w.status()
			if sup != nil {
				refused = fmt.Errorf("worker %d was refused: %v", w.id, sup)
				return true
			}
			if int64(produced)-1 != acked {
				pending = fmt.Sprintf("worker %d: produced %d, acked through %d", w.id, produced, acked)
			}
		}
		return pending == ""
	})
	switch {
	case refused != nil:
		return refused
	case pending != "":
		return fmt.Errorf("not every event acked within %v: %s", timeout, pending)
	}
	return nil
}

// steady waits until every replica reports its shared state complete: faults hit a deployment in
// steady state, not one still in its first reseed window.
func steady(t *testing.T, addrs ...string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for _, addr := range addrs {
		for {
			s, err := readReplica(context.Background(), t, addr)
			if err == nil && s.state.GetSharedStateComplete() {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("replica %s never reported its shared state complete: %v %v", addr, s.state, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}
