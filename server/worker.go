package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/server/auth"
)

// workerService implements WorkerService: one Publish stream per worker rank.
type workerService struct {
	kvrouterv1.UnimplementedWorkerServiceServer
	// shards holds the state and log of each model; a stream works in its worker's model's shard.
	shards   kvstate.ShardSource
	presence *kvstate.Presence // this replica's streams
	metrics  *metrics
	logger   *slog.Logger
	clock    kvstate.Clock
	stopping <-chan struct{} // closed when the server shuts down: streams end so workers reconnect elsewhere
	// conditionalDisagg is on: decode workers without KV events are worth a warning (§8 item 8).
	conditionalDisagg bool
	limits            publishLimits
	// maxWorkersPerModel bounds the ranks one model registers, maxRanksPerWorker those of one
	// worker id in a model (0: no bound).
	maxWorkersPerModel, maxRanksPerWorker int
	// maxModels bounds the models a hello may create (0: no bound).
	maxModels int
	// dumps bounds what the streams' dumps in parts hold, together.
	dumps *dumpBudget
	// tracer makes the spans of applied messages (server/tracing.go); nil: tracing is off.
	tracer trace.Tracer
}

var roleFromProto = map[kvrouterv1.WorkerRole]kvstate.Role{
	kvrouterv1.WorkerRole_WORKER_ROLE_PREFILL:    kvstate.RolePrefill,
	kvrouterv1.WorkerRole_WORKER_ROLE_DECODE:     kvstate.RoleDecode,
	kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED: kvstate.RoleAggregated,
}

var roleToProto = map[kvstate.Role]kvrouterv1.WorkerRole{
	kvstate.RolePrefill:    kvrouterv1.WorkerRole_WORKER_ROLE_PREFILL,
	kvstate.RoleDecode:     kvrouterv1.WorkerRole_WORKER_ROLE_DECODE,
	kvstate.RoleAggregated: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED,
}

var tierFromProto = map[kvrouterv1.StorageTier]kvstate.Tier{
	kvrouterv1.StorageTier_STORAGE_TIER_DEVICE:   kvstate.TierDevice,
	kvrouterv1.StorageTier_STORAGE_TIER_HOST:     kvstate.TierHost,
	kvrouterv1.StorageTier_STORAGE_TIER_DISK:     kvstate.TierDisk,
	kvrouterv1.StorageTier_STORAGE_TIER_EXTERNAL: kvstate.TierExternal,
}

// publishStream is the per-stream state of one Publish call.
type publishStream struct {
	svc *workerService
	// shard is the state and log of the worker's model: every change of the stream goes to it.
	shard   *kvstate.Shard
	stream  grpc.BidiStreamingServer[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse]
	info    kvstate.WorkerInfo // the registered hello
	acked   uint64
	hasAck  bool
	logger  *slog.Logger
	release func() // lets go of the worker's lease
	dump    *pendingDump
	// epoch is the registration epoch this stream holds the rank at: every change it appends names
	// it, so that once a newer stream registers the rank nothing more of this one applies.
	epoch uint64
	// restores is the state's restore count at registration: a registration that ends with a
	// snapshot reload is not a takeover.
	restores uint64
	// dumpAsked is set once a resync was sent, until a dump applies: the worker is asked once.
	dumpAsked bool
}

// pendingDump is a dump whose first parts arrived (KvDump.more_follows): it applies, whole, with
// the last. Its events wait in the log's encoding (16 bytes a block), counted in the replica's
// dumpBudget.
type pendingDump struct {
	through uint64
	events  kvstate.EncodedEvents
	held    int64 // bytes taken from the dumpBudget
}

// dumpBudget bounds the memory that the dumps in parts of all the streams of a replica hold
// between their parts, together (max_dump_bytes_in_flight): a stream may hold a million-block dump
// for as long as its worker takes to send it, and many streams may.
type dumpBudget struct {
	limit int64
	used  atomic.Int64
}

// take counts n more bytes held, unless that would pass the limit (then it counts nothing).
func (b *dumpBudget) take(n int64) bool {
	for {
		cur := b.used.Load()
		if n > 0 && cur+n > b.limit {
			return false
		}
		if b.used.CompareAndSwap(cur, cur+n) {
			return true
		}
	}
}

// dropDump gives up the stream's dump in parts, and the memory it held.
func (ps *publishStream) dropDump() {
	if ps.dump != nil {
		ps.svc.dumps.take(-ps.dump.held)
		ps.dump = nil
	}
}

// dumpRetryDelay is suggested to a worker whose dump found the replica's budget for dumps in parts
// full: other workers' dumps complete within seconds.
const dumpRetryDelay = 2 * time.Second

// hold takes the worker's lease at the stream's registration epoch: it keeps the worker alive, for
// every replica, while the stream is open here.
func (ps *publishStream) hold(ctx context.Context) {
	var liveness kvstate.Liveness = kvstate.LocalLiveness{}
	if ps.shard.Liveness != nil {
		liveness = ps.shard.Liveness
	}
	ps.release = liveness.Hold(ctx, ps.info.Key, ps.epoch)
}

// recvResult is one message (or the error that ended the stream) from the receiving goroutine.
type recvResult struct {
	msg *kvrouterv1.PublishRequest
	err error
}

func (s *workerService) Publish(stream grpc.BidiStreamingServer[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse]) error {
	ctx := stream.Context()
	// One goroutine receives; this one applies and sends (a stream allows one of each at a time).
	// Receiving apart lets the handler notice shutdown while a worker is idle.
	msgs := make(chan recvResult, 16)
	caller := auth.FromContext(ctx)
	go func() {
		for {
			f := &publishFrame{limits: s.limits}
			err := stream.RecvMsg(f)
			if err == nil {
				err = f.check()
			}
			if err == nil {
				// Over its event rate, the caller is slowed here, where waiting stops the reading
				// and so the sending (flow control), and refused past auth.MaxEventWait.
				err = caller.TakeEvents(ctx, f.counts.blocks)
			}
			select {
			case msgs <- recvResult{f.msg, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	// next returns the next message; a tick (nil when not wanted) interrupts the wait with neither.
	// ended (nil before the registration) closes when the stream no longer holds its worker rank.
	var ended <-chan struct{}
	var ps *publishStream
	// replaced (nil before the registration) closes when the credentials file is reloaded: the
	// stream's caller is checked again then (still: the worker it registered).
	var replaced <-chan struct{}
	var still func() error
	next := func(tick <-chan time.Time) (*kvrouterv1.PublishRequest, error) {
		for {
			select {
			case r := <-msgs:
				return r.msg, r.err
			case <-tick:
				return nil, nil
			case <-ended:
				return nil, ps.lost()
			case <-replaced:
				if err := still(); err != nil {
					return nil, err
				}
				replaced = caller.Replaced()
			case <-ctx.Done():
				return nil, status.FromContextError(ctx.Err()).Err()
			case <-s.stopping:
				return nil, status.Error(codes.Unavailable, "router is shutting down; reconnect to another replica")
			}
		}
	}

	first, err := next(nil)
	if err != nil {
		if errors.Is(err, io.EOF) {
			return nil
		}
		return err
	}
	hello := first.GetHello()
	if hello == nil {
		return failedPrecondition("HELLO_REQUIRED", "the first message on a Publish stream must be a hello (got %s)", messageKind(first))
	}
	info, err := workerInfo(hello)
	if err != nil {
		return err
	}
	if err := caller.MayPublishFor(info.Key.ID, info.Model); err != nil {
		return err
	}
	replaced = caller.Replaced()
	still = func() error { return caller.MayStillPublishFor(info.Key.ID, info.Model) }
	if err := still(); err != nil { // a reload since the call was admitted
		return err
	}
	if err := s.modelRoom(info.Model); err != nil {
		return err
	}
	sh, err := s.shards.Open(ctx, info.Model)
	if err != nil {
		return toStatus(fmt.Errorf("hello.model: %w", err))
	}
	if err := s.admit(sh.State, info); err != nil {
		return err
	}
	if err := s.oneModel(ctx, info, hello.GetFreshStart()); err != nil {
		return err
	}
	// The worker counts as connected before its hello applies, so the housekeeper cannot remove it
	// in between.
	s.presence.Connected(info.Key)
	// The grace period runs from when the stream closes: the time is read when the deferred call
	// runs, not when the defer statement does (that would be the stream's start).
	defer func() {
		var epoch uint64 // 0 if the registration failed: this stream owes no removal
		if ps != nil {
			epoch = ps.epoch
		}
		s.presence.Disconnected(info.Key, s.clock.Now().UnixNano(), epoch)
	}()
	spanCtx, sp := s.startSpan(ctx, SpanPublishHello, info)
	res, err := sh.Log.Append(spanCtx, kvstate.WorkerUp{Info: info, Reset: hello.GetFreshStart()})
	if sp != nil {
		sp.end(sh.Log, res, err, AttrRole.String(info.Role.String()), AttrEpoch.Int64(int64(res.Epoch)))
	}
	if err != nil {
		return toStatus(err)
	}
	ps = &publishStream{svc: s, shard: sh, stream: stream, info: info, epoch: res.Epoch, restores: sh.State.Restores(),
		logger: s.logger.With("worker", info.Key.String(), "model", info.Model, "role", info.Role.String())}
	ended = sh.State.EpochEnds(info.Key, ps.epoch)
	ps.hold(ctx)
	defer func() { ps.release() }()
	defer ps.dropDump()
	ps.logger.Info("worker connected", "endpoint", info.Endpoint, "block_size", info.BlockSize, "fresh_start", hello.GetFreshStart())
	if s.conditionalDisagg && info.Role == kvstate.RoleDecode && !info.KVEventsEnabled {
		ps.logger.Warn("decode worker publishes no KV events: its cache is invisible to the router, so conditional disaggregation will never bypass to it; enable KV events on the engine (vLLM --kv-events-config, TensorRT-LLM --publish-kv-events)")
	}
	if err := ps.sendRegistered(); err != nil {
		return err
	}
	// With a shared log that may buffer (Redis mode), acks of buffered events wait until they are
	// published, and a resync may be asked after an outage: both are checked between messages and
	// on a timer, for an idle worker.
	buffering, _ := sh.Log.(kvstate.BufferingLog)
	var tick <-chan time.Time
	if buffering != nil {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		tick = t.C
	}
	for {
		msg, err := next(tick)
		if errors.Is(err, io.EOF) {
			ps.logger.Info("worker stream closed")
			return nil
		}
		if err != nil {
			if st, _ := status.FromError(err); st.Code() == codes.FailedPrecondition || st.Code() == codes.Unavailable {
				ps.logger.Warn("worker stream ended", "err", err)
			}
			return err
		}
		if msg != nil {
			if err := ps.handle(ctx, msg); err != nil {
				ps.logger.Warn("worker stream ended by error", "err", err)
				return err
			}
		}
		if buffering != nil {
			if err := ps.refresh(buffering); err != nil {
				return err
			}
		}
	}
}

// admit refuses a new worker rank of a model that has max_workers_per_model already. A rank the
// state knows re-registers freely. Replicas admit on their own view of the state, so registrations
// racing on several replicas may pass the cap by one per replica.
//
// A worker id is held to max_ranks_per_worker ranks in the model as well, so that one worker's
// credential (whose worker_ids name a few ids) cannot fill the model's cap with ranks of its own
// and lock every other worker of the model out: before, the documented worker-7 credential
// registered 10,000 ranks of worker 7 in 3.7 s. A credential may so register at most
// max_ranks_per_worker ranks for each of its worker ids.
func (s *workerService) admit(state *kvstate.State, info kvstate.WorkerInfo) error {
	if state.Worker(info.Key) != nil {
		return nil
	}
	m := state.Model(info.Model)
	if m == nil {
		return nil
	}
	workers := m.Workers()
	if s.maxWorkersPerModel > 0 && len(workers) >= s.maxWorkersPerModel {
		return limitExceeded("WORKERS_PER_MODEL", "hello.model", "max_workers_per_model", s.maxWorkersPerModel, len(workers),
			"model %q has %d worker ranks registered, the most max_workers_per_model allows (%d)", info.Model, len(workers), s.maxWorkersPerModel)
	}
	if s.maxRanksPerWorker > 0 {
		ranks := 0
		for _, w := range workers {
			if w.Info.Key.ID == info.Key.ID {
				ranks++
			}
		}
		if ranks >= s.maxRanksPerWorker {
			return limitExceeded("RANKS_PER_WORKER", "hello.dp_rank", "max_ranks_per_worker", s.maxRanksPerWorker, ranks,
				"worker %d has %d ranks registered in model %q, the most max_ranks_per_worker allows (%d)", info.Key.ID, ranks, info.Model, s.maxRanksPerWorker)
		}
	}
	return nil
}

// modelRoom refuses a hello naming a model this replica does not know when it knows max_models
// already. A model lives on (a log sharded by model keeps a shard of it on every replica), and every
// model adds series to /metrics: before, a worker credential without models made 30,000 of them,
// and a scrape took 4 s and 93 MB. Replicas count on their own view, so a model new on several at
// once may pass the cap by one each.
func (s *workerService) modelRoom(model string) error {
	if s.maxModels <= 0 {
		return nil
	}
	n := 0
	for _, sh := range s.shards.Shards() {
		if sh.Model == model || sh.State.Model(model) != nil {
			return nil
		}
		n += len(sh.State.Models())
	}
	if n >= s.maxModels {
		return limitExceeded("MODELS", "hello.model", "max_models", s.maxModels, n,
			"model %q would be this router's %d-th model, past max_models (%d)", model, n+1, s.maxModels)
	}
	return nil
}

// oneModel refuses a hello naming another model than the one the worker rank is registered with
// in the deployment (WORKER_CONFLICT), unless the worker starts afresh, which moves it: its
// registration in the other model is removed first. One state holding every model decides that as
// it applies the hello; a log sharded by model has a state per model, and the edge asks them all
// (kvstate.ShardSource.RegisteredElsewhere), so that every layout answers alike.
func (s *workerService) oneModel(ctx context.Context, info kvstate.WorkerInfo, fresh bool) error {
	held, other, err := s.shards.RegisteredElsewhere(ctx, info.Key, info.Model)
	switch {
	case err != nil:
		return toStatus(fmt.Errorf("hello: %w", err))
	case other == "":
		return nil
	case held == nil:
		return toStatus(fmt.Errorf("%w: worker %v is registered as model %q, which this replica does not serve: start it afresh on a replica that does, or after its grace period",
			kvstate.ErrWorkerConflict, info.Key, other))
	case !fresh:
		if w := held.State.Worker(info.Key); w != nil {
			return toStatus(kvstate.WorkerConflict(w.Info))
		}
		return nil // removed meanwhile
	}
	if _, err := held.Log.Append(ctx, kvstate.WorkerRemoved{Key: info.Key}); err != nil {
		return toStatus(fmt.Errorf("hello: removing the worker's registration as model %q: %w", other, err))
	}
	return nil
}

// lost returns the status that ends a stream that no longer holds its worker rank.
func (ps *publishStream) lost() error {
	err := ps.shard.State.Holds(ps.info.Key, ps.epoch)
	switch {
	case err != nil && ps.shard.State.Restores() != ps.restores:
		// The state was reloaded from a snapshot that does not hold this registration (the shared
		// log was lost and reseeded, or this replica fell behind its trim point): register again.
		return status.Errorf(codes.Unavailable, "worker %v: the router reloaded its shared state, which does not hold this stream's registration; reconnect and register again", ps.info.Key)
	case errors.Is(err, kvstate.ErrSuperseded):
		ps.svc.metrics.superseded.Inc()
		return failedPrecondition("WORKER_SUPERSEDED", "worker %v: a newer Publish stream registered this worker_id and dp_rank (on this or another replica); this stream no longer publishes for it. Two processes with the same worker_id? Do not reconnect automatically on this status", ps.info.Key)
	case err != nil:
		return status.Errorf(codes.Unavailable, "worker %v was removed from the router's state; reconnect and register again", ps.info.Key)
	}
	return nil
}

// refresh acks events that became durable since, and asks for a dump when the log says so or when
// the state no longer holds what this stream acked (the shared log lost it).
func (ps *publishStream) refresh(l kvstate.BufferingLog) error {
	if l.TakeResync(ps.info.Key) {
		if err := ps.askDump("shared log outage: events were lost for the other replicas", 0); err != nil {
			return err
		}
	}
	if l.Buffered(ps.info.Key) > 0 {
		return nil
	}
	w := ps.shard.State.Worker(ps.info.Key)
	if w == nil {
		return nil
	}
	st := w.Status()
	if ps.hasAck && (!st.HasLastEvent || st.LastEventID < ps.acked) && !ps.dumpAsked {
		held := "none"
		if st.HasLastEvent {
			held = fmt.Sprint(st.LastEventID)
		}
		ps.logger.Warn("the shared state lost events this stream acked: asking the worker for a dump", "acked", ps.acked, "held", held)
		expected := uint64(0)
		if st.HasLastEvent {
			expected = st.LastEventID + 1
		}
		return ps.askDump(fmt.Sprintf("the router's shared state lost events (acked through %d, holds %s); send a dump", ps.acked, held), expected)
	}
	return ps.ack(kvstate.Result{LastEventID: st.LastEventID, HasLastEvent: st.HasLastEvent})
}

// askDump sends a resync request, once until a dump applies.
func (ps *publishStream) askDump(reason string, expected uint64) error {
	ps.dumpAsked = true
	ps.svc.metrics.resyncs.Inc()
	return ps.stream.Send(resync(reason, expected))
}

func (ps *publishStream) handle(ctx context.Context, msg *kvrouterv1.PublishRequest) error {
	svc := ps.svc
	if d := ps.dump; d != nil {
		switch msg.GetMessage().(type) {
		case *kvrouterv1.PublishRequest_Dump, *kvrouterv1.PublishRequest_Load:
		default:
			return failedPrecondition("DUMP_IN_PROGRESS", "%s: a dump in parts is in progress (through_event_id %d, %d blocks so far): send its remaining parts, the last without more_follows, first",
				messageKind(msg), d.through, d.events.Blocks())
		}
	}
	switch m := msg.GetMessage().(type) {
	case *kvrouterv1.PublishRequest_Hello:
		info, err := workerInfo(m.Hello)
		if err != nil {
			return err
		}
		if !info.SameCapacity(ps.info) || m.Hello.GetFreshStart() {
			return failedPrecondition("HELLO_CHANGED", "hello: a second hello on a stream must repeat the first (worker %v model %q role %v block_size %d total_kv_blocks %d max_num_batched_tokens %d) and must not set fresh_start; open a new stream to re-register",
				ps.info.Key, ps.info.Model, ps.info.Role, ps.info.BlockSize, ps.info.TotalKVBlocks, ps.info.MaxNumBatchedTokens)
		}
		spanCtx, sp := svc.startSpan(ctx, SpanPublishHello, info)
		res, err := ps.shard.Log.Append(spanCtx, kvstate.WorkerUp{Info: info, Epoch: ps.epoch})
		if sp != nil {
			sp.end(ps.shard.Log, res, err, AttrRole.String(info.Role.String()), AttrEpoch.Int64(int64(ps.epoch)))
		}
		if err != nil {
			return ps.appendError(err)
		}
		ps.info = info
		return ps.sendRegistered()
	case *kvrouterv1.PublishRequest_Events:
		events, err := ps.convertEvents("events.events", m.Events.GetEvents(), true)
		if err != nil {
			return err
		}
		if len(events) == 0 {
			return invalidArgument("events.events", "must not be empty")
		}
		spanCtx, sp := svc.startSpan(ctx, SpanPublishEvents, ps.info)
		res, err := ps.shard.Log.Append(spanCtx, kvstate.KVEvents{Worker: ps.info.Key, Epoch: ps.epoch, Events: events})
		if sp != nil {
			sp.end(ps.shard.Log, res, err, append(eventAttributes(events), AttrApplied.Int(res.Applied))...)
		}
		if err != nil {
			return ps.appendError(err)
		}
		svc.metrics.observeEvents(res)
		if res.Gap {
			ps.logger.Warn("event id gap; dropped the worker's blocks and asked for a dump", "expected", res.ExpectedEventID, "got", res.GotEventID)
			if err := ps.askDump(fmt.Sprintf("gap: expected event %d, got %d", res.ExpectedEventID, res.GotEventID), res.ExpectedEventID); err != nil {
				return err
			}
		}
		if res.Buffered {
			return nil // applied here, not durable yet: acked once published
		}
		return ps.ack(res)
	case *kvrouterv1.PublishRequest_Dump:
		events, err := ps.convertEvents("dump.events", m.Dump.GetEvents(), false)
		if err != nil {
			return err
		}
		blocks := 0
		for i, ev := range events {
			if ev.Kind != kvstate.EventStored {
				return invalidArgumentf(fmt.Sprintf("dump.events[%d]", i), "must be a stored event (a dump lists the blocks the worker holds)")
			}
			blocks += len(ev.Blocks)
		}
		through := m.Dump.GetThroughEventId()
		if d := ps.dump; d != nil {
			if through != d.through {
				return invalidArgumentf("dump.through_event_id", "must be the same in every part of a dump (the first part had %d, got %d)", d.through, through)
			}
			blocks += d.events.Blocks()
		}
		if blocks > svc.limits.maxDumpBlocks {
			ps.dropDump()
			return limitExceeded("DUMP_TOO_LARGE", "dump.events", "max_dump_blocks", svc.limits.maxDumpBlocks, blocks,
				"the dump holds %d blocks (all its parts so far), more than max_dump_blocks %d", blocks, svc.limits.maxDumpBlocks)
		}
		if m.Dump.GetMoreFollows() {
			if ps.dump == nil {
				ps.dump = &pendingDump{through: through}
			}
			d := ps.dump
			d.events.Append(events)
			if grow := int64(d.events.Size()) - d.held; !svc.dumps.take(grow) {
				ps.dropDump()
				return withDetails(status.Newf(codes.ResourceExhausted,
					"dump.events: the dumps in parts that this replica's streams hold take %d bytes, and this one's %d more would pass max_dump_bytes_in_flight %d; send the dump again later (or to another replica)",
					svc.dumps.used.Load(), d.events.Size(), svc.dumps.limit),
					&errdetails.ErrorInfo{Reason: "DUMPS_IN_FLIGHT", Domain: errorDomain, Metadata: map[string]string{
						"field": "dump.events", "limit": "max_dump_bytes_in_flight", "max": strconv.FormatInt(svc.dumps.limit, 10)}},
					&errdetails.RetryInfo{RetryDelay: durationpb.New(dumpRetryDelay)})
			} else {
				d.held += grow
			}
			return nil
		}
		if d := ps.dump; d != nil {
			all, err := d.events.Events(events)
			ps.dropDump()
			if err != nil {
				return status.Errorf(codes.Internal, "dump: decoding its earlier parts: %v", err)
			}
			events = all
		}
		spanCtx, sp := svc.startSpan(ctx, SpanPublishDump, ps.info)
		res, err := ps.shard.Log.Append(spanCtx, kvstate.KVDump{Worker: ps.info.Key, Epoch: ps.epoch, ThroughEventID: through, Events: events})
		if sp != nil {
			sp.end(ps.shard.Log, res, err, append(eventAttributes(events), AttrApplied.Int(res.Applied))...)
		}
		if err != nil {
			return ps.appendError(err)
		}
		svc.metrics.observeEvents(res)
		ps.dumpAsked = false
		ps.logger.Info("applied dump", "through_event_id", through, "events", len(events), "blocks", blocks)
		if res.Buffered {
			return nil
		}
		return ps.ack(res)
	case *kvrouterv1.PublishRequest_Load:
		if m.Load.GetDpRank() != ps.info.Key.Rank {
			return invalidArgumentf("load.dp_rank", "must equal the stream's registered dp_rank %d (got %d)", ps.info.Key.Rank, m.Load.GetDpRank())
		}
		_, err := ps.shard.Log.Append(ctx, kvstate.LoadReported{Worker: ps.info.Key, Epoch: ps.epoch, KVUsedBlocks: m.Load.GetKvUsedBlocks(), WaitingRequests: m.Load.GetWaitingRequests()})
		return ps.appendError(err)
	}
	return invalidArgument("message", "must set one of hello, events, dump, load")
}

// appendError maps an append's error; a change refused because a newer stream holds the rank ends
// the stream as superseded.
func (ps *publishStream) appendError(err error) error {
	if errors.Is(err, kvstate.ErrSuperseded) {
		return ps.lost()
	}
	return toStatus(err)
}

// sendRegistered answers a hello with the last event id held for the rank, and asks for a dump at
// once if the rank is waiting for one (the request may have been lost with a previous stream).
func (ps *publishStream) sendRegistered() error {
	w := ps.shard.State.Worker(ps.info.Key)
	if w == nil {
		return status.Errorf(codes.Unavailable, "worker %v was removed while registering; reconnect", ps.info.Key)
	}
	st := w.Status()
	reg := &kvrouterv1.Registered{}
	if st.HasLastEvent {
		reg.LastEventId = &st.LastEventID
	}
	if err := ps.stream.Send(&kvrouterv1.PublishResponse{Message: &kvrouterv1.PublishResponse_Registered{Registered: reg}}); err != nil {
		return err
	}
	if st.AwaitingResync {
		expected := uint64(0)
		if st.HasLastEvent {
			expected = st.LastEventID + 1
		}
		ps.dumpAsked = true
		return ps.stream.Send(resync("a dump is still awaited after an event id gap", expected))
	}
	return nil
}

// ack sends a cumulative ack when the applied event id moved forward. An ack never goes back: a
// state that lost acked events asks for a dump instead (refresh), and acks resume with it.
func (ps *publishStream) ack(res kvstate.Result) error {
	if !res.HasLastEvent || (ps.hasAck && res.LastEventID <= ps.acked) {
		return nil
	}
	ps.acked, ps.hasAck = res.LastEventID, true
	return ps.stream.Send(&kvrouterv1.PublishResponse{Message: &kvrouterv1.PublishResponse_Ack{Ack: &kvrouterv1.Ack{EventId: res.LastEventID}}})
}

func resync(reason string, expected uint64) *kvrouterv1.PublishResponse {
	return &kvrouterv1.PublishResponse{Message: &kvrouterv1.PublishResponse_Resync{Resync: &kvrouterv1.ResyncRequest{Reason: reason, ExpectedEventId: expected}}}
}

func messageKind(m *kvrouterv1.PublishRequest) string {
	switch m.GetMessage().(type) {
	case *kvrouterv1.PublishRequest_Events:
		return "events"
	case *kvrouterv1.PublishRequest_Dump:
		return "dump"
	case *kvrouterv1.PublishRequest_Load:
		return "load"
	case *kvrouterv1.PublishRequest_Hello:
		return "hello"
	}
	return "an empty message"
}

// workerInfo validates a hello and converts it.
func workerInfo(h *kvrouterv1.WorkerHello) (kvstate.WorkerInfo, error) {
	role, ok := roleFromProto[h.GetRole()]
	switch {
	case h.GetWorkerId() == 0:
		return kvstate.WorkerInfo{}, invalidArgument("hello.worker_id", "must not be 0")
	case h.GetModel() == "":
		return kvstate.WorkerInfo{}, invalidArgument("hello.model", "must not be empty")
	case len(h.GetModel()) > maxModelBytes:
		return kvstate.WorkerInfo{}, invalidArgumentf("hello.model", "must be at most %d bytes (got %d)", maxModelBytes, len(h.GetModel()))
	case !ok:
		return kvstate.WorkerInfo{}, invalidArgumentf("hello.role", "must be PREFILL, DECODE or AGGREGATED (got %v)", h.GetRole())
	case h.GetBlockSize() == 0:
		return kvstate.WorkerInfo{}, invalidArgument("hello.block_size", "must be > 0")
	case len(h.GetEndpoint()) > maxEndpointBytes:
		// Every Route answer and ListWorkers carries it: a 4 MB endpoint broke ListWorkers for
		// clients with the default 4 MiB receive limit.
		return kvstate.WorkerInfo{}, invalidArgumentf("hello.endpoint", "must be at most %d bytes (got %d)", maxEndpointBytes, len(h.GetEndpoint()))
	}
	return kvstate.WorkerInfo{
		Key:   kvstate.WorkerKey{ID: h.GetWorkerId(), Rank: h.GetDpRank()},
		Model: h.GetModel(), Role: role, BlockSize: h.GetBlockSize(),
		TotalKVBlocks: h.GetTotalKvBlocks(), MaxNumBatchedTokens: h.GetMaxNumBatchedTokens(),
		Endpoint: h.GetEndpoint(), SupportsBypass: h.GetSupportsBypass(), KVEventsEnabled: h.GetKvEventsEnabled(),
	}, nil
}

// convertEvents validates a batch of events completely before converting it, so a bad event rejects
// the whole batch and nothing of it is applied. With checkOrder, event ids must strictly increase.
func (ps *publishStream) convertEvents(field string, in []*kvrouterv1.KvEvent, checkOrder bool) ([]kvstate.Event, error) {
	out := make([]kvstate.Event, 0, len(in))
	var salt uint64
	saltFor := ""
	for i, ev := range in {
		// Field paths are formatted only for errors: a batch can hold thousands of blocks.
		f := func() string { return fmt.Sprintf("%s[%d]", field, i) }
		if checkOrder && i > 0 && ev.GetEventId() <= in[i-1].GetEventId() {
			return nil, invalidArgumentf(f()+".event_id", "must be greater than the previous event's id %d within a batch (got %d)", in[i-1].GetEventId(), ev.GetEventId())
		}
		if ev.GetDpRank() != ps.info.Key.Rank {
			return nil, invalidArgumentf(f()+".dp_rank", "must equal the stream's registered dp_rank %d (got %d)", ps.info.Key.Rank, ev.GetDpRank())
		}
		tier, ok := tierFromProto[ev.GetStorageTier()]
		if !ok {
			return nil, invalidArgumentf(f()+".storage_tier", "must be DEVICE, HOST, DISK or EXTERNAL (got %v)", ev.GetStorageTier())
		}
		e := kvstate.Event{ID: ev.GetEventId(), Tier: tier}
		switch d := ev.GetData().(type) {
		case *kvrouterv1.KvEvent_Stored:
			st := d.Stored
			if len(st.GetBlocks()) == 0 {
				return nil, invalidArgument(f()+".stored.blocks", "must not be empty")
			}
			e.Kind = kvstate.EventStored
			if st.ParentHash != nil {
				e.Parent, e.HasParent = st.GetParentHash(), true
			}
			if key := st.GetLoraName() + "\x00" + st.GetCacheNamespace(); key != saltFor || i == 0 {
				salt, saltFor = blockhash.Salt(st.GetLoraName(), st.GetCacheNamespace()), key
			}
			e.Blocks = make([]kvstate.Block, len(st.GetBlocks()))
			for j, b := range st.GetBlocks() {
				bf := func() string { return fmt.Sprintf("%s.stored.blocks[%d]", f(), j) }
				switch {
				case b.TokensHash != nil && len(b.GetTokenIds()) > 0:
					return nil, invalidArgument(bf(), "must set exactly one of token_ids and tokens_hash (both are set)")
				case b.TokensHash != nil:
					e.Blocks[j] = kvstate.Block{Hash: b.GetBlockHash(), Local: b.GetTokensHash()}
				case len(b.GetTokenIds()) != int(ps.info.BlockSize):
					if len(b.GetTokenIds()) == 0 {
						return nil, invalidArgument(bf(), "must set exactly one of token_ids and tokens_hash (neither is set)")
					}
					return nil, invalidArgumentf(bf()+".token_ids", "must hold exactly block_size %d tokens (got %d)", ps.info.BlockSize, len(b.GetTokenIds()))
				default:
					e.Blocks[j] = kvstate.Block{Hash: b.GetBlockHash(), Local: blockhash.Local(b.GetTokenIds(), salt)}
				}
			}
		case *kvrouterv1.KvEvent_Removed:
			if len(d.Removed.GetBlockHashes()) == 0 {
				return nil, invalidArgument(f()+".removed.block_hashes", "must not be empty")
			}
			e.Kind, e.Removed = kvstate.EventRemoved, d.Removed.GetBlockHashes()
		case *kvrouterv1.KvEvent_Cleared:
			e.Kind = kvstate.EventCleared
		default:
			return nil, invalidArgument(f(), "must set one of stored, removed, cleared")
		}
		out = append(out, e)
	}
	return out, nil
}
