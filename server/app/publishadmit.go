package app

import (
	"context"
	"fmt"

	"github.com/kvrouter/kvrouter/kvstate"
)

// admit refuses a new worker rank of a model that has max_workers_per_model already. A rank the
// state knows re-registers freely. Replicas admit on their own view of the state, so registrations
// racing on several replicas may pass the cap by one per replica.
//
// A worker id is held to max_ranks_per_worker ranks in the model as well, so that one worker's
// credential (whose worker_ids name a few ids) cannot fill the model's cap with ranks of its own
// and lock every other worker of the model out: before, the documented worker-7 credential
// registered 10,000 ranks of worker 7 in 3.7 s. A credential may so register at most
// max_ranks_per_worker ranks for each of its worker ids.
func (p *Publishing) admit(state *kvstate.State, info kvstate.WorkerInfo) error {
	if state.Worker(info.Key) != nil {
		return nil
	}
	m := state.Model(info.Model)
	if m == nil {
		return nil
	}
	workers := m.Workers()
	if most := p.opts.MaxWorkersPerModel; most > 0 && len(workers) >= most {
		return overLimit("WORKERS_PER_MODEL", "hello.model", "max_workers_per_model", most, len(workers),
			"model %q has %d worker ranks registered, the most max_workers_per_model allows (%d)", info.Model, len(workers), most)
	}
	if most := p.opts.MaxRanksPerWorker; most > 0 {
		ranks := 0
		for _, w := range workers {
			if w.Info.Key.ID == info.Key.ID {
				ranks++
			}
		}
		if ranks >= most {
			return overLimit("RANKS_PER_WORKER", "hello.dp_rank", "max_ranks_per_worker", most, ranks,
				"worker %d has %d ranks registered in model %q, the most max_ranks_per_worker allows (%d)", info.Key.ID, ranks, info.Model, most)
		}
	}
	return nil
}

// modelRoom refuses a hello naming a model this replica does not know when it knows max_models
// already. A model lives on (a log sharded by model keeps a shard of it on every replica), and every
// model adds series to /metrics: before, a worker credential without models made 30,000 of them,
// and a scrape took 4 s and 93 MB. Replicas count on their own view, so a model new on several at
// once may pass the cap by one each.
func (p *Publishing) modelRoom(model string) error {
	most := p.opts.MaxModels
	if most <= 0 {
		return nil
	}
	n := 0
	for _, sh := range p.opts.Shards.Shards() {
		if sh.Model == model || sh.State.Model(model) != nil {
			return nil
		}
		n += len(sh.State.Models())
	}
	if n >= most {
		return overLimit("MODELS", "hello.model", "max_models", most, n,
			"model %q would be this router's %d-th model, past max_models (%d)", model, n+1, most)
	}
	return nil
}

// oneModel refuses a hello naming another model than the one the worker rank is registered with
// in the deployment (WORKER_CONFLICT), unless the worker starts afresh, which moves it: its
// registration in the other model is removed first. One state holding every model decides that as
// it applies the hello; a log sharded by model has a state per model, and the session asks them all
// (kvstate.ShardSource.RegisteredElsewhere), so that every layout answers alike.
func (p *Publishing) oneModel(ctx context.Context, info kvstate.WorkerInfo, fresh bool) error {
	held, other, err := p.opts.Shards.RegisteredElsewhere(ctx, info.Key, info.Model)
	switch {
	case err != nil:
		return fmt.Errorf("hello: %w", err)
	case other == "":
		return nil
	case held == nil:
		return fmt.Errorf("%w: worker %v is registered as model %q, which this replica does not serve: start it afresh on a replica that does, or after its grace period",
			kvstate.ErrWorkerConflict, info.Key, other)
	case !fresh:
		if w := held.State.Worker(info.Key); w != nil {
			return kvstate.WorkerConflict(w.Info)
		}
		return nil // removed meanwhile
	}
	if _, err := held.Log.Append(ctx, kvstate.WorkerRemoved{Key: info.Key}); err != nil {
		return fmt.Errorf("hello: removing the worker's registration as model %q: %w", other, err)
	}
	return nil
}
