package server

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
)

// scriptedHealth answers Check by the service name asked: "block" waits for release, "panic"
// panics, "fail" returns an error, anything else is SERVING.
type scriptedHealth struct {
	healthpb.UnimplementedHealthServer
	blocked chan struct{} // receives when a "block" call has started
	release chan struct{}
}

func (h *scriptedHealth) Check(_ context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	switch req.GetService() {
	case "block":
		h.blocked <- struct{}{}
		<-h.release
	case "panic":
		panic("scripted panic")
	case "fail":
		return nil, status.Error(codes.FailedPrecondition, "scripted failure")
	}
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

// poolServer serves h through a handler pool of n goroutines, with the server's codec and a
// recovery interceptor, on bufconn; it returns a client and the pool.
func poolServer(t *testing.T, n int, h *scriptedHealth) (healthpb.HealthClient, *handlerPool) {
	t.Helper()
	codec := newLimitingCodec(maxRouteBytes(1000))
	pool := newHandlerPool(n, codec)
	gs := grpc.NewServer(grpc.ForceServerCodecV2(codec), grpc.ChainUnaryInterceptor(recovery.UnaryServerInterceptor(
		recovery.WithRecoveryHandler(func(p any) error { return status.Errorf(codes.Internal, "recovered: %v", p) }))))
	gs.RegisterService(pool.wrap(&healthpb.Health_ServiceDesc), h)
	lis := bufconn.Listen(1 << 20)
	go gs.Serve(lis)
	conn, err := grpc.NewClient("passthrough:///bufconn",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		gs.Stop()
		pool.close()
	})
	return healthpb.NewHealthClient(conn), pool
}

// TestHandlerPool: calls through a handler pool answer as they would without it: responses
// (marshaled on the pooled goroutine) arrive whole, errors keep their status, a panic is recovered
// by the interceptor and the pool keeps serving, and a call that finds every pooled goroutine busy
// runs at once on its own instead of waiting.
func TestHandlerPool(t *testing.T) {
	h := &scriptedHealth{blocked: make(chan struct{}, 1), release: make(chan struct{})}
	client, _ := poolServer(t, 1, h)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	check := func(service string) (*healthpb.HealthCheckResponse, error) {
		return client.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
	}
	for range 100 {
		resp, err := check("")
		if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("Check() = %v, %v; want SERVING", resp, err)
		}
	}
	if _, err := check("fail"); status.Code(err) != codes.FailedPrecondition || status.Convert(err).Message() != "scripted failure" {
		t.Errorf("Check(fail) = %v, want FailedPrecondition: scripted failure", err)
	}
	if _, err := check("panic"); status.Code(err) != codes.Internal {
		t.Errorf("Check(panic) = %v, want Internal from the recovery interceptor", err)
	}
	if resp, err := check(""); err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Check() after a panic = %v, %v; want SERVING", resp, err)
	}

	// The one pooled goroutine blocks; other calls still run, each on its own goroutine.
	done := make(chan error, 1)
	go func() {
		_, err := check("block")
		done <- err
	}()
	<-h.blocked
	for range 10 {
		if resp, err := check(""); err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("Check() beside a blocked call = %v, %v; want SERVING", resp, err)
		}
	}
	close(h.release)
	if err := <-done; err != nil {
		t.Errorf("Check(block) = %v after release, want SERVING", err)
	}
}

// TestHandlerPoolClose: close joins the pooled goroutines (goleak checks at the end), may be
// called twice, and calls after it still run, on their own goroutines.
func TestHandlerPoolClose(t *testing.T) {
	client, pool := poolServer(t, 4, &scriptedHealth{})
	pool.close()
	pool.close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if resp, err := client.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Check() after close = %v, %v; want SERVING", resp, err)
	}
}
