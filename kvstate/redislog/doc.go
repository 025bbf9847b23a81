// Package redislog is the Redis backend of kvstate.Log: one Redis stream (or a Redis Cluster hash
// tag) that every replica appends its changes to and tails, so that every replica applies the same
// changes in the same order (DESIGN "Redis mode").
//
// The files split the backend by job: log.go appends and awaits, tails and catches up, buffers
// worker changes through an outage, publishes bookings in the background, and writes snapshots and
// trims the stream; generation.go fences appends by the log's generation and reseeds or reloads a
// lost log; leases.go keeps worker liveness leases. docs/operations.md describes the keys.
package redislog
