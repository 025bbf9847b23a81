// Package gotest holds the Go client's tests that need kvrouter's server: the client
// (clients/go/kvclient) and the engine bridge (clients/go/bridge) against real routers served in
// this process on loopback ports (server/servertest), over shared logs and Redis. They live here,
// in the server's module, so that the client's own module (clients/go) needs nothing of the
// server, as etcd keeps its client's integration tests out of its client module. The client
// module's unit tests stay beside its code.
package gotest
