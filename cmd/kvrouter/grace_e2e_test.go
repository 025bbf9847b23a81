package main

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// closeStream half-closes the worker's stream and waits for the server to end it.
func (w *worker) closeStream() {
	w.t.Helper()
	if err := w.stream.CloseSend(); err != nil {
		w.t.Fatalf("CloseSend() = %v", err)
	}
	for {
		if _, err := w.stream.Recv(); err != nil {
			if !errors.Is(err, io.EOF) {
				w.t.Fatalf("stream ended with %v, want a clean close", err)
			}
			return
		}
	}
}

// TestGracePeriodAfterLongStream: a worker's stream lives longer than the grace period and closes.
// The worker and its blocks stay, on every replica, for the grace period counted from the close;
// a reconnect (to another replica) within it resumes after the last acked event with nothing lost;
// and a worker that does not come back is removed once the grace period after its close is over.
func TestGracePeriodAfterLongStream(t *testing.T) {
	t.Run("embedded", func(t *testing.T) {
		bin := buildBinary(t)
		a := startProcess(t, bin, "--worker-grace-period", "3s")
		testGracePeriodAfterLongStream(t, a, a)
	})
	onEveryRedis(t, func(t *testing.T, r redisTarget) {
		bin := buildBinary(t)
		a := startProcess(t, bin, append(r.flags, "--replica-id", "a", "--worker-grace-period", "3s")...)
		b := startProcess(t, bin, append(r.flags, "--replica-id", "b", "--worker-grace-period", "3s")...)
		testGracePeriodAfterLongStream(t, a, b)
	})
}

func testGracePeriodAfterLongStream(t *testing.T, a, b *serverProcess) {
	const grace = 3 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 4*defaultTestTimeout)
	defer cancel()
	replicas := map[string]*serverProcess{"A": a, "B": b}
	if a == b {
		replicas = map[string]*serverProcess{"A": a}
	}

	// present fails unless every replica lists worker 1 with want blocks.
	present := func(when string, want uint64) {
		t.Helper()
		for name, r := range replicas {
			ws := listWorkers(t, r.addr)[1]
			if ws == nil {
				t.Fatalf("%s: worker 1 is gone from replica %s, want it kept for the grace period after its stream closed\n%s", when, name, r.logs)
			}
			if got := ws.GetCachedBlocks().GetDevice(); got != want {
				t.Fatalf("%s: replica %s holds %d blocks of worker 1, want %d", when, name, got, want)
			}
		}
	}

	// holds reports whether the replica at addr lists worker 1 with want blocks.
	holds := func(addr string, want uint64) bool {
		ws := listWorkers(t, addr)[1]
		return ws != nil && ws.GetCachedBlocks().GetDevice() == want
	}

	// The stream lives longer than the grace period, publishing all along.
	w := &worker{t: t, id: 1, acked: -1}
	w.connect(ctx, a.addr)
	for start := time.Now(); time.Since(start) < grace+time.Second; time.Sleep(100 * time.Millisecond) {
		if !w.publish() {
			t.Fatal("publishing failed")
		}
	}
	acked := w.next
	// Wait until B has applied everything A acked, so that what follows measures the grace period only.
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool { return holds(b.addr, acked) }) {
		t.Fatalf("replica B never held the %d blocks A acked", acked)
	}
	w.closeStream()
	closed := time.Now()

	// Kept on every replica for most of the grace period (the margin absorbs sweep intervals).
	for time.Since(closed) < grace-time.Second {
		present("after the close", acked)
		time.Sleep(100 * time.Millisecond)
	}

	// A reconnect within the grace period, to the other replica, resumes after the last ack.
	reg := w.connect(ctx, b.addr)
	if reg.LastEventId == nil || reg.GetLastEventId() != acked-1 {
		t.Fatalf("Registered.last_event_id after reconnecting %v after the close = %v, want %d (the last acked event)", time.Since(closed), reg.LastEventId, acked-1)
	}
	for range 5 {
		if !w.publish() {
			t.Fatal("publishing after the reconnect failed")
		}
	}
	acked = w.next
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool { return holds(a.addr, acked) }) {
		t.Fatalf("replica A never held the %d blocks B acked", acked)
	}

	// The worker leaves for good: it stays for the grace period, then is removed everywhere.
	w.closeStream()
	closed = time.Now()
	for time.Since(closed) < grace-time.Second {
		present("after the final close", acked)
		time.Sleep(100 * time.Millisecond)
	}
	for name, r := range replicas {
		if !kvtest.Poll(time.Until(closed.Add(grace+defaultTestTimeout)), 50*time.Millisecond, func() bool { return listWorkers(t, r.addr)[1] == nil }) {
			t.Fatalf("replica %s still lists worker 1 %v after its stream closed (grace %v)", name, time.Since(closed), grace)
		}
	}
	// Removal is timed from the server's record of the close, a little before the client saw it.
	if took := time.Since(closed); took < grace-200*time.Millisecond {
		t.Errorf("worker 1 was removed %v after its stream closed, before the grace period of %v", took, grace)
	}
}
