// Package servertest serves kvrouter's gRPC server in the caller's own process on a loopback TCP
// port: for the tests of the clients that talk to it (a real server and a real connection, no
// mock), and for kvsim, which runs the router beside its simulated fleet.
package servertest

import (
	"io"
	"log/slog"
	"net"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server"
	"github.com/kvrouter/kvrouter/server/app"
)

// Serve serves state and log on a free loopback port and returns the server and its listener;
// mutate adjusts the options first. Replicas served over one state and log share it, as replicas
// sharing a Redis log do. The caller stops the server.
func Serve(state *kvstate.State, log kvstate.Log, maxPromptTokens int, mutate ...func(*server.Options)) (*server.Server, net.Listener, error) {
	opts := server.Options{
		State: state, Log: log, Registry: prometheus.NewRegistry(),
		Dispatcher:      app.New(state, log, policy.NewKernel(state, policy.DefaultConfig()), app.Options{}),
		Logger:          slog.New(slog.NewTextHandler(io.Discard, nil)),
		MaxPromptTokens: maxPromptTokens, MaxRecvMsgBytes: 16 << 20, MaxConcurrentStreams: 1000,
	}
	for _, m := range mutate {
		m(&opts)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, err
	}
	srv := server.New(opts)
	go srv.Serve(lis)
	return srv, lis, nil
}
