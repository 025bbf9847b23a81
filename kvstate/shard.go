package kvstate

import (
	"context"
	"errors"
)

// Shard is one state machine: a State and the Log every change to it goes through. A deployment
// whose shared log is split by model (kvstate/replication.Shards) runs one shard per model, each
// applied on its own and in its own order; otherwise one shard holds every model. Nothing in a
// shard's state depends on another shard's changes (docs/architecture.md, "The shared log's order,
// and sharding it by model").
type Shard struct {
	// Model is the model the shard holds; "" for a shard that holds every model.
	Model string
	State *State
	Log   Log
	// Liveness keeps the shard's workers alive while their streams are open on some replica; nil
	// means LocalLiveness (one process).
	Liveness Liveness
}

// ErrModelNotServed: the replica is configured to serve other models only, so it holds no shard
// for this one.
var ErrModelNotServed = errors.New("model is not served by this replica")

// ShardSource finds the shards a replica holds: replication.Shards for a log sharded by model, OneShard
// otherwise. The edge holds one and never knows which.
type ShardSource interface {
	// Open returns the shard that holds model, creating it if no replica has yet (a worker's hello
	// naming a new model). ErrModelNotServed when this replica serves other models only;
	// ErrLogUnavailable when the store could not be asked.
	Open(ctx context.Context, model string) (*Shard, error)
	// Lookup returns the shard holding model on this replica, if there is one; unlike Open it
	// never creates one.
	Lookup(model string) (*Shard, bool)
	// Find returns the shard holding model, adding it here when the deployment has one this
	// replica has not picked up yet (another replica created it a moment ago); nil when no
	// replica has one. Unlike Open it never creates one. ErrLogUnavailable when the store could
	// not be asked.
	Find(ctx context.Context, model string) (*Shard, error)
	// Shards returns every shard this replica holds, in model order.
	Shards() []*Shard
	// EndElsewhere applies c, a PrefillDone or Freed that no shard of this replica holds the
	// booking of, to a shard this replica does not hold (a replica serving a subset of the
	// models): ErrUnknownRequest when none holds it either, ErrLogUnavailable when the store could
	// not tell.
	EndElsewhere(ctx context.Context, c Change) error
	// RegisteredElsewhere returns where the worker rank is registered in this deployment under a
	// model other than model: the shard holding it, when this replica holds that shard, and that
	// model's name ("" when there is none). A rank belongs to one model: a hello naming another
	// is refused (ErrWorkerConflict) unless it starts afresh, which moves it. With one shard for
	// every model the state decides that itself, and this returns nothing. ErrLogUnavailable when
	// the store could not be asked.
	RegisteredElsewhere(ctx context.Context, key WorkerKey, model string) (*Shard, string, error)
	// Ready is closed once this replica has caught up with the shards it found at start (a
	// replica routing before would route from a partial view); nil when there is nothing to catch
	// up with (an unshared, in-process log).
	Ready() <-chan struct{}
	// Observe installs timing hooks on every shard's shared log, including shards added later.
	Observe(Observers)
}

// OneShard is the ShardSource of a replica whose log is not sharded: its one shard holds every
// model.
type OneShard struct{ Shard *Shard }

// Open returns the one shard, whatever the model.
func (o OneShard) Open(context.Context, string) (*Shard, error) { return o.Shard, nil }

// Lookup returns the one shard, whatever the model.
func (o OneShard) Lookup(string) (*Shard, bool) { return o.Shard, true }

// Find returns the one shard, whatever the model.
func (o OneShard) Find(context.Context, string) (*Shard, error) { return o.Shard, nil }

// Shards returns the one shard.
func (o OneShard) Shards() []*Shard { return []*Shard{o.Shard} }

// EndElsewhere has nowhere else to look: the one shard holds every model.
func (o OneShard) EndElsewhere(context.Context, Change) error { return ErrUnknownRequest }

// RegisteredElsewhere returns nothing: the one state holds every model and refuses a conflicting
// registration itself.
func (o OneShard) RegisteredElsewhere(context.Context, WorkerKey, string) (*Shard, string, error) {
	return nil, "", nil
}

// Ready is the shared log's (nil for a log that is not shared).
func (o OneShard) Ready() <-chan struct{} {
	if sl, ok := o.Shard.Log.(SharedLog); ok {
		return sl.Ready()
	}
	return nil
}

// Observe installs obs on the shared log (nothing for a log that is not shared).
func (o OneShard) Observe(obs Observers) {
	if sl, ok := o.Shard.Log.(SharedLog); ok {
		sl.Observe(obs)
	}
}

// HeldElsewhere returns the first of shards, other than model's, whose state holds the worker rank,
// and its model.
func HeldElsewhere(shards []*Shard, key WorkerKey, model string) (*Shard, string, error) {
	for _, sh := range shards {
		if sh.Model != model && sh.State.Worker(key) != nil {
			return sh, sh.Model, nil
		}
	}
	return nil, "", nil
}
