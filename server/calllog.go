package server

import (
	"context"
	"fmt"
	"log/slog"
	"path"
	"sync"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/kvrouter/kvrouter/kvstate"
)

// callLevel is the level of a finished call's log line: debug for a successful one (a line per
// routed request would cost more than routing it), the middleware's usual mapping otherwise.
func callLevel(c codes.Code) slog.Level {
	if c == codes.OK {
		return slog.LevelDebug
	}
	return slog.Level(logging.DefaultServerCodeToLevel(c))
}

// callLinesPerSecond is how many lines of failed calls the log takes a second for each method and
// status code (callLogSampler).
const callLinesPerSecond = 10

// callLogSampler keeps the "finished call" lines of failed calls to callLinesPerSecond a second for
// each method and status code, and the next line kept says how many were left out ("suppressed").
// A caller refused over and over (over its rate, past a cap, with bad input) would otherwise write
// a line per refusal at the default level: an authenticated flood would be a log flood too (the
// unauthenticated ones are sampled by the Authenticator). The calls all still count in the gRPC
// metrics. Successful calls log at debug, which an operator turns on to see every call, and are
// not sampled.
type callLogSampler struct {
	clock  kvstate.Clock
	mu     sync.Mutex
	counts map[callLogKey]*callLogWindow // methods and codes are few: the map stays small
}

type callLogKey struct{ method, code string }

type callLogWindow struct {
	second             int64 // unix second of logged
	logged, suppressed int
}

func newCallLogSampler() *callLogSampler {
	return &callLogSampler{clock: kvstate.SystemClock, counts: map[callLogKey]*callLogWindow{}}
}

// allow says whether the line of a call to method that ended with code is logged, and how many
// lines of that method and code were left out since the last one logged.
func (s *callLogSampler) allow(method, code string) (ok bool, suppressed int) {
	if code == codes.OK.String() {
		return true, 0
	}
	sec := s.clock.Now().Unix()
	s.mu.Lock()
	defer s.mu.Unlock()
	k := callLogKey{method, code}
	w := s.counts[k]
	if w == nil {
		w = &callLogWindow{}
		s.counts[k] = w
	}
	if w.second != sec {
		w.second, w.logged = sec, 0
	}
	if w.logged >= callLinesPerSecond {
		w.suppressed++
		return false, 0
	}
	w.logged++
	suppressed, w.suppressed = w.suppressed, 0
	return true, suppressed
}

// unaryCallLog logs each finished unary call with the fields of go-grpc-middleware's logging
// interceptor, which the stream calls keep using, so both read alike; failed calls' lines are
// sampled (callLogSampler).
//
// Profile lesson (docs/benchmarks/history.md, "Route over gRPC: kvload and profiles"): the
// middleware builds every field of the line, peer address and timestamps included, before the
// logger decides the line is below its level; that was 8% of the server's CPU per Route call, where
// nearly every line is a debug line nobody keeps. This interceptor asks the logger first.
func unaryCallLog(l *slog.Logger, sampler *callLogSampler) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		start := time.Now()
		resp, err := handler(ctx, req)
		code := status.Code(err)
		lvl := callLevel(code)
		if !l.Enabled(ctx, lvl) {
			return resp, err
		}
		ok, suppressed := sampler.allow(info.FullMethod, code.String())
		if !ok {
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
		if suppressed > 0 {
			attrs = append(attrs, "suppressed", suppressed)
		}
		l.Log(ctx, lvl, "finished call", attrs...)
		return resp, err
	}
}

// interceptorLogger adapts slog to the middleware's logger, sampling its "finished call" lines of
// failed calls as unaryCallLog does.
func interceptorLogger(l *slog.Logger, sampler *callLogSampler) logging.Logger {
	return logging.LoggerFunc(func(ctx context.Context, lvl logging.Level, msg string, fields ...any) {
		if msg == "finished call" && lvl > logging.LevelDebug {
			var service, method, code string
			for i := 0; i+1 < len(fields); i += 2 {
				v, _ := fields[i+1].(string)
				switch fields[i] {
				case "grpc.service":
					service = v
				case "grpc.method":
					method = v
				case "grpc.code":
					code = v
				}
			}
			ok, suppressed := sampler.allow("/"+service+"/"+method, code)
			if !ok {
				return
			}
			if suppressed > 0 {
				fields = append(fields, "suppressed", suppressed)
			}
		}
		l.Log(ctx, slog.Level(lvl), msg, fields...)
	})
}
