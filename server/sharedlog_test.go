package server

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/testing/protocmp"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
)

// testSharedLog is a third log backend, for tests only: the in-process log, with the abilities of
// a shared, buffering log driven by the test. The edge must give it everything it gives the Redis
// log (readiness gating, the shared-state health entry, GetState's report, the shared-log metrics,
// resync requests) through kvstate.SharedLog and kvstate.BufferingLog alone.
type testSharedLog struct {
	*kvstate.MemLog
	ready      chan struct{}
	readyOnce  sync.Once
	degraded   atomic.Bool
	incomplete atomic.Bool
	resync     atomic.Bool
	observers  atomic.Pointer[kvstate.Observers]
}

var _ kvstate.BufferingLog = (*testSharedLog)(nil)

func newTestSharedLog(state *kvstate.State) *testSharedLog {
	return &testSharedLog{MemLog: kvstate.NewMemLog(state), ready: make(chan struct{})}
}

func (l *testSharedLog) markReady()                     { l.readyOnce.Do(func() { close(l.ready) }) }
func (l *testSharedLog) Backend() string                { return "test-backend" }
func (l *testSharedLog) Ready() <-chan struct{}         { return l.ready }
func (l *testSharedLog) Degraded() bool                 { return l.degraded.Load() }
func (l *testSharedLog) Incomplete() bool               { return l.incomplete.Load() }
func (l *testSharedLog) LastID() string                 { return "42-7" }
func (l *testSharedLog) Pending() int                   { return 3 }
func (l *testSharedLog) Generation() string             { return "g1/seeded" }
func (l *testSharedLog) Observe(o kvstate.Observers)    { l.observers.Store(&o) }
func (l *testSharedLog) Buffered(kvstate.WorkerKey) int { return 0 }
func (l *testSharedLog) TakeResync(kvstate.WorkerKey) bool {
	return l.resync.Swap(false)
}
func (l *testSharedLog) Stats() kvstate.SharedLogStats {
	return kvstate.SharedLogStats{Degraded: l.Degraded(), Incomplete: l.Incomplete(), BufferedChanges: 5, LostChanges: 2, Length: 1234,
		SnapshotBytes: 99, SnapshotAt: time.Now().Add(-time.Minute), GenerationChanges: 1}
}

// TestThirdLogBackend runs the server on testSharedLog: nothing in the edge knows its type.
func TestThirdLogBackend(t *testing.T) {
	var sl *testSharedLog
	e := newTestEnv(t, func(o *Options) {
		sl = newTestSharedLog(o.State)
		o.Log = sl
	})
	h := healthpb.NewHealthClient(e.conn)
	healthOf := func(service string) healthpb.HealthCheckResponse_ServingStatus {
		resp, err := h.Check(e.ctx, &healthpb.HealthCheckRequest{Service: service})
		if err != nil {
			t.Fatalf("Health.Check(%q) = %v", service, err)
		}
		return resp.GetStatus()
	}
	waitHealth := func(service string, want healthpb.HealthCheckResponse_ServingStatus) {
		t.Helper()
		// The shared-state entry appears at the watcher's first tick after the log is ready: until
		// then Check answers NOT_FOUND (unknown service), which is "not yet" here (failed once in CI
		// under load, where that tick came after the router's SERVING).
		eventually(t, fmt.Sprintf("Health.Check(%q) to report %v", service, want), func() bool {
			resp, err := h.Check(e.ctx, &healthpb.HealthCheckRequest{Service: service})
			return err == nil && resp.GetStatus() == want
		})
	}
	router := kvrouterv1.RouterService_ServiceDesc.ServiceName

	// Not caught up yet: not serving, and it stays so until the log says it is ready.
	if got := healthOf(router); got != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("Health.Check(%q) before the log is ready = %v, want NOT_SERVING", router, got)
	}
	sl.markReady()
	waitHealth(router, healthpb.HealthCheckResponse_SERVING)
	waitHealth(SharedStateService, healthpb.HealthCheckResponse_SERVING)

	// The store becomes unreachable: the shared state is not served, routing is.
	sl.degraded.Store(true)
	waitHealth(SharedStateService, healthpb.HealthCheckResponse_NOT_SERVING)
	if got := healthOf(router); got != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("Health.Check(%q) while degraded = %v, want SERVING", router, got)
	}
	if got := e.gauge("kvrouter_shared_log_degraded", "", ""); got != 1 {
		t.Errorf("kvrouter_shared_log_degraded = %v, want 1", got)
	}
	if got := e.gauge("kvrouter_shared_log_stream_length", "", ""); got != 1234 {
		t.Errorf("kvrouter_shared_log_stream_length = %v, want 1234", got)
	}
	sl.degraded.Store(false)
	sl.incomplete.Store(true)
	waitHealth(SharedStateService, healthpb.HealthCheckResponse_NOT_SERVING)

	resp, err := e.admin.GetState(e.ctx, &kvrouterv1.GetStateRequest{})
	if err != nil {
		t.Fatalf("GetState() = %v", err)
	}
	want := &kvrouterv1.GetStateResponse{Log: "test-backend", LogLastId: "42-7", PendingChanges: 3, LogGeneration: "g1/seeded", SharedStateComplete: false}
	if diff := cmp.Diff(want, resp, protocmp.Transform(), protocmp.IgnoreFields(&kvrouterv1.GetStateResponse{}, "digest", "log_position")); diff != "" {
		t.Errorf("GetState() mismatch (-want +got):\n%s", diff)
	}
	sl.incomplete.Store(false)
	waitHealth(SharedStateService, healthpb.HealthCheckResponse_SERVING)

	// The log asks for a worker's whole cache (its buffer overflowed): the stream relays it.
	p := e.connect(1)
	sl.resync.Store(true)
	got := p.recv()
	if got.GetResync() == nil {
		t.Fatalf("after TakeResync, the stream received %v, want a ResyncRequest", got)
	}
}
