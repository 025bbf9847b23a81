// Package servertest serves kvrouter's gRPC server in the caller's own process on a loopback TCP
// port: for the tests of the clients that talk to it (a real server and a real connection, no
// mock), and for kvsim, which runs the router beside its simulated fleet. Its replicas are built by
// the composition root (server/replica), as `kvrouter serve` builds its own.
package servertest

import (
	"io"
	"log/slog"
	"net"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/server"
	"github.com/kvrouter/kvrouter/server/config"
	"github.com/kvrouter/kvrouter/server/replica"
)

// quiet drops the server's log lines.
var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// Serve serves state and log, with the default configuration and prompts of up to
// maxPromptTokens tokens, on a free loopback port and returns the server and its listener; mutate
// adjusts the server's options first. Replicas served over one state and log share it, as replicas
// sharing a Redis log do. The caller stops the server.
func Serve(state *kvstate.State, log kvstate.Log, maxPromptTokens int, mutate ...func(*server.Options)) (*server.Server, net.Listener, error) {
	cfg := config.New()
	cfg.MaxPromptTokens = maxPromptTokens
	rep, err := replica.Build(replica.Options{Config: cfg, Logger: quiet, Shard: &kvstate.Shard{State: state, Log: log}})
	if err != nil {
		return nil, nil, err
	}
	return ServeReplica(rep, mutate...)
}

// ServeReplica serves rep on a free loopback port, with a registry of its own and no log lines;
// mutate adjusts the server's options first. The caller runs rep (if it has logs to run) and stops
// the server.
func ServeReplica(rep *replica.Replica, mutate ...func(*server.Options)) (*server.Server, net.Listener, error) {
	opts := rep.ServerOptions()
	opts.Registry, opts.Logger = prometheus.NewRegistry(), quiet
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
