package auth

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"net/url"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	grpctap "google.golang.org/grpc/tap"
)

// TestOpenServices: health and reflection answer callers without credentials only when the
// configuration opens them, and otherwise any valid credential, of any role; a service no rule
// names needs the admin role.
func TestOpenServices(t *testing.T) {
	token := "frontend-token"
	sum := sha256.Sum256([]byte(token))
	path := filepath.Join(t.TempDir(), "credentials.yaml")
	if err := os.WriteFile(path, []byte("credentials:\n  - name: fe\n    roles: [frontend]\n    token_sha256: "+hex.EncodeToString(sum[:])+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	const health, reflection, other = "/grpc.health.v1.Health/Check", "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", "/some.Other/Call"
	anonymous := context.Background()
	frontend := metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer "+token))
	tests := []struct {
		name   string
		open   []string
		ctx    context.Context
		method string
		want   codes.Code
	}{
		{"health open", []string{"grpc.health.v1.Health"}, anonymous, health, codes.OK},
		{"health closed", nil, anonymous, health, codes.Unauthenticated},
		{"health closed, any credential", nil, frontend, health, codes.OK},
		{"reflection open", []string{"grpc.reflection.v1.ServerReflection"}, anonymous, reflection, codes.OK},
		{"reflection closed", nil, anonymous, reflection, codes.Unauthenticated},
		{"reflection closed, any credential", nil, frontend, reflection, codes.OK},
		{"an unknown service needs admin", nil, frontend, other, codes.PermissionDenied},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, err := New(Options{CredentialsFile: path, Open: tt.open, AnyCaller: []string{"grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"},
				Services: map[string]Role{"kvrouter.v1.RouterService": RoleFrontend}})
			if err != nil {
				t.Fatal(err)
			}
			_, err = a.UnaryServerInterceptor()(tt.ctx, nil, &grpc.UnaryServerInfo{FullMethod: tt.method},
				func(context.Context, any) (any, error) { return nil, nil })
			if got := status.Code(err); got != tt.want {
				t.Errorf("%s = %v, want %v", tt.method, err, tt.want)
			}
		})
	}
}

// TestTapHandleAdmitsOnHeaders: TapHandle refuses a call on its headers (no credentials, or the
// wrong role) with the status the interceptors would give, and admits one once: the interceptor
// after it neither checks it again nor takes a second Route call from the credential's rate.
func TestTapHandleAdmitsOnHeaders(t *testing.T) {
	token := "frontend-token"
	sum := sha256.Sum256([]byte(token))
	path := filepath.Join(t.TempDir(), "credentials.yaml")
	if err := os.WriteFile(path, []byte("credentials:\n  - name: fe\n    roles: [frontend]\n    route_rate_limit: 1\n    token_sha256: "+hex.EncodeToString(sum[:])+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	const route, admin = "/kvrouter.v1.RouterService/Route", "/kvrouter.v1.AdminService/GetState"
	a, err := New(Options{CredentialsFile: path, RouteMethod: route,
		Services: map[string]Role{"kvrouter.v1.RouterService": RoleFrontend, "kvrouter.v1.AdminService": RoleAdmin}})
	if err != nil {
		t.Fatal(err)
	}
	frontend := metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer "+token))
	tap := a.TapHandle()
	for _, tt := range []struct {
		name   string
		ctx    context.Context
		method string
		want   codes.Code
	}{
		{"no credentials", context.Background(), route, codes.Unauthenticated},
		{"the wrong role", frontend, admin, codes.PermissionDenied},
	} {
		if _, err := tap(tt.ctx, &grpctap.Info{FullMethodName: tt.method}); status.Code(err) != tt.want {
			t.Errorf("%s: TapHandle = %v, want %v", tt.name, err, tt.want)
		}
	}
	ctx, err := tap(frontend, &grpctap.Info{FullMethodName: route}) // the one call a second the rate allows
	if err != nil {
		t.Fatalf("TapHandle(Route as fe) = %v", err)
	}
	var got *Caller
	_, err = a.UnaryServerInterceptor()(ctx, nil, &grpc.UnaryServerInfo{FullMethod: route}, func(ctx context.Context, _ any) (any, error) {
		got = FromContext(ctx)
		return nil, nil
	})
	if err != nil || got == nil || got.Name != "fe" {
		t.Fatalf("the interceptor after TapHandle = %v, caller %v; want the call admitted once, as fe", err, got)
	}
	if _, err := tap(frontend, &grpctap.Info{FullMethodName: route}); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("a second Route within the second = %v, want RESOURCE_EXHAUSTED", err)
	}
}

// TestSANKinds: a client certificate's URI SANs match URI identities and its DNS SANs match DNS
// identities; a DNS SAN spelled like a URI identity does not pass for it (a lax CA might sign one).
func TestSANKinds(t *testing.T) {
	path := filepath.Join(t.TempDir(), "credentials.yaml")
	if err := os.WriteFile(path, []byte("credentials:\n  - name: fe\n    roles: [frontend]\n    identity: spiffe://fleet/fe\n"+
		"  - name: dns\n    roles: [frontend]\n    identity: fe.fleet.internal\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := New(Options{CredentialsFile: path, Services: map[string]Role{"kvrouter.v1.RouterService": RoleFrontend}})
	if err != nil {
		t.Fatal(err)
	}
	spiffe, _ := url.Parse("spiffe://fleet/fe")
	withCert := func(cert *x509.Certificate) context.Context {
		info := credentials.TLSInfo{State: tls.ConnectionState{VerifiedChains: [][]*x509.Certificate{{cert}}}}
		return peer.NewContext(context.Background(), &peer.Peer{AuthInfo: info})
	}
	for _, tt := range []struct {
		name string
		cert *x509.Certificate
		want string // the credential, "" when refused
	}{
		{"URI SAN, URI identity", &x509.Certificate{URIs: []*url.URL{spiffe}}, "fe"},
		{"DNS SAN, DNS identity", &x509.Certificate{DNSNames: []string{"fe.fleet.internal"}}, "dns"},
		{"DNS SAN spelled as the URI identity", &x509.Certificate{DNSNames: []string{"spiffe://fleet/fe"}}, ""},
	} {
		c, err := a.check(withCert(tt.cert), "/kvrouter.v1.RouterService/Route")
		switch {
		case tt.want == "" && status.Code(err) != codes.Unauthenticated:
			t.Errorf("%s: %v, %v; want UNAUTHENTICATED", tt.name, c, err)
		case tt.want != "" && (err != nil || c.Name != tt.want):
			t.Errorf("%s: %v, %v; want credential %q", tt.name, c, err, tt.want)
		}
	}
}
