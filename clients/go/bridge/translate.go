package bridge

import (
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"

	"github.com/kvrouter/kvrouter/clients/go/enginefeed"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// Reasons the bridge drops what an engine sent, beyond enginefeed's decode reasons. The values are
// metric labels (kvrouter_bridge_dropped_blocks_total{reason}).
const (
	// ReasonDPRankMismatch: a batch whose data_parallel_rank is not the rank of the socket it came on.
	ReasonDPRankMismatch = "dp_rank_mismatch"
	// ReasonBlockSize: a stored event whose block_size is not the worker's registered one.
	ReasonBlockSize = "block_size_mismatch"
	// ReasonTokenCount: a stored event whose token ids are not block_size per block (offloading
	// connectors that send no tokens, a truncated event).
	ReasonTokenCount = "token_count"
	// ReasonExtraKeys: stored blocks with extra hash keys (multimodal inputs, a cache salt), which the
	// router's token hashing cannot tell apart from plain text (ExtraKeysSkip).
	ReasonExtraKeys = "extra_keys"
	// ReasonUnknownMedium: a medium the bridge does not map to a storage tier.
	ReasonUnknownMedium = "unknown_medium"
	// ReasonRemote: blocks an engine reports as held elsewhere (locality REMOTE).
	ReasonRemote = "remote_locality"
	// ReasonOtherGroup: events of a KV-cache group other than the one forwarded (hybrid models).
	ReasonOtherGroup = "other_group"
)

// ExtraKeys says what the bridge does with stored blocks that carry extra hash keys.
type ExtraKeys int

const (
	// ExtraKeysSkip drops a stored chain from its first block with extra keys on: the router hashes
	// tokens only, so an image's placeholder tokens would match another image's. The blocks before
	// it are forwarded; blocks stored after it on that chain are dropped by the router as children
	// of an unknown parent. No false cache hit, some missed ones.
	ExtraKeysSkip ExtraKeys = iota
	// ExtraKeysIgnore forwards such blocks as if they had no extra keys: right for text-only models
	// whose only extra key is a LoRA name or a salt the router does not need, wrong for multimodal.
	ExtraKeysIgnore
)

// tierOf maps an engine's medium to a storage tier: the values vLLM, SGLang, TensorRT-LLM and
// LMCache send, as Dynamo maps them; nil or absent is the GPU. ok is false for anything else.
func tierOf(medium string) (tier kvrouterv1.StorageTier, ok bool) {
	switch medium {
	case "", "GPU", "DEVICE":
		return kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, true
	case "CPU", "CPU_PINNED", "CPU_TIER1":
		return kvrouterv1.StorageTier_STORAGE_TIER_HOST, true
	case "CPU_TIER2", "DISK", "NVME", "STORAGE", "FS":
		return kvrouterv1.StorageTier_STORAGE_TIER_DISK, true
	case "EXTERNAL", "NETWORK", "REMOTE", "SHARED", "OBJ":
		return kvrouterv1.StorageTier_STORAGE_TIER_EXTERNAL, true
	}
	return 0, false
}

// allTiers are the tiers the mirror dumps, in order, and the tiers an AllBlocksCleared is forwarded
// for. One cleared event drops every tier of the rank at the router (§4.3), but a router of the
// release before cleared only the tier the event names, and replicas of both releases share the
// log during a rolling upgrade: a cleared event per tier clears the whole rank at either.
var allTiers = []kvrouterv1.StorageTier{
	kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, kvrouterv1.StorageTier_STORAGE_TIER_HOST,
	kvrouterv1.StorageTier_STORAGE_TIER_DISK, kvrouterv1.StorageTier_STORAGE_TIER_EXTERNAL,
}

// translator turns one rank's engine events into kvrouter events.
type translator struct {
	blockSize int
	group     int64
	extraKeys ExtraKeys
}

// drop is what translate did not forward: blocks dropped, by reason.
type drop struct {
	reason string
	blocks int
}

// translate appends the kvrouter events an engine event stands for to out, and reports what it
// dropped (reason "" when nothing). Stored blocks carry their tokens_hash, not their tokens.
func (t *translator) translate(ev *enginefeed.Event, out []*kvrouterv1.KvEvent) ([]*kvrouterv1.KvEvent, drop) {
	if ev.Kind == enginefeed.AllBlocksCleared {
		for _, tier := range allTiers {
			out = append(out, &kvrouterv1.KvEvent{StorageTier: tier, Data: &kvrouterv1.KvEvent_Cleared{Cleared: &kvrouterv1.CacheCleared{}}})
		}
		return out, drop{}
	}
	n := len(ev.BlockHashes)
	if ev.Locality == "REMOTE" {
		return out, drop{ReasonRemote, n}
	}
	if ev.HasGroup && ev.GroupIdx != t.group {
		return out, drop{ReasonOtherGroup, n}
	}
	tier, ok := tierOf(ev.Medium)
	if !ok {
		return out, drop{ReasonUnknownMedium, n}
	}
	if n == 0 {
		return out, drop{}
	}
	if ev.Kind == enginefeed.BlockRemoved {
		hashes := make([]uint64, n)
		copy(hashes, ev.BlockHashes)
		return append(out, &kvrouterv1.KvEvent{StorageTier: tier, Data: &kvrouterv1.KvEvent_Removed{Removed: &kvrouterv1.BlocksRemoved{BlockHashes: hashes}}}), drop{}
	}
	if ev.BlockSize != t.blockSize {
		return out, drop{ReasonBlockSize, n}
	}
	if len(ev.TokenIDs) != n*t.blockSize {
		return out, drop{ReasonTokenCount, n}
	}
	keep, dropped := n, drop{}
	if ev.ExtraKeys && t.extraKeys == ExtraKeysSkip {
		keep, dropped = ev.FirstExtraKey, drop{ReasonExtraKeys, n - ev.FirstExtraKey}
		if keep == 0 {
			return out, dropped
		}
	}
	// The bridge hashes the tokens itself (8 bytes a block on the wire instead of 4 per token),
	// so that its mirror holds exactly what the router holds.
	salt := blockhash.Salt(ev.LoraName, "")
	hashes := make([]uint64, keep)
	blocks := make([]kvrouterv1.StoredBlock, keep) // one allocation for the event's blocks
	stored := &kvrouterv1.BlocksStored{Blocks: make([]*kvrouterv1.StoredBlock, keep), LoraName: ev.LoraName}
	for i := range keep {
		hashes[i] = blockhash.Local(ev.TokenIDs[i*t.blockSize:(i+1)*t.blockSize], salt)
		blocks[i].BlockHash = ev.BlockHashes[i]
		blocks[i].TokensHash = &hashes[i]
		stored.Blocks[i] = &blocks[i]
	}
	if ev.HasParent {
		parent := ev.ParentHash
		stored.ParentHash = &parent
	}
	return append(out, &kvrouterv1.KvEvent{StorageTier: tier, Data: &kvrouterv1.KvEvent_Stored{Stored: stored}}), dropped
}
