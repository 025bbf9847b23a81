package app_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
	"github.com/kvrouter/kvrouter/server/app/publishtest"
)

// TestPublishSession runs the Publish protocol's contract directly against the sessions, with no
// transport; server's TestPublishContract runs the same cases through the gRPC edge.
func TestPublishSession(t *testing.T) {
	publishtest.Run(t, func(t *testing.T, limits publishtest.Limits) publishtest.Env {
		state := kvstate.NewState()
		shard := &kvstate.Shard{State: state, Log: kvstate.NewMemLog(state)}
		return &sessionEnv{state: state, p: app.NewPublishing(app.PublishOptions{
			Shards: kvstate.OneShard{Shard: shard}, MaxWorkersPerModel: limits.MaxWorkersPerModel, MaxDumpBlocks: limits.MaxDumpBlocks,
		})}
	})
}

// sessionEnv is a replica's sessions, driven directly.
type sessionEnv struct {
	state *kvstate.State
	p     *app.Publishing
}

func (e *sessionEnv) State() *kvstate.State { return e.state }

func (e *sessionEnv) Connect(*testing.T) publishtest.Conn { return &sessionConn{p: e.p} }

// sessionConn is a worker stream over a session: replies queue up as the session sends them, and
// the first refusal ends the stream, as the gRPC edge ends it.
type sessionConn struct {
	p       *app.Publishing
	s       *app.PublishSession
	replies []publishtest.Reply
	ended   error
}

func (c *sessionConn) Registered(id uint64, has bool) error {
	r := publishtest.Reply{Kind: "registered", HasLast: has}
	if has {
		r.EventID = id
	}
	c.replies = append(c.replies, r)
	return nil
}

func (c *sessionConn) Ack(id uint64) error {
	c.replies = append(c.replies, publishtest.Reply{Kind: "ack", EventID: id})
	return nil
}

func (c *sessionConn) Resync(_ string, id uint64) error {
	c.replies = append(c.replies, publishtest.Reply{Kind: "resync", EventID: id})
	return nil
}

func (c *sessionConn) Send(t *testing.T, m publishtest.Message) {
	if c.ended != nil {
		return // the stream is over: the message is lost, as on a closed gRPC stream
	}
	ctx := t.Context()
	var err error
	switch {
	case c.s == nil && m.Hello != nil:
		c.s, err = c.p.Open(ctx, m.Hello.Info, m.Hello.Fresh, c)
	case c.s == nil:
		t.Fatalf("the first message of a session must be a hello (got %+v)", m)
	case m.Hello != nil:
		err = c.s.Hello(ctx, m.Hello.Info, m.Hello.Fresh)
	case m.Events != nil:
		err = c.s.Events(ctx, m.Events)
	case m.Dump != nil:
		err = c.s.Dump(ctx, *m.Dump)
	case m.Load != nil:
		err = c.s.Load(ctx, *m.Load)
	case m.Leave != nil:
		if err = c.s.Leave(ctx, *m.Leave); err == nil {
			err = errLeft // the transport ends the stream with OK
		}
	}
	if err != nil {
		c.end(err)
	}
}

// end ends the stream with err, closing its session.
func (c *sessionConn) end(err error) {
	c.ended = err
	if c.s != nil {
		c.s.Close()
	}
}

func (c *sessionConn) Recv(t *testing.T) (publishtest.Reply, *publishtest.Outcome) {
	t.Helper()
	if len(c.replies) > 0 {
		r := c.replies[0]
		c.replies = c.replies[1:]
		return r, nil
	}
	if c.ended == nil && c.s != nil {
		select {
		case <-c.s.Ended():
			c.end(c.s.Lost())
		case <-time.After(5 * time.Second): // real time: how long a reply may take to come
		}
	}
	if c.ended == nil {
		t.Fatal("no reply and the stream did not end")
	}
	return publishtest.Reply{}, outcome(t, c.ended)
}

func (c *sessionConn) Close() {
	if c.ended == nil {
		c.end(errors.New("closed by the worker"))
	}
}

// errLeft ends a session stream after a leave, as the gRPC edge ends it with OK.
var errLeft = errors.New("the worker left")

// outcome classifies a session's error as the suite compares it.
func outcome(t *testing.T, err error) *publishtest.Outcome {
	t.Helper()
	var fe *policy.FieldError
	var r *app.Refusal
	switch {
	case errors.As(err, &fe):
		return &publishtest.Outcome{Code: "InvalidArgument", Field: fe.Field}
	case errors.As(err, &r):
		code := map[app.RefusalKind]string{app.RefusedPrecondition: "FailedPrecondition", app.RefusedLimit: "ResourceExhausted",
			app.RefusedUnavailable: "Unavailable", app.RefusedInternal: "Internal"}[r.Kind]
		return &publishtest.Outcome{Code: code, Reason: r.Reason, Field: r.Metadata["field"]}
	case errors.Is(err, context.Canceled):
		return &publishtest.Outcome{Code: "Canceled"}
	case errors.Is(err, errLeft):
		return &publishtest.Outcome{Code: "OK"}
	}
	t.Fatalf("session error %v is neither a field error nor a refusal", err)
	return nil
}
