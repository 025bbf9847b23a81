package server

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/server/auth"
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
	// Each served Watch stays open, reading, until the context ends: the most open at once is what
	// the cap bounds. (A stream that ended early, as when a loaded machine's connection is cut and
	// the client reconnects, frees its slot; that is not a breach, and is logged.)
	var (
		mu         sync.Mutex
		open, most int
		endedEarly []string
		wg         sync.WaitGroup
	)
	for range 3 * healthStreamsPerConn {
		wg.Go(func() {
			w, err := health.Watch(ctx, &healthpb.HealthCheckRequest{})
			if err != nil {
				return
			}
			if _, err := w.Recv(); err != nil {
				return
			}
			mu.Lock()
			open++
			most = max(most, open)
			mu.Unlock()
			for err == nil {
				_, err = w.Recv()
			}
			mu.Lock()
			open--
			if c := status.Code(err); c != codes.Canceled && c != codes.DeadlineExceeded {
				endedEarly = append(endedEarly, err.Error())
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	if len(endedEarly) > 0 {
		t.Logf("Watch streams that ended before the test's deadline, not by it: %q", endedEarly)
	}
	if most != healthStreamsPerConn {
		t.Errorf("%d Watch streams were served at once on one health connection, want %d", most, healthStreamsPerConn)
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

// TestRefusedCallsCutTheConnection: a connection whose calls are refused more than
// max_refused_calls_per_conn times within a second is closed (kvrouter_connections_cut_total): a
// client opening calls without credentials and resetting each at once (HTTP/2 rapid reset) costs
// the router a stream's admission per call, on the connection's reader goroutine, for as long as
// the connection lives. A connection whose calls are admitted is not touched. The cut host's next
// connections are closed before their handshake for cutPenalty: before, the attacker reconnected at
// once, and its handshakes took the frontend's Route p99 past 3x in the abuse suite.
func TestRefusedCallsCutTheConnection(t *testing.T) {
	token := "a-frontend-token"
	sum := sha256.Sum256([]byte(token))
	path := filepath.Join(t.TempDir(), "credentials.yaml")
	if err := os.WriteFile(path, []byte("credentials:\n  - name: fe\n    roles: [frontend, admin]\n    token_sha256: "+hex.EncodeToString(sum[:])+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := auth.New(auth.Options{CredentialsFile: path, Services: Services, RouteMethod: RouteMethod, PublishMethod: PublishMethod})
	if err != nil {
		t.Fatal(err)
	}
	e := newTestEnv(t, func(o *Options) { o.Auth, o.MaxRefusedCallsPerConn = a, 5 })
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go e.srv.Serve(lis)
	addr := lis.Addr().String()

	// A legitimate client on its own connection, before and after.
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	admin := kvrouterv1.NewAdminServiceClient(conn)
	authed := metadata.AppendToOutgoingContext(e.ctx, "authorization", "Bearer "+token)
	if _, err := admin.GetState(authed, &kvrouterv1.GetStateRequest{}); err != nil {
		t.Fatal(err)
	}

	raw, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	if _, err := raw.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(raw, raw)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, f := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", RouteMethod}, {":authority", addr},
		{"content-type", "application/grpc"}, {"te", "trailers"}} {
		_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	closed := make(chan error, 1)
	go func() {
		for {
			if _, err := fr.ReadFrame(); err != nil {
				closed <- err
				return
			}
		}
	}()
	for id := uint32(1); id <= 2*20; id += 2 { // 20 calls without credentials, each reset at once
		if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hb.Bytes(), EndHeaders: true}) != nil ||
			fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
			break // closed already
		}
	}
	select {
	case <-closed:
	case <-time.After(defaultTestTimeout):
		t.Fatalf("the connection resetting 20 refused calls is still open %v later, want it closed past max_refused_calls_per_conn 5", defaultTestTimeout)
	}
	if got := e.counter("kvrouter_connections_cut_total", "", ""); got != 1 {
		t.Errorf("kvrouter_connections_cut_total = %v, want 1", got)
	}
	if _, err := admin.GetState(authed, &kvrouterv1.GetStateRequest{}); err != nil {
		t.Errorf("the legitimate client after the cut: %v", err)
	}

	// The cut host's next connections are closed at once, before any handshake, for the penalty
	// (set long here, so that a slow machine cannot outlast it between the cut and the dial); after
	// it, the host connects again.
	e.srv.conns.penalty.Store(int64(time.Hour))
	again, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	_ = again.SetReadDeadline(time.Now().Add(defaultTestTimeout))
	if _, err := again.Read(make([]byte, 1)); !errors.Is(err, io.EOF) && !isReset(err) {
		t.Fatalf("a connection from the cut host within the penalty read %v, want it closed at once", err)
	}
	e.srv.conns.penalty.Store(int64(time.Millisecond))
	eventually(t, "a connection from the cut host accepted after the penalty", func() bool {
		c, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return false
		}
		defer c.Close()
		_, err = kvrouterv1.NewAdminServiceClient(c).GetState(authed, &kvrouterv1.GetStateRequest{})
		return err == nil
	})
}
