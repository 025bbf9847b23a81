package replication

// Sharding: one log, and one state, per model, each placed by the store (on Redis, under a hash tag
// of its own, so that a Redis Cluster spreads the models' streams over its masters) (docs/architecture.md, "The shared log's
// order, and sharding it by model").

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

// ShardsOptions configure a log sharded by model.
type ShardsOptions struct {
	// Models are the models this replica serves (it tails their shards only); empty: every model
	// in the registry, including those added later.
	Models []string
	// Log configures every shard's Log. Its Prefix names the deployment: the store keeps the
	// registry of shards under it, and places each model's shard under a prefix of its own
	// (logstore.Deployment.PlaceShard; on Redis "kvr:{prod/<model, query-escaped>[#n]}", n chosen
	// so that on a Redis Cluster each master holds as few shards as possible). None of them is the
	// unsharded log under the same Prefix.
	Log Options
	// NewState returns the state of a new shard; nil means kvstate.NewState.
	NewState func() *kvstate.State
	// Poll is how often the registry is read for shards that other replicas added; zero means 1 s.
	Poll time.Duration
	// WorkerGracePeriod, when set, gives every shard its worker leases (Leases, under the shard's
	// prefix), swept every min(1 s, grace/3): a worker whose replica died is removed from its
	// model's shard by whichever replica sees its lease run out. Zero: no leases.
	WorkerGracePeriod time.Duration
	// Observers are installed on every shard's Log as it is made (the edge's metrics and tracing
	// hooks), so that a shard another replica added later is observed like the first.
	Observers kvstate.Observers
}

// Shards is a log sharded by model: a kvstate.Shard (a State and a replication.Log) per model, found in
// a registry that every replica shares, so that the first replica to meet a model (a worker's hello
// naming it) creates its shard and every other replica serving all models picks it up. Each shard's
// Log runs on its own goroutine (its own tailer): shards apply in parallel, and in no order relative
// to one another, which nothing in the state needs.
type Shards struct {
	store      logstore.Store
	deployment logstore.Deployment
	opts       ShardsOptions

	mu     sync.Mutex
	shards map[string]*shardRun // by model
	run    context.Context      // Run's, once it runs: shards added after start at once
	wg     sync.WaitGroup
	ready  chan struct{} // closed by Run once the shards found at start have caught up
	// conflicts are the models the registry names another prefix for than the one held here (by
	// Run's goroutine only).
	conflicts map[string]string
	// lineage is the deployment's lineage as this replica first saw it (lineageSettled), under mu.
	lineage string
}

// shardRun is a shard, its Log and its worker leases (nil without a grace period).
type shardRun struct {
	shard  *kvstate.Shard
	log    *Log
	leases *Leases
	prefix string
}

// NewShards returns a sharded log in store. Call Run to read the registry and run the shards.
func NewShards(store logstore.Store, opts ShardsOptions) *Shards {
	if opts.NewState == nil {
		opts.NewState = kvstate.NewState
	}
	if opts.Poll <= 0 {
		opts.Poll = time.Second
	}
	if opts.Log.Logger == nil {
		opts.Log.Logger = slog.Default()
	}
	if opts.Log.LoadGate == nil {
		// As many shards restore at once as there are cores (measured: docs/benchmarks/history.md,
		// "Cold start from the snapshots of a sharded log").
		opts.Log.LoadGate = make(chan struct{}, runtime.GOMAXPROCS(0))
	}
	return &Shards{store: store, deployment: store.Deployment(opts.Log.Prefix), opts: opts, shards: make(map[string]*shardRun), ready: make(chan struct{}), conflicts: make(map[string]string)}
}

// serves says whether this replica serves model.
func (s *Shards) serves(model string) bool {
	return len(s.opts.Models) == 0 || slices.Contains(s.opts.Models, model)
}

// Open returns the shard of model, creating it (in the registry, and here) if no replica has yet.
func (s *Shards) Open(ctx context.Context, model string) (*kvstate.Shard, error) {
	if !s.serves(model) {
		return nil, fmt.Errorf("%w: %q (this replica serves %s)", kvstate.ErrModelNotServed, model, strings.Join(s.opts.Models, ", "))
	}
	s.mu.Lock()
	r := s.shards[model]
	s.mu.Unlock()
	if r != nil {
		return r.shard, nil
	}
	prefix, ok, err := s.deployment.Shard(ctx, model)
	if err == nil && !ok {
		if prefix, err = s.deployment.PlaceShard(ctx, model); err == nil {
			// The first replica to register the model wins; the others take its prefix.
			prefix, _, err = s.deployment.Register(ctx, model, prefix)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("%w: finding the shard of model %q: %v", kvstate.ErrLogUnavailable, model, err)
	}
	return s.add(ctx, model, prefix).shard, nil
}

// add makes the shard of model under prefix, unless it exists, and starts its Log if Run runs.
func (s *Shards) add(ctx context.Context, model, prefix string) *shardRun {
	if r, ok := s.held(model); ok {
		return r
	}
	trusted := s.lineageSettled(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.shards[model]; r != nil {
		return r
	}
	opts := s.opts.Log
	opts.Prefix = prefix
	opts.IndexBookings = true // a replica serving other models ends its bookings (EndElsewhere)
	opts.NoFreshWindow = trusted
	st := s.opts.NewState()
	store := s.store.Log(prefix)
	l := New(store, st, opts)
	l.Observe(s.opts.Observers)
	r := &shardRun{shard: &kvstate.Shard{Model: model, State: st, Log: l}, log: l, prefix: prefix}
	if g := s.opts.WorkerGracePeriod; g > 0 {
		r.leases = NewLeases(store, l, g, opts.Logger)
		r.leases.AfterOutages(l)
		r.shard.Liveness = r.leases
	}
	s.shards[model] = r
	if s.run != nil {
		s.start(r)
	}
	return r
}

// held returns the shard of model run here, if there is one.
func (s *Shards) held(model string) (*shardRun, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.shards[model]
	return r, ok
}

// readLineage reads (or makes) the deployment's lineage and remembers the one seen first: Redis
// lost its data since when it is another.
func (s *Shards) readLineage(ctx context.Context) (lineage string, now int64, err error) {
	lineage, now, err = s.deployment.Lineage(ctx, newGenerationID())
	if err != nil {
		return "", 0, fmt.Errorf("reading the deployment's lineage: %v", err)
	}
	s.mu.Lock()
	if s.lineage == "" {
		s.lineage = lineage
	}
	s.mu.Unlock()
	return lineage, now, nil
}

// lineageSettled reports whether a shard made now for a model may skip its fresh log's reseed
// window (Options.NoFreshWindow): no replica can hold lost state of it, because Redis has kept the
// deployment's data since this replica first saw it, and since longer than the window (so that
// a loss before, from which a replica with state might reseed, is over). A new deployment, or one
// whose Redis lost its data, keeps the window for its models' logs.
func (s *Shards) lineageSettled(ctx context.Context) bool {
	lineage, now, err := s.readLineage(ctx)
	if err != nil {
		return false
	}
	s.mu.Lock()
	first := s.lineage
	s.mu.Unlock()
	created, _ := strconv.ParseInt(lineage[strings.LastIndexByte(lineage, '/')+1:], 10, 64)
	window := s.opts.Log.withDefaults().ReseedWindow.Milliseconds()
	return lineage == first && created > 0 && now-created > window
}

// start runs r's Log, and its leases, until Run's context ends. The caller holds mu.
func (s *Shards) start(r *shardRun) {
	ctx := s.run
	s.wg.Go(func() { _ = r.log.Run(ctx) })
	if r.leases != nil {
		s.wg.Go(func() { r.leases.Run(ctx, min(time.Second, s.opts.WorkerGracePeriod/3+time.Millisecond)) })
	}
}

// Shards returns the shards this replica holds, by model name.
func (s *Shards) Shards() []*kvstate.Shard {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*kvstate.Shard, 0, len(s.shards))
	for _, r := range s.shards {
		out = append(out, r.shard)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Model < out[j].Model })
	return out
}

// Lookup returns the shard of model, if this replica holds one; unlike Shard it never creates
// one (a Route for a model no worker registered has nothing to route to).
func (s *Shards) Lookup(model string) (*kvstate.Shard, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.shards[model]; r != nil {
		return r.shard, true
	}
	return nil, false
}

// Find returns the shard of model if this replica holds it, or, when it serves model and the
// registry names a shard for it that this replica has not picked up yet (the registry is read every
// Poll), adds that shard here and returns it. Nil when no replica has made one.
func (s *Shards) Find(ctx context.Context, model string) (*kvstate.Shard, error) {
	if sh, ok := s.Lookup(model); ok || !s.serves(model) {
		return sh, nil
	}
	prefix, ok, err := s.deployment.Shard(ctx, model)
	switch {
	case err != nil:
		return nil, fmt.Errorf("%w: finding the shard of model %q: %v", kvstate.ErrLogUnavailable, model, err)
	case !ok:
		return nil, nil
	}
	return s.add(ctx, model, prefix).shard, nil
}

// RegisteredElsewhere returns where the worker rank is registered under another model than model:
// a shard this replica holds whose state holds it, or, for the models of the registry it does not
// serve, a worker lease of the rank in that model's shard (a worker holds one while its stream is
// open on some replica, and for the grace period after: as long as it is registered).
func (s *Shards) RegisteredElsewhere(ctx context.Context, key kvstate.WorkerKey, model string) (*kvstate.Shard, string, error) {
	if sh, other, _ := kvstate.HeldElsewhere(s.Shards(), key, model); sh != nil {
		return sh, other, nil
	}
	if len(s.opts.Models) == 0 {
		return nil, "", nil // every model's shard is held here, and checked above
	}
	registry, err := s.deployment.Shards(ctx)
	if err != nil {
		return nil, "", fmt.Errorf("%w: reading the registry of shards: %v", kvstate.ErrLogUnavailable, err)
	}
	match := fmt.Sprintf("%d/%d/", key.ID, key.Rank)
	for other, prefix := range registry {
		if other == model || s.serves(other) {
			continue
		}
		found, err := s.store.Log(prefix).HasLease(ctx, match)
		if err != nil {
			return nil, "", fmt.Errorf("%w: reading the worker leases of model %q: %v", kvstate.ErrLogUnavailable, other, err)
		}
		if found {
			return nil, other, nil
		}
	}
	return nil, "", nil
}

// EndElsewhere applies c, a PrefillDone or Freed, that no shard this replica holds has the
// booking of. The booking may be in the shard of a model this replica does not serve (it holds no
// state of it): the shard whose booking index names the request gets the change in its log, once
// that shard's replicas have published what they booked before the call (bookingindex.go). It may
// be in a shard of a model this replica serves and has not picked up yet (the registry is read
// every Poll; another replica made the shard, or registered it again after Redis lost its data,
// moments ago): that shard is added here, and the call is ErrLogUnavailable until it has loaded.
// And while the deployment's data is younger than the reseed window (Redis lost it, or the
// deployment is new), a replica holding the booking may not have registered its shard again yet:
// ErrLogUnavailable too, as a log's fresh generation is incomplete for the window. Otherwise
// ErrUnknownRequest.
func (s *Shards) EndElsewhere(ctx context.Context, c kvstate.Change) error {
	registry, err := s.deployment.Shards(ctx)
	if err != nil {
		return fmt.Errorf("%w: reading the registry of shards: %v", kvstate.ErrLogUnavailable, err)
	}
	var unsure error
	for model, prefix := range registry {
		if s.serves(model) {
			if _, ok := s.held(model); !ok {
				s.add(ctx, model, prefix)
				unsure = fmt.Errorf("%w: the shard of model %q, made moments ago on another replica, is loading here and may hold the booking; retry", kvstate.ErrLogUnavailable, model)
			}
			continue
		}
		opts := s.opts.Log.withDefaults()
		opts.Prefix = prefix
		found, err := endElsewhere(ctx, s.store.Log(prefix), opts, c)
		switch {
		case found && err == nil:
			return nil
		case err != nil:
			unsure = fmt.Errorf("model %q: %w", model, err)
		}
	}
	if unsure != nil {
		return unsure
	}
	lineage, now, err := s.readLineage(ctx)
	if err != nil {
		return fmt.Errorf("%w: %v", kvstate.ErrLogUnavailable, err)
	}
	created, _ := strconv.ParseInt(lineage[strings.LastIndexByte(lineage, '/')+1:], 10, 64)
	if now-created < s.opts.Log.withDefaults().ReseedWindow.Milliseconds() {
		return fmt.Errorf("%w: not booked in any shard, and Redis lost its data moments ago (or the deployment is new): a replica holding the booking may not have registered its shard again yet; retry", kvstate.ErrLogUnavailable)
	}
	return kvstate.ErrUnknownRequest
}

// A sharded log is a source of shards for the edge.
var _ kvstate.ShardSource = (*Shards)(nil)

// Log returns the Log of model's shard, or nil when this replica holds none.
func (s *Shards) Log(model string) *Log {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.shards[model]; r != nil {
		return r.log
	}
	return nil
}

// Liveness returns the worker leases of model's shard, or nil when this replica holds none or
// runs no leases (ShardsOptions.WorkerGracePeriod).
func (s *Shards) Liveness(model string) kvstate.Liveness {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.shards[model]; r != nil && r.leases != nil {
		return r.leases
	}
	return nil
}

// Prefix returns the key prefix of model's shard, or "" when this replica holds none.
func (s *Shards) Prefix(model string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.shards[model]; r != nil {
		return r.prefix
	}
	return ""
}

// Backend names the store, as GetState reports it.
func (s *Shards) Backend() string { return s.store.Name() }

// Ready is closed once the registry was read and every shard this replica serves that it names
// has caught up with its log (Log.Ready): the shards a starting replica finds. A shard added later
// starts empty everywhere, so it has nothing to catch up with before routing.
func (s *Shards) Ready() <-chan struct{} { return s.ready }

// Observe installs obs on every shard's Log, and on those made later.
func (s *Shards) Observe(obs kvstate.Observers) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.opts.Observers = obs
	for _, r := range s.shards {
		r.log.Observe(obs)
	}
}

// Run runs every shard's Log, and reads the registry every Poll for the shards of the models this
// replica serves that other replicas added, until ctx ends; it returns once every Log has.
func (s *Shards) Run(ctx context.Context) error {
	s.mu.Lock()
	s.run = ctx
	for _, r := range s.shards {
		s.start(r)
	}
	s.mu.Unlock()
	defer s.wg.Wait()
	found := make(chan []*Log, 1) // the logs of the first registry read, for Ready
	first := true
	s.wg.Go(func() {
		var logs []*Log
		select {
		case logs = <-found:
		case <-ctx.Done():
			return
		}
		for _, l := range logs {
			select {
			case <-l.Ready():
			case <-ctx.Done():
				return
			}
		}
		close(s.ready)
	})
	readRegistry := func(ctx context.Context) {
		registry, err := s.deployment.Shards(ctx)
		if err != nil {
			return // the store unreachable: each shard's Log reports it; the registry is read again later
		}
		s.readLineage(ctx)
		var logs []*Log
		for model, prefix := range registry {
			if s.serves(model) {
				logs = append(logs, s.add(ctx, model, prefix).log)
			}
		}
		s.repairRegistry(ctx, registry)
		if first {
			first = false
			found <- logs
		}
	}
	readRegistry(ctx)
	kvstate.Every(ctx, s.opts.Poll, readRegistry)
	return nil
}

// repairRegistry registers again the shards this replica holds that registry lacks: Redis lost its
// data (restarted empty, or failed over to a replica that had not copied the registry yet), and a
// replica starting now must find the shards where the running ones keep them. Each shard's Log
// repairs its own keys (a reseed from its state). A model registered under another prefix than the
// one held here (a replica registered it anew before this one repaired) is logged: this replica
// then applies a log the others no longer write.
func (s *Shards) repairRegistry(ctx context.Context, registry map[string]string) {
	s.mu.Lock()
	held := make(map[string]string, len(s.shards))
	for model, r := range s.shards {
		held[model] = r.prefix
	}
	s.mu.Unlock()
	for model, prefix := range held {
		switch got, ok := registry[model]; {
		case !ok:
			if _, set, err := s.deployment.Register(ctx, model, prefix); err == nil && set {
				s.opts.Log.Logger.Warn("registered a shard again that the store lost", "model", model, "prefix", prefix, "deployment", s.opts.Log.Prefix)
			}
		case got != prefix && s.conflicts[model] != got:
			s.conflicts[model] = got // logged once
			s.opts.Log.Logger.Error("the registry names another shard for this model than the one this replica applies: restart this replica",
				"model", model, "held", prefix, "registry", got)
		}
	}
}
