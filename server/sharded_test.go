package server

import (
	"context"
	"fmt"
	"hash/fnv"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/server/app"
)

// servedShards is an in-process shard per model, for the models of served only: as a replica
// configured with redis_models refuses the others.
type servedShards struct {
	*kvtest.MemShards
	served []string
}

func (s servedShards) Open(ctx context.Context, model string) (*kvstate.Shard, error) {
	for _, m := range s.served {
		if m == model {
			return s.MemShards.Open(ctx, model)
		}
	}
	return nil, fmt.Errorf("%w: %q", kvstate.ErrModelNotServed, model)
}

// withShards serves src, a shard per model.
func withShards(src kvstate.ShardSource) func(*Options) {
	return func(o *Options) {
		o.Shards, o.Dispatcher = src, app.NewSharded(src, o.Dispatcher.Config(), app.Options{})
	}
}

// connectModel registers an aggregated worker of model with block size 4, and stores the first n
// blocks of promptTokens on it.
func (e *testEnv) connectModel(id uint64, model string, n int) *publisher {
	e.t.Helper()
	p := e.publish()
	h := hello(id, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4)
	h.GetHello().Model = model
	p.send(h)
	wantMsg(e.t, p.recv(), registered(nil))
	p.send(events(stored(0, nil, 0, n)))
	wantMsg(e.t, p.recv(), ack(0))
	return p
}

// TestShardedServer: with a shard per model, each Publish stream works in its worker's model's
// shard, Route and Free find the model's shard, GetState reports each shard and sums them,
// ListWorkers and the metrics cover every shard, and a model this replica does not serve is refused
// at the hello.
func TestShardedServer(t *testing.T) {
	src := servedShards{MemShards: &kvtest.MemShards{}, served: []string{"a", "b"}}
	e := newTestEnv(t, withShards(src))
	pa, pb := e.connectModel(1, "a", 3), e.connectModel(2, "b", 2)
	defer pa.stream.CloseSend()
	defer pb.stream.CloseSend()

	for model, worker := range map[string]uint64{"a": 1, "b": 2} {
		resp, err := e.router.Route(e.ctx, &kvrouterv1.RouteRequest{RequestId: "r-" + model, Model: model, TokenIds: promptTokens(3)})
		if err != nil || resp.GetDecode().GetWorkerId() != worker {
			t.Fatalf("Route(%s) = %v, %v; want decode on worker %d", model, resp, err, worker)
		}
	}
	if _, err := e.router.Free(e.ctx, &kvrouterv1.FreeRequest{RequestId: "r-b"}); err != nil {
		t.Fatalf("Free(r-b) = %v", err)
	}
	_, err := e.router.Route(e.ctx, &kvrouterv1.RouteRequest{RequestId: "r-c", Model: "c", TokenIds: promptTokens(3)})
	if status.Code(err) != codes.NotFound {
		t.Errorf("Route(model c) = %v, want NOT_FOUND", err)
	}

	st, err := e.admin.GetState(e.ctx, &kvrouterv1.GetStateRequest{})
	if err != nil {
		t.Fatalf("GetState() = %v", err)
	}
	shards := src.Shards()
	digest := fnv.New64a()
	var position uint64
	var want []*kvrouterv1.ShardState
	for _, sh := range shards {
		d := fmt.Sprintf("%016x", sh.State.Digest())
		fmt.Fprintf(digest, "%s=%s;", sh.Model, d)
		position += sh.Log.Position()
		want = append(want, &kvrouterv1.ShardState{Model: sh.Model, LogPosition: sh.Log.Position(), Digest: d, Workers: 1,
			IndexBlocks: uint64(sh.State.IndexBlocks()), Bookings: uint64(sh.State.Load().Bookings()), SharedStateComplete: true})
	}
	if len(shards) != 2 || shards[0].State.Worker(kvstate.WorkerKey{ID: 2}) != nil || shards[1].State.Worker(kvstate.WorkerKey{ID: 1}) != nil {
		t.Fatalf("each model's shard should hold its own worker only")
	}
	wantMsg(t, st, &kvrouterv1.GetStateResponse{Log: "embedded", LogPosition: position, LogLastId: "a=,b=", LogGeneration: "a=,b=",
		Digest: fmt.Sprintf("%016x", digest.Sum64()), Workers: 2, IndexBlocks: 5, Bookings: 1, SharedStateComplete: true, Shards: want})
	if got := st.GetShards(); got[0].GetBookings() != 1 || got[1].GetBookings() != 0 {
		t.Errorf("bookings by shard = %d, %d; want 1 (r-a), 0 (r-b freed)", got[0].GetBookings(), got[1].GetBookings())
	}

	list, err := e.admin.ListWorkers(e.ctx, &kvrouterv1.ListWorkersRequest{})
	if err != nil || len(list.GetWorkers()) != 2 || list.GetWorkers()[0].GetModel() != "a" || list.GetWorkers()[1].GetModel() != "b" {
		t.Errorf("ListWorkers() = %v, %v; want the workers of a and b, in model order", list, err)
	}
	for model, blocks := range map[string]float64{"a": 3, "b": 2} {
		if got := e.gauge("kvrouter_index_blocks", "model", model); got != blocks {
			t.Errorf("kvrouter_index_blocks{model=%s} = %v, want %v", model, got, blocks)
		}
	}
	if got := e.gauge("kvrouter_bookings", "", ""); got != 1 {
		t.Errorf("kvrouter_bookings = %v, want 1", got)
	}

	p := e.publish()
	h := hello(3, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4)
	h.GetHello().Model = "c"
	p.send(h)
	err = p.endErr()
	s, _ := status.FromError(err)
	var reason string
	for _, d := range s.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			reason = info.GetReason()
		}
	}
	if s.Code() != codes.FailedPrecondition || reason != "MODEL_NOT_SERVED" || s.Message() != `hello.model: model is not served by this replica: "c"` {
		t.Errorf("hello for model c = %v (reason %q), want FAILED_PRECONDITION MODEL_NOT_SERVED naming hello.model", err, reason)
	}
}

// TestOneModelPerWorker: a worker rank registered with one model is refused a hello naming another
// (FAILED_PRECONDITION, WORKER_CONFLICT, the same message), whether one state holds every model or
// each model has a shard; a hello that starts afresh moves it, out of the first model. Before,
// a shard per model accepted the second registration and the rank served two models.
func TestOneModelPerWorker(t *testing.T) {
	for _, layout := range []struct {
		name string
		opts []func(*Options)
	}{
		{"one state", nil},
		{"a shard per model", []func(*Options){withShards(servedShards{MemShards: &kvtest.MemShards{}, served: []string{"a", "b"}})}},
	} {
		t.Run(layout.name, func(t *testing.T) {
			e := newTestEnv(t, layout.opts...)
			pa := e.connectModel(7, "a", 2)
			defer pa.stream.CloseSend()
			p := e.publish()
			h := hello(7, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4)
			h.GetHello().Model = "b"
			p.send(h)
			err := p.endErr()
			st := status.Convert(err)
			want := `worker is registered with a different configuration: worker 7/0 is registered as model "a", role aggregated, block_size 4, total_kv_blocks 100, max_num_batched_tokens 8192`
			if st.Code() != codes.FailedPrecondition || errorReason(err) != "WORKER_CONFLICT" || st.Message() != want {
				t.Fatalf("hello for worker 7 in model b while it is registered in a = %v %q (%s), want FAILED_PRECONDITION WORKER_CONFLICT %q",
					st.Code(), st.Message(), errorReason(err), want)
			}
			fresh := e.publish()
			h.GetHello().FreshStart = true
			fresh.send(h)
			wantMsg(t, fresh.recv(), registered(nil))
			defer fresh.stream.CloseSend()
			ws, err := e.admin.ListWorkers(e.ctx, &kvrouterv1.ListWorkersRequest{})
			if err != nil {
				t.Fatal(err)
			}
			var models []string
			for _, w := range ws.GetWorkers() {
				if w.GetWorker().GetWorkerId() == 7 {
					models = append(models, w.GetModel())
				}
			}
			if fmt.Sprint(models) != "[b]" {
				t.Errorf("worker 7 after a fresh start in model b is registered in %v, want [b] only", models)
			}
		})
	}
}

// errorReason returns the ErrorInfo reason of a status error.
func errorReason(err error) string {
	for _, d := range status.Convert(err).Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return ei.GetReason()
		}
	}
	return ""
}
