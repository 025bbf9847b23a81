package server

import (
	"sync/atomic"
	"testing"
	"time"

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
	deadline := time.Now().Add(defaultTestTimeout)
	for {
		w := e.state.Worker(kvstate.WorkerKey{ID: id})
		if w != nil && !w.Status().Connected {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("the server never recorded worker %d's stream as closed", id)
		}
		time.Sleep(time.Millisecond)
	}
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
	e := newTestEnv(t, func(o *Options) { o.Now = clock.Now })
	hk := &kvstate.Housekeeper{State: e.state, Log: e.log, Grace: grace, BookingExpiry: time.Hour, Now: clock.Now}

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
