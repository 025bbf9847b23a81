package bridge

import (
	"slices"

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
	// ReasonTokenCount: a stored event whose token ids are not block_size per block (a truncated
	// event).
	ReasonTokenCount = "token_count"
	// ReasonUnknownBlock: a stored event without token ids (the placeholder vLLM's offloading
	// connector sends) naming a block the bridge holds on no tier, so that nothing tells its key.
	ReasonUnknownBlock = "unknown_block"
	// ReasonExtraKeys: stored blocks with extra hash keys the bridge cannot map (a key of unknown
	// shape, a list of extra keys for another number of blocks), or any extra keys with
	// ExtraKeysSkip.
	ReasonExtraKeys = "extra_keys"
	// ReasonPromptEmbeds: stored blocks computed from prompt embeddings instead of token ids, which
	// no Route can name.
	ReasonPromptEmbeds = "prompt_embeds"
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
	// ExtraKeysHash keys such blocks as the router keys a Route (docs/hashing.md): the LoRA name
	// salts them (the event's lora_name), a cache salt on a prompt's first block salts that block
	// and every block after it on its chain (cache_namespace), and multimodal identifiers are folded
	// into the blocks that hold them (MultimodalHash). Blocks computed from prompt embeddings, and
	// keys of a shape it does not know, are dropped from that block on.
	ExtraKeysHash ExtraKeys = iota
	// ExtraKeysSkip drops a stored chain from its first block with extra keys on, as the bridge did
	// before it mapped them: no LoRA, salted or multimodal block reaches the router.
	ExtraKeysSkip
	// ExtraKeysIgnore forwards such blocks as if they had no extra keys (but the LoRA name): only for
	// a model whose extra keys carry nothing the router must tell apart.
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

// translator turns one rank's engine events into kvrouter events, and records them in the rank's
// mirror as it goes: the mirror tells it how a block already held was keyed and how many
// announcements of it are not yet removed.
type translator struct {
	m         *mirror
	blockSize int
	group     int64
	extraKeys ExtraKeys
	// namespaces holds, for every block stored with a cache salt and not removed since, the salt's
	// part of its hash (blockhash.NamespaceSalt) and the tiers holding it: vLLM names a request's
	// cache salt on its first block only, so the blocks stored after it, in later events too, are
	// salted with their parent's namespace. Blocks without a salt are not kept.
	namespaces map[uint64]namespaced
	mm         []uint64 // scratch: one block's multimodal hashes
}

type namespaced struct {
	salt  uint64
	tiers uint8 // a bit per storage tier
}

func tierBit(tier kvrouterv1.StorageTier) uint8 { return 1 << uint(tier) }

// forget drops what the translator and the mirror know of stored blocks: the router no longer
// holds them.
func (t *translator) forget() {
	t.m.clear()
	clear(t.namespaces)
}

// drop is what translate did not forward: blocks dropped, by reason.
type drop struct {
	reason string
	blocks int
}

// translate appends the kvrouter events an engine event stands for to out, records them in the
// mirror, and reports what it dropped (reason "" when nothing). Stored blocks carry their
// tokens_hash, not their tokens.
func (t *translator) translate(ev *enginefeed.Event, out []*kvrouterv1.KvEvent) ([]*kvrouterv1.KvEvent, drop) {
	t.m.mu.Lock()
	defer t.m.mu.Unlock()
	if ev.Kind == enginefeed.AllBlocksCleared {
		t.m.clearLocked()
		clear(t.namespaces)
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
	switch {
	case ev.Kind == enginefeed.BlockRemoved:
		return t.removed(ev, tier, out), drop{}
	case len(ev.TokenIDs) == 0:
		return t.storedWithoutTokens(ev, tier, out)
	}
	return t.stored(ev, tier, out)
}

// removed forwards the hashes of a removal that leave tier without the block (releaseLocked).
func (t *translator) removed(ev *enginefeed.Event, tier kvrouterv1.StorageTier, out []*kvrouterv1.KvEvent) []*kvrouterv1.KvEvent {
	n := len(ev.BlockHashes)
	// Without one remaining count per hash the counts say nothing certain, and the mirror's are used.
	counted := len(ev.RemainingCopies) == n
	hashes := make([]uint64, 0, n)
	for i, h := range ev.BlockHashes {
		var remaining int64
		if counted {
			remaining = ev.RemainingCopies[i]
		}
		if t.m.releaseLocked(tier, h, remaining, counted) {
			hashes = append(hashes, h)
		}
	}
	if len(hashes) == 0 {
		return out
	}
	if len(t.namespaces) > 0 {
		for _, h := range hashes {
			if e, ok := t.namespaces[h]; ok {
				if e.tiers &^= tierBit(tier); e.tiers == 0 {
					delete(t.namespaces, h)
				} else {
					t.namespaces[h] = e
				}
			}
		}
	}
	return append(out, &kvrouterv1.KvEvent{StorageTier: tier, Data: &kvrouterv1.KvEvent_Removed{Removed: &kvrouterv1.BlocksRemoved{BlockHashes: hashes}}})
}

// storedWithoutTokens forwards a stored event that names its blocks by hash only: what vLLM's
// offloading connector sends for a block copied to the CPU or to storage (block_size 0, no parent,
// no token ids) unless its self-describing events are on. A block the bridge holds on another tier
// is keyed as it was there, with the parent it had; one it holds on no tier is dropped.
//
// The connector names an offloaded chunk by the hash of its last block. A chunk of one engine block
// (the connector's default) is therefore the block itself. A chunk of several is forwarded as its
// last block only: the router then counts the chunk's blocks on the slower tier only where the
// faster one still holds them before it, a missed hit at worst.
func (t *translator) storedWithoutTokens(ev *enginefeed.Event, tier kvrouterv1.StorageTier, out []*kvrouterv1.KvEvent) ([]*kvrouterv1.KvEvent, drop) {
	runs := chainedRuns{tier: tier}
	unknown := 0
	for _, h := range ev.BlockHashes {
		b, ok := t.m.keyLocked(h)
		if !ok {
			unknown++
			continue
		}
		runs.add(b)
		if e, ok := t.namespaces[h]; ok {
			t.remember(h, e.salt, tier)
		}
	}
	for _, e := range runs.events {
		t.m.storeLocked(tier, e.GetStored())
	}
	out = append(out, runs.events...)
	if unknown > 0 {
		return out, drop{ReasonUnknownBlock, unknown}
	}
	return out, drop{}
}

// stored forwards a stored event with its blocks' token ids, keyed as Route keys a prompt.
func (t *translator) stored(ev *enginefeed.Event, tier kvrouterv1.StorageTier, out []*kvrouterv1.KvEvent) ([]*kvrouterv1.KvEvent, drop) {
	n := len(ev.BlockHashes)
	if ev.BlockSize != t.blockSize {
		return out, drop{ReasonBlockSize, n}
	}
	if len(ev.TokenIDs) != n*t.blockSize {
		return out, drop{ReasonTokenCount, n}
	}
	keep, dropped := n, drop{}
	mapKeys := ev.HasExtraKeys() && t.extraKeys == ExtraKeysHash
	switch {
	case !ev.HasExtraKeys():
	case t.extraKeys == ExtraKeysSkip:
		if keep = firstWithKeys(ev); keep < n {
			dropped = drop{ReasonExtraKeys, n - keep}
		}
	case t.extraKeys == ExtraKeysHash && len(ev.ExtraKeyEnds) != n:
		return out, drop{ReasonExtraKeys, n} // keys listed for another number of blocks: which are whose?
	}
	if keep == 0 {
		return out, dropped
	}
	// A block copied to a slower tier without extra keys keeps the key it has on a faster one:
	// vLLM's self-describing offloading events carry the tokens but not the extra keys, and an image
	// block, or a salted one, keyed from its tokens alone would be another block.
	reuseKeys := tier != kvrouterv1.StorageTier_STORAGE_TIER_DEVICE && !ev.HasExtraKeys()
	// The bridge hashes the tokens itself (8 bytes a block on the wire instead of 4 per token),
	// so that its mirror holds exactly what the router holds.
	salt := blockhash.Salt(ev.LoraName, "")
	var ns uint64 // the namespace's part of the salt, inherited along the chain
	if ev.HasParent {
		ns = t.namespaces[ev.ParentHash].salt
	}
	eventNS := blockhash.NamespaceSalt(ev.CacheSalt) // SGLang names the salt on every event of the request
	hashes := make([]uint64, keep)
	blocks := make([]kvrouterv1.StoredBlock, keep) // one allocation for the event's blocks
	stored := &kvrouterv1.BlocksStored{Blocks: make([]*kvrouterv1.StoredBlock, keep), LoraName: ev.LoraName}
	for i := range keep {
		tokens := ev.TokenIDs[i*t.blockSize : (i+1)*t.blockSize]
		if eventNS != 0 {
			ns = eventNS
		} else if e, ok := t.namespaces[ev.BlockHashes[i]]; ok {
			ns = e.salt // stored before (in another tier): what it was then
		}
		known := false
		if reuseKeys {
			var k mirroredBlock
			if k, known = t.m.keyLocked(ev.BlockHashes[i]); known {
				hashes[i] = k.tokensHash
			}
		}
		switch {
		case known:
		case !mapKeys:
			hashes[i] = blockhash.Local(tokens, salt+ns)
		default:
			mm, salted, reason := t.blockKeys(ev, i)
			if reason != "" {
				keep, dropped = i, drop{reason, n - i}
				break
			}
			if salted != 0 {
				ns = salted
			}
			hashes[i] = blockhash.LocalMultimodal(tokens, mm, salt+ns)
		}
		if keep == i {
			break
		}
		blocks[i].BlockHash = ev.BlockHashes[i]
		blocks[i].TokensHash = &hashes[i]
		stored.Blocks[i] = &blocks[i]
		if ns != 0 {
			t.remember(ev.BlockHashes[i], ns, tier)
		}
	}
	if keep == 0 {
		return out, dropped
	}
	stored.Blocks = stored.Blocks[:keep]
	if ev.HasParent {
		parent := ev.ParentHash
		stored.ParentHash = &parent
	}
	t.m.storeLocked(tier, stored)
	return append(out, &kvrouterv1.KvEvent{StorageTier: tier, Data: &kvrouterv1.KvEvent_Stored{Stored: stored}}), dropped
}

// remember records that block hash of tier is salted with namespace salt ns.
func (t *translator) remember(hash, ns uint64, tier kvrouterv1.StorageTier) {
	if t.namespaces == nil {
		t.namespaces = make(map[uint64]namespaced)
	}
	e := t.namespaces[hash]
	e.salt, e.tiers = ns, e.tiers|tierBit(tier)
	t.namespaces[hash] = e
}

// blockKeys reads stored block i's extra keys as vLLM writes them (LoRA name, multimodal inputs,
// the cache salt on a prompt's first block, prompt embeddings): it returns the block's multimodal
// hashes, sorted, and the namespace salt of a cache salt the block names (0 for none), or the
// reason the block cannot be forwarded.
//
// A string key is the LoRA name when it equals the event's lora_name, and a multimodal identifier
// when it is 64 hex digits (vLLM's digest of an input, before vLLM 0.19 wrote inputs as pairs). On
// the first block of a prompt (an event without a parent, block 0), the last other string is the
// cache salt; any other string is a multimodal identifier a frontend chose (vLLM before 0.19).
func (t *translator) blockKeys(ev *enginefeed.Event, i int) (mm []uint64, ns uint64, reason string) {
	keys := ev.BlockExtraKeys(i)
	first := i == 0 && !ev.HasParent
	saltAt := -1 // the index of the cache salt among keys
	for k, key := range keys {
		switch key.Kind {
		case enginefeed.ExtraBytes:
			return nil, 0, ReasonPromptEmbeds
		case enginefeed.ExtraString:
			if first && !(key.Text == ev.LoraName && ev.LoraName != "") && !blockhash.IsEngineDigest(key.Text) {
				saltAt = k
			}
		case enginefeed.ExtraPair:
		default:
			return nil, 0, ReasonExtraKeys
		}
	}
	mm = t.mm[:0]
	for k, key := range keys {
		switch {
		case k == saltAt:
			ns = blockhash.NamespaceSalt(key.Text)
		case key.Kind == enginefeed.ExtraPair:
			mm = append(mm, blockhash.MultimodalHash(key.Text))
		case key.Text == ev.LoraName && ev.LoraName != "":
		default: // a string: a digest, or an identifier a frontend chose
			mm = append(mm, blockhash.MultimodalHash(key.Text))
		}
	}
	slices.Sort(mm)
	t.mm = mm
	return mm, ns, ""
}

// firstWithKeys returns the index of the first stored block with extra keys (len(BlockHashes)
// when none has).
func firstWithKeys(ev *enginefeed.Event) int {
	for i := range ev.BlockHashes {
		if len(ev.BlockExtraKeys(i)) > 0 {
			return i
		}
	}
	return len(ev.BlockHashes)
}
