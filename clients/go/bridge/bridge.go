// Package bridge subscribes to an inference engine's KV-cache event feed (vLLM, SGLang and
// TensorRT-LLM publish the same ZMQ feed, read by clients/go/enginefeed) and publishes what it says
// to kvrouter through the Go client's Publisher, one worker rank per data-parallel rank of the
// engine, so that engines take part in routing without a line of code changed.
//
// Nothing acknowledged is lost and nothing lost goes unnoticed: the Publisher keeps every event
// until the router acks it and resumes across replicas; a gap in the engine's sequence numbers is
// filled from the engine's replay endpoint when there is one, and otherwise the worker's blocks are
// cleared at the router (it then under-counts the cache until the engine stores blocks again,
// which costs cache hits, never a wrong route to a block that is gone). A sequence that goes back
// is an engine restart: a clear; so is a lost connection to the engine, since the engine on the
// other side may be a new process (its history is replayed after the clear). The router's ResyncRequest is answered with the bridge's mirror of
// what it forwarded. Events that cannot be read or mapped are counted by reason and skipped.
package bridge

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/kvrouter/kvrouter/clients/go/enginefeed"
	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// Options configure a Bridge. Hello, Conns and Endpoint are required.
type Options struct {
	// Hello registers the engine's worker; each rank registers with its dp_rank, and always with
	// fresh_start: a bridge that starts knows nothing of the engine's cache but what it will hear.
	Hello *kvrouterv1.WorkerHello
	// Conns are the router replicas, tried in turn (kvclient.PublisherOptions.Conns).
	Conns []grpc.ClientConnInterface
	// Endpoint is the engine's PUB endpoint of its first rank ("tcp://127.0.0.1:5557"); rank r
	// publishes on the port plus r, as vLLM and SGLang number them. ReplayEndpoint is its ROUTER
	// replay endpoint ("" when the engine has none), numbered the same way.
	Endpoint, ReplayEndpoint string
	// Topic is the subscription prefix ("" receives every topic).
	Topic string
	// FirstDPRank and DPRanks are the ranks served: FirstDPRank .. FirstDPRank+DPRanks-1 (default 1 rank).
	FirstDPRank, DPRanks int
	// KVGroup is the KV-cache group forwarded for hybrid models (events of other groups are dropped).
	KVGroup int64
	// ExtraKeys says what happens to stored blocks with extra hash keys (default ExtraKeysSkip).
	ExtraKeys ExtraKeys
	// ReplayTimeout bounds one request to the replay endpoint (default 10 s).
	ReplayTimeout time.Duration
	// DialRetry is the pause between attempts to subscribe to an engine that is not there (default 500 ms).
	DialRetry time.Duration
	// MaxUnacked bounds each rank's events waiting for the router's ack (kvclient default when 0).
	MaxUnacked int
	// Registerer receives the metrics (nil: not registered). Logger receives the logs; a reason of
	// dropped input is logged at most once per LogInterval (default 10 s) and rank.
	Registerer  prometheus.Registerer
	Logger      *slog.Logger
	LogInterval time.Duration
}

// Bridge forwards one engine's KV events to kvrouter.
type Bridge struct {
	opts    Options
	metrics *metrics
	ranks   []*rank
}

// New checks the options and returns a Bridge; Run starts it.
func New(opts Options) (*Bridge, error) {
	if opts.Hello == nil || len(opts.Conns) == 0 || opts.Endpoint == "" {
		return nil, errors.New("bridge: Hello, Conns and Endpoint are required")
	}
	if opts.Hello.GetBlockSize() == 0 {
		return nil, errors.New("bridge: Hello.block_size must be > 0")
	}
	if opts.DPRanks == 0 {
		opts.DPRanks = 1
	}
	if opts.DPRanks < 0 || opts.FirstDPRank < 0 {
		return nil, fmt.Errorf("bridge: data-parallel ranks must be >= 0 (first %d, count %d)", opts.FirstDPRank, opts.DPRanks)
	}
	if opts.ReplayTimeout <= 0 {
		opts.ReplayTimeout = 10 * time.Second
	}
	if opts.DialRetry <= 0 {
		opts.DialRetry = 500 * time.Millisecond
	}
	if opts.LogInterval <= 0 {
		opts.LogInterval = 10 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	b := &Bridge{opts: opts, metrics: newMetrics(opts.Registerer)}
	for i := range opts.DPRanks {
		dp := opts.FirstDPRank + i
		ep, err := RankEndpoint(opts.Endpoint, dp)
		if err != nil {
			return nil, err
		}
		replay := ""
		if opts.ReplayEndpoint != "" {
			if replay, err = RankEndpoint(opts.ReplayEndpoint, dp); err != nil {
				return nil, err
			}
		}
		r, err := newRank(b, int32(dp), ep, replay)
		if err != nil {
			return nil, err
		}
		b.ranks = append(b.ranks, r)
	}
	return b, nil
}

// RankEndpoint returns the endpoint of data-parallel rank dp: a tcp endpoint's port plus dp, as
// vLLM's offset_endpoint_port numbers them. Only rank 0 may use another transport.
func RankEndpoint(endpoint string, dp int) (string, error) {
	if dp == 0 {
		return endpoint, nil
	}
	addr, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return "", fmt.Errorf("bridge: endpoint %q: ranks after 0 need a tcp:// endpoint to offset its port", endpoint)
	}
	host, port, err := net.SplitHostPort(addr)
	n, perr := strconv.Atoi(port)
	if err != nil || perr != nil || n+dp > 65535 {
		return "", fmt.Errorf("bridge: endpoint %q: want tcp://host:port with room for rank %d", endpoint, dp)
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(n+dp)), nil
}

// Run forwards events until ctx ends, then flushes what the router has not acked (for at most
// drain) and returns. It returns early with the error that stops a rank for good: the router
// refused the worker (another process registered the same worker rank, an invalid hello).
func (b *Bridge) Run(ctx context.Context, drain time.Duration) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var wg sync.WaitGroup
	for _, r := range b.ranks {
		wg.Go(func() {
			if err := r.run(ctx); err != nil {
				cancel(err)
			}
		})
	}
	wg.Wait()
	err := context.Cause(ctx)
	if errors.Is(err, context.Canceled) {
		err = nil // stopped by the caller
	}
	dctx, dcancel := context.WithTimeout(context.Background(), drain)
	defer dcancel()
	for _, r := range b.ranks {
		if cerr := r.pub.Close(dctx); cerr != nil && err == nil && !errors.Is(cerr, kvclient.ErrPublisherClosed) {
			err = fmt.Errorf("dp rank %d: flushing: %w", r.dp, cerr)
		}
	}
	return err
}

// Ready returns nil when every rank is subscribed to the engine and its publisher runs, else why not.
func (b *Bridge) Ready() error {
	for _, r := range b.ranks {
		if err := r.pub.Err(); err != nil {
			return fmt.Errorf("dp rank %d: %w", r.dp, err)
		}
		if !r.connected.Load() {
			return fmt.Errorf("dp rank %d: not subscribed to %s", r.dp, r.endpoint)
		}
	}
	return nil
}

// rank forwards one data-parallel rank of the engine.
type rank struct {
	b                *Bridge
	dp               int32
	label            string // dp as a metric label
	endpoint, replay string
	pub              *kvclient.Publisher
	mirror           *mirror
	tr               translator
	log              *slog.Logger
	logged           map[string]*logState // by reason; used by the run goroutine only

	// Owned by the run goroutine.
	dec     *enginefeed.Decoder
	batch   enginefeed.Batch
	out     []*kvrouterv1.KvEvent
	started bool
	next    uint64 // the sequence number expected next

	connected atomic.Bool

	lagMu    sync.Mutex
	inflight []inflightBatch // published, not acked yet, in event id order
}

// inflightBatch is a published engine batch waiting for the router's ack of its last event.
type inflightBatch struct {
	lastEventID uint64
	seq         uint64
	ts          float64
}

func newRank(b *Bridge, dp int32, endpoint, replay string) (*rank, error) {
	r := &rank{
		b: b, dp: dp, label: strconv.Itoa(int(dp)), endpoint: endpoint, replay: replay,
		mirror: newMirror(),
		tr:     translator{blockSize: int(b.opts.Hello.GetBlockSize()), group: b.opts.KVGroup, extraKeys: b.opts.ExtraKeys},
		log:    b.opts.Logger.With("dp_rank", dp),
		logged: make(map[string]*logState),
		dec:    enginefeed.NewDecoder(),
	}
	hello := proto.Clone(b.opts.Hello).(*kvrouterv1.WorkerHello)
	hello.DpRank, hello.FreshStart = uint32(dp), true
	pub, err := kvclient.NewPublisher(kvclient.PublisherOptions{
		Hello:      hello,
		Conns:      b.opts.Conns,
		MaxUnacked: b.opts.MaxUnacked,
		Dump: func(context.Context) ([]*kvrouterv1.KvEvent, error) {
			b.metrics.resets.WithLabelValues(r.label, "resync_request").Inc()
			return r.mirror.dump(), nil
		},
		OnAck:  r.acked,
		Logger: r.log,
	})
	if err != nil {
		return nil, fmt.Errorf("bridge: dp rank %d: %w", dp, err)
	}
	r.pub = pub
	return r, nil
}

// run subscribes to the engine and forwards its batches until ctx ends or the publisher stops.
func (r *rank) run(ctx context.Context) error {
	for ctx.Err() == nil {
		if err := r.subscribe(ctx); err != nil {
			if perr := r.pub.Err(); perr != nil {
				return fmt.Errorf("dp rank %d: %w", r.dp, perr)
			}
			if ctx.Err() == nil {
				r.logLimited("subscribe", "subscription to the engine failed; retrying", "endpoint", r.endpoint, "error", err)
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(r.b.opts.DialRetry):
		}
	}
	return nil
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
	r.started = false // the next batch starts this subscription
	r.b.metrics.connected.WithLabelValues(r.label).Set(1)
	defer func() {
		r.connected.Store(false)
		r.b.metrics.connected.WithLabelValues(r.label).Set(0)
	}()
	r.log.Info("subscribed to the engine", "endpoint", r.endpoint, "replay", r.replay)
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

// handle takes one PUB message: it checks its sequence number against the last one, fills a gap
// from the replay endpoint or clears the worker, and forwards the batch. It returns an error only
// when the publisher stopped (or ctx ended).
func (r *rank) handle(ctx context.Context, frames [][]byte) error {
	m, err := enginefeed.ParseMessage(frames)
	if err != nil {
		r.b.metrics.batches.WithLabelValues(r.label, string(enginefeed.Malformed)).Inc()
		r.logLimited(string(enginefeed.Malformed), "dropped a malformed message", "error", err)
		return nil
	}
	r.b.metrics.engineSeq.WithLabelValues(r.label).Set(float64(m.Seq))
	switch {
	case !r.started:
		// The first batch of a subscription. After a lost connection nothing says whether this is
		// the same engine process (its numbers may even have grown past ours) or a new one, so
		// what was forwarded is cleared and rebuilt from the engine's history when it has one.
		r.started = true
		if r.next > 0 && r.mirror.blocks() > 0 {
			r.log.Warn("resubscribed to the engine: clearing its blocks and rebuilding them from its history", "seq", m.Seq)
			if err := r.reset(ctx, "reconnect"); err != nil {
				return err
			}
		}
		if m.Seq > 0 {
			if err := r.catchUp(ctx, 0, m.Seq, "joined the engine's stream after its start"); err != nil {
				return err
			}
		}
	case m.Seq == r.next:
	case m.Seq > r.next:
		r.b.metrics.gaps.WithLabelValues(r.label).Inc()
		if err := r.catchUp(ctx, r.next, m.Seq, "gap"); err != nil {
			return err
		}
	default:
		r.log.Warn("the engine's sequence went back: the engine restarted; clearing its blocks", "expected", r.next, "got", m.Seq)
		if err := r.reset(ctx, "engine_restart"); err != nil {
			return err
		}
		if m.Seq > 0 {
			if err := r.catchUp(ctx, 0, m.Seq, "engine restarted"); err != nil {
				return err
			}
		}
	}
	r.next = m.Seq + 1
	return r.forward(ctx, m)
}

// catchUp fills the batches [from, to) from the replay endpoint. Without one, or when the engine no
// longer holds them all, the worker's blocks are cleared (unless nothing was forwarded yet), and
// whatever the replay returned is forwarded after the clear.
func (r *rank) catchUp(ctx context.Context, from, to uint64, why string) error {
	var got []enginefeed.Message
	complete := false
	if r.replay != "" {
		var err error
		got, err = r.fetchReplay(ctx, from, to)
		switch {
		case err != nil:
			r.b.metrics.replays.WithLabelValues(r.label, "failed").Inc()
			r.log.Warn("replay failed", "from", from, "to", to, "error", err)
			got = nil
		case len(got) == int(to-from):
			complete = true
			r.b.metrics.replays.WithLabelValues(r.label, "complete").Inc()
		default:
			r.b.metrics.replays.WithLabelValues(r.label, "incomplete").Inc()
		}
	}
	if !complete {
		r.log.Warn("batches lost", "why", why, "from", from, "to", to, "replayed", len(got), "replay_endpoint", r.replay)
		if from > 0 || r.mirror.blocks() > 0 {
			if err := r.reset(ctx, "gap"); err != nil {
				return err
			}
		}
	}
	for _, m := range got {
		if err := r.forward(ctx, m); err != nil {
			return err
		}
	}
	return nil
}

// fetchReplay asks the replay endpoint for the batches from `from` on and returns those before
// `to`, in order, as long as they follow each other from `from`: the first missing one ends the list.
func (r *rank) fetchReplay(ctx context.Context, from, to uint64) ([]enginefeed.Message, error) {
	rctx, cancel := context.WithTimeout(ctx, r.b.opts.ReplayTimeout)
	defer cancel()
	d := zmq4.NewDealer(rctx, zmq4.WithDialerMaxRetries(2), zmq4.WithDialerRetry(100*time.Millisecond))
	defer d.Close()
	if err := d.Dial(r.replay); err != nil {
		return nil, err
	}
	if err := d.SendMulti(zmq4.NewMsgFrom(enginefeed.ReplayRequest(from)...)); err != nil {
		return nil, err
	}
	var out []enginefeed.Message
	want := from
	for {
		msg, err := d.Recv()
		if err != nil {
			return out, fmt.Errorf("waiting for the replay of %d..%d: %w", from, to-1, err)
		}
		m, end, err := enginefeed.ParseReplay(msg.Frames)
		if err != nil {
			return out, err
		}
		if end {
			return out, nil
		}
		if m.Seq == want && m.Seq < to {
			out = append(out, m)
			want++
		}
	}
}

// reset clears the worker's blocks at the router, and the mirror with them.
func (r *rank) reset(ctx context.Context, reason string) error {
	r.b.metrics.resets.WithLabelValues(r.label, reason).Inc()
	clearAll := enginefeed.Event{Kind: enginefeed.AllBlocksCleared}
	events, _ := r.tr.translate(&clearAll, nil)
	r.mirror.clear()
	return r.pub.Publish(ctx, events...)
}

// forward decodes one batch and publishes the events it maps to.
func (r *rank) forward(ctx context.Context, m enginefeed.Message) error {
	met := r.b.metrics
	if err := r.dec.Decode(m.Payload, &r.batch); err != nil {
		met.batches.WithLabelValues(r.label, string(enginefeed.Malformed)).Inc()
		r.logLimited(string(enginefeed.Malformed), "dropped a malformed batch", "seq", m.Seq, "error", err)
		return nil
	}
	b := &r.batch
	if b.HasDPRank && b.DPRank != int64(r.dp) {
		met.batches.WithLabelValues(r.label, ReasonDPRankMismatch).Inc()
		r.logLimited(ReasonDPRankMismatch, "dropped a batch of another data-parallel rank", "seq", m.Seq, "batch_dp_rank", b.DPRank)
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
		return nil
	}
	r.mirror.apply(out)
	if err := r.pub.Publish(ctx, out...); err != nil {
		return err
	}
	r.lagMu.Lock()
	r.inflight = append(r.inflight, inflightBatch{lastEventID: out[len(out)-1].GetEventId(), seq: m.Seq, ts: b.TS})
	r.lagMu.Unlock()
	met.eventsOut.WithLabelValues(r.label).Add(float64(len(out)))
	met.blocksOut.WithLabelValues(r.label).Add(float64(forwarded))
	met.mirrored.WithLabelValues(r.label).Set(float64(r.mirror.blocks()))
	clear(out) // the publisher owns the events now
	return nil
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
		r.b.metrics.ackedSeq.WithLabelValues(r.label).Set(float64(b.seq))
		n++
	}
	r.inflight = append(r.inflight[:0], r.inflight[n:]...)
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
