// Package kvstate holds what the router knows: block hashing, the prefix index of cached blocks, the
// worker registry, load bookkeeping, and the ordered log of changes that feeds them.
//
// State is a deterministic state machine: every change arrives as a Change appended to a Log, and a
// replica's state is a function of the log prefix it has applied. Reads (overlap and load) come from
// local memory and never wait on the log.
//
// A "§N.M" in this package's comments names a section of docs/dynamo-behaviour.md, the Dynamo
// behaviour the router matches.
package kvstate

import (
	"fmt"
)

// WorkerKey identifies one worker rank: an engine instance and a data-parallel rank inside it.
type WorkerKey struct {
	ID   uint64
	Rank uint32
}

// String formats the key as id/rank, as logs and error messages show it.
func (k WorkerKey) String() string { return fmt.Sprintf("%d/%d", k.ID, k.Rank) }

// Role is the phase of inference a worker runs.
type Role uint8

// Roles. RoleUnspecified is never stored.
const (
	RoleUnspecified Role = iota
	RolePrefill
	RoleDecode
	RoleAggregated
)

// String returns the role's lower-case name.
func (r Role) String() string {
	switch r {
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	case RoleAggregated:
		return "aggregated"
	}
	return "unspecified"
}

// Tier is a storage tier. Lower values are faster; overlap depth per tier is cumulative, so a block
// held on the device also counts for every slower tier.
type Tier uint8

// Storage tiers, fastest first.
const (
	TierDevice Tier = iota
	TierHost
	TierDisk
	TierExternal
	// NumTiers is the number of tiers.
	NumTiers = 4
)

// String returns the tier's lower-case name.
func (t Tier) String() string {
	switch t {
	case TierDevice:
		return "device"
	case TierHost:
		return "host"
	case TierDisk:
		return "disk"
	case TierExternal:
		return "external"
	}
	return fmt.Sprintf("tier(%d)", uint8(t))
}

// WorkerInfo is what a worker advertises when it registers.
type WorkerInfo struct {
	Key                 WorkerKey
	Model               string
	Role                Role
	BlockSize           uint32
	TotalKVBlocks       uint64 // 0 = unknown
	MaxNumBatchedTokens uint64 // 0 = unknown
	Endpoint            string
	SupportsBypass      bool
	KVEventsEnabled     bool
}

// SameCapacity reports whether two registrations describe the same engine configuration. A worker
// may re-send its hello (for example after a reconnect), but not change what it is.
func (w WorkerInfo) SameCapacity(o WorkerInfo) bool {
	return w.Key == o.Key && w.Model == o.Model && w.Role == o.Role && w.BlockSize == o.BlockSize &&
		w.TotalKVBlocks == o.TotalKVBlocks && w.MaxNumBatchedTokens == o.MaxNumBatchedTokens
}

// EventKind says what a KV event did.
type EventKind uint8

// KV event kinds.
const (
	EventStored EventKind = iota + 1
	EventRemoved
	EventCleared
)

// Block is one stored block: the engine's identifier and the router's local hash of its tokens.
type Block struct {
	Hash  uint64 // engine block_hash (external sequence hash)
	Local uint64 // local hash of the tokens, salted (see blockhash.Salt)
}

// Event is one KV-cache event of a worker rank.
type Event struct {
	ID        uint64
	Tier      Tier
	Kind      EventKind
	Parent    uint64 // engine hash of the parent block, if HasParent
	HasParent bool
	Blocks    []Block  // EventStored
	Removed   []uint64 // EventRemoved: engine hashes
}

// TierCounts counts blocks per tier.
type TierCounts [NumTiers]uint64

// Total returns the sum over all tiers.
func (c TierCounts) Total() uint64 {
	var n uint64
	for _, v := range c {
		n += v
	}
	return n
}
