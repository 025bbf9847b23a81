// Package memstore is the in-memory store of the shared log (kvstate/logstore): the embedded
// mode's store, where one process is the whole deployment, and the reference every other store is
// checked against (kvstate/logstore/storetest). Every operation holds the log's lock for its
// duration, which makes each one atomic as the port asks.
//
// A process's memory is its store: a restart loses it, as a Redis without persistence would, and
// the replication engine treats it the same way (a fresh generation).
package memstore

import (
	"context"
	"fmt"
	"maps"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

// Options configure a Store.
type Options struct {
	// Name is what the store calls itself (GetState's backend); "" means "memory".
	Name string
	// Clock is the store's clock; nil means kvstate.SystemClock.
	Clock kvstate.Clock
}

// Store keeps every log of a deployment in process memory. It is safe for concurrent use.
type Store struct {
	opts Options

	mu          sync.Mutex
	logs        map[string]*Log
	deployments map[string]*Deployment
}

// New returns an empty store.
func New(opts Options) *Store {
	if opts.Name == "" {
		opts.Name = "memory"
	}
	opts.Clock = kvstate.ClockOr(opts.Clock)
	return &Store{opts: opts, logs: make(map[string]*Log), deployments: make(map[string]*Deployment)}
}

var _ logstore.Store = (*Store)(nil)

// Name names the store.
func (s *Store) Name() string { return s.opts.Name }

// Ping always succeeds: the store is this process.
func (s *Store) Ping(context.Context) error { return nil }

// Log returns the log under prefix, made on first use.
func (s *Store) Log(prefix string) logstore.LogStore {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.logs[prefix]
	if l == nil {
		l = &Log{name: s.opts.Name, now: s.opts.Clock.Now, marks: map[string]string{}, bookings: map[string]int64{},
			leases: map[string]lease{}, workers: map[string]int64{}, appended: make(chan struct{})}
		s.logs[prefix] = l
	}
	return l
}

// Deployment returns the registry of the deployment under prefix, made on first use.
func (s *Store) Deployment(prefix string) logstore.Deployment {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := s.deployments[prefix]
	if d == nil {
		d = &Deployment{prefix: prefix, now: s.opts.Clock.Now, shards: map[string]string{}}
		s.deployments[prefix] = d
	}
	return d
}

// Deployment is a deployment's registry of shards in memory.
type Deployment struct {
	prefix  string
	now     func() time.Time
	mu      sync.Mutex
	shards  map[string]string
	lineage string
}

// Shards returns a copy of the registry.
func (d *Deployment) Shards(context.Context) (map[string]string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return maps.Clone(d.shards), nil
}

// Shard returns the prefix registered for model.
func (d *Deployment) Shard(_ context.Context, model string) (string, bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	p, ok := d.shards[model]
	return p, ok, nil
}

// Register registers prefix for model unless one is.
func (d *Deployment) Register(_ context.Context, model, prefix string) (string, bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if p, ok := d.shards[model]; ok {
		return p, false, nil
	}
	d.shards[model] = prefix
	return prefix, true, nil
}

// PlaceShard returns the deployment's prefix with the model, query-escaped, added: one log per
// model, none of them the deployment's unsharded log.
func (d *Deployment) PlaceShard(_ context.Context, model string) (string, error) {
	return d.prefix + "/" + url.QueryEscape(model), nil
}

// Lineage returns (or makes) the deployment's lineage.
func (d *Deployment) Lineage(_ context.Context, newID string) (string, int64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := d.now().UnixMilli()
	if d.lineage == "" {
		d.lineage = newID + "/" + strconv.FormatInt(now, 10)
	}
	return d.lineage, now, nil
}

var _ logstore.Deployment = (*Deployment)(nil)

// lease is a named lease's holder and deadline.
type lease struct {
	holder string
	until  time.Time
}

// Log is one log in memory.
type Log struct {
	name string
	now  func() time.Time

	mu         sync.Mutex
	entries    []logstore.Record // in position order, trimmed from the front
	lastMs     uint64            // the last position handed out
	lastSeq    uint64
	generation string
	count      uint64
	snapshot   []byte
	position   string // "" when no snapshot
	leases     map[string]lease
	marks      map[string]string
	bookings   map[string]int64
	workers    map[string]int64 // worker lease -> deadline, unix ms
	appended   chan struct{}    // closed and replaced when entries are appended
}

var _ logstore.LogStore = (*Log)(nil)

// Name names the store.
func (l *Log) Name() string { return l.name }

// Ping always succeeds.
func (l *Log) Ping(context.Context) error { return nil }

// nextPosition returns a position after every one handed out, from the store's clock. The caller
// holds mu.
func (l *Log) nextPosition() string {
	ms := uint64(max(l.now().UnixMilli(), 0))
	if ms > l.lastMs {
		l.lastMs, l.lastSeq = ms, 0
	} else {
		l.lastSeq++
	}
	return strconv.FormatUint(l.lastMs, 10) + "-" + strconv.FormatUint(l.lastSeq, 10)
}

// Append appends each entry if the generation is gen.
func (l *Log) Append(ctx context.Context, gen string, entries []logstore.Entry) []error {
	errs := make([]error, len(entries))
	if err := ctx.Err(); err != nil {
		for i := range errs {
			errs[i] = err
		}
		return errs
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, e := range entries {
		if l.generation != gen || gen == "" {
			errs[i] = fmt.Errorf("%w (the log's is %q)", logstore.ErrFenced, l.generation)
			continue
		}
		l.count++
		l.entries = append(l.entries, logstore.Record{
			ID: l.nextPosition(), Generation: gen, HasGeneration: true, Number: l.count, HasNumber: true,
			Data: slices.Clone(e.Data), Replica: e.Replica, Seqs: e.Seqs, TraceParent: e.TraceParents,
		})
		for _, o := range e.Index {
			switch o.Op {
			case logstore.OpBook:
				l.bookings[o.ID] = o.Score
			case logstore.OpFree:
				delete(l.bookings, o.ID)
			case logstore.OpExpire:
				maps.DeleteFunc(l.bookings, func(_ string, score int64) bool { return score < o.Score })
			}
		}
	}
	close(l.appended)
	l.appended = make(chan struct{})
	return errs
}

// Read returns up to count entries after position after, waiting up to block for one.
func (l *Log) Read(ctx context.Context, after string, count int, block time.Duration) ([]logstore.Record, error) {
	var timeout <-chan time.Time
	if block > 0 {
		t := time.NewTimer(block)
		defer t.Stop()
		timeout = t.C
	}
	for {
		l.mu.Lock()
		i := sort.Search(len(l.entries), func(i int) bool { return logstore.ComparePositions(l.entries[i].ID, after) > 0 })
		out := slices.Clone(l.entries[i:min(len(l.entries), i+max(count, 1))])
		wait := l.appended
		l.mu.Unlock()
		if len(out) > 0 || block < 0 {
			return out, nil
		}
		select {
		case <-wait:
		case <-timeout:
			return nil, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Head returns the log's generation, counter, length and bounds.
func (l *Log) Head(context.Context) (logstore.Head, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	h := logstore.Head{Generation: l.generation, Count: l.count, Length: int64(len(l.entries)), Last: "0-0"}
	if n := len(l.entries); n > 0 {
		h.First, h.Last = l.entries[0].ID, l.entries[n-1].ID
	}
	return h, nil
}

// Bootstrap returns the generation, creating it if missing.
func (l *Log) Bootstrap(_ context.Context, newID string) (string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.generation == "" {
		if len(l.entries) > 0 || l.snapshot != nil {
			l.generation = newID + "/adopted"
		} else {
			l.generation = newID + "/fresh/" + strconv.FormatInt(l.now().UnixMilli(), 10)
		}
	}
	return l.generation, nil
}

// Reseed replaces the generation as r says.
func (l *Log) Reseed(_ context.Context, r logstore.Reseed) (bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	g := l.generation
	switch {
	case r.RewoundBehind != 0:
		if g != r.Expected || l.count >= r.RewoundBehind {
			return false, nil
		}
	case g != "":
		if g != r.Expected {
			return false, nil
		}
		id, rest, _ := strings.Cut(g, "/")
		created, ok := strings.CutPrefix(rest, "fresh/")
		ms, err := strconv.ParseInt(created, 10, 64)
		if id == "" || !ok || err != nil || l.now().UnixMilli()-ms > r.Window.Milliseconds() {
			return false, nil
		}
	case r.Expected != "":
		return false, nil
	}
	l.entries, l.count = nil, 0
	l.bookings = maps.Clone(r.Bookings)
	if l.bookings == nil {
		l.bookings = map[string]int64{}
	}
	l.snapshot, l.position = slices.Clone(r.Snapshot), "0-0"
	l.generation = r.New
	return true, nil
}

// Now returns the store's clock.
func (l *Log) Now(context.Context) (time.Time, error) { return l.now(), nil }

// TakeLease takes or extends the lease name.
func (l *Log) TakeLease(_ context.Context, name, holder string, ttl time.Duration) (bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	if cur, ok := l.leases[name]; ok && cur.holder != holder && now.Before(cur.until) {
		return false, nil
	}
	l.leases[name] = lease{holder: holder, until: now.Add(ttl)}
	return true, nil
}

// ReleaseLease lets go of the lease name.
func (l *Log) ReleaseLease(_ context.Context, name string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.leases, name)
	return nil
}

// ReadSnapshot returns the snapshot (shared, not copied: callers only read it).
func (l *Log) ReadSnapshot(context.Context) ([]byte, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.snapshot, nil
}

// SnapshotPosition returns the position the snapshot covers.
func (l *Log) SnapshotPosition(context.Context) (string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.position, nil
}

// WriteSnapshot commits s if the generation is s.Generation, and trims the log.
func (l *Log) WriteSnapshot(_ context.Context, s logstore.Snapshot) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.generation != s.Generation {
		return fmt.Errorf("%w: the snapshot was not committed", logstore.ErrFenced)
	}
	l.snapshot, l.position = s.Data, s.Position // the engine hands over a buffer it no longer writes
	if s.TrimBefore != "" {
		i := sort.Search(len(l.entries), func(i int) bool { return logstore.ComparePositions(l.entries[i].ID, s.TrimBefore) >= 0 })
		l.entries = slices.Delete(l.entries, 0, i)
	}
	return nil
}

// WriteMark sets replica's watermark.
func (l *Log) WriteMark(_ context.Context, replica, value string) (int64, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now().UnixMicro()
	switch value {
	case "":
	case "new":
		l.marks[replica] = "new " + strconv.FormatInt(now, 10)
	default:
		l.marks[replica] = value
	}
	return now, nil
}

// SetMark sets replica's watermark as it is.
func (l *Log) SetMark(_ context.Context, replica, value string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.marks[replica] = value
	return nil
}

// ReadMarks returns the clock, the tip, the watermarks and the booking index's answer at once.
func (l *Log) ReadMarks(_ context.Context, booking string) (logstore.Marks, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := logstore.Marks{Now: l.now().UnixMicro(), Tip: "0-0", Marks: maps.Clone(l.marks)}
	if n := len(l.entries); n > 0 {
		m.Tip = l.entries[n-1].ID
	}
	_, m.Indexed = l.bookings[booking]
	return m, nil
}

// DeleteMark forgets replica's watermark.
func (l *Log) DeleteMark(_ context.Context, replica string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.marks, replica)
	return nil
}

// RefreshLeases sets the worker leases' deadline.
func (l *Log) RefreshLeases(_ context.Context, members []string, deadlineMs int64, onlyNew bool) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, m := range members {
		if _, ok := l.workers[m]; ok && onlyNew {
			continue
		}
		l.workers[m] = deadlineMs
	}
	return nil
}

// ClaimExpired removes and returns up to max expired worker leases, earliest first.
func (l *Log) ClaimExpired(_ context.Context, beforeMs int64, max int) ([]string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for m, d := range l.workers {
		if d < beforeMs {
			out = append(out, m)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if l.workers[out[i]] != l.workers[out[j]] {
			return l.workers[out[i]] < l.workers[out[j]]
		}
		return out[i] < out[j]
	})
	out = out[:min(len(out), max)]
	for _, m := range out {
		delete(l.workers, m)
	}
	return out, nil
}

// HasLease reports whether a worker lease starts with prefix.
func (l *Log) HasLease(_ context.Context, prefix string) (bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for m := range l.workers {
		if strings.HasPrefix(m, prefix) {
			return true, nil
		}
	}
	return false, nil
}
