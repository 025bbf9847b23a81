package kvclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// PublisherOptions configure a Publisher. Hello and Conns are required.
type PublisherOptions struct {
	// Hello registers the worker rank. Its fresh_start applies to the first registration only: a
	// reconnect resumes after the router's last event.
	Hello *kvrouterv1.WorkerHello
	// Conns are the router replicas (or one dns:/// target), tried in turn after a stream fails.
	Conns []grpc.ClientConnInterface
	// Dump returns the worker's whole cache as stored events, when the router asks for a resync.
	// Publishing is paused while it runs, so the dump reflects every event published before it. Nil:
	// a resync request stops the publisher with an error.
	Dump func(ctx context.Context) ([]*kvrouterv1.KvEvent, error)
	// MaxBatchEvents bounds the events of one message (default 256; halved, down to one, each time the
	// router refuses a message as too large); FlushInterval is the longest an
	// event waits for its batch to fill (default 2 ms).
	MaxBatchEvents int
	FlushInterval  time.Duration
	// MaxUnacked bounds the events kept until the router acks them (default 65,536): Publish blocks
	// past it. They are what a reconnect replays.
	MaxUnacked int
	// MaxDumpBlocks bounds the blocks of one dump part (default 16,384, the router's max_batch_blocks).
	MaxDumpBlocks int
	// HashTokens sends each stored block's tokens_hash (8 bytes, the router's hashing) instead of its
	// token ids.
	HashTokens bool
	// OnAck, when set, is called with the event id of every Ack the router sends: every event up to
	// it is held by the router. It runs on the stream's goroutine, so it must return quickly.
	OnAck  func(eventID uint64)
	Logger *slog.Logger
}

// ErrPublisherClosed is returned by Publish after Close.
var ErrPublisherClosed = errors.New("kvclient: publisher closed")

// Publisher streams one worker rank's KV events to the router. It numbers events, batches them,
// keeps every event until the router acks it, and after a failed stream reconnects (to the next of
// Conns, with exponential backoff and jitter) and resumes after the router's last event, so that
// every event is applied once. It answers resync requests with a dump and sends load reports. A
// newer stream for the same worker rank (WORKER_SUPERSEDED) or a refused event stops it: Err says
// why. A refused credential (UNAUTHENTICATED, PERMISSION_DENIED) does not, since rotating the token
// or certificate may mend it: each refusal is logged at error, and the attempts go on with a growing
// backoff. A credential over its rate limit (RESOURCE_EXHAUSTED with RetryInfo) reconnects after
// the router's retry delay, with its batches as large as before. It is safe for concurrent use.
type Publisher struct {
	opts   PublisherOptions
	cancel context.CancelFunc
	done   chan struct{}

	mu      sync.Mutex
	changed chan struct{} // closed and replaced on every change the waiters care about
	nextID  uint64
	pending []*kvrouterv1.KvEvent  // unacked, ids ascending
	sent    int                    // pending[:sent] went out on the current stream
	acked   int64                  // last acked id, -1 before the first
	load    *kvrouterv1.LoadReport // the latest report, until it is sent
	// lastLoad is the latest report, sent or not: a new stream sends it again, since the router
	// may not have read it from the stream that broke.
	lastLoad *kvrouterv1.LoadReport
	dumping  bool // Publish waits while the cache is dumped
	closing  bool
	leave    *kvrouterv1.WorkerLeave // set by Leave: sent in place of anything else
	left     bool                    // the router removed the worker rank after the leave
	err      error                   // why the publisher stopped
	// The router's answer to the first registration: its last event id for the rank (-1: none).
	registered bool
	firstLast  int64
	batch      int // events per message now: MaxBatchEvents, less after RESOURCE_EXHAUSTED
}

// NewPublisher starts publishing for opts.Hello's worker rank.
func NewPublisher(opts PublisherOptions) (*Publisher, error) {
	if opts.Hello == nil || len(opts.Conns) == 0 {
		return nil, errors.New("kvclient: PublisherOptions needs Hello and at least one of Conns")
	}
	if opts.Hello.GetEndpoint() == "" && !opts.Hello.GetNoEndpoint() {
		// The router's rule, before a stream opens: it would refuse the hello.
		return nil, invalidArgument("hello.endpoint", "must be set to the address frontends reach the worker at (or set hello.no_endpoint for a fleet whose frontends find workers by worker_id)")
	}
	if opts.MaxBatchEvents <= 0 {
		opts.MaxBatchEvents = 256
	}
	if opts.FlushInterval <= 0 {
		opts.FlushInterval = 2 * time.Millisecond
	}
	if opts.MaxUnacked <= 0 {
		opts.MaxUnacked = 1 << 16
	}
	if opts.MaxDumpBlocks <= 0 {
		opts.MaxDumpBlocks = 16_384
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Publisher{opts: opts, cancel: cancel, done: make(chan struct{}), changed: make(chan struct{}), acked: -1, batch: opts.MaxBatchEvents}
	go p.run(ctx)
	return p, nil
}

// Publish queues events for the router, numbering them in order. It takes ownership of the events:
// it sets their event_id and dp_rank (and tokens_hash with HashTokens), and they must not change
// until the router acked them. It
// blocks while MaxUnacked events wait for their ack or a dump runs, until ctx ends. A stored block
// whose token count is not the hello's block_size is refused here, as the router would refuse it.
func (p *Publisher) Publish(ctx context.Context, events ...*kvrouterv1.KvEvent) error {
	for i, ev := range events {
		if err := p.prepare(i, ev); err != nil {
			return err
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		switch {
		case p.err != nil:
			return p.err
		case p.closing:
			return ErrPublisherClosed
		case !p.dumping && len(p.pending)+len(events) <= max(p.opts.MaxUnacked, len(events)):
			for _, ev := range events {
				ev.EventId = p.nextID
				p.nextID++
				p.pending = append(p.pending, ev)
			}
			p.notifyLocked()
			return nil
		}
		if err := p.waitLocked(ctx); err != nil {
			return err
		}
	}
}

// prepare checks event i of a Publish call and fills tokens_hash when asked to.
func (p *Publisher) prepare(i int, ev *kvrouterv1.KvEvent) error {
	ev.DpRank = p.opts.Hello.GetDpRank()
	st := ev.GetStored()
	if st == nil {
		return nil
	}
	salt := blockhash.Salt(st.GetLoraName(), st.GetCacheNamespace())
	for j, b := range st.GetBlocks() {
		if b.TokensHash != nil {
			if len(b.GetMmHashes()) > 0 {
				return status.Errorf(codes.InvalidArgument, "events[%d].stored.blocks[%d].mm_hashes: must be empty with tokens_hash, which already holds them", i, j)
			}
			continue
		}
		if n, want := len(b.GetTokenIds()), int(p.opts.Hello.GetBlockSize()); n != want {
			return status.Errorf(codes.InvalidArgument, "events[%d].stored.blocks[%d].token_ids: must hold exactly block_size %d tokens (got %d)", i, j, want, n)
		}
		if p.opts.HashTokens {
			mm := slices.Sorted(slices.Values(b.GetMmHashes()))
			h := blockhash.LocalMultimodal(b.GetTokenIds(), mm, salt)
			b.TokensHash, b.TokenIds, b.MmHashes = &h, nil, nil
		}
	}
	return nil
}

// ReportLoad sends the worker's load: the latest report is sent once, and again after a reconnect.
func (p *Publisher) ReportLoad(r *kvrouterv1.LoadReport) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r = proto.Clone(r).(*kvrouterv1.LoadReport)
	r.DpRank = p.opts.Hello.GetDpRank()
	p.load, p.lastLoad = r, r
	p.notifyLocked()
}

// LastAcked returns the last event id the router acked, if any.
func (p *Publisher) LastAcked() (uint64, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return uint64(max(p.acked, 0)), p.acked >= 0
}

// Registration waits for the router's first registration of the worker rank and returns the last
// event id the router held for the rank then, and whether it held any (a rank it did not know, or
// one registered with fresh_start, has none). A worker that resumes without fresh_start (a restarted
// process that kept its own record, such as the engine bridge's checkpoint) learns from it whether
// the router still holds what it last acked, before it decides what to send.
func (p *Publisher) Registration(ctx context.Context) (lastEventID uint64, held bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for !p.registered {
		if p.err != nil {
			return 0, false, p.err
		}
		if err := p.waitLocked(ctx); err != nil {
			return 0, false, err
		}
	}
	return uint64(max(p.firstLast, 0)), p.firstLast >= 0, nil
}

// Err returns why the publisher stopped, or nil while it runs.
func (p *Publisher) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// Flush waits until the router acked every event published so far, or ctx ends, or the publisher
// stops on an error (which it returns).
func (p *Publisher) Flush(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.flushLocked(ctx)
}

func (p *Publisher) flushLocked(ctx context.Context) error {
	for len(p.pending) > 0 && p.err == nil {
		if err := p.waitLocked(ctx); err != nil {
			return err
		}
	}
	return p.err
}

// Close sends what is queued, waits until the router acked all of it (or ctx ends), and ends the
// stream. It returns the publisher's error, if it stopped on one.
func (p *Publisher) Close(ctx context.Context) error {
	p.mu.Lock()
	p.closing = true
	p.notifyLocked()
	err := p.flushLocked(ctx)
	p.mu.Unlock()
	if err == nil {
		// Everything is acked: the stream half-closes by itself, and the run loop ends. If ctx ends
		// first, the stream is cut instead, which loses nothing.
		select {
		case <-p.done:
		case <-ctx.Done():
		}
	}
	p.cancel()
	<-p.done
	return err
}

// Leave removes the worker rank at the router now, with its blocks, instead of a grace period
// after the stream ends: for a worker that stopped serving (its engine is down) and must get no
// more requests. Events not acked yet are dropped, since the worker's blocks go with it. It waits
// until the router confirmed the removal (reconnecting if need be) or ctx ends, and closes the
// publisher either way. If ctx ends first, the worker is removed a grace period after its stream
// closed, as after Close.
func (p *Publisher) Leave(ctx context.Context, reason string) error {
	select {
	case <-p.done:
		if err := p.Err(); err != nil {
			return err
		}
		return ErrPublisherClosed
	default:
	}
	p.mu.Lock()
	p.closing = true
	if p.leave == nil {
		p.leave = &kvrouterv1.WorkerLeave{Reason: reason}
	}
	p.pending, p.sent = nil, 0
	p.notifyLocked()
	for !p.left && p.err == nil {
		if err := p.waitLocked(ctx); err != nil {
			break
		}
	}
	err := p.err
	if !p.left && err == nil {
		err = ctx.Err()
	}
	p.mu.Unlock()
	p.cancel()
	<-p.done
	return err
}

func (p *Publisher) notifyLocked() {
	close(p.changed)
	p.changed = make(chan struct{})
}

// waitLocked waits, with mu released, for the next change or for ctx to end.
func (p *Publisher) waitLocked(ctx context.Context) error {
	ch := p.changed
	p.mu.Unlock()
	defer p.mu.Lock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (p *Publisher) fail(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err == nil {
		p.err = err
	}
	p.notifyLocked()
}

// run keeps a stream open, moving to the next connection with backoff after a failure, until the
// publisher closes or stops on an error no reconnect can mend.
//
// A stream that registered resets the backoff, except one the router ended for the credential
// (UNAUTHENTICATED, PERMISSION_DENIED): those go on with a growing backoff, since a rotated token
// or certificate may mend them, and a router that registers the worker and then refuses it must not
// be called again at once every time. A rate limit (RESOURCE_EXHAUSTED with RetryInfo) waits the
// router's retry delay on top of the backoff, so that workers limited at one moment do not all
// come back at the next.
func (p *Publisher) run(ctx context.Context) {
	defer close(p.done)
	retry := backoff.NewExponentialBackOff()
	retry.InitialInterval, retry.MaxInterval = 50*time.Millisecond, 5*time.Second
	first := true
	for i := 0; ; i = (i + 1) % len(p.opts.Conns) {
		registered, err := p.stream(ctx, p.opts.Conns[i], first)
		first = first && !registered
		refused := credentialRefused(err)
		if registered && !refused {
			retry.Reset()
		}
		if ctx.Err() != nil || p.closed() {
			return
		}
		var wait time.Duration
		if delay, limited := retryDelay(err); limited {
			wait = delay + retry.NextBackOff()
			p.opts.Logger.Warn("the router is rate limiting this worker's credential; reconnecting after its retry delay",
				"retry_delay", delay, "wait", wait, "err", err)
		} else if refused {
			wait = retry.NextBackOff()
			p.opts.Logger.Error("the router refused this worker's credential; reconnecting in case it is rotated",
				"code", status.Code(err).String(), "message", status.Convert(err).Message(), "wait", wait)
		} else {
			if registered && p.smallerBatches(err) {
				continue // at once: the router is fine, the message was too large
			}
			if err := fatal(err, registered); err != nil {
				p.fail(err)
				return
			}
			wait = retry.NextBackOff()
			p.opts.Logger.Warn("kvrouter publish stream failed; reconnecting", "err", err, "wait", wait)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// retryDelay returns the delay of a RESOURCE_EXHAUSTED status carrying a RetryInfo (a credential
// over its rate limit), and whether err is one.
func retryDelay(err error) (time.Duration, bool) {
	st, _ := status.FromError(err)
	if st.Code() != codes.ResourceExhausted {
		return 0, false
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.RetryInfo); ok {
			return max(info.GetRetryDelay().AsDuration(), 0), true
		}
	}
	return 0, false
}

// credentialRefused reports whether the router refused the stream's credential.
func credentialRefused(err error) bool {
	c := status.Code(err)
	return c == codes.Unauthenticated || c == codes.PermissionDenied
}

// smallerBatches halves the events per message after the router refused one as too large
// (RESOURCE_EXHAUSTED without RetryInfo: over max_publish_msg_bytes or max_batch_blocks), and
// reports whether it could.
func (p *Publisher) smallerBatches(err error) bool {
	if status.Code(err) != codes.ResourceExhausted {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.batch <= 1 {
		return false // one event alone is too large: no retry will pass
	}
	p.batch /= 2
	p.opts.Logger.Warn("the router refused a message as too large; sending fewer events per message", "events_per_message", p.batch, "err", err)
	return true
}

// closed reports whether the publisher closed and the router acked everything (after a leave:
// removed the worker).
func (p *Publisher) closed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closing && len(p.pending) == 0 && (p.leave == nil || p.left)
}

// fatal returns the error that stops the publisher, or nil when a reconnect may mend err. A
// RESOURCE_EXHAUSTED (without RetryInfo) of a stream that registered is a message too large even
// alone; one that ended the stream before the registration is a bound on streams or workers
// (max_publish_streams, max_workers_per_model) that a later attempt may pass.
func fatal(err error, registered bool) error {
	st, _ := status.FromError(err)
	switch st.Code() {
	case codes.FailedPrecondition:
		for _, d := range st.Details() {
			if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetReason() == "WORKER_SUPERSEDED" {
				return fmt.Errorf("kvclient: another stream registered this worker rank (two processes with one worker_id?): %w", err)
			}
		}
		return fmt.Errorf("kvclient: the router refused the registration: %w", err)
	case codes.ResourceExhausted:
		if registered {
			return fmt.Errorf("kvclient: the router refused what this worker sent: %w", err)
		}
	case codes.InvalidArgument, codes.Unimplemented:
		return fmt.Errorf("kvclient: the router refused what this worker sent: %w", err)
	}
	return nil
}

// stream runs one Publish stream: register, resume, then send events and answer the router until
// the stream fails or the publisher closes. It reports whether the router registered the worker.
func (p *Publisher) stream(ctx context.Context, cc grpc.ClientConnInterface, first bool) (registered bool, err error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := kvrouterv1.NewWorkerServiceClient(cc).Publish(sctx)
	if err != nil {
		return false, err
	}
	hello := proto.Clone(p.opts.Hello).(*kvrouterv1.WorkerHello)
	hello.FreshStart = first && p.opts.Hello.GetFreshStart()
	if err := s.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: hello}}); err != nil {
		return false, recvErr(s, err)
	}
	m, err := s.Recv()
	if err != nil {
		return false, err
	}
	reg := m.GetRegistered()
	if reg == nil {
		return false, fmt.Errorf("kvclient: the router answered the hello with %v, not Registered", m)
	}
	needDump := p.resume(reg, first, hello.FreshStart)

	resync := make(chan struct{}, 1)
	failed := make(chan error, 1)
	go func() {
		for {
			m, err := s.Recv()
			if err != nil {
				failed <- err
				return
			}
			switch msg := m.GetMessage().(type) {
			case *kvrouterv1.PublishResponse_Ack:
				p.ack(msg.Ack.GetEventId())
			case *kvrouterv1.PublishResponse_Resync:
				p.opts.Logger.Info("the router asked for a dump", "reason", msg.Resync.GetReason())
				select {
				case resync <- struct{}{}:
				default:
				}
			}
		}
	}()

	// After a failed Send the stream's status comes from Recv, which the goroutine above owns.
	sendErr := func(err error) error {
		if !errors.Is(err, io.EOF) {
			return err
		}
		select {
		case err := <-failed:
			return err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	for {
		if needDump {
			if err := p.dump(ctx, s); err != nil {
				return true, sendErr(err)
			}
			needDump = false
		}
		batch, load, leave, closed, changed := p.next()
		switch {
		case leave != nil:
			return true, p.sendLeave(ctx, s, leave, failed)
		case batch != nil:
			err = s.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: batch}}})
		case load != nil:
			err = s.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Load{Load: load}})
		case closed:
			_ = s.CloseSend()
			return true, nil
		}
		if err != nil {
			return true, sendErr(err)
		}
		if batch != nil || load != nil {
			continue
		}
		select {
		case <-changed:
			p.waitForBatch(ctx)
		case <-resync:
			needDump = true
		case err := <-failed:
			return true, err
		case <-ctx.Done():
			return true, ctx.Err()
		}
	}
}

// recvErr returns the stream's own status after a failed Send (Send reports only io.EOF).
func recvErr(s grpc.BidiStreamingClient[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse], err error) error {
	if errors.Is(err, io.EOF) {
		for {
			if _, rerr := s.Recv(); rerr != nil {
				return rerr
			}
		}
	}
	return err
}

// resume drops what the router already holds after a registration and rewinds the stream to the
// first unacked event. A first registration without fresh_start continues the rank's numbering
// after the router's last event. It reports whether the router lost events this publisher had seen
// acked, so that only a dump can restore them.
func (p *Publisher) resume(reg *kvrouterv1.Registered, first, freshStart bool) (needDump bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sent = 0
	p.load = cloneLoad(p.lastLoad) // sent again on the new stream
	if !p.registered {
		p.registered, p.firstLast = true, -1
		if reg.LastEventId != nil {
			p.firstLast = int64(reg.GetLastEventId())
		}
		p.notifyLocked()
	}
	if reg.LastEventId == nil {
		return p.acked >= 0 && !freshStart
	}
	last := int64(reg.GetLastEventId())
	if first && !freshStart {
		// A worker that resumes a rank: its events (none sent yet) follow the router's last one.
		p.nextID = uint64(last) + 1
		for i, ev := range p.pending {
			ev.EventId = p.nextID + uint64(i)
		}
		p.nextID += uint64(len(p.pending))
		p.acked = last
		p.notifyLocked()
		return false
	}
	if last < p.acked {
		return true
	}
	p.dropThroughLocked(last)
	return false
}

func cloneLoad(r *kvrouterv1.LoadReport) *kvrouterv1.LoadReport {
	if r == nil {
		return nil
	}
	return proto.Clone(r).(*kvrouterv1.LoadReport)
}

func (p *Publisher) ack(id uint64) {
	p.mu.Lock()
	p.dropThroughLocked(int64(id))
	p.mu.Unlock()
	if p.opts.OnAck != nil {
		p.opts.OnAck(id)
	}
}

// dropThroughLocked forgets the events through id: the router holds them.
func (p *Publisher) dropThroughLocked(id int64) {
	n := 0
	for n < len(p.pending) && int64(p.pending[n].GetEventId()) <= id {
		n++
	}
	p.pending = p.pending[n:]
	p.sent = max(p.sent-n, 0)
	p.acked = max(p.acked, id)
	p.notifyLocked()
}

// next returns what to send now: the leave, else a batch of unsent events, else the load report;
// closed when the publisher closed and everything is acked; otherwise the channel that announces
// the next change.
func (p *Publisher) next() (batch []*kvrouterv1.KvEvent, load *kvrouterv1.LoadReport, leave *kvrouterv1.WorkerLeave, closed bool, changed <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.leave != nil {
		return nil, nil, p.leave, false, nil
	}
	if unsent := p.pending[p.sent:]; len(unsent) > 0 {
		batch = unsent[:min(len(unsent), p.batch)]
		p.sent += len(batch)
		return batch, nil, nil, false, nil
	}
	if p.load != nil {
		load, p.load = p.load, nil
		return nil, load, nil, false, nil
	}
	return nil, nil, nil, p.closing && len(p.pending) == 0, p.changed
}

// sendLeave sends the leave and waits for the router to end the stream: with OK, the worker rank
// is removed.
func (p *Publisher) sendLeave(ctx context.Context, s grpc.BidiStreamingClient[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse], leave *kvrouterv1.WorkerLeave, failed <-chan error) error {
	if err := s.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Leave{Leave: leave}}); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	_ = s.CloseSend()
	var err error
	select {
	case err = <-failed:
	case <-ctx.Done():
		return ctx.Err()
	}
	if !errors.Is(err, io.EOF) {
		return err
	}
	p.mu.Lock()
	p.left = true
	p.notifyLocked()
	p.mu.Unlock()
	return nil
}

// waitForBatch lets a batch fill for up to FlushInterval once an event arrived, unless it is full.
func (p *Publisher) waitForBatch(ctx context.Context) {
	deadline := time.Now().Add(p.opts.FlushInterval)
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(p.pending)-p.sent < p.batch && !p.closing && p.err == nil {
		wctx, cancel := context.WithDeadline(ctx, deadline)
		err := p.waitLocked(wctx)
		cancel()
		if err != nil {
			return
		}
	}
}

// dump sends the worker's whole cache, in parts, with publishing paused; the events it reflects are
// forgotten, and the next event follows it.
func (p *Publisher) dump(ctx context.Context, s grpc.BidiStreamingClient[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse]) error {
	if p.opts.Dump == nil {
		return status.Error(codes.Unimplemented, "kvclient: the router asked for a dump of the worker's cache and PublisherOptions.Dump is nil")
	}
	p.mu.Lock()
	p.dumping = true
	if p.nextID == 0 {
		p.nextID = 1 // through_event_id 0 then stands for "nothing before"
	}
	through := p.nextID - 1
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		p.dumping = false
		p.notifyLocked()
		p.mu.Unlock()
	}()
	events, err := p.opts.Dump(ctx)
	if err != nil {
		return status.Errorf(codes.Unimplemented, "kvclient: PublisherOptions.Dump: %v", err)
	}
	for i, ev := range events {
		if err := p.prepare(i, ev); err != nil {
			return err
		}
	}
	for start := 0; ; {
		end, blocks := start, 0
		for end < len(events) && (end == start || blocks+dumpBlocks(events[end]) <= p.opts.MaxDumpBlocks) {
			blocks += dumpBlocks(events[end])
			end++
		}
		part := &kvrouterv1.KvDump{ThroughEventId: through, Events: events[start:end], MoreFollows: end < len(events)}
		if err := s.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Dump{Dump: part}}); err != nil {
			return err
		}
		if start = end; start >= len(events) {
			break
		}
	}
	p.mu.Lock()
	p.dropThroughLocked(int64(through)) // in the dump; the router acks it when it applied it
	p.mu.Unlock()
	return nil
}

func dumpBlocks(ev *kvrouterv1.KvEvent) int {
	return len(ev.GetStored().GetBlocks()) + len(ev.GetRemoved().GetBlockHashes())
}
