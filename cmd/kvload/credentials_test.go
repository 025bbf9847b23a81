package main

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc/credentials"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/server"
	"github.com/kvrouter/kvrouter/server/auth"
	"github.com/kvrouter/kvrouter/server/servertest"
	"github.com/kvrouter/kvrouter/server/servertest/testpki"
)

const loadToken = "kvload-test-token-0123456789"

// startSecureRouter serves a kvrouter on a loopback port that lets in only the bearer token
// loadToken (a worker and frontend credential, with routeRateLimit Route calls a second, 0: no
// limit) and, with ca, serves TLS and requires a client certificate ca signs.
func startSecureRouter(t *testing.T, ca *testpki.CA, routeRateLimit float64) string {
	t.Helper()
	sum := sha256.Sum256([]byte(loadToken))
	creds := fmt.Sprintf("credentials:\n  - name: load\n    roles: [worker, frontend]\n    token_sha256: %s\n    any_worker: true\n    route_rate_limit: %g\n",
		hex.EncodeToString(sum[:]), routeRateLimit)
	path := filepath.Join(t.TempDir(), "credentials.yaml")
	if err := os.WriteFile(path, []byte(creds), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := auth.New(auth.Options{CredentialsFile: path, Services: server.Services, AnyCaller: server.ReflectionServices,
		RouteMethod: server.RouteMethod, PublishMethod: server.PublishMethod, MaxPublishStreams: 1024, EventBurst: 16_384})
	if err != nil {
		t.Fatalf("auth.New() = %v", err)
	}
	state := kvstate.NewState()
	srv, lis, err := servertest.Serve(state, kvstate.NewMemLog(state), 1<<16, func(o *server.Options) {
		o.Auth = a
		if ca != nil {
			o.Creds = credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{ca.Server(t).TLS(t)}, ClientCAs: ca.Pool(),
				ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12})
		}
	})
	if err != nil {
		t.Fatalf("servertest.Serve() = %v", err)
	}
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// TestKvloadThroughCredentials seeds and drives a router that checks credentials: over mutual TLS
// with the token, and with the token over plaintext to loopback. The router knows no caller but the
// token's, so seeding alone shows the token is sent on the Publish streams, and the report's
// errors show it on the Route calls; a Route rate limit shows in the report as RESOURCE_EXHAUSTED.
func TestKvloadThroughCredentials(t *testing.T) {
	ca := testpki.NewCA(t, "router CA")
	dir := t.TempDir()
	caFile := ca.WriteCert(t, dir, "ca.crt")
	certFile, keyFile := ca.Client(t, "spiffe://fleet/kvload").Write(t, dir, "kvload")
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(loadToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name      string
		ca        *testpki.CA
		rateLimit float64
		args      []string
		wantCodes []string // of the failed Route calls
	}{
		{"mutual TLS and token", ca, 0, []string{"--cacert", caFile, "--cert", certFile, "--key", keyFile, "--token-file", tokenFile}, nil},
		{"token over plaintext to loopback", nil, 0, []string{"--token-file", tokenFile}, nil},
		{"route rate limit", ca, 20, []string{"--cacert", caFile, "--cert", certFile, "--key", keyFile, "--token-file", tokenFile}, []string{"ResourceExhausted"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
			defer cancel()
			addr := startSecureRouter(t, tc.ca, tc.rateLimit)
			out := filepath.Join(t.TempDir(), "report.json")
			args := append([]string{"--addr", addr, "--workers", "2", "--blocks", "500", "--prompt-blocks", "16", "--roots", "2",
				"--route-tokens", "200", "--prompts", "2", "--requests", "200", "--concurrency", "4", "--json", out}, tc.args...)
			r, stderr := runForReport(ctx, t, args, out)
			var codes []string
			for code := range r.Errors {
				codes = append(codes, code)
			}
			if r.Calls != 200 || !cmp.Equal(tc.wantCodes, codes) {
				t.Errorf("report: %d calls, failed with %v; want 200, failed with %v\nstderr:\n%s", r.Calls, r.Errors, tc.wantCodes, stderr)
			}
		})
	}
}

func TestKvloadRejectsBadCredentialFlags(t *testing.T) {
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte("t\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.crt")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--cert", tokenFile}, "--cert and --key go together"},
		{[]string{"--key", tokenFile}, "--cert and --key go together"},
		{[]string{"--addr", "10.0.0.1:50051", "--token-file", tokenFile}, "--token-file without --cacert or --cert would send the token unencrypted to --addr 10.0.0.1:50051"},
		{[]string{"--cacert", missing}, missing},
		{[]string{"--token-file", missing}, missing},
	} {
		var stderr strings.Builder
		args := append([]string{"--requests", "10"}, tc.args...)
		if code := run(context.Background(), args, &stderr); code != 2 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("run(%q) = %d, %q; want 2, naming %q", args, code, stderr.String(), tc.want)
		}
	}
}
