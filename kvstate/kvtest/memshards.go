package kvtest

import (
	"context"
	"slices"
	"strings"
	"sync"

	"github.com/kvrouter/kvrouter/kvstate"
)

// MemShards is an in-process kvstate.ShardSource, for tests, with a shard (a State and a MemLog) per model, made when
// a worker of the model first registers: the layout of a sharded shared log, in one process.
type MemShards struct {
	mu     sync.Mutex
	shards map[string]*kvstate.Shard
}

// Open returns model's shard, making it on first use.
func (m *MemShards) Open(_ context.Context, model string) (*kvstate.Shard, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if sh := m.shards[model]; sh != nil {
		return sh, nil
	}
	st := kvstate.NewState()
	sh := &kvstate.Shard{Model: model, State: st, Log: kvstate.NewMemLog(st)}
	if m.shards == nil {
		m.shards = make(map[string]*kvstate.Shard)
	}
	m.shards[model] = sh
	return sh, nil
}

// Lookup returns model's shard, if one was made.
func (m *MemShards) Lookup(model string) (*kvstate.Shard, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	sh, ok := m.shards[model]
	return sh, ok
}

// Find returns model's shard, or nil if none was made.
func (m *MemShards) Find(_ context.Context, model string) (*kvstate.Shard, error) {
	sh, _ := m.Lookup(model)
	return sh, nil
}

// Shards returns every shard, in model order.
func (m *MemShards) Shards() []*kvstate.Shard {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]*kvstate.Shard, 0, len(m.shards))
	for _, sh := range m.shards {
		out = append(out, sh)
	}
	slices.SortFunc(out, func(a, b *kvstate.Shard) int { return strings.Compare(a.Model, b.Model) })
	return out
}

// EndElsewhere has nowhere else to look: every shard is in this process.
func (m *MemShards) EndElsewhere(context.Context, kvstate.Change) error {
	return kvstate.ErrUnknownRequest
}

// RegisteredElsewhere returns the shard of another model whose state holds the worker rank.
func (m *MemShards) RegisteredElsewhere(_ context.Context, key kvstate.WorkerKey, model string) (*kvstate.Shard, string, error) {
	return kvstate.HeldElsewhere(m.Shards(), key, model)
}

// Ready is nil: an in-process log has nothing to catch up with.
func (m *MemShards) Ready() <-chan struct{} { return nil }

// Observe does nothing: an in-process log has no timings to report.
func (m *MemShards) Observe(kvstate.Observers) {}

var _ kvstate.ShardSource = (*MemShards)(nil)
