package kvstate

import (
	"testing"
)

// TestReplicasAgreeWhateverTheOrder: the replica that routed a request applies its booking and the
// request's end first (local-first), and a worker removal or a booking expiry from the log after;
// every other replica applies the same changes in log order, where the removal or the expiry came
// first. Once the request is freed, every replica holds the same state: no booking, the session
// bound alike, nothing remembered of the request. Before, the other replicas kept a record of the
// Free (a tombstone, for a booking that would never come) until some booking outlived the booking
// expiry, so their digests differed from the routing replica's for good.
func TestReplicasAgreeWhateverTheOrder(t *testing.T) {
	booking := Booking{RequestID: "r", At: 10, Model: testModel, Session: "chat", SessionExpires: 1000,
		Hops: []HopBooking{{Worker: w1, PrefillTokens: 64}, {Worker: w0r0, Blocks: []uint64{1, 2}}}}
	for _, tt := range []struct {
		name  string
		cause Change // applied after the request on the routing replica, before it on the others
	}{
		{"every hop's worker removed", nil},
		{"the prefill worker removed", WorkerRemoved{Key: w1}},
		{"the booking expired", BookingsExpired{Before: 20}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			causes := []Change{tt.cause}
			if tt.cause == nil {
				causes = []Change{WorkerRemoved{Key: w1}, WorkerRemoved{Key: w0r0}}
			}
			routing, other := NewState(), NewState()
			for _, s := range []*State{routing, other} {
				run(t, s, []step{up(w0r0), up(w1)})
			}
			// The routing replica: its booking and its Free at once, then the log's changes (its own
			// echoes skipped).
			for _, c := range []Change{Booked{Booking: booking}, PrefillDone{RequestID: "r"}, Freed{RequestID: "r"}} {
				if _, err := routing.Apply(c); err != nil {
					t.Fatalf("routing replica: Apply(%T) = %v", c, err)
				}
			}
			for _, c := range causes {
				if _, err := routing.ApplyReplicated(c); err != nil {
					t.Fatalf("routing replica: ApplyReplicated(%T) = %v", c, err)
				}
			}
			// Any other replica: the log's order.
			for _, c := range append(causes, Booked{Booking: booking}, PrefillDone{RequestID: "r"}, Freed{RequestID: "r"}) {
				if _, err := other.ApplyReplicated(c); err != nil {
					t.Fatalf("other replica: ApplyReplicated(%T) = %v", c, err)
				}
			}
			for name, s := range map[string]*State{"routing": routing, "other": other} {
				if n := s.Load().Bookings(); n != 0 {
					t.Errorf("%s replica holds %d bookings after the Free, want 0", name, n)
				}
				if w, ok := s.Session(testModel, "chat", 0); !ok || w != w0r0 {
					t.Errorf("%s replica: session bound to %v, %v; want %v", name, w, ok, w0r0)
				}
			}
			if routing.Digest() != other.Digest() {
				t.Error("the replicas' digests differ once the request was freed")
			}
		})
	}
}
