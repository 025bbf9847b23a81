package server

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// serveHealthLoopback serves e's health port on a loopback listener until the test ends, and
// returns its address.
func (e *testEnv) serveHealthLoopback() string {
	e.t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		e.t.Fatal(err)
	}
	go e.srv.ServeHealth(lis)
	return lis.Addr().String()
}

// TestHealthPortLimits: the health port takes callers without credentials, so one caller must not
// grow what it holds. Past health_max_connections a new connection is closed at once (counted),
// and the ones held keep working; one connection holds at most healthStreamsPerConn streams (a
// Watch holds one for as long as it wants). Before, one connection opened 50,000 streams (+560 MiB).
func TestHealthPortLimits(t *testing.T) {
	e := newTestEnv(t, func(o *Options) { o.HealthMaxConnections = 2 })
	addr := e.serveHealthLoopback()
	var held []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		held = append(held, c)
	}
	eventually(t, "the two connections held", func() bool { return e.gauge("kvrouter_connections", "port", "health") == 2 })
	extra, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	_ = extra.SetReadDeadline(time.Now().Add(defaultTestTimeout))
	if _, err := extra.Read(make([]byte, 1)); !errors.Is(err, io.EOF) && !isReset(err) {
		t.Fatalf("a third connection past health_max_connections 2 read %v, want it closed at once", err)
	}
	if got := e.counter("kvrouter_connections_refused_total", "port", "health"); got != 1 {
		t.Errorf("kvrouter_connections_refused_total{port=health} = %v, want 1", got)
	}
	for _, c := range held {
		c.Close()
	}
	eventually(t, "the slots given back", func() bool { return e.gauge("kvrouter_connections", "port", "health") == 0 })

	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	// A first call, so that the client has the server's settings (its stream cap) before the
	// Watches open: streams opened before are refused by the server and retried, in any order.
	if _, err := health.Check(e.ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var watching atomic.Int32
	var wg sync.WaitGroup
	for range 3 * healthStreamsPerConn {
		wg.Go(func() {
			w, err := health.Watch(ctx, &healthpb.HealthCheckRequest{})
			if err != nil {
				return
			}
			if _, err := w.Recv(); err == nil {
				watching.Add(1)
			}
		})
	}
	wg.Wait()
	if got := watching.Load(); got != healthStreamsPerConn {
		t.Errorf("%d Watch streams were served at once on one health connection, want %d", got, healthStreamsPerConn)
	}
}

// isReset reports whether err is a connection reset by the peer.
func isReset(err error) bool { return err != nil && strings.Contains(err.Error(), "connection reset") }

// TestConnectionAndHeaderLimits: the gRPC port holds at most max_connections connections (one past
// it is closed at once, counted), and refuses a call whose headers pass max_header_list_bytes before
// it reads them (before, 5 MB authorization headers were taken in, before authentication).
func TestConnectionAndHeaderLimits(t *testing.T) {
	e := newTestEnv(t, func(o *Options) { o.MaxConnections = 2; o.MaxHeaderListBytes = 4 << 10 })
	// e's own client holds one connection of its listener once it calls.
	if _, err := e.admin.GetState(e.ctx, &kvrouterv1.GetStateRequest{}); err != nil {
		t.Fatal(err)
	}
	big := metadata.AppendToOutgoingContext(e.ctx, "x-padding", strings.Repeat("a", 8<<10))
	if _, err := e.admin.GetState(big, &kvrouterv1.GetStateRequest{}); err == nil {
		t.Errorf("GetState with 8 KiB of headers, past max_header_list_bytes 4 KiB = ok, want it refused")
	}
	if _, err := e.admin.GetState(e.ctx, &kvrouterv1.GetStateRequest{}); err != nil {
		t.Errorf("GetState after the refused call = %v, want the connection still serving", err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go e.srv.Serve(lis) // a second listener: its own cap, and the same gauge
	for range 2 {
		held, err := net.Dial("tcp", lis.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer held.Close()
	}
	eventually(t, "three connections held", func() bool { return e.gauge("kvrouter_connections", "port", "grpc") == 3 })
	extra, err := net.Dial("tcp", lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	_ = extra.SetReadDeadline(time.Now().Add(defaultTestTimeout))
	if _, err := extra.Read(make([]byte, 1)); !errors.Is(err, io.EOF) && !isReset(err) {
		t.Fatalf("a connection past max_connections 2 read %v, want it closed at once", err)
	}
	if got := e.counter("kvrouter_connections_refused_total", "port", "grpc"); got != 1 {
		t.Errorf("kvrouter_connections_refused_total{port=grpc} = %v, want 1", got)
	}
}
