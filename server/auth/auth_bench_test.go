package auth

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// BenchmarkUnaryCheck is the interceptor's cost on a Route call with a bearer token: the token's
// SHA-256, the lookup, the role check and, for a credential with a Route rate limit, its bucket.
func BenchmarkUnaryCheck(b *testing.B) {
	b.Run("unlimited", func(b *testing.B) { benchmarkUnaryCheck(b, "") })
	b.Run("rate-limited", func(b *testing.B) { benchmarkUnaryCheck(b, "    route_rate_limit: 1e12\n") })
}

func benchmarkUnaryCheck(b *testing.B, limit string) {
	token := "kvr_0123456789abcdef0123456789abcdef0123456789abcdef"
	sum := sha256.Sum256([]byte(token))
	path := filepath.Join(b.TempDir(), "credentials.yaml")
	file := "credentials:\n  - name: fe\n    roles: [frontend]\n" + limit + "    token_sha256: " + hex.EncodeToString(sum[:]) + "\n"
	if err := os.WriteFile(path, []byte(file), 0o600); err != nil {
		b.Fatal(err)
	}
	a, err := New(Options{CredentialsFile: path, Services: map[string]Role{"kvrouter.v1.RouterService": RoleFrontend},
		RouteMethod: "/kvrouter.v1.RouterService/Route"})
	if err != nil {
		b.Fatal(err)
	}
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer "+token))
	info := &grpc.UnaryServerInfo{FullMethod: "/kvrouter.v1.RouterService/Route"}
	handler := func(ctx context.Context, req any) (any, error) { return nil, nil }
	check := a.UnaryServerInterceptor()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := check(ctx, nil, info, handler); err != nil {
			b.Fatal(err)
		}
	}
}
