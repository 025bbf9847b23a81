package server

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
)

// testClock is a clock the server and the housekeeper share, moved by the test.
type testClock struct{ ns atomic.Int64 }

func (c *testClock) Now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *testClock) set(t time.Time)         { c.ns.Store(t.UnixNano()) }
func (c *testClock) advance(d time.Duration) { c.ns.Add(int64(d)) }

// waitDisconnected waits until the server has recorded that worker id's stream closed.
func (e *testEnv) waitDisconnected(id uint64) {
	e.t.Helper()
	eventually(e.t, fmt.Sprintf("worker %d's stream to be recorded as closed", id), func() bool {
		return !e.presence.IsConnected(kvstate.WorkerKey{ID: id})
	})
}

// TestGracePeriodRunsFromTheClose holds a stream for three grace periods, closes it, and checks that
// the worker keeps its blocks for a whole grace period after the close (not after the stream's
// start), that a reconnect within it resumes after the last acked event, and that a worker which
// does not come back is removed once the grace period after its close has passed.
func TestGracePeriodRunsFromTheClose(t *testing.T) {
	const grace = 10 * time.Second
	clock := &testClock{}
	t0 := time.Unix(1_700_000_000, 0)
	clock.set(t0)
	e := newTestEnv(t, func(o *Options) { o.Clock = clock })
	hk := &kvstate.Housekeeper{State: e.state, Log: e.log, Presence: e.presence, Grace: grace, BookingExpiry: time.Hour, Clock: clock}

	p := e.connect(1)
	p.send(events(stored(0, nil, 0, 1), stored(1, nil, 1, 1), stored(2, nil, 2, 1)))
	wantMsg(t, p.recv(), ack(2))
	clock.advance(3 * grace) // a long-lived stream, as every real worker's
	p.stream.CloseSend()
	if err := p.endErr(); err != nil {
		t.Fatalf("stream end = %v", err)
	}
	e.waitDisconnected(1)
	closedAt := clock.Now()

	clock.set(closedAt.Add(grace - time.Millisecond))
	hk.Sweep(e.ctx)
	if got := e.cachedBlocks(1); got != 3 {
		t.Fatalf("blocks just before the grace period after the close ended = %d, want 3 (the worker must stay)", got)
	}

	// A reconnect within the grace period resumes after the last acked event.
	p = e.publish()
	p.send(hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4))
	last := uint64(2)
	wantMsg(t, p.recv(), registered(&last))
	p.send(events(stored(3, nil, 3, 1)))
	wantMsg(t, p.recv(), ack(3))
	clock.advance(2 * grace)
	p.stream.CloseSend()
	if err := p.endErr(); err != nil {
		t.Fatalf("stream end = %v", err)
	}
	e.waitDisconnected(1)
	closedAt = clock.Now()

	clock.set(closedAt.Add(grace / 2))
	hk.Sweep(e.ctx)
	if got := e.cachedBlocks(1); got != 4 {
		t.Fatalf("blocks half a grace period after the second close = %d, want 4", got)
	}
	clock.set(closedAt.Add(grace))
	hk.Sweep(e.ctx)
	if got := e.cachedBlocks(1); got != -1 {
		t.Fatalf("worker still listed (%d blocks) a whole grace period after its stream closed; want it removed", got)
	}
}

// TestNewerStreamTakesOver: a second live stream for the same worker_id and dp_rank takes the rank
// over. The older stream ends with FAILED_PRECONDITION WORKER_SUPERSEDED, and what it sent after the
// takeover is neither applied nor acked; the newer one resumes after the last applied event. A
// fresh_start stream takes over too, and starts the rank afresh.
func TestNewerStreamTakesOver(t *testing.T) {
	e := newTestEnv(t)
	const superseded = "worker 1/0: a newer Publish stream registered this worker_id and dp_rank (on this or another replica); this stream no longer publishes for it. Two processes with the same worker_id? Do not reconnect automatically on this status"
	old := e.connect(1)
	old.send(events(stored(0, nil, 0, 1)))
	wantMsg(t, old.recv(), ack(0))

	newer := e.publish()
	newer.send(hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4))
	last := uint64(0)
	wantMsg(t, newer.recv(), registered(&last))
	// The older stream, not knowing yet, sends an event with other content: it must not apply.
	_ = old.stream.Send(events(stored(1, nil, 7, 3)))
	wantStatus(t, old.endErr(), codes.FailedPrecondition, superseded)
	if got := e.cachedBlocks(1); got != 1 {
		t.Errorf("cached blocks after the superseded stream's event = %d, want 1 (nothing of it applied)", got)
	}
	newer.send(events(stored(1, nil, 1, 1)))
	wantMsg(t, newer.recv(), ack(1))
	if got := e.cachedBlocks(1); got != 2 {
		t.Errorf("cached blocks after the newer stream's event = %d, want 2", got)
	}

	fresh := e.publish()
	h := hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4)
	h.GetHello().FreshStart = true
	fresh.send(h)
	wantMsg(t, fresh.recv(), registered(nil))
	wantStatus(t, newer.endErr(), codes.FailedPrecondition, superseded)
	fresh.send(events(stored(0, nil, 5, 1)))
	wantMsg(t, fresh.recv(), ack(0))
	if got := e.cachedBlocks(1); got != 1 {
		t.Errorf("cached blocks after the fresh start = %d, want 1", got)
	}
	if got := e.counter("kvrouter_publish_streams_superseded_total", "", ""); got != 2 {
		t.Errorf("kvrouter_publish_streams_superseded_total = %v, want 2", got)
	}
	if !e.presence.IsConnected(kvstate.WorkerKey{ID: 1}) {
		t.Error("the worker is not connected after two takeovers, want the live stream counted")
	}
	fresh.stream.CloseSend()
}
