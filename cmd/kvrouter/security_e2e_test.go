package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/server/servertest/testpki"
)

// secureRouter is a `kvrouter serve` with TLS, client certificates and a credentials file, and what
// its callers hold.
type secureRouter struct {
	t         *testing.T
	proc      *serverProcess
	dir       string
	ca        *testpki.CA
	caFile    string
	credsFile string
	tokens    map[string]string // credential name -> bearer token
}

// newToken returns a random bearer token.
func newToken(t *testing.T) string {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return "kvr_" + hex.EncodeToString(b)
}

func sha256Hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// writeCredentials replaces the credentials file atomically, as a secret volume's update does.
// Each entry's {token:NAME} stands for the SHA-256 of NAME's token.
func (r *secureRouter) writeCredentials(content string) {
	r.t.Helper()
	for name, tok := range r.tokens {
		content = strings.ReplaceAll(content, "{token:"+name+"}", sha256Hex(tok))
	}
	tmp := r.credsFile + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		r.t.Fatal(err)
	}
	if err := os.Rename(tmp, r.credsFile); err != nil {
		r.t.Fatal(err)
	}
}

const testCredentials = `credentials:
  - name: frontend
    roles: [frontend]
    token_sha256: {token:frontend}
  - name: frontend-slow
    roles: [frontend]
    token_sha256: {token:frontend-slow}
    route_rate_limit: 1
  - name: worker-7
    roles: [worker]
    token_sha256: {token:worker-7}
    worker_ids: [7]
    models: [llama]
  - name: worker-8
    roles: [worker]
    identity: spiffe://fleet/worker/8
    worker_ids: [8]
    event_rate_limit: 10
    max_publish_streams: 1
  - name: ops
    roles: [admin]
    token_sha256: {token:ops}
`

// startSecureRouter starts kvrouter with TLS, optional client certificates (tls_client_auth
// optional: a certificate, when given, must verify) and testCredentials, reloading files every
// 50 ms, with reflection closed to callers without credentials.
func startSecureRouter(t *testing.T, extra ...string) *secureRouter {
	t.Helper()
	dir := t.TempDir()
	r := &secureRouter{t: t, dir: dir, ca: testpki.NewCA(t, "kvrouter test CA"), credsFile: filepath.Join(dir, "credentials.yaml"),
		tokens: map[string]string{}}
	for _, name := range []string{"frontend", "frontend-slow", "worker-7", "ops", "stranger"} {
		r.tokens[name] = newToken(t)
	}
	r.caFile = r.ca.WriteCert(t, dir, "ca.crt")
	cert, key := r.ca.Server(t).Write(t, dir, "server")
	r.writeCredentials(testCredentials)
	args := append([]string{"--tls-cert-file", cert, "--tls-key-file", key, "--tls-client-ca-file", r.caFile, "--tls-client-auth", "optional",
		"--credentials-file", r.credsFile, "--file-reload-interval", "50ms", "--auth-open-reflection=false", "--log-level", "debug"}, extra...)
	// Health checks carry the operator's token: the tests may close health to callers without one.
	dial, err := kvclient.DialCredentials(kvclient.CredentialOptions{CAFile: r.caFile, ServerName: "localhost", Token: r.tokens["ops"]})
	if err != nil {
		t.Fatal(err)
	}
	r.proc = startProcessWith(t, buildBinary(t), dial, args...)
	return r
}

// serveLlama registers worker 7 for llama, for the test's length, so that Route has a worker.
func (r *secureRouter) serveLlama() {
	r.t.Helper()
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+r.tokens["worker-7"]))
	r.t.Cleanup(cancel)
	if _, err := register(ctx, r.dial(nil), 7, "llama"); err != nil {
		r.t.Fatalf("registering worker 7 = %v", err)
	}
}

// clientTLS trusts the router's CA and presents cert when given.
func (r *secureRouter) clientTLS(cert *testpki.Leaf) *tls.Config {
	c := &tls.Config{RootCAs: r.ca.Pool(), ServerName: "localhost", MinVersion: tls.VersionTLS12}
	if cert != nil {
		c.Certificates = []tls.Certificate{cert.TLS(r.t)}
	}
	return c
}

// dial connects over TLS, presenting cert when given.
func (r *secureRouter) dial(cert *testpki.Leaf) *grpc.ClientConn {
	r.t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+r.proc.addr, grpc.WithTransportCredentials(credentials.NewTLS(r.clientTLS(cert))))
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { conn.Close() })
	return conn
}

// as returns a context that sends name's bearer token ("" sends none).
func (r *secureRouter) as(name string) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	if name != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+r.tokens[name])
	}
	return ctx, cancel
}

// router returns a function that sends a query-only llama Route on conn as name and returns its error.
func (r *secureRouter) router(conn *grpc.ClientConn) func(name string) error {
	router := kvrouterv1.NewRouterServiceClient(conn)
	return func(name string) error {
		ctx, cancel := r.as(name)
		defer cancel()
		_, err := router.Route(ctx, llamaRoute())
		return err
	}
}

func llamaRoute() *kvrouterv1.RouteRequest {
	return &kvrouterv1.RouteRequest{RequestId: "r", Model: "llama", TokenIds: []uint32{1, 2, 3, 4, 5, 6, 7, 8}, QueryOnly: true}
}

func helloFor(id uint64, model string) *kvrouterv1.PublishRequest {
	return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
		WorkerId: id, Model: model, Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 4,
		TotalKvBlocks: 1000, KvEventsEnabled: true, Endpoint: fmt.Sprintf("w%d", id)}}}
}

// register opens a Publish stream on conn and sends a hello; it returns the stream and the
// registration's outcome (nil: registered).
func register(ctx context.Context, conn *grpc.ClientConn, id uint64, model string) (grpc.BidiStreamingClient[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse], error) {
	stream, err := kvrouterv1.NewWorkerServiceClient(conn).Publish(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(helloFor(id, model)); err != nil {
		_, err = stream.Recv()
		return nil, err
	}
	resp, err := stream.Recv()
	if err == nil && resp.GetRegistered() == nil {
		err = fmt.Errorf("first answer %v, want Registered", resp)
	}
	return stream, err
}

// wantCode checks err's status code and that its message holds every part of want.
func wantCode(t *testing.T, what string, err error, code codes.Code, want ...string) {
	t.Helper()
	st, _ := status.FromError(err)
	if st.Code() != code {
		t.Errorf("%s: %v, want %v", what, err, code)
		return
	}
	for _, w := range want {
		if !strings.Contains(st.Message(), w) {
			t.Errorf("%s: message %q lacks %q", what, st.Message(), w)
		}
	}
}

// TestOnlyTheRightCallersIn: with a credentials file, a call without credentials is UNAUTHENTICATED
// on every service but health (reflection closed too, as configured); each role reaches its own service only; a worker publishes only for
// its own worker ids and models, by token or by its client certificate's identity; and no secret
// shows in the answers, the log or GetConfig.
func TestOnlyTheRightCallersIn(t *testing.T) {
	r := startSecureRouter(t)
	conn := r.dial(nil)
	router, admin := kvrouterv1.NewRouterServiceClient(conn), kvrouterv1.NewAdminServiceClient(conn)

	t.Run("no credentials", func(t *testing.T) {
		ctx, cancel := r.as("")
		defer cancel()
		_, err := router.Route(ctx, llamaRoute())
		wantCode(t, "Route", err, codes.Unauthenticated, "no credentials", "authorization: Bearer")
		_, err = admin.ListWorkers(ctx, &kvrouterv1.ListWorkersRequest{})
		wantCode(t, "ListWorkers", err, codes.Unauthenticated)
		_, err = register(ctx, conn, 7, "llama")
		wantCode(t, "Publish", err, codes.Unauthenticated)
		refl, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
		if err == nil {
			_ = refl.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}})
			_, err = refl.Recv()
		}
		wantCode(t, "reflection", err, codes.Unauthenticated)
		resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("health without credentials = %v, %v; want SERVING (open by default)", resp, err)
		}
	})

	t.Run("wrong token", func(t *testing.T) {
		ctx, cancel := r.as("stranger") // a well-formed token the file does not hold
		defer cancel()
		_, err := router.Route(ctx, llamaRoute())
		wantCode(t, "Route", err, codes.Unauthenticated, "invalid bearer token")
		if strings.Contains(err.Error(), r.tokens["stranger"]) {
			t.Errorf("the refusal echoes the token: %v", err)
		}
		bad := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Basic dXNlcjpwYXNz")
		_, err = router.Route(bad, llamaRoute())
		wantCode(t, "Route with Basic auth", err, codes.Unauthenticated, `must be "Bearer <token>"`)
	})

	t.Run("worker", func(t *testing.T) {
		ctx, cancel := r.as("worker-7")
		defer cancel()
		_, err := router.Route(ctx, llamaRoute())
		wantCode(t, "worker calls Route", err, codes.PermissionDenied, `credential "worker-7" (role worker) may not call /kvrouter.v1.RouterService/Route: it needs role frontend`)
		_, err = admin.GetConfig(ctx, &kvrouterv1.GetConfigRequest{})
		wantCode(t, "worker reads AdminService", err, codes.PermissionDenied, "needs role admin")
		_, err = register(ctx, conn, 8, "llama")
		wantCode(t, "worker 7 publishes for worker 8", err, codes.PermissionDenied, `credential "worker-7" may publish for worker ids [7], not 8`)
		_, err = register(ctx, conn, 7, "mistral")
		wantCode(t, "worker 7 publishes for another model", err, codes.PermissionDenied, `not "mistral"`)
		if _, err := register(ctx, conn, 7, "llama"); err != nil {
			t.Fatalf("worker 7 registers as worker 7 = %v", err)
		}
	})

	t.Run("worker by client certificate", func(t *testing.T) {
		certConn := r.dial(r.ca.Client(t, "spiffe://fleet/worker/8"))
		ctx, cancel := r.as("")
		defer cancel()
		// (worker-8 may hold one stream at a time: a refused one has ended when its status arrives.)
		_, err := register(ctx, certConn, 7, "llama")
		wantCode(t, "worker 8 publishes for worker 7", err, codes.PermissionDenied, `"worker-8" may publish for worker ids [8], not 7`)
		if _, err := register(ctx, certConn, 8, "llama"); err != nil {
			t.Fatalf("worker 8 registers by its certificate = %v", err)
		}
		_, err = kvrouterv1.NewRouterServiceClient(certConn).Route(ctx, llamaRoute())
		wantCode(t, "worker 8 calls Route", err, codes.PermissionDenied)
		unknown := r.dial(r.ca.Client(t, "spiffe://fleet/nobody"))
		_, err = kvrouterv1.NewRouterServiceClient(unknown).Route(ctx, llamaRoute())
		wantCode(t, "a certificate no credential names", err, codes.Unauthenticated, "spiffe://fleet/nobody", "match no credential")
	})

	t.Run("frontend", func(t *testing.T) {
		ctx, cancel := r.as("frontend")
		defer cancel()
		_, err := register(ctx, conn, 7, "llama")
		wantCode(t, "frontend publishes", err, codes.PermissionDenied, "needs role worker")
		_, err = admin.ListWorkers(ctx, &kvrouterv1.ListWorkersRequest{})
		wantCode(t, "frontend reads AdminService", err, codes.PermissionDenied)
		if _, err := router.Route(ctx, llamaRoute()); err != nil {
			t.Errorf("frontend routes = %v", err)
		}
	})

	t.Run("admin", func(t *testing.T) {
		ctx, cancel := r.as("ops")
		defer cancel()
		resp, err := admin.GetConfig(ctx, &kvrouterv1.GetConfigRequest{})
		if err != nil {
			t.Fatalf("admin GetConfig = %v", err)
		}
		for _, e := range resp.GetEntries() {
			for name, tok := range r.tokens {
				if strings.Contains(e.GetValue(), tok) || strings.Contains(e.GetValue(), sha256Hex(tok)) {
					t.Errorf("GetConfig %s shows %s's token or its hash", e.GetKey(), name)
				}
			}
		}
		_, err = router.Route(ctx, llamaRoute())
		wantCode(t, "admin routes", err, codes.PermissionDenied, "needs role frontend")
	})

	for name, tok := range r.tokens {
		if strings.Contains(r.proc.logs.String(), tok) || strings.Contains(r.proc.logs.String(), sha256Hex(tok)) {
			t.Errorf("the server log shows %s's token or its hash", name)
		}
	}
}

// TestMutualTLSHandshake: with client certificates required, a certificate from another CA, and
// none at all, fail the handshake; one from the configured CA passes it.
func TestMutualTLSHandshake(t *testing.T) {
	dir := t.TempDir()
	ca, other := testpki.NewCA(t, "fleet CA"), testpki.NewCA(t, "someone else's CA")
	caFile := ca.WriteCert(t, dir, "ca.crt")
	cert, key := ca.Server(t).Write(t, dir, "server")
	good := ca.Client(t, "spiffe://fleet/frontend")
	client := func(leaf *testpki.Leaf) *tls.Config {
		c := &tls.Config{RootCAs: ca.Pool(), ServerName: "localhost"}
		if leaf != nil {
			c.Certificates = []tls.Certificate{leaf.TLS(t)}
		}
		return c
	}
	p := startProcessWith(t, buildBinary(t), []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(client(good)))},
		"--tls-cert-file", cert, "--tls-key-file", key, "--tls-client-ca-file", caFile)
	for _, tt := range []struct {
		name string
		cert *testpki.Leaf
		ok   bool
	}{
		{"a certificate from the configured CA", good, true},
		{"a certificate from another CA", other.Client(t, "spiffe://fleet/frontend"), false},
		{"no certificate", nil, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			conn, err := grpc.NewClient("passthrough:///"+p.addr, grpc.WithTransportCredentials(credentials.NewTLS(client(tt.cert))))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
			switch {
			case tt.ok && err != nil:
				t.Errorf("health = %v, want SERVING", err)
			case !tt.ok && status.Code(err) != codes.Unavailable:
				t.Errorf("health = %v, want the handshake to fail (UNAVAILABLE)", err)
			}
		})
	}
	p.logs.waitLine(t, `"mutual_tls":true`)
}

// TestRotationWithoutRestart: a replaced server certificate is served to the next connection, and a
// replaced credentials file lets the new token in and the revoked one no more, without a restart; a
// broken replacement changes nothing.
func TestRotationWithoutRestart(t *testing.T) {
	r := startSecureRouter(t)
	r.serveLlama()
	servedSerial := func() string {
		t.Helper()
		conn := r.dial(nil) // a new connection: a new handshake
		var p peer.Peer
		ctx, cancel := r.as("")
		defer cancel()
		if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Peer(&p)); err != nil {
			t.Fatalf("health = %v", err)
		}
		return p.AuthInfo.(credentials.TLSInfo).State.PeerCertificates[0].SerialNumber.String()
	}
	before := servedSerial()
	rotated := r.ca.Server(t)
	rotated.Write(t, r.dir, "server")
	if !kvtest.Poll(10*time.Second, 20*time.Millisecond, func() bool { return servedSerial() == rotated.Cert.SerialNumber.String() }) {
		t.Fatalf("served certificate %s after the rotation, want the new %s (the old was %s)", servedSerial(), rotated.Cert.SerialNumber, before)
	}

	route := r.router(r.dial(nil))
	if err := route("frontend"); err != nil {
		t.Fatalf("frontend before the rotation = %v", err)
	}
	// The frontend's token is revoked; "stranger" gets the frontend role.
	r.writeCredentials(strings.Replace(testCredentials, "token_sha256: {token:frontend}\n", "token_sha256: {token:stranger}\n", 1))
	if !kvtest.Poll(10*time.Second, 20*time.Millisecond, func() bool { return route("stranger") == nil }) {
		t.Fatalf("the new token after the rotation = %v, want accepted", route("stranger"))
	}
	wantCode(t, "the revoked token", route("frontend"), codes.Unauthenticated, "invalid bearer token")

	// A broken file (a truncated write, say) leaves the last good version in force.
	if err := os.WriteFile(r.credsFile, []byte("credentials:\n  - name: [oops\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if !kvtest.Poll(10*time.Second, 20*time.Millisecond, func() bool {
		return strings.Contains(r.proc.logs.String(), "credentials file not reloaded; the previous version stays in force")
	}) {
		t.Fatalf("no log line about the broken credentials file:\n%s", r.proc.logs)
	}
	if err := route("stranger"); err != nil {
		t.Errorf("after a broken credentials file, the last good version = %v, want it still in force", err)
	}
}

// retryDelay is the RetryInfo delay of a RESOURCE_EXHAUSTED status, or -1 without one.
func retryDelay(err error) time.Duration {
	for _, d := range status.Convert(err).Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			return ri.GetRetryDelay().AsDuration()
		}
	}
	return -1
}

// TestPerCredentialLimits: a credential over its Route rate gets RESOURCE_EXHAUSTED with RetryInfo
// while another goes on unaffected; a worker over its event rate is refused the same way, and one
// over its Publish stream bound is refused a second stream.
func TestPerCredentialLimits(t *testing.T) {
	r := startSecureRouter(t, "--max-batch-blocks", "64")
	conn := r.dial(nil)
	r.serveLlama()
	route := r.router(conn)

	t.Run("route rate", func(t *testing.T) {
		// frontend-slow may make 1 call a second, after a burst of 1.
		var err error
		for i := 0; i < 5 && err == nil; i++ {
			err = route("frontend-slow")
		}
		wantCode(t, "frontend-slow over its rate", err, codes.ResourceExhausted, `credential "frontend-slow" is over its Route rate limit (1 calls/s)`)
		if d := retryDelay(err); d <= 0 || d > time.Second {
			t.Errorf("RetryInfo delay %v, want in (0, 1s]", d)
		}
		for i := 0; i < 20; i++ {
			if err := route("frontend"); err != nil {
				t.Fatalf("frontend, unlimited, call %d while frontend-slow is limited = %v", i, err)
			}
		}
	})

	t.Run("event rate and streams", func(t *testing.T) {
		// worker-8 may publish 10 blocks a second, after a burst of one whole message (64 blocks),
		// on one stream at a time.
		certConn := r.dial(r.ca.Client(t, "spiffe://fleet/worker/8"))
		ctx, cancel := r.as("")
		defer cancel()
		stream, err := register(ctx, certConn, 8, "llama")
		if err != nil {
			t.Fatalf("register worker 8 = %v", err)
		}
		_, err = register(ctx, certConn, 8, "llama")
		wantCode(t, "a second stream", err, codes.ResourceExhausted, `credential "worker-8" holds 1 Publish streams, the most it may (max_publish_streams 1)`)

		batch := func(first uint64) *kvrouterv1.PublishRequest {
			var events []*kvrouterv1.KvEvent
			for i := first; i < first+60; i++ {
				var parent *uint64
				if i > 0 {
					p := i - 1
					parent = &p
				}
				events = append(events, &kvrouterv1.KvEvent{EventId: i, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
					Data: &kvrouterv1.KvEvent_Stored{Stored: &kvrouterv1.BlocksStored{ParentHash: parent,
						Blocks: []*kvrouterv1.StoredBlock{{BlockHash: i, TokenIds: []uint32{uint32(i), 1, 2, 3}}}}}})
			}
			return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: events}}}
		}
		if err := stream.Send(batch(0)); err != nil {
			t.Fatal(err)
		}
		if resp, err := stream.Recv(); err != nil || resp.GetAck().GetEventId() != 59 {
			t.Fatalf("the first 60 blocks (within the burst) = %v, %v; want ack 59", resp, err)
		}
		// 60 more need 6 s of a 10/s rate: more than the 1 s a stream is slowed for.
		if err := stream.Send(batch(60)); err != nil {
			t.Fatal(err)
		}
		_, err = stream.Recv()
		wantCode(t, "60 more blocks at once", err, codes.ResourceExhausted, `credential "worker-8" is over its KV event rate limit (10 blocks/s)`)
		if d := retryDelay(err); d < 3*time.Second || d > 6*time.Second {
			t.Errorf("RetryInfo delay %v, want about 5 s (the 6 s the rate needs less the 1 s of slowing)", d)
		}
		// The refused stream ended; worker 7, another credential, publishes on (its stream takes the
		// registration over from serveLlama's).
		ctx7, cancel7 := r.as("worker-7")
		defer cancel7()
		s7, err := register(ctx7, conn, 7, "llama")
		if err != nil {
			t.Fatalf("worker 7 while worker 8 is limited = %v", err)
		}
		if err := s7.Send(batch(0)); err != nil {
			t.Fatal(err)
		}
		if resp, err := s7.Recv(); err != nil || resp.GetAck().GetEventId() != 59 {
			t.Errorf("worker 7's batch = %v, %v; want ack 59", resp, err)
		}
	})
}

// TestHealthPort: the plaintext health port answers probes without TLS or credentials, with the main
// port's health answers, and serves nothing else; the main port's health stays closed as configured.
func TestHealthPort(t *testing.T) {
	healthAddr := freePort(t)
	r := startSecureRouter(t, "--health-listen", healthAddr, "--auth-open-health=false")
	conn, err := grpc.NewClient("passthrough:///"+healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, svc := range []string{"", "kvrouter.v1.RouterService"} {
		resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("health %q on the health port = %v, %v; want SERVING", svc, resp, err)
		}
	}
	_, err = kvrouterv1.NewRouterServiceClient(conn).Route(ctx, llamaRoute())
	wantCode(t, "Route on the health port", err, codes.Unimplemented)
	_, err = healthpb.NewHealthClient(r.dial(nil)).Check(ctx, &healthpb.HealthCheckRequest{})
	wantCode(t, "health without credentials on the main port, closed", err, codes.Unauthenticated)
}
