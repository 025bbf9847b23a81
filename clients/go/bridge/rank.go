package bridge

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/go-zeromq/zmq4"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvrouter/kvrouter/clients/go/enginefeed"
	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// rank forwards one data-parallel rank of the engine.
//
// It keeps the engine's stream in order: next is the sequence number it expects, and every batch
// it takes (live or from the replay endpoint) must be that one. A batch that never comes is lost:
// what the router holds of the rank may then be stale (the lost batch may have removed blocks), so
// the worker's blocks are cleared before the next batch is forwarded. A batch is taken only once
// its payload decoded, so a payload damaged on the way is fetched again from the replay endpoint
// like any batch that did not arrive.
type rank struct {
	b                *Bridge
	dp               int32
	label            string // dp as a metric label
	endpoint, replay string
	hello            *kvrouterv1.WorkerHello // the rank's registration
	pub              *kvclient.Publisher     // owned by the run goroutine; nil while the engine is down
	pubRef           atomic.Pointer[kvclient.Publisher]
	health           *health
	mirror           *mirror
	tr               translator
	log              *slog.Logger
	logged           map[string]*logState // by reason; used by the run goroutine only
	checkpoints      *checkpointFile      // nil without a state directory

	// Owned by the run goroutine.
	dec              *enginefeed.Decoder
	live, replayed   enginefeed.Batch
	out              []*kvrouterv1.KvEvent
	started          bool   // this subscription knows where it stands in the engine's stream
	next             uint64 // the sequence number expected next
	last             batchRef
	haveLast         bool              // last is the batch taken most recently, of the engine now followed
	inherited        bool              // the router holds blocks of the rank that the mirror lacks (resumed from a checkpoint)
	fromReplay       map[uint64]uint64 // digests of batches taken from the replay that the live feed may repeat
	resumeCheckpoint *checkpoint       // the checkpoint to resume from, until the router's registration confirms it

	connected atomic.Bool

	lagMu    sync.Mutex
	inflight []inflightBatch // published, not acked yet, in event id order
	acks     batchAck        // the newest batch the router acked whole
	// The id of the last event published, when any was (owned by the run goroutine).
	lastPublished uint64
	published     bool
}

// batchRef names one engine batch: its sequence number and a digest of its payload, which tells
// apart two engine processes that used the same number.
type batchRef struct {
	seq, digest uint64
}

func digestOf(payload []byte) uint64 { return xxhash.Sum64(payload) }

// inflightBatch is a published engine batch waiting for the router's ack of its last event.
type inflightBatch struct {
	lastEventID uint64
	batch       batchRef
	ts          float64
}

// batchAck is the newest engine batch whose every event the router acked, and the id of its last event.
type batchAck struct {
	batch   batchRef
	eventID uint64
	ok      bool
}

func newRank(b *Bridge, dp int32, endpoint, replay string) (*rank, error) {
	r := &rank{
		b: b, dp: dp, label: strconv.Itoa(int(dp)), endpoint: endpoint, replay: replay,
		mirror:     newMirror(),
		log:        b.opts.Logger.With("dp_rank", dp),
		logged:     make(map[string]*logState),
		dec:        enginefeed.NewDecoder(),
		fromReplay: make(map[uint64]uint64),
		health:     newHealth(),
	}
	r.tr = translator{m: r.mirror, blockSize: int(b.opts.Hello.GetBlockSize()), group: b.opts.KVGroup, extraKeys: b.opts.ExtraKeys}
	r.hello = proto.Clone(b.opts.Hello).(*kvrouterv1.WorkerHello)
	r.hello.DpRank, r.hello.FreshStart = uint32(dp), true
	if b.opts.StateDir != "" {
		r.checkpoints = newCheckpointFile(b.opts.StateDir, r.hello, endpoint)
		cp, err := r.checkpoints.load()
		switch {
		case err != nil:
			r.log.Warn("ignoring the bridge's checkpoint: starting afresh", "file", r.checkpoints.path, "error", err)
		case cp != nil:
			// A bridge that restarts while the router still holds the worker's blocks resumes where it
			// stopped: the router keeps what it has, and the engine's replay buffer brings what changed since.
			r.resumeCheckpoint = cp
			r.log.Info("resuming from the bridge's checkpoint", "file", r.checkpoints.path, "seq", cp.Seq, "event_id", cp.EventID)
		}
	}
	return r, nil
}

// startPublisher registers the worker rank at the router: from the checkpoint, the first time, when
// there is one; afresh otherwise.
func (r *rank) startPublisher(ctx context.Context) error {
	hello := proto.Clone(r.hello).(*kvrouterv1.WorkerHello)
	hello.FreshStart = r.resumeCheckpoint == nil
	pub, err := kvclient.NewPublisher(kvclient.PublisherOptions{
		Hello:      hello,
		Conns:      r.b.opts.Conns,
		MaxUnacked: r.b.opts.MaxUnacked,
		Dump: func(context.Context) ([]*kvrouterv1.KvEvent, error) {
			r.b.metrics.resets.WithLabelValues(r.label, "resync_request").Inc()
			return r.mirror.dump(), nil
		},
		OnAck:  r.acked,
		Logger: r.log,
	})
	if err != nil {
		return fmt.Errorf("bridge: dp rank %d: %w", r.dp, err)
	}
	r.pub = pub
	r.pubRef.Store(pub)
	return r.resumeFromCheckpoint(ctx)
}

// run forwards the engine's batches until ctx ends or the publisher stops. It subscribes, and once
// the engine is up registers the worker; when the engine goes down, it removes the worker from the
// router and subscribes again, to register afresh once the engine is back.
func (r *rank) run(ctx context.Context) error {
	for ctx.Err() == nil {
		sctx, cancel := context.WithCancel(ctx)
		r.health.subscribing(cancel)
		err := r.subscribe(sctx)
		r.health.subscribing(nil)
		cancel()
		if r.pub != nil {
			if perr := r.pub.Err(); perr != nil {
				return fmt.Errorf("dp rank %d: %w", r.dp, perr)
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		if r.pub != nil && !r.health.isUp() {
			if err := r.leave(ctx); err != nil {
				return fmt.Errorf("dp rank %d: %w", r.dp, err)
			}
			continue
		}
		if err != nil && !errors.Is(err, context.Canceled) {
			r.logLimited("subscribe", "subscription to the engine failed; retrying", "endpoint", r.endpoint, "error", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(r.b.opts.DialRetry):
		}
	}
	return nil
}

// register waits, once subscribed, until the engine is up, and registers the worker rank if it is
// not registered.
func (r *rank) register(ctx context.Context) error {
	if r.pub != nil {
		return nil
	}
	if err := r.health.waitUp(ctx); err != nil {
		return err
	}
	return r.startPublisher(ctx)
}

// leave removes the worker rank from the router now that the engine is down, so that no request is
// routed to it any more, and forgets what was forwarded: when the engine is up again, the rank
// registers afresh and rebuilds from the engine's replay buffer. It returns an error only when the
// router says another process holds the worker rank.
func (r *rank) leave(ctx context.Context) error {
	reason := r.health.downReason()
	r.log.Warn("the engine is down: removing the worker from the router until it is up again", "reason", reason,
		"down_after", r.b.opts.DownAfter)
	r.b.metrics.leaves.WithLabelValues(r.label).Inc()
	lctx, cancel := context.WithTimeout(ctx, r.b.opts.ReplayTimeout)
	defer cancel()
	if err := r.pub.Leave(lctx, "kvrouter bridge: engine down: "+reason); err != nil {
		if status.Code(err) == codes.FailedPrecondition {
			return err
		}
		r.log.Warn("the router did not confirm the removal; it removes the worker a grace period after its stream closed", "error", err)
	}
	r.pub = nil
	r.pubRef.Store(nil)
	r.resumeCheckpoint = nil
	r.tr.forget() // and the mirror
	r.b.metrics.mirrored.WithLabelValues(r.label).Set(0)
	r.haveLast, r.next, r.inherited, r.started = false, 0, false, false
	clear(r.fromReplay)
	r.lagMu.Lock()
	r.inflight, r.acks = nil, batchAck{}
	r.lastPublished, r.published = 0, false
	r.lagMu.Unlock()
	return nil
}

// stopped returns the error that ends run: the publisher's, or nil when ctx ended.
func (r *rank) stopped(ctx context.Context, err error) error {
	if perr := r.pub.Err(); perr != nil {
		return fmt.Errorf("dp rank %d: %w", r.dp, perr)
	}
	if ctx.Err() != nil {
		return nil
	}
	return fmt.Errorf("dp rank %d: %w", r.dp, err)
}

// resumeFromCheckpoint waits, after a start from a checkpoint, for the router's registration. When
// the router still holds every event the checkpoint says it acked, the rank goes on after the
// checkpoint's batch; otherwise (the grace period ran out, the router lost its state) the worker is
// cleared and rebuilt from the engine's history, as on a fresh start.
func (r *rank) resumeFromCheckpoint(ctx context.Context) error {
	cp := r.resumeCheckpoint
	if cp == nil {
		return nil
	}
	r.resumeCheckpoint = nil
	last, held, err := r.pub.Registration(ctx)
	if err != nil {
		return err
	}
	if held && last >= cp.EventID {
		r.next, r.last, r.haveLast, r.inherited = cp.Seq+1, batchRef{cp.Seq, cp.Digest}, true, true
		r.lastPublished, r.published = last, true
		r.setAcked(batchAck{batch: r.last, eventID: last, ok: true})
		return nil
	}
	r.log.Warn("the router no longer holds what the bridge's checkpoint says it acked: clearing the worker and rebuilding it from the engine's history",
		"checkpoint_event_id", cp.EventID, "router_last_event_id", last, "router_held", held)
	return r.reset(ctx, "router_state_lost")
}

// subscribe runs one subscription: it returns when the connection to the engine fails.
func (r *rank) subscribe(ctx context.Context) error {
	sub := zmq4.NewSub(ctx, zmq4.WithDialerRetry(r.b.opts.DialRetry), zmq4.WithDialerMaxRetries(0))
	defer sub.Close()
	if err := sub.Dial(r.endpoint); err != nil {
		return err
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, r.b.opts.Topic); err != nil {
		return err
	}
	r.connected.Store(true)
	r.health.connected()
	r.started = false
	r.b.metrics.connected.WithLabelValues(r.label).Set(1)
	defer func() {
		r.connected.Store(false)
		r.b.metrics.connected.WithLabelValues(r.label).Set(0)
	}()
	r.log.Info("subscribed to the engine", "endpoint", r.endpoint, "replay", r.replay)
	if err := r.register(ctx); err != nil {
		return err
	}
	if r.replay != "" {
		// Subscribed first, so that nothing published during the replay is missed for good.
		if err := r.rejoin(ctx); err != nil {
			return err
		}
	}
	for {
		msg, err := sub.Recv()
		if err != nil {
			return err
		}
		if err := r.handle(ctx, msg.Frames); err != nil {
			return err
		}
	}
}

// rejoin runs as a subscription starts, when the engine has a replay endpoint: it brings the
// router up to what the engine's replay buffer holds at once, rather than at the engine's next
// batch (an idle engine may publish nothing for long). After batches of an engine were taken, it
// goes on after the last one if the engine still holds that batch unchanged (the same process:
// nothing was lost); otherwise (another process, or one whose buffer moved past it) the worker is
// cleared and rebuilt from the buffer. It returns an error only when the publisher stopped.
func (r *rank) rejoin(ctx context.Context) error {
	if r.haveLast {
		same, err := r.resumeAfterLast(ctx)
		var rerr *replayError
		switch {
		case errors.As(err, &rerr):
			r.b.metrics.replays.WithLabelValues(r.label, "failed").Inc()
			r.log.Warn("replay failed; the engine's next batch decides", "from", r.last.seq, "error", err)
			return nil // started stays false
		case err != nil:
			return err
		case same:
			r.started = true
			return nil
		}
		r.log.Warn("subscribed to an engine that does not hold the last batch forwarded (a new process, or one whose replay buffer moved past it): clearing the worker and rebuilding it from the replay buffer",
			"last_seq", r.last.seq)
		if err := r.reset(ctx, "reconnect"); err != nil {
			return err
		}
		r.haveLast, r.next = false, 0
	}
	complete, first := true, true
	err := r.replayFrom(ctx, 0, func(m enginefeed.Message) (bool, error) {
		if first && m.Seq > 0 {
			complete = false
			r.log.Warn("the engine's replay buffer no longer starts at its first batch: blocks stored before it stay unknown until stored again",
				"first_seq", m.Seq)
		}
		first = false
		taken, err := r.takeReplayed(ctx, m)
		complete = complete && taken
		return true, err
	})
	var rerr *replayError
	switch {
	case errors.As(err, &rerr):
		r.b.metrics.replays.WithLabelValues(r.label, "failed").Inc()
		r.log.Warn("replay failed", "from", 0, "error", err)
	case err != nil:
		return err
	case complete:
		r.b.metrics.replays.WithLabelValues(r.label, "complete").Inc()
	default:
		r.b.metrics.replays.WithLabelValues(r.label, "incomplete").Inc()
	}
	r.started = true
	return nil
}

// resumeAfterLast asks the replay endpoint for the batches from the last one taken on. It reports
// whether the engine still holds that batch unchanged, and then takes the batches after it.
func (r *rank) resumeAfterLast(ctx context.Context) (same bool, err error) {
	err = r.replayFrom(ctx, r.last.seq, func(m enginefeed.Message) (bool, error) {
		if !same {
			same = m.Seq == r.last.seq && digestOf(m.Payload) == r.last.digest
			return same, nil
		}
		_, err := r.takeReplayed(ctx, m)
		return true, err
	})
	var rerr *replayError
	if same && errors.As(err, &rerr) {
		// The engine is the same; what the replay did not bring shows as a gap at the next batch.
		r.log.Warn("replay broke off", "error", err)
		return true, nil
	}
	if same && err == nil {
		r.b.metrics.replays.WithLabelValues(r.label, "complete").Inc()
	}
	return same, err
}

// handle takes one live PUB message: it checks its sequence number against the one expected,
// fills a gap from the replay endpoint, and forwards the batch. It returns an error only when the
// publisher stopped (or ctx ended).
func (r *rank) handle(ctx context.Context, frames [][]byte) error {
	m, err := enginefeed.ParseMessage(frames)
	if err != nil {
		r.b.metrics.batches.WithLabelValues(r.label, string(enginefeed.Malformed)).Inc()
		r.logLimited(string(enginefeed.Malformed), "dropped a malformed message", "error", err)
		return nil
	}
	if err := r.dec.Decode(m.Payload, &r.live); err != nil {
		// Not taken, so its number is not counted: the next batch shows the gap, and the replay
		// endpoint's copy is used, if it has a readable one.
		r.b.metrics.batches.WithLabelValues(r.label, string(enginefeed.Malformed)).Inc()
		r.logLimited(string(enginefeed.Malformed), "dropped a malformed batch", "seq", m.Seq, "error", err)
		return nil
	}
	r.b.metrics.engineSeq.WithLabelValues(r.label).Set(float64(m.Seq))
	digest := digestOf(m.Payload)
	switch {
	case !r.started:
		// The first batch of a subscription that could not rejoin through a replay endpoint.
		// Nothing says whether this is the engine process followed before (its numbers may even
		// have grown past ours) or a new one, so what was forwarded is cleared and rebuilt from
		// the engine's history when it has one.
		r.started = true
		if r.haveLast {
			if r.holdsBlocks() {
				r.log.Warn("resubscribed to the engine: clearing its blocks and rebuilding them from its history", "seq", m.Seq)
				if err := r.reset(ctx, "reconnect"); err != nil {
					return err
				}
			}
			r.haveLast, r.next = false, 0
		}
		if m.Seq > r.next {
			if err := r.catchUp(ctx, r.next, m.Seq); err != nil {
				return err
			}
		}
	case m.Seq == r.next:
	case m.Seq > r.next:
		r.b.metrics.gaps.WithLabelValues(r.label).Inc()
		if err := r.catchUp(ctx, r.next, m.Seq); err != nil {
			return err
		}
	default:
		if d, ok := r.fromReplay[m.Seq]; ok && d == digest {
			return nil // taken from the replay already
		}
		r.log.Warn("the engine's sequence went back: the engine restarted; clearing its blocks", "expected", r.next, "got", m.Seq)
		if err := r.reset(ctx, "engine_restart"); err != nil {
			return err
		}
		r.haveLast, r.next = false, 0
		clear(r.fromReplay)
		if m.Seq > 0 {
			if err := r.catchUp(ctx, 0, m.Seq); err != nil {
				return err
			}
		}
	}
	if len(r.fromReplay) > 0 {
		clear(r.fromReplay) // the live feed is past what the replay brought
	}
	return r.take(ctx, m, &r.live, digest)
}

// catchUp fetches the batches [from, to) from the replay endpoint and takes them. What it cannot
// fetch, take treats as lost.
func (r *rank) catchUp(ctx context.Context, from, to uint64) error {
	if r.replay == "" {
		return nil
	}
	complete, want := true, from
	err := r.replayFrom(ctx, from, func(m enginefeed.Message) (bool, error) {
		if m.Seq >= to {
			return false, nil
		}
		taken, err := r.takeReplayed(ctx, m)
		complete = complete && taken && m.Seq == want
		want = m.Seq + 1
		return true, err
	})
	var rerr *replayError
	switch {
	case errors.As(err, &rerr):
		r.b.metrics.replays.WithLabelValues(r.label, "failed").Inc()
		r.log.Warn("replay failed", "from", from, "to", to, "error", err)
	case err != nil:
		return err
	case complete && want == to:
		r.b.metrics.replays.WithLabelValues(r.label, "complete").Inc()
	default:
		r.b.metrics.replays.WithLabelValues(r.label, "incomplete").Inc()
	}
	return nil
}

// takeReplayed decodes a batch of the replay endpoint and takes it, unless it was taken already.
// It reports whether the batch was taken: one that does not decode there either is lost, and the
// next batch taken finds the gap.
func (r *rank) takeReplayed(ctx context.Context, m enginefeed.Message) (bool, error) {
	if m.Seq < r.next {
		return true, nil
	}
	if err := r.dec.Decode(m.Payload, &r.replayed); err != nil {
		r.b.metrics.batches.WithLabelValues(r.label, string(enginefeed.Malformed)).Inc()
		r.logLimited(string(enginefeed.Malformed), "dropped a malformed batch of the replay endpoint: it is lost", "seq", m.Seq, "error", err)
		return false, nil
	}
	digest := digestOf(m.Payload)
	r.fromReplay[m.Seq] = digest
	return true, r.take(ctx, m, &r.replayed, digest)
}

// take forwards batch m, decoded into b, as the next of the engine's stream. The batches between
// the one expected and m never came: if the router holds blocks of the rank, a lost batch may have
// removed some of them, so the worker is cleared first. Blocks those batches stored stay unknown
// until stored again, which costs cache hits, never a route to a block that is gone.
func (r *rank) take(ctx context.Context, m enginefeed.Message, b *enginefeed.Batch, digest uint64) error {
	if m.Seq > r.next {
		r.log.Warn("batches lost", "from", r.next, "to", m.Seq, "replay_endpoint", r.replay)
		if r.holdsBlocks() {
			if err := r.reset(ctx, "gap"); err != nil {
				return err
			}
		}
	}
	r.next, r.last, r.haveLast = m.Seq+1, batchRef{m.Seq, digest}, true
	return r.forward(ctx, m, b)
}

// holdsBlocks reports whether the router may hold blocks of the rank.
func (r *rank) holdsBlocks() bool { return r.inherited || r.mirror.blocks() > 0 }

// replayError is a request to the replay endpoint that failed.
type replayError struct{ err error }

func (e *replayError) Error() string { return "replay: " + e.err.Error() }
func (e *replayError) Unwrap() error { return e.err }

// replayFrom asks the replay endpoint for the batches from sequence number from on, and passes
// each to take in order, as long as each follows the one before (the first may come after from,
// when the engine no longer holds it), until take says to stop or the answer ends. It returns
// take's error as it is, and a failed request as a *replayError.
func (r *rank) replayFrom(ctx context.Context, from uint64, take func(enginefeed.Message) (more bool, err error)) error {
	rctx, cancel := context.WithTimeout(ctx, r.b.opts.ReplayTimeout)
	defer cancel()
	d := zmq4.NewDealer(rctx, zmq4.WithDialerMaxRetries(2), zmq4.WithDialerRetry(100*time.Millisecond))
	defer d.Close()
	if err := d.Dial(r.replay); err != nil {
		return &replayError{err}
	}
	if err := d.SendMulti(zmq4.NewMsgFrom(enginefeed.ReplayRequest(from)...)); err != nil {
		return &replayError{err}
	}
	var prev uint64
	started := false
	for {
		msg, err := d.Recv()
		if err != nil {
			return &replayError{fmt.Errorf("waiting for the replay from %d: %w", from, err)}
		}
		m, end, err := enginefeed.ParseReplay(msg.Frames)
		if err != nil {
			return &replayError{err}
		}
		if end {
			return nil
		}
		if m.Seq < from || (started && m.Seq != prev+1) {
			if started {
				return nil // not the engine's buffer as vLLM keeps it: stop at the first break
			}
			continue
		}
		started, prev = true, m.Seq
		more, err := take(m)
		if err != nil || !more {
			return err
		}
	}
}

// reset clears the worker's blocks at the router, and the mirror with them.
func (r *rank) reset(ctx context.Context, reason string) error {
	r.b.metrics.resets.WithLabelValues(r.label, reason).Inc()
	clearAll := enginefeed.Event{Kind: enginefeed.AllBlocksCleared}
	events, _ := r.tr.translate(&clearAll, nil) // forgets the mirror and the namespaces
	r.inherited = false
	return r.publish(ctx, events)
}

// forward publishes the events a decoded batch maps to.
func (r *rank) forward(ctx context.Context, m enginefeed.Message, b *enginefeed.Batch) error {
	met := r.b.metrics
	if b.HasDPRank && b.DPRank != int64(r.dp) {
		met.batches.WithLabelValues(r.label, ReasonDPRankMismatch).Inc()
		r.logLimited(ReasonDPRankMismatch, "dropped a batch of another data-parallel rank", "seq", m.Seq, "batch_dp_rank", b.DPRank)
		r.noEvents()
		return nil
	}
	met.batches.WithLabelValues(r.label, "ok").Inc()
	for _, s := range b.Skipped {
		met.dropped.WithLabelValues(r.label, string(s.Reason)).Inc()
		r.logLimited(string(s.Reason), "dropped an event the bridge cannot read", "seq", m.Seq, "event", s.Index, "detail", s.Detail)
	}
	met.blocksIn.WithLabelValues(r.label).Add(float64(b.Blocks()))
	out, forwarded := r.out[:0], 0
	for i := range b.Events {
		ev := &b.Events[i]
		n := len(out)
		var d drop
		out, d = r.tr.translate(ev, out)
		for _, e := range out[n:] {
			forwarded += len(e.GetStored().GetBlocks()) + len(e.GetRemoved().GetBlockHashes())
		}
		if d.reason != "" {
			met.dropped.WithLabelValues(r.label, d.reason).Inc()
			met.droppedBlocks.WithLabelValues(r.label, d.reason).Add(float64(d.blocks))
			r.logLimited(d.reason, "dropped blocks the router cannot use", "seq", m.Seq, "event", ev.Kind.String(), "blocks", d.blocks,
				"medium", ev.Medium, "block_size", ev.BlockSize, "tokens", len(ev.TokenIDs))
		}
	}
	r.out = out[:0]
	if len(out) == 0 {
		r.noEvents()
		return nil
	}
	if err := r.publish(ctx, out); err != nil { // the translator recorded them in the mirror first
		return err
	}
	r.lagMu.Lock()
	r.inflight = append(r.inflight, inflightBatch{lastEventID: r.lastPublished, batch: r.last, ts: b.TS})
	r.lagMu.Unlock()
	met.eventsOut.WithLabelValues(r.label).Add(float64(len(out)))
	met.blocksOut.WithLabelValues(r.label).Add(float64(forwarded))
	met.mirrored.WithLabelValues(r.label).Set(float64(r.mirror.blocks()))
	clear(out) // the publisher owns the events now
	return nil
}

// publish hands events to the publisher and records the id of the last one.
func (r *rank) publish(ctx context.Context, events []*kvrouterv1.KvEvent) error {
	if err := r.pub.Publish(ctx, events...); err != nil {
		return err
	}
	r.lastPublished, r.published = events[len(events)-1].GetEventId(), true
	return nil
}

// noEvents records that the batch just taken sent the router nothing (no events, or all dropped):
// it is done once what was published before it is acked, at once when nothing waits, so that the
// acked sequence number (and the checkpoint) does not stay behind on a batch the router never had
// to ack.
func (r *rank) noEvents() {
	r.lagMu.Lock()
	defer r.lagMu.Unlock()
	if len(r.inflight) > 0 {
		r.inflight = append(r.inflight, inflightBatch{lastEventID: r.lastPublished, batch: r.last})
		return
	}
	r.b.metrics.ackedSeq.WithLabelValues(r.label).Set(float64(r.last.seq))
	if r.published {
		r.acks = batchAck{batch: r.last, eventID: r.lastPublished, ok: true}
	}
}

// acked is the publisher's OnAck: every batch whose last event is acked is done.
func (r *rank) acked(id uint64) {
	now := float64(time.Now().UnixNano()) / 1e9
	r.lagMu.Lock()
	defer r.lagMu.Unlock()
	n := 0
	for n < len(r.inflight) && r.inflight[n].lastEventID <= id {
		b := r.inflight[n]
		if b.ts > 0 {
			r.b.metrics.ackLag.WithLabelValues(r.label).Observe(max(now-b.ts, 0))
		}
		r.b.metrics.ackedSeq.WithLabelValues(r.label).Set(float64(b.batch.seq))
		r.acks = batchAck{batch: b.batch, eventID: b.lastEventID, ok: true}
		n++
	}
	r.inflight = append(r.inflight[:0], r.inflight[n:]...)
}

func (r *rank) setAcked(a batchAck) {
	r.lagMu.Lock()
	defer r.lagMu.Unlock()
	r.acks = a
}

// ackedBatch returns the newest batch the router acked whole, if any.
func (r *rank) ackedBatch() batchAck {
	r.lagMu.Lock()
	defer r.lagMu.Unlock()
	return r.acks
}

// logState is when a reason was last logged, and how many times it was not logged since.
type logState struct {
	last       time.Time
	suppressed int
}

// logLimited logs a warning for reason at most once per LogInterval, saying how many of the same
// reason were not logged since the last one: bad input from an engine never floods the log.
func (r *rank) logLimited(reason, msg string, args ...any) {
	now := time.Now()
	st := r.logged[reason]
	if st == nil {
		st = &logState{}
		r.logged[reason] = st
	} else if now.Sub(st.last) < r.b.opts.LogInterval {
		st.suppressed++
		return
	}
	r.log.Warn(msg, append(args, "reason", reason, "not_logged_since_last", st.suppressed)...)
	st.last, st.suppressed = now, 0
}
