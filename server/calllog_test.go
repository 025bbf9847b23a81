package server

import (
	"bytes"
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
)

// lockedBuffer is a log destination the server's goroutines may write while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) lines(msg string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, line := range strings.Split(l.b.String(), "\n") {
		if strings.Contains(line, "msg=\""+msg+"\"") {
			out = append(out, line)
		}
	}
	return out
}

// TestUnaryCallLog: a finished unary call is logged at debug when it succeeds and at the
// middleware's level for its code when it fails, with the middleware's fields; below the logger's
// level nothing is logged.
func TestUnaryCallLog(t *testing.T) {
	ok := func(e *testEnv) { e.admin.ListWorkers(e.ctx, &kvrouterv1.ListWorkersRequest{}) }                //nolint:errcheck // the log line is checked
	invalid := func(e *testEnv) { e.router.Route(e.ctx, &kvrouterv1.RouteRequest{TokenIds: []uint32{1}}) } //nolint:errcheck // as above
	tests := []struct {
		name      string
		level     slog.Level
		call      func(*testEnv)
		wantLines int
		wantParts []string
	}{
		{"success at debug", slog.LevelDebug, ok, 1,
			[]string{"level=DEBUG", "grpc.service=kvrouter.v1.AdminService", "grpc.method=ListWorkers", "grpc.method_type=unary", "grpc.code=OK"}},
		{"success below debug is dropped", slog.LevelInfo, ok, 0, nil},
		{"invalid argument at info", slog.LevelInfo, invalid, 1,
			[]string{"level=INFO", "grpc.method=Route", "grpc.code=InvalidArgument", "grpc.error=", "peer.address=", "grpc.time_ms="}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out := &lockedBuffer{}
			env := newTestEnv(t, func(o *Options) {
				o.Logger = slog.New(slog.NewTextHandler(out, &slog.HandlerOptions{Level: tc.level}))
			})
			tc.call(env)
			lines := out.lines("finished call")
			if len(lines) != tc.wantLines {
				t.Fatalf("%d finished-call lines, want %d:\n%s", len(lines), tc.wantLines, strings.Join(lines, "\n"))
			}
			var missing []string
			for _, part := range tc.wantParts {
				if !strings.Contains(lines[0], part) {
					missing = append(missing, part)
				}
			}
			if diff := cmp.Diff([]string(nil), missing); diff != "" {
				t.Errorf("log line %q lacks (-want +got):\n%s", lines[0], diff)
			}
		})
	}
}

// TestFailedCallLinesAreSampled: the lines of failed calls are kept to callLinesPerSecond a second
// for each method and code, on the unary and the stream path alike, and the next line kept says how
// many were left out; successful calls (debug) are all logged. Before, every refused call wrote a
// line at the default level, so a flood of refused calls flooded the log.
func TestFailedCallLinesAreSampled(t *testing.T) {
	out := &lockedBuffer{}
	logger := slog.New(slog.NewTextHandler(out, &slog.HandlerOptions{Level: slog.LevelDebug}))
	sampler := newCallLogSampler()
	now := time.Unix(1000, 0)
	sampler.clock = kvstate.ClockFunc(func() time.Time { return now })
	unary := unaryCallLog(logger, sampler)
	refuse := func(context.Context, any) (any, error) {
		return nil, status.Error(codes.ResourceExhausted, "over the rate")
	}
	accept := func(context.Context, any) (any, error) { return nil, nil }
	route := &grpc.UnaryServerInfo{FullMethod: RouteMethod}
	stream := interceptorLogger(logger, sampler)
	publishRefused := func() {
		stream.Log(context.Background(), logging.LevelWarn, "finished call",
			"grpc.service", "kvrouter.v1.WorkerService", "grpc.method", "Publish", "grpc.code", "ResourceExhausted")
	}
	for range 3 * callLinesPerSecond {
		_, _ = unary(context.Background(), nil, route, refuse)
		_, _ = unary(context.Background(), nil, route, accept)
		publishRefused()
	}
	now = now.Add(time.Second)
	_, _ = unary(context.Background(), nil, route, refuse)
	publishRefused()

	count := func(parts ...string) int {
		n := 0
		for _, line := range out.lines("finished call") {
			if !slices.ContainsFunc(parts, func(p string) bool { return !strings.Contains(line, p) }) {
				n++
			}
		}
		return n
	}
	got := map[string]int{
		"Route refused":        count("grpc.method=Route", "grpc.code=ResourceExhausted"),
		"Route accepted":       count("grpc.method=Route", "grpc.code=OK"),
		"Publish refused":      count("grpc.method=Publish", "grpc.code=ResourceExhausted"),
		"Route, 20 left out":   count("grpc.method=Route", "suppressed=20"),
		"Publish, 20 left out": count("grpc.method=Publish", "suppressed=20"),
	}
	want := map[string]int{
		"Route refused":        callLinesPerSecond + 1,
		"Route accepted":       3 * callLinesPerSecond,
		"Publish refused":      callLinesPerSecond + 1,
		"Route, 20 left out":   1,
		"Publish, 20 left out": 1,
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("lines logged (-want +got):\n%s", diff)
	}
}
