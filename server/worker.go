package server

import (
	"errors"
	"io"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/server/app"
	"github.com/kvrouter/kvrouter/server/auth"
)

// workerService implements WorkerService: one Publish stream per worker rank. It maps the stream's
// messages to an app.PublishSession, which holds the protocol (admission, epochs, dumps, acks after
// durable, resync), and the session's replies and refusals back to messages and statuses. What is
// the transport's stays here: sizing and counting a message before it is decoded (publishFrame),
// the caller's credential and event rate, and shutdown.
type workerService struct {
	kvrouterv1.UnimplementedWorkerServiceServer
	publishing *app.Publishing
	logger     *slog.Logger
	limits     publishLimits
	stopping   <-chan struct{} // closed when the server shuts down: streams end so workers reconnect elsewhere
}

// publishStream is one Publish call: its stream, the caller's messages as one goroutine receives
// them, and, once registered, its session.
type publishStream struct {
	svc    *workerService
	stream grpc.BidiStreamingServer[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse]
	caller *auth.Caller
	msgs   chan recvResult
	// session is nil until the hello registered; ended and replaced are nil (never ready) until
	// then as well.
	session  *app.PublishSession
	ended    <-chan struct{}
	replaced <-chan struct{} // closes when the credentials file is reloaded
}

// recvResult is one message (or the error that ended the stream) from the receiving goroutine.
type recvResult struct {
	msg *kvrouterv1.PublishRequest
	err error
}

func (s *workerService) Publish(stream grpc.BidiStreamingServer[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse]) error {
	ps := &publishStream{svc: s, stream: stream, caller: auth.FromContext(stream.Context()), msgs: make(chan recvResult, 16)}
	// One goroutine receives; this one applies and sends (a stream allows one of each at a time).
	// Receiving apart lets the handler notice shutdown while a worker is idle.
	go ps.receive()
	first, err := ps.next(nil)
	if err != nil {
		if errors.Is(err, io.EOF) {
			return nil
		}
		return err
	}
	if err := ps.open(first); err != nil {
		return toStatus(err)
	}
	defer ps.session.Close()
	return ps.serve()
}

// receive reads the stream's messages into ps.msgs until the stream or its first bad message ends.
func (ps *publishStream) receive() {
	ctx := ps.stream.Context()
	for {
		f := &publishFrame{limits: ps.svc.limits}
		err := ps.stream.RecvMsg(f)
		if err == nil {
			err = f.check()
		}
		if err == nil {
			// Over its event rate, the caller is slowed here, where waiting stops the reading and so
			// the sending (flow control), and refused past auth.MaxEventWait.
			err = ps.caller.TakeEvents(ctx, f.counts.blocks)
		}
		select {
		case ps.msgs <- recvResult{f.msg, err}:
		case <-ctx.Done():
			return
		}
		if err != nil {
			return
		}
	}
}

// next returns the next message; a tick (nil when not wanted) interrupts the wait with neither.
func (ps *publishStream) next(tick <-chan time.Time) (*kvrouterv1.PublishRequest, error) {
	ctx := ps.stream.Context()
	for {
		select {
		case r := <-ps.msgs:
			return r.msg, r.err
		case <-tick:
			return nil, nil
		case <-ps.ended:
			if err := ps.session.Lost(); err != nil {
				return nil, toStatus(err)
			}
			ps.ended = nil // closed, yet the rank is held: nothing more to wait for
		case <-ps.replaced:
			// The stream's caller is checked again (still: the worker it registered).
			if err := ps.caller.MayStillPublishFor(ps.session.Info().Key.ID, ps.session.Info().Model); err != nil {
				return nil, err
			}
			ps.replaced = ps.caller.Replaced()
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		case <-ps.svc.stopping:
			return nil, status.Error(codes.Unavailable, "router is shutting down; reconnect to another replica")
		}
	}
}

// open registers the worker of the stream's first message, which must be a hello its caller may
// publish for.
func (ps *publishStream) open(first *kvrouterv1.PublishRequest) error {
	hello := first.GetHello()
	if hello == nil {
		return failedPrecondition("HELLO_REQUIRED", "the first message on a Publish stream must be a hello (got %s)", messageKind(first))
	}
	info, err := workerInfo(hello)
	if err != nil {
		return err
	}
	if err := ps.caller.MayPublishFor(info.Key.ID, info.Model); err != nil {
		return err
	}
	replaced := ps.caller.Replaced()
	if err := ps.caller.MayStillPublishFor(info.Key.ID, info.Model); err != nil { // a reload since the call was admitted
		return err
	}
	session, err := ps.svc.publishing.Open(ps.stream.Context(), info, hello.GetFreshStart(), streamReplies{ps.stream})
	if err != nil {
		return err
	}
	ps.session, ps.ended, ps.replaced = session, session.Ended(), replaced
	return nil
}

// serve maps the registered stream's messages to its session until the stream ends. A session whose
// log may buffer (a shared log in an outage) is refreshed between messages and every second, for
// an idle worker.
func (ps *publishStream) serve() error {
	sess := ps.session
	var tick <-chan time.Time
	if sess.Buffering() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		tick = t.C
	}
	for {
		msg, err := ps.next(tick)
		if errors.Is(err, io.EOF) {
			sess.Logger().Info("worker stream closed")
			return nil
		}
		if err != nil {
			if st, _ := status.FromError(err); st.Code() == codes.FailedPrecondition || st.Code() == codes.Unavailable {
				sess.Logger().Warn("worker stream ended", "err", err)
			}
			return err
		}
		if msg != nil {
			if err := ps.handle(msg); errors.Is(err, errLeft) {
				return nil
			} else if err != nil {
				err = toStatus(err)
				sess.Logger().Warn("worker stream ended by error", "err", err)
				return err
			}
		}
		if err := sess.Refresh(); err != nil {
			return toStatus(err)
		}
	}
}

// errLeft ends a stream whose worker left: the stream ends with OK.
var errLeft = errors.New("the worker left")

// handle maps one message to the session.
func (ps *publishStream) handle(msg *kvrouterv1.PublishRequest) error {
	ctx, sess := ps.stream.Context(), ps.session
	if err := sess.Expect(kindOf(msg)); err != nil {
		return err
	}
	switch m := msg.GetMessage().(type) {
	case *kvrouterv1.PublishRequest_Hello:
		info, err := workerInfo(m.Hello)
		if err != nil {
			return err
		}
		return sess.Hello(ctx, info, m.Hello.GetFreshStart())
	case *kvrouterv1.PublishRequest_Events:
		events, err := convertEvents("events.events", m.Events.GetEvents(), sess.Info(), true)
		if err != nil {
			return err
		}
		return sess.Events(ctx, events)
	case *kvrouterv1.PublishRequest_Dump:
		events, err := convertEvents("dump.events", m.Dump.GetEvents(), sess.Info(), false)
		if err != nil {
			return err
		}
		return sess.Dump(ctx, app.DumpPart{ThroughEventID: m.Dump.GetThroughEventId(), Events: events, MoreFollows: m.Dump.GetMoreFollows()})
	case *kvrouterv1.PublishRequest_Load:
		return sess.Load(ctx, app.LoadReport{Rank: m.Load.GetDpRank(), KVUsedBlocks: m.Load.GetKvUsedBlocks(), WaitingRequests: m.Load.GetWaitingRequests()})
	case *kvrouterv1.PublishRequest_Leave:
		if err := sess.Leave(ctx, m.Leave.GetReason()); err != nil {
			return err
		}
		return errLeft
	}
	return invalidArgument("message", "must set one of hello, events, dump, load, leave")
}

// streamReplies sends a session's replies on its Publish stream.
type streamReplies struct {
	stream grpc.BidiStreamingServer[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse]
}

func (r streamReplies) Registered(lastEventID uint64, has bool) error {
	reg := &kvrouterv1.Registered{}
	if has {
		reg.LastEventId = &lastEventID
	}
	return r.stream.Send(&kvrouterv1.PublishResponse{Message: &kvrouterv1.PublishResponse_Registered{Registered: reg}})
}

func (r streamReplies) Ack(eventID uint64) error {
	return r.stream.Send(&kvrouterv1.PublishResponse{Message: &kvrouterv1.PublishResponse_Ack{Ack: &kvrouterv1.Ack{EventId: eventID}}})
}

func (r streamReplies) Resync(reason string, expected uint64) error {
	return r.stream.Send(&kvrouterv1.PublishResponse{Message: &kvrouterv1.PublishResponse_Resync{Resync: &kvrouterv1.ResyncRequest{Reason: reason, ExpectedEventId: expected}}})
}

// kindOf returns the kind of m (0 for an empty message).
func kindOf(m *kvrouterv1.PublishRequest) app.MessageKind {
	switch m.GetMessage().(type) {
	case *kvrouterv1.PublishRequest_Hello:
		return app.MessageHello
	case *kvrouterv1.PublishRequest_Events:
		return app.MessageEvents
	case *kvrouterv1.PublishRequest_Dump:
		return app.MessageDump
	case *kvrouterv1.PublishRequest_Load:
		return app.MessageLoad
	case *kvrouterv1.PublishRequest_Leave:
		return app.MessageLeave
	}
	return 0
}

func messageKind(m *kvrouterv1.PublishRequest) string { return kindOf(m).String() }
