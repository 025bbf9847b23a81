package kvstate

import (
	"context"
	"time"
)

// SharedLog is a Log that several replicas share through a store (kvstate/replication is the Redis
// one). Beyond appending, the edge needs from it a readiness, a health, a report of where this
// replica stands, and figures for metrics; a backend that implements this interface gets readiness
// gating, the shared-state health entry, GetState's report and the kvrouter_shared_log_* metrics
// without the edge knowing its type.
type SharedLog interface {
	Log
	// Backend names the store, as GetState reports it ("redis").
	Backend() string
	// Ready is closed once this replica has caught up with the log for the first time: before, it
	// would route from a partial view.
	Ready() <-chan struct{}
	// Degraded reports that the store is unreachable, or changes made meanwhile still wait to be
	// published; routing goes on from local state.
	Degraded() bool
	// Incomplete reports that this replica knows its state may not be the shared one (the log was
	// lost and is not re-established yet, or may still be replaced by a replica with state, or it
	// holds a newer version than this replica reads).
	Incomplete() bool
	// LastID is the store's name for the last entry applied here; replicas with the same LastID,
	// Generation and no Pending changes have applied the same log.
	LastID() string
	// Pending is how many local changes are applied here but not yet in the log.
	Pending() int
	// Generation names the log's lineage; it changes when the store lost the log and it was
	// reseeded.
	Generation() string
	// Stats returns the log's current figures.
	Stats() SharedLogStats
	// Observe installs timing hooks; safe to call at any time.
	Observe(Observers)
}

// BufferingLog is a SharedLog that keeps worker changes locally while its store is unreachable and
// publishes them when it returns. A Publish stream asks it whether its worker's changes are durable
// (so acks wait) and whether the worker must resend its cache (the buffer overflowed).
type BufferingLog interface {
	SharedLog
	// Buffered returns how many of the worker's changes are not durable yet.
	Buffered(key WorkerKey) int
	// TakeResync reports, once, that the worker must resend its whole cache.
	TakeResync(key WorkerKey) bool
}

// SharedLogStats is a point-in-time view of a shared log, for metrics.
type SharedLogStats struct {
	Degraded          bool
	Incomplete        bool
	BufferedChanges   int   // worker changes waiting to be published
	LostChanges       int64 // changes kept only locally (past the buffer bound)
	Length            int64 // entries the store holds (trimmed behind snapshots)
	SnapshotBytes     int64
	SnapshotAt        time.Time // zero before the first snapshot written or loaded here
	GenerationChanges uint64    // times this replica moved to another generation of the log
	// NewerVersion: the log holds an entry or snapshot of a newer version than this replica
	// reads; it stopped applying there (and is Incomplete) until it is upgraded.
	NewerVersion bool
}

// Observers receive a shared log's timings as they happen, for metrics.
type Observers struct {
	// Append is called with how long each synchronous append to the store took.
	Append func(took time.Duration)
	// Apply is called for each applied entry with the time since it was appended.
	Apply func(lag time.Duration)
	// TraceParent returns the W3C traceparent of the traced call that ctx belongs to, or "" when
	// the call is not traced. The log carries it in the entry it appends, so that each replica's
	// apply of the entry can be linked to the call that appended it; kvstate itself knows nothing
	// of tracing.
	TraceParent func(ctx context.Context) string
	// ApplyTraced is called as an entry carrying traceparents starts to apply (on every replica,
	// the appender's included), with the store's id of the entry; it returns the function to call
	// once the entry is applied. An entry joins the changes of several calls, so traceParents is
	// a comma-separated list, one per traced call among them.
	ApplyTraced func(traceParents, entryID string) (applied func())
}
