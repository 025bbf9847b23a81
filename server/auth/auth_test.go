package auth

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
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
