package server

import (
	"context"
	"fmt"
	"log/slog"
	"path"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// callLevel is the level of a finished call's log line: debug for a successful one (a line per
// routed request would cost more than routing it), the middleware's usual mapping otherwise.
func callLevel(c codes.Code) slog.Level {
	if c == codes.OK {
		return slog.LevelDebug
	}
	return slog.Level(logging.DefaultServerCodeToLevel(c))
}

// unaryCallLog logs each finished unary call with the fields of go-grpc-middleware's logging
// interceptor, which the stream calls keep using, so both read alike.
//
// Profile lesson (docs/BENCHMARKS.md, "Route over gRPC"): the middleware builds every field of the
// line, peer address and timestamps included, before the logger decides the line is below its
// level; that was 8% of the server's CPU per Route call, where nearly every line is a debug line
// nobody keeps. This interceptor asks the logger first.
func unaryCallLog(l *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		start := time.Now()
		resp, err := handler(ctx, req)
		code := status.Code(err)
		lvl := callLevel(code)
		if !l.Enabled(ctx, lvl) {
			return resp, err
		}
		attrs := []any{"protocol", "grpc", "grpc.component", "server",
			"grpc.service", path.Dir(info.FullMethod)[1:], "grpc.method", path.Base(info.FullMethod), "grpc.method_type", "unary"}
		if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
			attrs = append(attrs, "peer.address", p.Addr.String())
		}
		attrs = append(attrs, "grpc.start_time", start.Format(time.RFC3339), "grpc.code", code.String())
		if err != nil {
			attrs = append(attrs, "grpc.error", err.Error())
		}
		attrs = append(attrs, "grpc.time_ms", fmt.Sprintf("%.3f", float64(time.Since(start).Microseconds())/1000))
		l.Log(ctx, lvl, "finished call", attrs...)
		return resp, err
	}
}
