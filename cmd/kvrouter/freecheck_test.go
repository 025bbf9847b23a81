package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// freeCheck watches the Free calls of the booking load (fleet.bookOn) on one connection and keeps
// those a router must never give: NOT_FOUND for a request the fleet booked, when no earlier call for
// it may have freed it (every earlier one was answered, UNAVAILABLE). Such an answer leaves the
// booking on every replica. It is the booking-left column's cause, named with the request, the
// replica and the time, so that a failure in CI can be traced in the replicas' logs.
type freeCheck struct {
	addr string

	mu        sync.Mutex
	uncertain map[string]bool // request ids whose earlier Free may have gone through
	wrong     []string        // the answers a router must not give, first few
	nWrong    int
}

// interceptor records each Free's outcome.
func (c *freeCheck) interceptor(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	err := invoker(ctx, method, req, reply, cc, opts...)
	free, ok := req.(*kvrouterv1.FreeRequest)
	if !ok {
		return err
	}
	id := free.GetRequestId()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.uncertain == nil {
		c.uncertain = make(map[string]bool)
	}
	switch code := status.Code(err); {
	case code == codes.OK:
		delete(c.uncertain, id)
	case code == codes.NotFound && !c.uncertain[id]:
		c.nWrong++
		if len(c.wrong) < 5 {
			c.wrong = append(c.wrong, fmt.Sprintf("%s Free(%s) on %s = %v", time.Now().Format("15:04:05.000"), id, c.addr, err))
		}
	case code == codes.NotFound:
		delete(c.uncertain, id)
	case code != codes.Unavailable:
		c.uncertain[id] = true // a deadline or a broken connection: the call may have been applied
	}
	return err
}

// report returns how many Free calls were answered NOT_FOUND for a booking that existed, and the
// first few.
func (c *freeCheck) report() (int, []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nWrong, append([]string(nil), c.wrong...)
}
