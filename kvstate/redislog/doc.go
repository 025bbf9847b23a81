// Package redislog is the Redis backend of kvstate.Log: one Redis stream (or a Redis Cluster hash
// tag) that every replica appends its changes to and tails, so that every replica applies the same
// changes in the same order (DESIGN "Redis mode").
//
// The files split the backend by job: log.go appends worker changes and awaits their apply;
// tail.go tails the stream, applies it and catches up after a trim; outage.go buffers worker
// changes while Redis is unreachable; bookings.go applies bookings locally and publishes them in
// the background; snapshot.go writes snapshots and trims the stream; generation.go fences appends
// by the log's generation and reseeds or reloads a lost log; leases.go keeps worker liveness
// leases. docs/operations.md describes the keys.
package redislog
