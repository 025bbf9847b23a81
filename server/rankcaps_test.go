package server

import (
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// TestWorkerRankCaps: a worker id registers at most max_ranks_per_worker ranks in a model, and a
// model at most max_workers_per_model ranks; a rank already registered registers again freely.
// Before, one worker credential (worker_ids [7]) registered 10,000 ranks of worker 7 and every
// other worker of the model was refused.
func TestWorkerRankCaps(t *testing.T) {
	e := newTestEnv(t, func(o *Options) { o.MaxRanksPerWorker, o.MaxWorkersPerModel = 3, 5 })
	register := func(id uint64, rank uint32) error {
		p := e.publish()
		h := hello(id, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4)
		h.GetHello().DpRank = rank
		p.send(h)
		_, err := p.stream.Recv()
		if err == nil {
			t.Cleanup(func() { _ = p.stream.CloseSend() })
		}
		return err
	}
	reason := func(err error) string {
		for _, d := range status.Convert(err).Details() {
			if info, ok := d.(*errdetails.ErrorInfo); ok {
				return info.GetReason()
			}
		}
		return ""
	}
	for _, step := range []struct {
		id     uint64
		rank   uint32
		reason string // "" when registered
	}{
		{7, 0, ""}, {7, 1, ""}, {7, 2, ""},
		{7, 3, "RANKS_PER_WORKER"}, // the worker's fourth rank
		{8, 0, ""},                 // another worker of the model is not locked out
		{7, 1, ""},                 // a registered rank again (a second stream supersedes the first)
		{9, 0, ""},
		{10, 0, "WORKERS_PER_MODEL"}, // the model's sixth rank
	} {
		err := register(step.id, step.rank)
		switch {
		case step.reason == "" && err != nil:
			t.Fatalf("worker %d rank %d: %v, want registered", step.id, step.rank, err)
		case step.reason != "" && (status.Code(err) != codes.ResourceExhausted || reason(err) != step.reason):
			t.Fatalf("worker %d rank %d: %v (reason %q), want RESOURCE_EXHAUSTED %s", step.id, step.rank, err, reason(err), step.reason)
		}
	}
}

// TestModelCap: hellos create at most max_models models; a worker of a model the router knows
// registers past it. Before, a worker credential without models made 30,000, each a permanent
// shard (sharded by model) and series on /metrics.
func TestModelCap(t *testing.T) {
	e := newTestEnv(t, func(o *Options) { o.MaxModels = 2 })
	register := func(id uint64, model string) error {
		p := e.publish()
		h := hello(id, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4)
		h.GetHello().Model = model
		p.send(h)
		_, err := p.stream.Recv()
		return err
	}
	for _, step := range []struct {
		id    uint64
		model string
		want  codes.Code
	}{
		{1, "a", codes.OK}, {2, "b", codes.OK},
		{3, "c", codes.ResourceExhausted}, // a third model
		{4, "a", codes.OK},                // a known model takes new workers
	} {
		if err := register(step.id, step.model); status.Code(err) != step.want {
			t.Fatalf("worker %d of model %q: %v, want %v", step.id, step.model, err, step.want)
		}
	}
	if got := len(e.state.Models()); got != 2 {
		t.Errorf("%d models, want 2", got)
	}
}
