// Package logstore is the port between the replication engine (kvstate/replication) and the store
// that holds a shared log: a fenced, numbered, trimmable sequence of entries beside its snapshot,
// leases, replica watermarks, worker leases and the registry of a deployment's shards.
//
// The engine holds every rule of replication (joining appends, waiting for the echo, local-first
// bookings, the outage buffer, generations and reseeds, snapshot cadence, watermarks); a store
// only keeps data and makes the few steps that must be atomic atomic. So a store is small:
// kvstate/logstore/redisstore is Redis, kvstate/logstore/memstore is process memory (the embedded
// mode), and kvstate/logstore/storetest is the conformance suite that every store passes.
//
// Positions are strings "<ms>-<seq>" ordered numerically by their two parts (ComparePositions):
// Redis stream ids, which the other stores imitate so that a snapshot names its position the same
// way whatever store wrote it. "0-0" is before the first entry.
package logstore

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"
)

// ErrFenced is an append, snapshot or other fenced write refused because the log's generation is
// not the writer's.
var ErrFenced = errors.New("the shared log's generation changed")

// ErrUnknownOutcome wraps an error after which a write may or may not have happened (the
// connection broke before the reply): the engine must not retry it blindly.
var ErrUnknownOutcome = errors.New("the store's reply was lost")

// Store is a deployment's store: its logs (one per shard, each under a prefix of its own) and the
// registry of its shards.
type Store interface {
	// Name names the store, as GetState reports it ("redis", "embedded").
	Name() string
	// Ping checks that the store answers.
	Ping(ctx context.Context) error
	// Log returns the log under prefix (the deployment's prefix for an unsharded log, a shard's
	// prefix from PlaceShard otherwise). Logs are cheap handles; two for one prefix are one log.
	Log(prefix string) LogStore
	// Deployment returns the registry of the shards of the deployment under prefix.
	Deployment(prefix string) Deployment
}

// Deployment is the registry of a deployment's shards: which prefix holds each model's log, and
// the deployment's lineage (which changes when the store lost its data).
type Deployment interface {
	// Shards returns the registry: model -> the prefix of its shard.
	Shards(ctx context.Context) (map[string]string, error)
	// Shard returns the prefix of model's shard, if registered.
	Shard(ctx context.Context, model string) (prefix string, ok bool, err error)
	// Register registers prefix for model unless a prefix is registered already (the first
	// register wins), and returns the prefix registered and whether it is this call's.
	Register(ctx context.Context, model, prefix string) (registered string, created bool, err error)
	// PlaceShard returns a prefix for a new shard of model, distinct from every other model's; a
	// store spread over several nodes places it on the least loaded.
	PlaceShard(ctx context.Context, model string) (string, error)
	// Lineage returns the deployment's lineage, "<id>/<created ms>", creating it from newID on the
	// store's clock if it is missing, and the store's time in milliseconds.
	Lineage(ctx context.Context, newID string) (lineage string, nowMs int64, err error)
}

// Entry is what the engine appends: one or several changes joined (Data), by Replica, whose
// sequence numbers (comma-separated, in order) and traceparents (comma-separated, "" when none is
// traced) it carries, with the booking index's changes (Index).
type Entry struct {
	Data         []byte
	Replica      string
	Seqs         string
	TraceParents string
	Index        []IndexOp
}

// IndexOp is one change to a log's booking index, made with its entry: add (OpBook) a booking at
// a score, remove (OpFree) one, or remove (OpExpire) those scored below Score.
type IndexOp struct {
	Op    byte
	ID    string
	Score int64
}

// The booking index's operations.
const (
	OpBook   = 'b'
	OpFree   = 'f'
	OpExpire = 'e'
)

// Record is an entry read back from a log, at its position, with the generation it was appended
// in and its number in it (both absent in entries of releases before generations existed).
type Record struct {
	ID            string
	Generation    string
	HasGeneration bool
	Number        uint64
	HasNumber     bool
	Data          []byte
	Replica       string
	Seqs          string
	TraceParent   string
}

// Head is what a log holds: its generation ("" when none), how many entries were appended in it
// (the fenced counter), how many it holds now, and the positions of its first ("" when empty)
// and last ("0-0" when empty) entries.
type Head struct {
	Generation string
	Count      uint64
	Length     int64
	First      string
	Last       string
}

// Reseed replaces a log's generation Expected ("": none) by New, with Snapshot as its snapshot at
// position "0-0", an empty log and counter, and Bookings as its booking index (request id ->
// score), if the generation is still Expected and either RewoundBehind is not 0 and the counter is
// below it (the log rewound behind an entry the reseeder applied), or the generation is missing,
// or it is a fresh one ("<id>/fresh/<created ms>") at most Window old on the store's clock.
type Reseed struct {
	Expected      string
	New           string
	Snapshot      []byte
	Window        time.Duration
	RewoundBehind uint64
	Bookings      map[string]int64
}

// Snapshot is a snapshot to commit: in Generation, covering the log up to Position; the log is
// trimmed behind TrimBefore ("": not trimmed).
type Snapshot struct {
	Generation string
	Data       []byte
	Position   string
	TrimBefore string
}

// Marks is what ReadMarks returns, read in one atomic step: the store's time in microseconds, the
// log's last position, every replica's watermark value, and whether the booking index holds the
// booking asked for.
type Marks struct {
	Now     int64
	Tip     string
	Marks   map[string]string
	Indexed bool
}

// LogStore is one log in a store.
type LogStore interface {
	// Name names the store, as Store.Name.
	Name() string
	// Ping checks that the store answers for this log.
	Ping(ctx context.Context) error
	// Append appends entries, in order, to the log if its generation is gen, each numbered with
	// the log's counter, each with its booking index changes, atomically per entry, and returns
	// each one's error: nil, ErrFenced (wrapped) when the generation is not gen, or another error
	// (wrapping ErrUnknownOutcome when the entry may have been appended all the same).
	Append(ctx context.Context, gen string, entries []Entry) []error
	// Read returns up to count entries after position after, blocking up to block for the first
	// when there is none (block < 0: not at all); none and no error at the end.
	Read(ctx context.Context, after string, count int, block time.Duration) ([]Record, error)
	// Head returns the log's generation, counter, length and bounds, read at once.
	Head(ctx context.Context) (Head, error)
	// Bootstrap returns the log's generation, creating it if missing: "<newID>/adopted" when the
	// log or a snapshot exists already (written before generations), else
	// "<newID>/fresh/<store ms>".
	Bootstrap(ctx context.Context, newID string) (string, error)
	// Reseed replaces the generation as r says, and reports whether it did.
	Reseed(ctx context.Context, r Reseed) (bool, error)
	// Now returns the store's clock, as the log's own node reads it.
	Now(ctx context.Context) (time.Time, error)

	// TakeLease takes the lease name for holder for ttl, or extends it if holder holds it, and
	// reports whether holder holds it.
	TakeLease(ctx context.Context, name, holder string, ttl time.Duration) (bool, error)
	// ReleaseLease lets go of the lease name.
	ReleaseLease(ctx context.Context, name string) error

	// ReadSnapshot returns the snapshot, or nil when there is none.
	ReadSnapshot(ctx context.Context) ([]byte, error)
	// SnapshotPosition returns the position the snapshot covers, or "" when there is none.
	SnapshotPosition(ctx context.Context) (string, error)
	// WriteSnapshot commits s as the snapshot if the generation is s.Generation (else ErrFenced)
	// and no other snapshot was committed since the writer's last read, and trims the log.
	WriteSnapshot(ctx context.Context, s Snapshot) error

	// WriteMark sets replica's watermark to value ("": unchanged; "new": announced, promising
	// nothing, at the store's time) and returns the store's time in microseconds.
	WriteMark(ctx context.Context, replica, value string) (nowUs int64, err error)
	// SetMark sets replica's watermark to value as it is.
	SetMark(ctx context.Context, replica, value string) error
	// ReadMarks returns the store's time, the log's tip and the watermarks, and whether the booking
	// index holds booking ("": not asked), in one step.
	ReadMarks(ctx context.Context, booking string) (Marks, error)
	// DeleteMark forgets replica's watermark.
	DeleteMark(ctx context.Context, replica string) error

	// RefreshLeases sets the deadline (unix ms) of the worker leases members; onlyNew leaves
	// existing ones alone.
	RefreshLeases(ctx context.Context, members []string, deadlineMs int64, onlyNew bool) error
	// ClaimExpired removes and returns up to max leases whose deadline is before beforeMs, in one
	// step: each expired lease is claimed by one caller only.
	ClaimExpired(ctx context.Context, beforeMs int64, max int) ([]string, error)
	// HasLease reports whether a lease whose member starts with prefix exists.
	HasLease(ctx context.Context, prefix string) (bool, error)
}

// ComparePositions orders two positions ("ms-seq").
func ComparePositions(a, b string) int {
	am, as := SplitPosition(a)
	bm, bs := SplitPosition(b)
	switch {
	case am != bm:
		if am < bm {
			return -1
		}
		return 1
	case as < bs:
		return -1
	case as > bs:
		return 1
	}
	return 0
}

// SplitPosition returns a position's two parts; malformed ones read as 0.
func SplitPosition(id string) (ms, seq uint64) {
	m, s, _ := strings.Cut(id, "-")
	ms, _ = strconv.ParseUint(m, 10, 64)
	seq, _ = strconv.ParseUint(s, 10, 64)
	return ms, seq
}
