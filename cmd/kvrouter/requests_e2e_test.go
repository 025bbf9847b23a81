package main

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// TestUnknownRequestBothModes: MarkPrefillComplete and Free for a request id nobody booked answer
// NOT_FOUND, with the same message, in embedded mode and in Redis mode, and in Redis mode they append
// nothing to the shared stream. A request booked on one replica and ended on another at once is
// found there.
func TestUnknownRequestBothModes(t *testing.T) {
	t.Run("embedded", func(t *testing.T) {
		a := startProcess(t, buildBinary(t))
		testUnknownRequests(t, a, a, nil)
	})
	onEveryRedis(t, func(t *testing.T, r redisTarget) {
		bin := buildBinary(t)
		// A new deployment's log is fresh: until its reseed window is over, a replica that lost
		// state could still replace it, and an unknown request is UNAVAILABLE, not NOT_FOUND.
		window := []string{"--redis-reseed-window", "1s"}
		a := startProcess(t, bin, append(append(r.flags, window...), "--replica-id", "a")...)
		b := startProcess(t, bin, append(append(r.flags, window...), "--replica-id", "b")...)
		steady(t, a.addr, b.addr)
		testUnknownRequests(t, a, b, &r)
	})
}

func testUnknownRequests(t *testing.T, a, b *serverProcess, r *redisTarget) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout)
	defer cancel()
	w := &worker{t: t, id: 1, acked: -1}
	w.connect(ctx, a.addr)
	if !w.publish() {
		t.Fatal("publishing failed")
	}
	routerA := kvrouterv1.NewRouterServiceClient(dial(t, a.addr))
	routerB := kvrouterv1.NewRouterServiceClient(dial(t, b.addr))
	streamLen := func() int64 {
		if r == nil {
			return 0
		}
		n, err := r.client.XLen(ctx, defaultStream).Result()
		if err != nil {
			t.Fatalf("XLEN = %v", err)
		}
		return n
	}

	// 1,000 junk calls, 100 at a time (in Redis mode each waits a moment for a booking that may be
	// on its way from another replica).
	before := streamLen()
	var wg sync.WaitGroup
	for i := range 1000 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprintf("junk-%d", i)
			want := fmt.Sprintf("request_id %q: request is not booked (never booked, already freed, or expired)", id)
			var err error
			if i%2 == 0 {
				_, err = routerB.Free(ctx, &kvrouterv1.FreeRequest{RequestId: id})
			} else {
				_, err = routerB.MarkPrefillComplete(ctx, &kvrouterv1.MarkPrefillCompleteRequest{RequestId: id})
			}
			if st, _ := status.FromError(err); st.Code() != codes.NotFound || st.Message() != want {
				t.Errorf("ending unknown request %s = %v %q, want NOT_FOUND %q", id, st.Code(), st.Message(), want)
			}
		}()
		if i%100 == 99 {
			wg.Wait()
		}
	}
	if after := streamLen(); after != before {
		t.Errorf("the shared stream grew from %d to %d entries on 1,000 calls for unknown requests, want no entry", before, after)
	}

	// Booked on A, ended on B right away.
	for i := range 50 {
		id := fmt.Sprintf("req-%d", i)
		if _, err := routerA.Route(ctx, &kvrouterv1.RouteRequest{RequestId: id, Model: "m", TokenIds: []uint32{1, 0, 1, 2}}); err != nil {
			t.Fatalf("Route(%s) on A = %v", id, err)
		}
		if _, err := routerB.MarkPrefillComplete(ctx, &kvrouterv1.MarkPrefillCompleteRequest{RequestId: id}); err != nil {
			t.Fatalf("MarkPrefillComplete(%s) on B right after A booked it = %v, want OK", id, err)
		}
		if _, err := routerB.Free(ctx, &kvrouterv1.FreeRequest{RequestId: id}); err != nil {
			t.Fatalf("Free(%s) on B = %v, want OK", id, err)
		}
	}
	if _, err := routerA.Free(ctx, &kvrouterv1.FreeRequest{RequestId: "req-0"}); status.Code(err) != codes.NotFound {
		t.Fatalf("Free(req-0) again, on A = %v, want NOT_FOUND", err)
	}
}
