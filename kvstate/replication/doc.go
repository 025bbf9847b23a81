// Package replication is the replication engine of the shared log: every replica appends its
// changes to one log in a store (kvstate/logstore) and tails it, so that every replica applies the
// same changes in the same order. It holds every rule of replication and talks to storage only
// through logstore.LogStore, so the same code runs over Redis (kvstate/logstore/redisstore), over
// process memory in embedded mode (kvstate/logstore/memstore) and over any store that passes
// kvstate/logstore/storetest.
//
// The files split the engine by job: log.go appends worker changes and awaits their apply, joining
// appends in a committer; tail.go tails the log, applies it and catches up after a trim;
// outage.go buffers worker changes while the store is unreachable; bookings.go applies bookings
// locally and publishes them in the background; snapshot.go writes snapshots and trims the log;
// generation.go fences appends by the log's generation and reseeds or reloads a lost log;
// watermark.go tells a booking that does not exist from one not published yet; bookingindex.go
// ends bookings of shards this replica does not serve; leases.go keeps worker liveness leases;
// shards.go runs one log per model. docs/architecture.md shows the layers, docs/operations.md the
// Redis keys.
package replication
