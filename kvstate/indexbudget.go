package kvstate

import "sync/atomic"

// indexBudget bounds the distinct blocks all models' indexes hold together (max_index_blocks), so
// that no publisher, mistaken or hostile, can grow the router's memory without end. Past the cap a
// stored block that would add a new position to an index is not indexed, nor are the blocks after
// it in its event (they continue a chain the index no longer follows); what is already indexed
// stays, and room comes back as workers evict. A refused block costs routing a cache hit, never a
// wrong answer.
//
// Replicas apply concurrent workers' events in different orders, so at the cap they may refuse
// different blocks: size the cap so that it is never reached in normal operation, and alert on
// kvrouter_index_blocks_refused_total.
type indexBudget struct {
	limit   int64 // 0: no cap
	used    atomic.Int64
	refused atomic.Uint64
}

// take counts one new index position, or says there is no room for it.
func (b *indexBudget) take() bool {
	if b.limit > 0 && b.used.Load() >= b.limit {
		return false
	}
	b.used.Add(1)
	return true
}

// SetMaxIndexBlocks caps the distinct blocks the state's indexes hold together (0: no cap). Set it
// before the state is used, to the same value on every replica.
func (s *State) SetMaxIndexBlocks(n int) { s.budget.limit = int64(n) }

// IndexBlocks returns the distinct blocks all models' indexes hold.
func (s *State) IndexBlocks() int64 { return s.budget.used.Load() }

// IndexBlocksRefused returns how many stored blocks were not indexed because the indexes were full.
func (s *State) IndexBlocksRefused() uint64 { return s.budget.refused.Load() }
