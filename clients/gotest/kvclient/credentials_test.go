package kvclient_test

import (
	"context"
	"crypto/tls"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/server/servertest/testpki"
)

// seenCall is what the server saw of one call: its authorization metadata and the URI SAN of the
// client certificate it verified.
type seenCall struct {
	Authorization string
	ClientURI     string
}

// recordingServer is a gRPC server on a loopback TCP port serving the standard health service, and
// recording every call it receives.
type recordingServer struct {
	addr  string
	mu    sync.Mutex
	calls []seenCall
}

// startRecordingServer serves with TLS and requires a client certificate issued by ca; with a nil
// ca it serves plaintext.
func startRecordingServer(t *testing.T, ca *testpki.CA) *recordingServer {
	t.Helper()
	rs := &recordingServer{}
	record := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		var c seenCall
		md, _ := metadata.FromIncomingContext(ctx)
		c.Authorization = strings.Join(md.Get("authorization"), ",")
		if p, ok := peer.FromContext(ctx); ok {
			if info, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(info.State.PeerCertificates) > 0 {
				for _, u := range info.State.PeerCertificates[0].URIs {
					c.ClientURI = u.String()
				}
			}
		}
		rs.mu.Lock()
		rs.calls = append(rs.calls, c)
		rs.mu.Unlock()
		return handler(ctx, req)
	}
	opts := []grpc.ServerOption{grpc.UnaryInterceptor(record)}
	if ca != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(&tls.Config{
			Certificates: []tls.Certificate{ca.Server(t).TLS(t)},
			ClientCAs:    ca.Pool(),
			ClientAuth:   tls.RequireAndVerifyClientCert,
			MinVersion:   tls.VersionTLS12,
		})))
	}
	srv := grpc.NewServer(opts...)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	rs.addr = lis.Addr().String()
	return rs
}

// last returns the last call the server saw.
func (rs *recordingServer) last(t *testing.T) seenCall {
	t.Helper()
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if len(rs.calls) == 0 {
		t.Fatal("the server saw no call")
	}
	return rs.calls[len(rs.calls)-1]
}

// check makes one health check over conn.
func check(conn *grpc.ClientConn) error {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	_, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

// checkOnNewConn dials addr with opts (a new connection, so a new TLS handshake) and makes one
// health check.
func checkOnNewConn(t *testing.T, addr string, opts []grpc.DialOption) error {
	t.Helper()
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatalf("grpc.NewClient() = %v", err)
	}
	defer conn.Close()
	return check(conn)
}

func dialCredentials(t *testing.T, o kvclient.CredentialOptions) []grpc.DialOption {
	t.Helper()
	opts, err := kvclient.DialCredentials(o)
	if err != nil {
		t.Fatalf("DialCredentials(%+v) = %v", o, err)
	}
	return opts
}

// writeFile replaces path atomically (a rename), as a secret volume's update does.
func writeFile(t *testing.T, path, data string) string {
	t.Helper()
	if err := os.WriteFile(path+".tmp", []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestDialCredentialsSendTokenAndClientCertificate(t *testing.T) {
	ca := testpki.NewCA(t, "router CA")
	srv := startRecordingServer(t, ca)
	dir := t.TempDir()
	caFile := ca.WriteCert(t, dir, "ca.crt")
	certFile, keyFile := ca.Client(t, "spiffe://fleet/worker/1").Write(t, dir, "client")
	tokenFile := writeFile(t, filepath.Join(dir, "token"), "tok-from-file\n")
	for _, tc := range []struct {
		name string
		o    kvclient.CredentialOptions
		want seenCall
	}{
		{"token file", kvclient.CredentialOptions{CAFile: caFile, CertFile: certFile, KeyFile: keyFile, TokenFile: tokenFile},
			seenCall{Authorization: "Bearer tok-from-file", ClientURI: "spiffe://fleet/worker/1"}},
		{"literal token", kvclient.CredentialOptions{CAFile: caFile, CertFile: certFile, KeyFile: keyFile, Token: "tok-literal"},
			seenCall{Authorization: "Bearer tok-literal", ClientURI: "spiffe://fleet/worker/1"}},
		{"client certificate only", kvclient.CredentialOptions{CAFile: caFile, CertFile: certFile, KeyFile: keyFile},
			seenCall{ClientURI: "spiffe://fleet/worker/1"}},
		{"server name the certificate carries", kvclient.CredentialOptions{CAFile: caFile, CertFile: certFile, KeyFile: keyFile, ServerName: "localhost", Token: "t"},
			seenCall{Authorization: "Bearer t", ClientURI: "spiffe://fleet/worker/1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := checkOnNewConn(t, srv.addr, dialCredentials(t, tc.o)); err != nil {
				t.Fatalf("Check() = %v", err)
			}
			if diff := cmp.Diff(tc.want, srv.last(t)); diff != "" {
				t.Errorf("the server saw (-want +got):\n%s", diff)
			}
		})
	}
}

// TestDialCredentialsHandshakeFailures: a router whose certificate the client cannot verify is
// refused, whatever else is right.
func TestDialCredentialsHandshakeFailures(t *testing.T) {
	ca := testpki.NewCA(t, "router CA")
	srv := startRecordingServer(t, ca)
	dir := t.TempDir()
	certFile, keyFile := ca.Client(t, "spiffe://fleet/worker/1").Write(t, dir, "client")
	for _, tc := range []struct {
		name string
		o    kvclient.CredentialOptions
	}{
		{"CA mismatch", kvclient.CredentialOptions{CAFile: testpki.NewCA(t, "another CA").WriteCert(t, dir, "other.crt"), CertFile: certFile, KeyFile: keyFile, Token: "t"}},
		{"system roots", kvclient.CredentialOptions{CertFile: certFile, KeyFile: keyFile, Token: "t"}},
		{"server name the certificate lacks", kvclient.CredentialOptions{CAFile: ca.WriteCert(t, dir, "ca.crt"), CertFile: certFile, KeyFile: keyFile, ServerName: "router.example"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkOnNewConn(t, srv.addr, dialCredentials(t, tc.o))
			if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "certificate") {
				t.Errorf("Check() = %v, want UNAVAILABLE for the router's certificate", err)
			}
		})
	}
	srv.mu.Lock()
	defer srv.mu.Unlock()
	if len(srv.calls) != 0 {
		t.Errorf("the server saw calls %v, want none", srv.calls)
	}
}

// TestDialCredentialsTokenFileRotation: a token file replaced while the connection is up is sent
// by the calls after the next look at it (at most a second later); while the file is missing the
// last token read goes on being sent.
func TestDialCredentialsTokenFileRotation(t *testing.T) {
	ca := testpki.NewCA(t, "router CA")
	srv := startRecordingServer(t, ca)
	dir := t.TempDir()
	certFile, keyFile := ca.Client(t, "spiffe://fleet/worker/1").Write(t, dir, "client")
	tokenFile := writeFile(t, filepath.Join(dir, "token"), "first\n")
	conn, err := grpc.NewClient(srv.addr, dialCredentials(t, kvclient.CredentialOptions{CAFile: ca.WriteCert(t, dir, "ca.crt"), CertFile: certFile, KeyFile: keyFile, TokenFile: tokenFile})...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	authorization := func() string {
		t.Helper()
		if err := check(conn); err != nil {
			t.Fatalf("Check() = %v", err)
		}
		return srv.last(t).Authorization
	}
	if got := authorization(); got != "Bearer first" {
		t.Fatalf("authorization = %q, want %q", got, "Bearer first")
	}

	time.Sleep(1100 * time.Millisecond)
	start := time.Now()
	_ = authorization() // a look at the file, unchanged
	writeFile(t, tokenFile, "second\n")
	got := authorization()
	if time.Since(start) < 900*time.Millisecond && got != "Bearer first" {
		// The file was looked at less than a second before: it is not looked at again yet.
		t.Errorf("authorization right after the rotation = %q, want the previous token (one look a second)", got)
	}
	kvtest.Eventually(t, testTimeout, "the rotated token", func() bool { return authorization() == "Bearer second" })

	if err := os.Remove(tokenFile); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond) // past the next look
	if got := authorization(); got != "Bearer second" {
		t.Errorf("authorization with the token file missing = %q, want the last token read", got)
	}
	writeFile(t, tokenFile, "")
	time.Sleep(1100 * time.Millisecond)
	if got := authorization(); got != "Bearer second" {
		t.Errorf("authorization with the token file empty = %q, want the last token read", got)
	}
	writeFile(t, tokenFile, "third")
	kvtest.Eventually(t, testTimeout, "the token written after the gap", func() bool { return authorization() == "Bearer third" })
}

// TestDialCredentialsClientCertificateRotation: the client certificate is read again at a new
// handshake once its files changed, with the same dial options, so a new connection presents the
// new identity. Half a rotation (the new certificate, the old key) keeps the last good pair in use.
func TestDialCredentialsClientCertificateRotation(t *testing.T) {
	ca := testpki.NewCA(t, "router CA")
	srv := startRecordingServer(t, ca)
	dir := t.TempDir()
	certFile, keyFile := ca.Client(t, "spiffe://fleet/worker/1").Write(t, dir, "client")
	opts := dialCredentials(t, kvclient.CredentialOptions{CAFile: ca.WriteCert(t, dir, "ca.crt"), CertFile: certFile, KeyFile: keyFile})
	clientURI := func() string {
		t.Helper()
		if err := checkOnNewConn(t, srv.addr, opts); err != nil {
			t.Fatalf("Check() = %v", err)
		}
		return srv.last(t).ClientURI
	}
	if got := clientURI(); got != "spiffe://fleet/worker/1" {
		t.Fatalf("client certificate URI = %q, want spiffe://fleet/worker/1", got)
	}
	next := ca.Client(t, "spiffe://fleet/worker/2")
	writeFile(t, certFile, string(next.CertPEM))
	if got := clientURI(); got != "spiffe://fleet/worker/1" {
		t.Errorf("client certificate URI with the new certificate and the old key = %q, want the last good one, spiffe://fleet/worker/1", got)
	}
	next.Write(t, dir, "client")
	if got := clientURI(); got != "spiffe://fleet/worker/2" {
		t.Errorf("client certificate URI after the rotation = %q, want spiffe://fleet/worker/2", got)
	}
}

// TestDialCredentialsPlaintext: a token over plaintext goes only where the caller allowed it.
func TestDialCredentialsPlaintext(t *testing.T) {
	srv := startRecordingServer(t, nil)
	for _, tc := range []struct {
		name string
		o    kvclient.CredentialOptions
		want seenCall
	}{
		{"no token", kvclient.CredentialOptions{Plaintext: true}, seenCall{}},
		{"token allowed without TLS", kvclient.CredentialOptions{Plaintext: true, Token: "loopback-token", AllowTokenWithoutTLS: true},
			seenCall{Authorization: "Bearer loopback-token"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := checkOnNewConn(t, srv.addr, dialCredentials(t, tc.o)); err != nil {
				t.Fatalf("Check() = %v", err)
			}
			if diff := cmp.Diff(tc.want, srv.last(t)); diff != "" {
				t.Errorf("the server saw (-want +got):\n%s", diff)
			}
		})
	}
}

// TestDialCredentialsTokenNeedsTLS: the token's per-call credentials refuse a plaintext connection
// even when a later option replaces the TLS transport.
func TestDialCredentialsTokenNeedsTLS(t *testing.T) {
	srv := startRecordingServer(t, nil)
	opts := dialCredentials(t, kvclient.CredentialOptions{Token: "t"})
	conn, err := grpc.NewClient(srv.addr, append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err == nil {
		err = check(conn)
		conn.Close()
	}
	if err == nil || !strings.Contains(err.Error(), "transport") {
		t.Errorf("a token over plaintext = %v, want refused for want of transport security", err)
	}
}

func TestDialCredentialsRefuse(t *testing.T) {
	ca := testpki.NewCA(t, "router CA")
	dir := t.TempDir()
	caFile := ca.WriteCert(t, dir, "ca.crt")
	leaf := ca.Client(t, "spiffe://fleet/worker/1")
	certFile, keyFile := leaf.Write(t, dir, "client")
	otherKey := ca.Client(t, "spiffe://fleet/worker/2").KeyPEM
	wrongKeyFile := writeFile(t, filepath.Join(dir, "wrong.key"), string(otherKey))
	badToken := writeFile(t, filepath.Join(dir, "bad-token"), "two words\n")
	emptyToken := writeFile(t, filepath.Join(dir, "empty-token"), "\n")
	missing := filepath.Join(dir, "missing")
	for _, tc := range []struct {
		name string
		o    kvclient.CredentialOptions
		want []string // in the error
	}{
		{"plaintext token without AllowTokenWithoutTLS", kvclient.CredentialOptions{Plaintext: true, Token: "secret-token"},
			[]string{"Plaintext", "Token", "AllowTokenWithoutTLS"}},
		{"plaintext token file without AllowTokenWithoutTLS", kvclient.CredentialOptions{Plaintext: true, TokenFile: emptyToken},
			[]string{"Plaintext", "TokenFile", "AllowTokenWithoutTLS"}},
		{"plaintext with a CA", kvclient.CredentialOptions{Plaintext: true, CAFile: caFile}, []string{"Plaintext", "CAFile"}},
		{"certificate without key", kvclient.CredentialOptions{CAFile: caFile, CertFile: certFile}, []string{"CertFile", "KeyFile"}},
		{"key without certificate", kvclient.CredentialOptions{CAFile: caFile, KeyFile: keyFile}, []string{"CertFile", "KeyFile"}},
		{"token and token file", kvclient.CredentialOptions{Token: "a", TokenFile: emptyToken}, []string{"Token", "TokenFile"}},
		{"missing CA file", kvclient.CredentialOptions{CAFile: missing}, []string{"CAFile", missing}},
		{"CA file without a certificate", kvclient.CredentialOptions{CAFile: keyFile}, []string{"CAFile", keyFile, "no PEM certificate"}},
		{"key of another certificate", kvclient.CredentialOptions{CertFile: certFile, KeyFile: wrongKeyFile}, []string{certFile, wrongKeyFile}},
		{"missing certificate", kvclient.CredentialOptions{CertFile: missing, KeyFile: keyFile}, []string{missing}},
		{"missing token file", kvclient.CredentialOptions{TokenFile: missing}, []string{"TokenFile", missing}},
		{"empty token file", kvclient.CredentialOptions{TokenFile: emptyToken}, []string{emptyToken, "holds no token"}},
		{"token file of two words", kvclient.CredentialOptions{TokenFile: badToken}, []string{badToken, "printable ASCII"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts, err := kvclient.DialCredentials(tc.o)
			if err == nil {
				t.Fatalf("DialCredentials() = %d options, want an error", len(opts))
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("DialCredentials() = %v, want it to name %q", err, w)
				}
			}
			for _, secret := range []string{"secret-token", "words", string(leaf.KeyPEM[40:80]), string(otherKey[40:80])} {
				if strings.Contains(err.Error(), secret) {
					t.Errorf("DialCredentials() = %v: it shows a secret", err)
				}
			}
		})
	}
}

func TestLoopbackTarget(t *testing.T) {
	got := map[string]bool{}
	want := map[string]bool{}
	for _, tc := range []struct {
		target string
		want   bool
	}{
		{"127.0.0.1:50051", true},
		{"127.1.2.3:50051", true},
		{"[::1]:50051", true},
		{"localhost:50051", true},
		{"LOCALHOST", true},
		{"localhost.:50051", true},
		{"dns:///localhost:50051", true},
		{"dns://8.8.8.8/127.0.0.1:50051", true},
		{"passthrough:///127.0.0.1:50051", true},
		{"unix:///run/kvrouter.sock", true},
		{"unix:kvrouter.sock", true},
		{"10.0.0.1:50051", false},
		{"[2001:db8::1]:50051", false},
		{"router.svc:50051", false},
		{"dns:///router.svc:50051", false},
		{"localhost.example:50051", false},
		{"0.0.0.0:50051", false},
	} {
		got[tc.target], want[tc.target] = kvclient.LoopbackTarget(tc.target), tc.want
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("LoopbackTarget (-want +got):\n%s", diff)
	}
}
