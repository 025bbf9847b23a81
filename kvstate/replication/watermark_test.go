package replication_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
	"github.com/kvrouter/kvrouter/kvstate/replication"
)

// startCutOff starts replica "a" behind a proxy that can cut it off from Redis, and replica "b"
// connected directly, both with short timeouts and reseed window, and waits until their shared
// state is complete and each has the other's watermark.
func startCutOff(t *testing.T, opts ...func(*replication.Options)) (a, b replica, proxy *redistest.Proxy, srv *redistest.Server) {
	t.Helper()
	srv = redistest.Start(t)
	proxy = redistest.StartProxy(t, srv.Addr)
	fast := func(addr string) redis.UniversalClient {
		c := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{addr}, DialTimeout: 200 * time.Millisecond,
			ReadTimeout: 300 * time.Millisecond, WriteTimeout: 300 * time.Millisecond, MaxRetries: -1, ContextTimeoutEnabled: true})
		t.Cleanup(func() { c.Close() })
		return c
	}
	short := append([]func(*replication.Options){func(o *replication.Options) { o.ReseedWindow = 300 * time.Millisecond }}, opts...)
	a = startReplicasNamed(t, fast(proxy.Addr), "a", 1, short...)[0]
	b = startReplicasNamed(t, fast(srv.Addr), "b", 1, short...)[0]
	rdb := srv.Client()
	key := fmt.Sprintf("kvr:{%s}:replicas", t.Name())
	eventually(t, "both replicas complete, with live watermarks", func() bool {
		marks, err := rdb.HGetAll(context.Background(), key).Result()
		if err != nil || len(marks) != 2 || a.log.Incomplete() || b.log.Incomplete() {
			return false
		}
		for _, v := range marks {
			if len(v) < 10 || v[0] < '0' || v[0] > '9' {
				return false // announced, no watermark yet
			}
		}
		return true
	})
	return a, b, proxy, srv
}

// TestFreeOfABookingNotPublishedYet: replica A, cut off from Redis, books a request; a Free for it
// sent to replica B cannot find the booking, and B answers that it cannot tell (ErrLogUnavailable,
// UNAVAILABLE for the client, which retries) rather than that the request is not booked: A may hold
// it. Once A is back, its booking reaches B, and the same Free frees it everywhere. Before
// watermarks, B waited 100 ms and answered NOT_FOUND; the client gave up, and the booking stayed
// on every replica until it expired.
func TestFreeOfABookingNotPublishedYet(t *testing.T) {
	a, b, proxy, _ := startCutOff(t, func(o *replication.Options) { o.WatermarkWait = 500 * time.Millisecond })
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "B to see the worker", func() bool { return b.state.Worker(wk) != nil })

	proxy.Cut()
	booking := kvstate.Booking{RequestID: "cut-off", At: time.Now().UnixNano(), Hops: []kvstate.HopBooking{{Worker: wk, Blocks: []uint64{1}, PrefillTokens: 16}}}
	if _, err := a.log.Append(ctx, kvstate.Booked{Booking: booking}); err != nil {
		t.Fatalf("A books while cut off = %v, want the booking applied locally", err)
	}
	if _, err := b.log.Append(ctx, kvstate.Freed{RequestID: "cut-off", At: time.Now().UnixNano()}); !errors.Is(err, kvstate.ErrLogUnavailable) {
		t.Fatalf("B frees a booking A holds and cannot publish = %v, want ErrLogUnavailable (A may hold it)", err)
	}
	// A junk id gets the same answer while A is cut off: B cannot tell it from the booking above.
	if _, err := b.log.Append(ctx, kvstate.Freed{RequestID: "junk", At: time.Now().UnixNano()}); !errors.Is(err, kvstate.ErrLogUnavailable) {
		t.Fatalf("B frees an unknown id while A is cut off = %v, want ErrLogUnavailable", err)
	}

	proxy.Heal()
	eventually(t, "the Free, retried on B, to find the booking", func() bool {
		_, err := b.log.Append(ctx, kvstate.Freed{RequestID: "cut-off", At: time.Now().UnixNano()})
		return err == nil
	})
	eventually(t, "A and B to converge with no booking", func() bool {
		return converged(a, b) && a.state.Load().Bookings() == 0 && b.state.Load().Bookings() == 0
	})
	if _, err := b.log.Append(ctx, kvstate.Freed{RequestID: "junk", At: time.Now().UnixNano()}); !errors.Is(err, kvstate.ErrUnknownRequest) {
		t.Errorf("B frees an unknown id once A is back = %v, want ErrUnknownRequest", err)
	}
}

// TestSilentReplicaIsTakenForDead: a replica that stays cut off for longer than ReplicaTimeout no
// longer holds such answers up: a Free for an unknown id is NOT_FOUND again (the replica would
// drop, with the expiry it appended meanwhile, whatever it booked before).
func TestSilentReplicaIsTakenForDead(t *testing.T) {
	const timeout = 2 * time.Second
	_, b, proxy, _ := startCutOff(t, func(o *replication.Options) { o.ReplicaTimeout, o.WatermarkWait = timeout, 300*time.Millisecond })
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	proxy.Cut()
	cut := time.Now()
	if _, err := b.log.Append(ctx, kvstate.Freed{RequestID: "junk", At: time.Now().UnixNano()}); !errors.Is(err, kvstate.ErrLogUnavailable) {
		t.Fatalf("Free of an unknown id right after A was cut off = %v, want ErrLogUnavailable", err)
	}
	eventually(t, "A to be taken for dead", func() bool {
		_, err := b.log.Append(ctx, kvstate.Freed{RequestID: "junk", At: time.Now().UnixNano()})
		return errors.Is(err, kvstate.ErrUnknownRequest)
	})
	// The timeout runs from A's last watermark, written up to an interval (50 ms) before the cut.
	if took := time.Since(cut); took < timeout-200*time.Millisecond {
		t.Errorf("A was taken for dead %v after it was cut off, before ReplicaTimeout %v", took, timeout)
	}
}

// TestStoppedReplicaHoldsNothingUp: a replica that stops cleanly marks its watermark gone, and the
// others answer NOT_FOUND for unknown ids at once, not after ReplicaTimeout.
func TestStoppedReplicaHoldsNothingUp(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client()
	short := func(o *replication.Options) {
		o.ReseedWindow, o.WatermarkWait = 300*time.Millisecond, 300*time.Millisecond
	}
	b := startReplicasNamed(t, rdb, "b", 1, short)[0]
	cctx, stopC := context.WithCancel(context.Background())
	o := replication.Options{Prefix: fmt.Sprintf("kvr:{%s}", t.Name()), Replica: "c", ReadBlock: 100 * time.Millisecond}
	short(&o)
	c := newLog(rdb, kvstate.NewState(), o)
	stopped := make(chan struct{})
	go func() { _ = c.Run(cctx); close(stopped) }()
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	eventually(t, "both complete, and B to know C", func() bool {
		if b.log.Incomplete() || c.Incomplete() {
			return false
		}
		_, err := b.log.Append(ctx, kvstate.Freed{RequestID: "junk", At: time.Now().UnixNano()})
		return errors.Is(err, kvstate.ErrUnknownRequest)
	})
	stopC()
	<-stopped
	start := time.Now()
	if _, err := b.log.Append(ctx, kvstate.Freed{RequestID: "junk", At: time.Now().UnixNano()}); !errors.Is(err, kvstate.ErrUnknownRequest) {
		t.Fatalf("Free of an unknown id after C stopped = %v, want ErrUnknownRequest", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("the answer took %v after C stopped cleanly, want it without waiting for C", took)
	}
}

// TestAppendWithoutReplyIsNotRepeated: replica A's append of a booking reaches Redis but its reply
// is lost (the connection breaks after the command was sent). Replica B frees the booking. When A
// reaches Redis again it does not append the booking a second time: it first reads the stream past
// the failure, where it finds its booking. Before, it appended it again, after the Free, and every
// replica held the booking until it expired.
func TestAppendWithoutReplyIsNotRepeated(t *testing.T) {
	a, b, proxy, srv := startCutOff(t)
	rdb := srv.Client()
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "B to see the worker", func() bool { return b.state.Worker(wk) != nil })
	proxy.MuteReplies()
	if _, err := a.log.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: "once", At: time.Now().UnixNano(),
		Hops: []kvstate.HopBooking{{Worker: wk, Blocks: []uint64{9}}}}}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "B to see the booking that reached Redis", func() bool { return b.state.Load().Booked("once") })
	if _, err := b.log.Append(ctx, kvstate.Freed{RequestID: "once", At: time.Now().UnixNano()}); err != nil {
		t.Fatalf("B frees the booking = %v", err)
	}
	time.Sleep(time.Second) // real time: A's append to Redis times out (300 ms) and is retried meanwhile, without a reply
	proxy.Heal()
	eventually(t, "A and B to converge", func() bool { return converged(a, b) })
	if na, nb := a.state.Load().Bookings(), b.state.Load().Bookings(); na != 0 || nb != 0 {
		t.Errorf("bookings after the Free: A %d, B %d; want 0 (the booking appended again after its Free)", na, nb)
	}
	n := 0
	entries, err := rdb.XRange(ctx, fmt.Sprintf("kvr:{%s}:log", t.Name()), "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		changes, _ := kvstate.DecodeEntry([]byte(e.Values["e"].(string)))
		for _, c := range changes {
			if bk, ok := c.(kvstate.Booked); ok && bk.Booking.RequestID == "once" {
				n++
			}
		}
	}
	if n != 1 {
		t.Errorf("the booking is in the stream %d times, want once", n)
	}
}

// TestFreeRightAfterAReseed: Redis restarts empty while replica A, cut off from it, holds a booking
// it has not published; replica B reseeds the log from its state (which lacks the booking), and a
// new replica C starts. Redis lost every watermark, and C never saw A's: a Free of A's booking sent
// to C is UNAVAILABLE for a while after the reseed (replicas holding changes may not have rejoined),
// not NOT_FOUND; once A is back and has published the booking, the retried Free frees it
// everywhere. Before, C answered NOT_FOUND, and the booking stayed until it expired.
func TestFreeRightAfterAReseed(t *testing.T) {
	a, b, proxy, srv := startCutOff(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*redisTestTimeout)
	defer cancel()
	if _, err := b.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "A to see the worker", func() bool { return a.state.Worker(wk) != nil })
	proxy.Cut()
	if _, err := a.log.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: "on-a", At: time.Now().UnixNano(),
		Hops: []kvstate.HopBooking{{Worker: wk, Blocks: []uint64{3}}}}}); err != nil {
		t.Fatal(err)
	}
	srv.Restart() // empty
	rdb := srv.Client()
	eventually(t, "B to reseed the lost log", func() bool {
		g, _ := rdb.Get(ctx, fmt.Sprintf("kvr:{%s}:generation", t.Name())).Result()
		return strings.Contains(g, "/seeded/") && b.log.Generation() == g
	})
	c := startReplicasNamed(t, rdb, "c", 1, func(o *replication.Options) { o.WatermarkWait = 300 * time.Millisecond })[0]
	eventually(t, "C to join the reseeded log", func() bool { return c.log.Generation() == b.log.Generation() && !c.log.Incomplete() })
	if _, err := c.log.Append(ctx, kvstate.Freed{RequestID: "on-a", At: time.Now().UnixNano()}); !errors.Is(err, kvstate.ErrLogUnavailable) {
		t.Fatalf("Free on C of a booking A holds unpublished, right after the reseed = %v, want ErrLogUnavailable", err)
	}
	proxy.Heal()
	eventually(t, "the Free, retried on C, to find the booking", func() bool {
		_, err := c.log.Append(ctx, kvstate.Freed{RequestID: "on-a", At: time.Now().UnixNano()})
		return err == nil
	})
	eventually(t, "A, B and C to converge with no booking", func() bool {
		return converged(a, b, c) && a.state.Load().Bookings() == 0 && c.state.Load().Bookings() == 0
	})
}
