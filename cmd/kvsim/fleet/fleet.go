// Package fleet replays requests through a simulated fleet of engines (cmd/kvsim/engine) and the
// real router, on a virtual clock: an hour of trace runs in minutes, and the same trace gives the
// same result. The router runs in this process: its gRPC server takes each engine's KV events and
// load through the Go client's Publisher, exactly as from a real worker, and requests are routed,
// marked prefill-complete and freed through the same orchestration the server uses
// (server/app), with the virtual time as its clock.
package fleet

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	"github.com/kvrouter/kvrouter/cmd/kvsim/engine"
	"github.com/kvrouter/kvrouter/cmd/kvsim/trace"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore"
	"github.com/kvrouter/kvrouter/kvstate/replication"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
	"github.com/kvrouter/kvrouter/server/config"
	kvreplica "github.com/kvrouter/kvrouter/server/replica"
	"github.com/kvrouter/kvrouter/server/servertest"
)

// ModelName is the model every simulated worker serves.
const ModelName = "sim"

// Config is one simulated fleet and how it is routed.
type Config struct {
	// Model times the engines and sizes their caches.
	Model engine.CostModel
	// Prefill, Decode and Aggregated are the number of workers of each role. Decode workers
	// support bypass (they prefill a request themselves when the router says so).
	Prefill, Decode, Aggregated int
	// Router is the router's configuration (policy.DefaultConfig, with conditional
	// disaggregation or not).
	Routing policy.Config
	// RoundRobin routes in turn, blind to caches and load, without the router: the baseline.
	RoundRobin bool
	// TimeScale divides the trace's arrival times: 2 replays it twice as fast (twice the load).
	TimeScale float64
	// Replicas is the number of router replicas (default 1); requests go to them in turn, and each
	// request is marked and freed on the replica that routed it. With RedisAddr they share state
	// through that Redis, as `kvrouter serve --redis-addr` does: every worker streams to one
	// replica, and before each routing decision the fleet waits until every replica has applied
	// the whole log. Without it, several replicas do not share: each keeps its own state, every
	// worker streams its events to each of them, and each replica sees only its own bookings.
	Replicas  int
	RedisAddr string
	// Seed seeds each replica's routing tie-breaks (replica k draws from Seed+k): with every input
	// on the virtual clock, one seed gives one result.
	Seed uint64
	// Progress, when set, is told how many requests finished, as they do.
	Progress func(done, total int)
}

// Record is what happened to one request.
type Record struct {
	ID                         string
	Arrival, FirstToken, Done  time.Duration
	PromptTokens, CachedTokens int
	OutputTokens               int
	Mode                       policy.Mode
	// ITLP99 is the 99th percentile of the request's own gaps between tokens (0 with one token).
	ITLP99 time.Duration
	// Precise says the worker chosen to prefill the request held the longest prefix of its prompt
	// that any worker of that role held at that moment (in the engines' caches, not the router's).
	Precise bool
}

// TTFT returns the request's time to first token.
func (r *Record) TTFT() time.Duration { return r.FirstToken - r.Arrival }

// Result is a replay's outcome.
type Result struct {
	Config  Config
	Records []Record
	// ITL holds every gap between two tokens of one request, over all requests, in milliseconds.
	ITL []float32
	// Span is the virtual time from the first arrival to the last request's end.
	Span time.Duration
	// Busy is the time each role's workers spent in forward passes, summed over its workers.
	Busy map[kvstate.Role]time.Duration
	// Workers is the number of workers of each role.
	Workers map[kvstate.Role]int
	// RouterBlocks and EngineBlocks are, after the run, each worker's blocks as the router holds
	// them and as its engine holds them: equal when the router's view is exact. PeakBlocks is the
	// most blocks each engine's cache held at any time.
	RouterBlocks, EngineBlocks, PeakBlocks map[uint64]uint64
	// Bookings is the number of bookings the router still holds after the run (0: every one freed).
	Bookings int
	// Preemptions counts sequences the engines preempted for lack of cache blocks.
	Preemptions int
}

// worker is one simulated engine and its stream to the router.
type worker struct {
	key      kvstate.WorkerKey
	role     kvstate.Role
	eng      *engine.Engine
	pubs     []*kvclient.Publisher // to its replica, or to every replica when they do not share
	stepping bool                  // a step end is scheduled
	dirty    bool                  // events published since the last flush
	// load is the last load report sent, and loadDirty says it may not have reached every replica:
	// flushAll waits until it has.
	load      kvstate.WorkerStatus
	loadDirty bool
}

// request is a trace request in flight.
type request struct {
	rec        *Record
	src        *trace.Request
	tokens     []uint32
	blocks     []uint64
	mode       policy.Mode
	prefill    *worker
	decode     *worker
	lastToken  time.Duration
	gaps       []time.Duration
	booked     bool
	rep        *replica // the replica that routed (and booked) it
	prefillSeq *engine.Seq
}

// replica is one router replica: its state, log, orchestration and gRPC server.
type replica struct {
	state *kvstate.State
	log   kvstate.Log
	redis *replication.Log // nil when the replica's log is in process
	disp  *app.Sharded
	conn  *grpc.ClientConn
}

type eventKind int

const (
	evArrival eventKind = iota
	evStepEnd
	evFirstToken
	evToken
	evFinished
	evTransferred
)

type event struct {
	at   time.Duration
	seq  uint64 // tie-break: events at one time run in the order they were scheduled
	kind eventKind
	req  *request
	w    *worker
}

type eventHeap []event

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(i, j int) bool {
	return h[i].at < h[j].at || (h[i].at == h[j].at && h[i].seq < h[j].seq)
}
func (h eventHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(event)) }
func (h *eventHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

// sim is one replay in progress.
type sim struct {
	ctx      context.Context
	cfg      Config
	replicas []*replica
	routed   int // requests routed, for the replica turn
	workers  []*worker
	byName   map[string]*worker
	events   eventHeap
	nextSeq  uint64
	now      time.Duration
	epoch    time.Time
	rr       [2]int // round-robin cursors: prefill, decode
	res      *Result
	done     int
	total    int
	byEng    map[*engine.Engine]*worker
	reqOf    map[*engine.Seq]*request
	err      error // the first failure inside an engine callback
}

// Run replays reqs through the fleet and returns what happened to each. It fails when the router
// refuses a request or a worker's stream fails.
func Run(ctx context.Context, cfg Config, reqs []trace.Request) (*Result, error) {
	if cfg.TimeScale <= 0 {
		cfg.TimeScale = 1
	}
	if cfg.Prefill+cfg.Decode+cfg.Aggregated == 0 || (cfg.Prefill > 0 && cfg.Decode == 0) {
		return nil, errors.New("fleet: need aggregated workers, or decode workers (with or without prefill workers)")
	}
	if cfg.Routing.QueueThreshold != nil {
		return nil, errors.New("fleet: router_queue_threshold must be unset: the router's queue waits in real time, the fleet runs on a virtual clock")
	}
	if cfg.Replicas < 1 {
		cfg.Replicas = 1
	}
	s := &sim{ctx: ctx, cfg: cfg, byName: map[string]*worker{}, byEng: map[*engine.Engine]*worker{},
		reqOf: map[*engine.Seq]*request{}, epoch: time.Unix(1_800_000_000, 0), total: len(reqs)}
	s.res = &Result{Config: cfg, Busy: map[kvstate.Role]time.Duration{}, Workers: map[kvstate.Role]int{},
		RouterBlocks: map[uint64]uint64{}, EngineBlocks: map[uint64]uint64{}, PeakBlocks: map[uint64]uint64{}}
	stop, err := s.startReplicas()
	defer stop()
	if err != nil {
		return nil, err
	}
	if err := s.startWorkers(); err != nil {
		return nil, err
	}
	defer func() {
		for _, w := range s.workers {
			for _, p := range w.pubs {
				_ = p.Close(context.Background())
			}
		}
	}()

	s.res.Records = make([]Record, len(reqs))
	for i := range reqs {
		r := &reqs[i]
		if blocks := r.InputTokens()/cfg.Model.BlockSize + 1 + max(1, r.OutputTokens)/cfg.Model.BlockSize; blocks > cfg.Model.TotalKVBlocks {
			return nil, fmt.Errorf("fleet: request %s needs %d blocks, more than a worker's cache of %d", r.ID, blocks, cfg.Model.TotalKVBlocks)
		}
		rec := &s.res.Records[i]
		*rec = Record{ID: r.ID, Arrival: time.Duration(float64(r.Arrival) / cfg.TimeScale), PromptTokens: r.InputTokens(), OutputTokens: max(1, r.OutputTokens)}
		s.schedule(rec.Arrival, evArrival, &request{rec: rec, src: r}, nil)
	}
	for s.events.Len() > 0 {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		ev := heap.Pop(&s.events).(event)
		s.now = ev.at
		if err := s.handle(ev); err != nil {
			return nil, err
		}
		if s.err != nil {
			return nil, s.err
		}
	}
	if s.done != len(reqs) {
		return nil, fmt.Errorf("fleet: %d of %d requests finished; the rest could not be scheduled (a prompt larger than a worker's cache?)", s.done, len(reqs))
	}
	s.res.Span = s.now
	if err := s.flushAll(); err != nil {
		return nil, err
	}
	for _, w := range s.workers {
		s.res.Busy[w.role] += w.eng.Busy()
		s.res.Workers[w.role]++
		s.res.EngineBlocks[w.key.ID] = uint64(w.eng.Cache().Used())
		s.res.Preemptions += w.eng.Preemptions()
	}
	if m := s.replicas[0].state.Model(ModelName); m != nil {
		for _, w := range m.Workers() {
			c := m.Index.BlockCounts(w.Slot)
			s.res.RouterBlocks[w.Info.Key.ID] = c.Total()
		}
	}
	for _, rep := range s.replicas {
		s.res.Bookings += rep.state.Load().Bookings()
	}
	return s.res, nil
}

// startReplicas starts the router replicas, each with its gRPC server on loopback; the returned
// function stops them.
func (s *sim) startReplicas() (stop func(), err error) {
	var stops []func()
	stop = func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	prefix := fmt.Sprintf("kvsim:{%d}", time.Now().UnixNano())
	if s.cfg.RedisAddr != "" {
		stops = append(stops, func() {
			// The run's keys: a stream and a few more under its prefix.
			store := redisstore.Dial(s.cfg.RedisAddr)
			_ = store.Forget(context.Background(), prefix)
			store.Close()
		})
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	clock := kvstate.ClockFunc(func() time.Time { return s.epoch.Add(s.now) })
	for k := range s.cfg.Replicas {
		cfg := config.New()
		cfg.Routing, cfg.MaxPromptTokens, cfg.MaxRecvMsgBytes = s.cfg.Routing, 1<<22, 64<<20
		cfg.RedisAddr, cfg.RedisPrefix, cfg.ReplicaID = s.cfg.RedisAddr, prefix, fmt.Sprintf("sim-%d", k)
		built, err := kvreplica.Build(kvreplica.Options{Config: cfg, Logger: quiet, Clock: clock, Rand: policy.NewSeededRand(s.cfg.Seed + uint64(k))})
		if err != nil {
			return stop, err
		}
		rep := &replica{state: built.State(), log: built.Log(), disp: built.Dispatcher}
		rep.redis, _ = rep.log.(*replication.Log)
		if rep.redis != nil {
			// Each replica's own context: its logs and leases stop after its server, whose streams
			// release their leases first (a shared context would stop them under the other
			// replicas' streams).
			runCtx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { _ = built.RunLogs(runCtx); close(done) }()
			stops = append(stops, func() { cancel(); <-done; built.Close() })
			select {
			case <-built.Ready():
			case <-time.After(30 * time.Second):
				return stop, fmt.Errorf("fleet: replica %d did not join the shared log at %s", k, s.cfg.RedisAddr)
			}
		}
		srv, lis, err := servertest.ServeReplica(built)
		if err != nil {
			return stop, err
		}
		stops = append(stops, srv.Stop)
		if rep.conn, err = grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
			return stop, err
		}
		stops = append(stops, func() { rep.conn.Close() })
		s.replicas = append(s.replicas, rep)
	}
	return stop, nil
}

// startWorkers creates the engines and registers each with the router through its Publisher: with
// one replica, or replicas sharing state, each worker streams to one replica (in turn); replicas
// that do not share get a stream from every worker.
func (s *sim) startWorkers() error {
	m := &s.cfg.Model
	add := func(role kvstate.Role, n int, name string, protoRole kvrouterv1.WorkerRole) error {
		for i := range n {
			w := &worker{key: kvstate.WorkerKey{ID: uint64(len(s.workers) + 1)}, role: role}
			label := fmt.Sprintf("%s-%d", name, i)
			w.eng = engine.New(label, *m, (*observer)(s))
			targets := s.replicas[int(w.key.ID-1)%len(s.replicas) : int(w.key.ID-1)%len(s.replicas)+1]
			if s.cfg.RedisAddr == "" {
				targets = s.replicas
			}
			for _, rep := range targets {
				pub, err := kvclient.NewPublisher(kvclient.PublisherOptions{
					Hello: &kvrouterv1.WorkerHello{WorkerId: w.key.ID, Model: ModelName, Role: protoRole, BlockSize: uint32(m.BlockSize),
						TotalKvBlocks: uint64(m.TotalKVBlocks), MaxNumBatchedTokens: uint64(m.MaxNumBatchedTokens), Endpoint: label,
						SupportsBypass: role == kvstate.RoleDecode, KvEventsEnabled: true, FreshStart: true},
					Conns: []grpc.ClientConnInterface{rep.conn}, MaxBatchEvents: 1024, FlushInterval: 100 * time.Microsecond,
				})
				if err != nil {
					return err
				}
				w.pubs = append(w.pubs, pub)
			}
			s.workers = append(s.workers, w)
			s.byName[label] = w
			s.byEng[w.eng] = w
		}
		return nil
	}
	if err := add(kvstate.RolePrefill, s.cfg.Prefill, "prefill", kvrouterv1.WorkerRole_WORKER_ROLE_PREFILL); err != nil {
		return err
	}
	if err := add(kvstate.RoleDecode, s.cfg.Decode, "decode", kvrouterv1.WorkerRole_WORKER_ROLE_DECODE); err != nil {
		return err
	}
	if err := add(kvstate.RoleAggregated, s.cfg.Aggregated, "agg", kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED); err != nil {
		return err
	}
	// Registered: every worker is in every replica's state.
	deadline := time.Now().Add(30 * time.Second)
	for {
		all := true
		for _, rep := range s.replicas {
			if m := rep.state.Model(ModelName); m == nil || len(m.Workers()) != len(s.workers) {
				all = false
			}
		}
		if all {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("fleet: the workers did not register with the router")
		}
		time.Sleep(time.Millisecond)
	}
}

func (s *sim) schedule(at time.Duration, kind eventKind, r *request, w *worker) {
	s.nextSeq++
	heap.Push(&s.events, event{at: at, seq: s.nextSeq, kind: kind, req: r, w: w})
}

// flushAll waits until the router holds every event published so far, so that a routing decision
// at the current virtual time sees the caches as they are at that time.
func (s *sim) flushAll() error {
	for _, w := range s.workers {
		if !w.dirty {
			continue
		}
		for _, p := range w.pubs {
			if err := p.Flush(s.ctx); err != nil {
				return fmt.Errorf("fleet: worker %d: %w", w.key.ID, err)
			}
		}
		w.dirty = false
	}
	if err := s.syncReplicas(); err != nil {
		return err
	}
	return s.awaitLoads()
}

// awaitLoads waits until every replica holds each worker's last load report. Load reports are not
// acknowledged (the protocol acks events), so the simulation reads the replicas' state: a routing
// decision at the current virtual time must see the loads of that time, whatever the host's speed.
func (s *sim) awaitLoads() error {
	deadline := time.Now().Add(30 * time.Second)
	for _, w := range s.workers {
		if !w.loadDirty {
			continue
		}
		for k, rep := range s.replicas {
			for !holdsLoad(rep, w) {
				if time.Now().After(deadline) {
					return fmt.Errorf("fleet: replica %d does not hold worker %d's last load report (%d used blocks, %d waiting) after 30 s",
						k, w.key.ID, w.load.KVUsedBlocks, w.load.WaitingRequests)
				}
				time.Sleep(20 * time.Microsecond)
			}
		}
		w.loadDirty = false
	}
	return nil
}

// holdsLoad reports whether rep's state shows w's last load report.
func holdsLoad(rep *replica, w *worker) bool {
	st := rep.state.Worker(w.key)
	if st == nil {
		return false
	}
	got := st.Status()
	return got.KVUsedBlocks == w.load.KVUsedBlocks && got.WaitingRequests == w.load.WaitingRequests
}

// syncReplicas waits, when replicas share a log, until every one has applied all of it: no
// replica has a change of its own still on its way, and all have read as far. Nothing appends
// meanwhile (the workers' events are acked, and the simulation waits), so equal positions mean
// the end of the log.
func (s *sim) syncReplicas() error {
	if len(s.replicas) < 2 || s.replicas[0].redis == nil {
		return nil
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		synced, first := true, s.replicas[0].redis.Position()
		for _, rep := range s.replicas {
			if rep.redis.Pending() > 0 || rep.redis.Position() != first {
				synced = false
				break
			}
		}
		if synced {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("fleet: the replicas did not catch up with the shared log within 30 s")
		}
		time.Sleep(20 * time.Microsecond)
	}
}

func (s *sim) handle(ev event) error {
	r := ev.req
	switch ev.kind {
	case evArrival:
		return s.arrive(r)
	case evStepEnd:
		ev.w.stepping = false
		s.kick(ev.w)
	case evFirstToken:
		r.rec.FirstToken = s.now
		r.lastToken = s.now
		if r.mode != policy.ModeDisaggregated && r.booked {
			if err := r.rep.disp.PrefillComplete(s.ctx, r.rec.ID); err != nil {
				return fmt.Errorf("fleet: MarkPrefillComplete(%s): %w", r.rec.ID, err)
			}
		}
	case evToken:
		gap := s.now - r.lastToken
		s.res.ITL = append(s.res.ITL, float32(float64(gap)/float64(time.Millisecond)))
		r.gaps = append(r.gaps, gap)
		r.lastToken = s.now
	case evFinished:
		if ev.w.role == kvstate.RolePrefill {
			// The prompt is computed: its KV moves to the decode worker.
			if r.booked {
				if err := r.rep.disp.PrefillComplete(s.ctx, r.rec.ID); err != nil {
					return fmt.Errorf("fleet: MarkPrefillComplete(%s): %w", r.rec.ID, err)
				}
			}
			r.rec.CachedTokens = r.prefillSeq.CachedTokens()
			s.schedule(s.now+s.cfg.Model.Transfer(len(r.blocks)), evTransferred, r, r.decode)
			s.kick(ev.w)
			return nil
		}
		r.rec.Done = s.now
		r.rec.ITLP99 = percentile(r.gaps, 0.99)
		r.gaps = nil
		if r.booked {
			if err := r.rep.disp.Free(s.ctx, r.rec.ID); err != nil {
				return fmt.Errorf("fleet: Free(%s): %w", r.rec.ID, err)
			}
		}
		r.tokens = nil
		s.done++
		if s.cfg.Progress != nil {
			s.cfg.Progress(s.done, s.total)
		}
		s.kick(ev.w)
	case evTransferred:
		s.submit(r.decode, r, &engine.Seq{ID: r.rec.ID, Prompt: r.tokens, Blocks: r.blocks, OutputTokens: r.rec.OutputTokens, Transferred: true})
	}
	return nil
}

// arrive routes a request and hands it to its first worker.
func (s *sim) arrive(r *request) error {
	r.tokens = r.src.AppendTokens(nil)
	bs := s.cfg.Model.BlockSize
	r.blocks = blockhash.Sequence(nil, blockhash.Locals(nil, r.tokens, bs, blockhash.Salt("", "")))
	if s.cfg.RoundRobin {
		// The baseline asks no router, but its workers still publish to one: without this
		// flush nothing waited for the router, and up to the publishers' MaxUnacked (65,536
		// events a worker, GiBs over a whole trace) piled up behind the virtual clock.
		if err := s.flushAll(); err != nil {
			return err
		}
		s.routeInTurn(r)
	} else if err := s.route(r); err != nil {
		return err
	}
	r.rec.Mode = r.mode
	r.rec.Precise = s.precise(r)
	if r.mode == policy.ModeDisaggregated {
		r.prefillSeq = &engine.Seq{ID: r.rec.ID, Prompt: r.tokens, Blocks: r.blocks, OutputTokens: 1, PrefillOnly: true}
		s.submit(r.prefill, r, r.prefillSeq)
		return nil
	}
	seq := &engine.Seq{ID: r.rec.ID, Prompt: r.tokens, Blocks: r.blocks, OutputTokens: r.rec.OutputTokens}
	s.submit(r.decode, r, seq)
	return nil
}

// precise reports whether the worker that prefills r holds, in its engine's cache, as long a prefix
// of r's prompt as any worker of its role.
func (s *sim) precise(r *request) bool {
	chosen := r.decode
	if r.mode == policy.ModeDisaggregated {
		chosen = r.prefill
	}
	have, best := chosen.eng.Cache().Lookup(r.blocks), 0
	for _, w := range s.workers {
		if w.role == chosen.role {
			best = max(best, w.eng.Cache().Lookup(r.blocks))
		}
	}
	return have == best
}

func (s *sim) route(r *request) error {
	if err := s.flushAll(); err != nil {
		return err
	}
	r.rep = s.replicas[s.routed%len(s.replicas)]
	s.routed++
	dec, err := r.rep.disp.Route(s.ctx, &app.Request{Request: policy.Request{ID: r.rec.ID, Model: ModelName, Tokens: r.tokens}, SessionID: r.src.Session})
	if err != nil {
		return fmt.Errorf("fleet: Route(%s): %w", r.rec.ID, err)
	}
	r.booked = dec.Booked
	r.mode = dec.Mode
	r.decode = s.workerOf(dec.Decode.Worker.Info.Key)
	if dec.Prefill != nil {
		r.prefill = s.workerOf(dec.Prefill.Worker.Info.Key)
	}
	return nil
}

// routeInTurn is the baseline: the next prefill worker and the next decode worker, in turn.
func (s *sim) routeInTurn(r *request) {
	var prefills, decodes []*worker
	for _, w := range s.workers {
		switch w.role {
		case kvstate.RolePrefill:
			prefills = append(prefills, w)
		default:
			decodes = append(decodes, w)
		}
	}
	r.decode = decodes[s.rr[1]%len(decodes)]
	s.rr[1]++
	r.mode = policy.ModeAggregated
	if len(prefills) > 0 {
		r.prefill = prefills[s.rr[0]%len(prefills)]
		s.rr[0]++
		r.mode = policy.ModeDisaggregated
	}
}

// workerOf returns the worker of a key the router chose; workers are numbered from 1 in order.
func (s *sim) workerOf(key kvstate.WorkerKey) *worker {
	return s.workers[key.ID-1]
}

func (s *sim) submit(w *worker, r *request, seq *engine.Seq) {
	s.reqOf[seq] = r
	w.eng.Submit(seq)
	s.kick(w)
}

// kick starts a pass on an idle worker that has work; its end is an event.
func (s *sim) kick(w *worker) {
	if w.stepping || w.eng.Idle() {
		return
	}
	d := w.eng.Step(s.now)
	s.res.PeakBlocks[w.key.ID] = max(s.res.PeakBlocks[w.key.ID], uint64(w.eng.Cache().Used()))
	used, waiting := uint64(w.eng.Cache().Referenced()), uint64(w.eng.Waiting())
	for _, p := range w.pubs {
		p.ReportLoad(&kvrouterv1.LoadReport{KvUsedBlocks: used, WaitingRequests: waiting})
	}
	w.load.KVUsedBlocks, w.load.WaitingRequests, w.loadDirty = used, waiting, true
	if d == 0 {
		return // nothing fits until a request finishes on this worker
	}
	w.stepping = true
	s.schedule(s.now+d, evStepEnd, nil, w)
}

// observer turns an engine's callbacks into events and KV events.
type observer sim

func (o *observer) Stored(e *engine.Engine, hashes []uint64, parent uint64, hasParent bool, tokens func(int) []uint32) {
	s := (*sim)(o)
	w := s.byEng[e]
	st := &kvrouterv1.BlocksStored{Blocks: make([]*kvrouterv1.StoredBlock, len(hashes))}
	for i, h := range hashes {
		st.Blocks[i] = &kvrouterv1.StoredBlock{BlockHash: h, TokenIds: tokens(i)}
	}
	if hasParent {
		st.ParentHash = &parent
	}
	s.publish(w, &kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}})
}

func (o *observer) Removed(e *engine.Engine, hashes []uint64) {
	s := (*sim)(o)
	s.publish(s.byEng[e], &kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
		Data: &kvrouterv1.KvEvent_Removed{Removed: &kvrouterv1.BlocksRemoved{BlockHashes: append([]uint64(nil), hashes...)}}})
}

func (o *observer) FirstToken(e *engine.Engine, seq *engine.Seq, at time.Duration) {
	s := (*sim)(o)
	w := s.byEng[e]
	if w.role == kvstate.RolePrefill {
		return // the decode worker's first token is the client's
	}
	r := s.reqOf[seq]
	if !seq.Transferred {
		r.rec.CachedTokens = seq.CachedTokens()
	}
	s.schedule(at, evFirstToken, r, w)
}

func (o *observer) Token(e *engine.Engine, seq *engine.Seq, at time.Duration) {
	s := (*sim)(o)
	s.schedule(at, evToken, s.reqOf[seq], s.byEng[e])
}

func (o *observer) Finished(e *engine.Engine, seq *engine.Seq, at time.Duration) {
	s := (*sim)(o)
	r := s.reqOf[seq]
	delete(s.reqOf, seq)
	s.schedule(at, evFinished, r, s.byEng[e])
}

func (s *sim) publish(w *worker, ev *kvrouterv1.KvEvent) {
	for i, p := range w.pubs {
		if i > 0 {
			ev = proto.Clone(ev).(*kvrouterv1.KvEvent) // each publisher owns (and numbers) its events
		}
		if err := p.Publish(s.ctx, ev); err != nil && s.err == nil {
			s.err = fmt.Errorf("fleet: worker %d's stream: %w", w.key.ID, err)
		}
	}
	w.dirty = true
}

// percentile returns the q-quantile of ds (nearest rank), sorting ds; 0 for none.
func percentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	i := int(math.Ceil(q*float64(len(ds)))) - 1
	return ds[max(0, min(i, len(ds)-1))]
}
