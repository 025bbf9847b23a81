package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/server/servertest"
)

const defaultTestTimeout = 10 * time.Second

// startRouter serves a kvrouter on a loopback port (servertest.Serve) and returns its address and
// state.
func startRouter(t *testing.T) (string, *kvstate.State) {
	t.Helper()
	state := kvstate.NewState()
	srv, lis, err := servertest.Serve(state, kvstate.NewMemLog(state), 1<<16)
	if err != nil {
		t.Fatalf("servertest.Serve() = %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
		defer cancel()
		srv.Shutdown(ctx, 0)
	})
	return lis.Addr().String(), state
}

// routeFromFile replays the written request the way ghz would (templates filled in) and returns
// the decision.
func routeFromFile(t *testing.T, ctx context.Context, addr, path string) *kvrouterv1.RouteResponse {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("reading --out: %v", err)
	}
	data := strings.NewReplacer("{{.RequestNumber}}", "7", "{{.TimestampUnixNano}}", "123").Replace(string(b))
	req := &kvrouterv1.RouteRequest{}
	if err := protojson.Unmarshal([]byte(data), req); err != nil {
		t.Fatalf("protojson.Unmarshal(--out) = %v", err)
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("grpc.NewClient() = %v", err)
	}
	defer conn.Close()
	resp, err := kvrouterv1.NewRouterServiceClient(conn).Route(ctx, req)
	if err != nil {
		t.Fatalf("Route(request from --out) = %v, want nil", err)
	}
	return resp
}

func TestKvloadSeedsAndWritesRequest(t *testing.T) {
	for _, tc := range []struct {
		name      string
		args      []string
		wantMode  kvrouterv1.RouteMode
		wantBook  bool
		wantRoles map[kvstate.Role]int
	}{
		{
			name: "aggregated, query only", args: []string{"--workers", "4"},
			wantMode: kvrouterv1.RouteMode_ROUTE_MODE_AGGREGATED, wantRoles: map[kvstate.Role]int{kvstate.RoleAggregated: 4},
		},
		{
			name: "disaggregated, booking", args: []string{"--workers", "5", "--prefill-workers", "2", "--query-only=false"},
			wantMode: kvrouterv1.RouteMode_ROUTE_MODE_DISAGGREGATED, wantBook: true,
			wantRoles: map[kvstate.Role]int{kvstate.RolePrefill: 2, kvstate.RoleDecode: 3},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
			defer cancel()
			addr, state := startRouter(t)
			out := filepath.Join(t.TempDir(), "route.json")
			args := append([]string{"--addr", addr, "--out", out, "--blocks", "2000", "--prompt-blocks", "32", "--roots", "3", "--route-tokens", "500"}, tc.args...)
			var stderr strings.Builder
			if code := run(ctx, args, &stderr); code != 0 {
				t.Fatalf("run(%q) = %d, want 0; stderr:\n%s", args, code, stderr.String())
			}

			m := state.Model("bench")
			if m == nil {
				t.Fatal(`model "bench" is not registered after kvload`)
			}
			roles := map[kvstate.Role]int{}
			var held uint64
			for _, w := range m.Workers() {
				roles[w.Info.Role]++
				held += m.Index.BlockCounts(w.Slot).Total()
			}
			for role, n := range tc.wantRoles {
				if roles[role] != n {
					t.Errorf("%d %v workers registered, want %d (all: %v)", roles[role], role, n, roles)
				}
			}
			// Every published block is held by its worker; shared prefixes make fewer distinct ones.
			if held < 2000 || m.Index.Len() >= int(held) {
				t.Errorf("workers hold %d blocks, %d distinct; want >= 2000 held and fewer distinct", held, m.Index.Len())
			}

			resp := routeFromFile(t, ctx, addr, out)
			if resp.GetMode() != tc.wantMode || resp.GetBooked() != tc.wantBook {
				t.Errorf("Route = mode %v, booked %v; want %v, %v", resp.GetMode(), resp.GetBooked(), tc.wantMode, tc.wantBook)
			}
			d := resp.GetDiagnostics()
			if d.GetPromptTokens() != 500 {
				t.Errorf("Route prompt_tokens = %d, want 500", d.GetPromptTokens())
			}
			// The request shares half a root with the published prompts: some worker holds a prefix.
			hop := d.GetDecode()
			if tc.wantMode == kvrouterv1.RouteMode_ROUTE_MODE_DISAGGREGATED {
				hop = d.GetPrefill()
			}
			if hop.GetOverlapBlocks().GetDevice() == 0 {
				t.Errorf("Route overlap = %v, want a cached prefix", hop.GetOverlapBlocks())
			}
		})
	}
}

func TestKvloadRejectsBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{},                               // no --out and no calls to drive
		{"--out", "x", "--workers", "0"}, // no workers
		{"--out", "x", "--prefill-workers", "64"},
		{"--out", "x", "--shared-max", "1"}, // prompts would have no new block
		{"--out", "x", "extra"},
		{"--requests", "10", "--duration", "1s"},
		{"--requests", "10", "--conns", "0"},
		{"--requests", "10", "--rate", "-1"},
		{"--requests", "10", "--server-pid", "1", "--server-metrics", "http://x/metrics"},
		{"--requests", "10", "--ingest-rate", "fast"},
		{"--out", "x", "--ingest-rate", "1000"},                             // ingest with no window
		{"--requests", "10", "--concurrency", "0", "--ingest-rate", "1000"}, // no callers need --duration
		{"--duration", "1s", "--concurrency", "0"},                          // no callers and no ingest: nothing to measure
		{"--duration", "1s", "--ingest-rate", "max", "--ingest-cap", "10", "--ingest-event-blocks", "128"},
		{"--duration", "1s", "--ingest-rate", "max", "--ingest-streams", "0"},
		{"--duration", "1s", "--ingest-rate", "max", "--ingest-batch", "0"},
	} {
		var stderr strings.Builder
		if code := run(context.Background(), args, &stderr); code != 2 {
			t.Errorf("run(%q) = %d, want 2; stderr: %s", args, code, stderr.String())
		}
	}
}
