package server

import (
	"context"
	"errors"
	"io"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/server/app/publishtest"
)

// TestPublishContract runs the Publish protocol's contract through the gRPC edge, with a real
// client on a stream; server/app's TestPublishSession runs the same cases against the sessions
// directly.
func TestPublishContract(t *testing.T) {
	publishtest.Run(t, func(t *testing.T, limits publishtest.Limits) publishtest.Env {
		return grpcEnv{newTestEnv(t, func(o *Options) {
			o.MaxWorkersPerModel, o.MaxDumpBlocks = limits.MaxWorkersPerModel, limits.MaxDumpBlocks
		})}
	})
}

// grpcEnv is a test server, reached through its WorkerService.
type grpcEnv struct{ e *testEnv }

func (g grpcEnv) State() *kvstate.State { return g.e.state }

func (g grpcEnv) Connect(t *testing.T) publishtest.Conn {
	ctx, cancel := context.WithCancel(g.e.ctx)
	s, err := g.e.workers.Publish(ctx)
	if err != nil {
		cancel()
		t.Fatalf("Publish() = %v", err)
	}
	return &grpcConn{stream: s, cancel: cancel}
}

// grpcConn is a worker stream over gRPC: it maps the suite's messages to protobuf and the stream's
// replies and status back.
type grpcConn struct {
	stream grpc.BidiStreamingClient[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse]
	cancel context.CancelFunc
}

func (c *grpcConn) Send(_ *testing.T, m publishtest.Message) {
	// A send on a stream the router ended fails with io.EOF; the status is Recv's to return.
	_ = c.stream.Send(publishRequest(m))
}

func (c *grpcConn) Recv(t *testing.T) (publishtest.Reply, *publishtest.Outcome) {
	t.Helper()
	m, err := c.stream.Recv() // bounded by the test server's context (defaultTestTimeout)
	if errors.Is(err, io.EOF) {
		return publishtest.Reply{}, &publishtest.Outcome{Code: "OK"}
	}
	if err != nil {
		st, _ := status.FromError(err)
		o := &publishtest.Outcome{Code: st.Code().String()}
		for _, d := range st.Details() {
			switch d := d.(type) {
			case *errdetails.ErrorInfo:
				o.Reason, o.Field = d.GetReason(), d.GetMetadata()["field"]
			case *errdetails.BadRequest:
				o.Field = d.GetFieldViolations()[0].GetField()
			}
		}
		return publishtest.Reply{}, o
	}
	switch r := m.GetMessage().(type) {
	case *kvrouterv1.PublishResponse_Registered:
		return publishtest.Reply{Kind: "registered", EventID: r.Registered.GetLastEventId(), HasLast: r.Registered.LastEventId != nil}, nil
	case *kvrouterv1.PublishResponse_Ack:
		return publishtest.Reply{Kind: "ack", EventID: r.Ack.GetEventId()}, nil
	case *kvrouterv1.PublishResponse_Resync:
		return publishtest.Reply{Kind: "resync", EventID: r.Resync.GetExpectedEventId()}, nil
	}
	t.Fatalf("unknown reply %v", m)
	return publishtest.Reply{}, nil
}

func (c *grpcConn) Close() { c.cancel() }

// publishRequest is the protobuf of m.
func publishRequest(m publishtest.Message) *kvrouterv1.PublishRequest {
	switch {
	case m.Hello != nil:
		i := m.Hello.Info
		role := roleToProto[i.Role]
		return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
			WorkerId: i.Key.ID, DpRank: i.Key.Rank, Model: i.Model, Role: role, BlockSize: i.BlockSize,
			TotalKvBlocks: i.TotalKVBlocks, MaxNumBatchedTokens: i.MaxNumBatchedTokens, Endpoint: i.Endpoint,
			SupportsBypass: i.SupportsBypass, KvEventsEnabled: i.KVEventsEnabled, FreshStart: m.Hello.Fresh,
		}}}
	case m.Events != nil:
		return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: kvEvents(m.Events)}}}
	case m.Dump != nil:
		return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Dump{Dump: &kvrouterv1.KvDump{
			ThroughEventId: m.Dump.ThroughEventID, Events: kvEvents(m.Dump.Events), MoreFollows: m.Dump.MoreFollows}}}
	case m.Load != nil:
		return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Load{Load: &kvrouterv1.LoadReport{
			DpRank: m.Load.Rank, KvUsedBlocks: m.Load.KVUsedBlocks, WaitingRequests: m.Load.WaitingRequests}}}
	case m.Leave != nil:
		return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Leave{Leave: &kvrouterv1.WorkerLeave{Reason: *m.Leave}}}
	}
	panic(errors.New("publishtest: a message with nothing set"))
}

// kvEvents is the protobuf of device-tier events, their blocks sent by their local hashes.
func kvEvents(in []kvstate.Event) []*kvrouterv1.KvEvent {
	out := make([]*kvrouterv1.KvEvent, 0, len(in))
	for _, e := range in {
		ev := &kvrouterv1.KvEvent{EventId: e.ID, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE}
		switch e.Kind {
		case kvstate.EventStored:
			st := &kvrouterv1.BlocksStored{}
			if e.HasParent {
				st.ParentHash = &e.Parent
			}
			for _, b := range e.Blocks {
				st.Blocks = append(st.Blocks, &kvrouterv1.StoredBlock{BlockHash: b.Hash, TokensHash: &b.Local})
			}
			ev.Data = &kvrouterv1.KvEvent_Stored{Stored: st}
		case kvstate.EventRemoved:
			ev.Data = &kvrouterv1.KvEvent_Removed{Removed: &kvrouterv1.BlocksRemoved{BlockHashes: e.Removed}}
		case kvstate.EventCleared:
			ev.Data = &kvrouterv1.KvEvent_Cleared{Cleared: &kvrouterv1.CacheCleared{}}
		}
		out = append(out, ev)
	}
	return out
}
