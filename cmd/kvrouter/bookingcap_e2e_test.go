package main

import (
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
)

// TestBookingsPerCredentialInEveryLayout: what one credential's bookings hold is bounded
// (max_booked_blocks_per_credential) on every replica, counting the bookings the credential made
// on the others, while another credential keeps its room; a Free makes room again. Before, one
// frontend credential could book until max_booked_blocks was full and every other caller was
// refused. Embedded, one Redis log, and sharded by model: one call, one answer.
func TestBookingsPerCredentialInEveryLayout(t *testing.T) {
	layouts := []struct {
		name  string
		flags func(t *testing.T) []string // nil: embedded, one replica
	}{
		{"embedded", nil},
		{"one Redis log", func(t *testing.T) []string { return []string{"--redis-addr", redistest.Start(t).Addr} }},
		{"sharded by model", func(t *testing.T) []string {
			return []string{"--redis-addr", redistest.Start(t).Addr, "--redis-shard-by-model"}
		}},
	}
	// Worker 7 has block size 4: a 64-token prompt books 16 blocks, and a bound of 40 holds two.
	prompt := make([]uint32, 64)
	for i := range prompt {
		prompt[i] = uint32(i + 1)
	}
	for _, layout := range layouts {
		t.Run(layout.name, func(t *testing.T) {
			flags := []string{"--max-booked-blocks-per-credential", "40"}
			a := startSecureRouter(t, flags...)
			b := a
			if layout.flags != nil {
				flags = append(flags, layout.flags(t)...)
				a = startSecureRouter(t, append(flags, "--replica-id", "a")...)
				b = startSecureRouter(t, append(flags, "--replica-id", "b")...)
			}
			a.serveLlama()
			routerA, routerB := kvrouterv1.NewRouterServiceClient(a.dial(nil)), kvrouterv1.NewRouterServiceClient(b.dial(nil))
			adminB := kvrouterv1.NewAdminServiceClient(b.dial(nil))
			route := func(r *secureRouter, router kvrouterv1.RouterServiceClient, as, id string) error {
				ctx, cancel := r.as(as)
				defer cancel()
				_, err := router.Route(ctx, &kvrouterv1.RouteRequest{RequestId: id, Model: "llama", TokenIds: prompt})
				return err
			}
			free := func(id string) error {
				ctx, cancel := b.as("frontend")
				defer cancel()
				_, err := routerB.Free(ctx, &kvrouterv1.FreeRequest{RequestId: id})
				return err
			}
			for _, id := range []string{"r1", "r2"} {
				if err := route(a, routerA, "frontend", id); err != nil {
					t.Fatalf("Route(%s) on A = %v, want booked", id, err)
				}
			}
			if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
				ctx, cancel := b.as("ops")
				defer cancel()
				st, err := adminB.GetState(ctx, &kvrouterv1.GetStateRequest{})
				return err == nil && st.GetBookings() == 2
			}) {
				t.Fatal("B never held A's two bookings")
			}
			err := route(b, routerB, "frontend", "r3")
			if got, want := bookingRefusal(err), "ResourceExhausted CREDENTIAL_BOOKINGS_FULL retry"; got != want {
				t.Fatalf("a third booking of the credential on B = %v (%s), want %s", err, got, want)
			}
			if err := route(b, routerB, "frontend-slow", "other"); err != nil {
				t.Errorf("another credential's booking on B = %v, want booked", err)
			}
			if err := free("r1"); err != nil {
				t.Fatal(err)
			}
			if err := route(b, routerB, "frontend", "r3"); err != nil {
				t.Errorf("the credential's booking on B after a Free = %v, want booked", err)
			}
			for _, id := range []string{"r2", "r3", "other"} {
				if err := free(id); err != nil {
					t.Errorf("Free(%s) = %v", id, err)
				}
			}
		})
	}
}

// bookingRefusal sums up a refusal: its code, ErrorInfo reason, and "retry" when it carries
// RetryInfo.
func bookingRefusal(err error) string {
	st := status.Convert(err)
	out := st.Code().String()
	if st.Code() == codes.OK {
		return out
	}
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			out += " " + d.GetReason()
		case *errdetails.RetryInfo:
			out += " retry"
		}
	}
	return out
}
