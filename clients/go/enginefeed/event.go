// Package enginefeed reads and writes the KV-cache event feed that vLLM publishes, and SGLang and
// TensorRT-LLM copy: ZMQ PUB messages of three frames (topic, sequence number as 8 bytes big-endian,
// msgpack payload), each payload a batch [ts, events, data_parallel_rank], and the replies of the
// engine's ROUTER replay endpoint. It is the wire format only: what a batch says, decoded by position
// or by name, with the reason an event could not be read. What to do with the events (map them to
// kvrouter's contract, track sequence gaps) is the bridge's job (clients/go/bridge).
//
// Engines differ by version, so decoding is tolerant where the format grew and strict where it
// did not. Events are msgpack arrays with the tag first (vLLM before June 2026, SGLang before
// September 2026) or maps with the tag under "type" (since); positional events may stop after
// their required fields or carry fields added later, and map events may carry keys this package
// does not know. Block hashes are integers (vLLM's uint64, SGLang's and Dynamo's int64, both read
// as the same 64 bits) or byte strings (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), read as
// their last 8 bytes big-endian, which is the integer vLLM would have sent.
package enginefeed

// Kind is what an event says happened to the engine's cache.
type Kind uint8

// Event kinds, named after the engines' tags.
const (
	// BlockStored: blocks were written to the cache, as one chain.
	BlockStored Kind = iota + 1
	// BlockRemoved: blocks were evicted.
	BlockRemoved
	// AllBlocksCleared: the whole cache was dropped.
	AllBlocksCleared
)

// Tags are the engines' names of the event kinds, indexed by Kind.
var tags = [...]string{BlockStored: "BlockStored", BlockRemoved: "BlockRemoved", AllBlocksCleared: "AllBlocksCleared"}

func (k Kind) String() string {
	if int(k) < len(tags) && tags[k] != "" {
		return tags[k]
	}
	return "Kind(?)"
}

// Event is one decoded KV-cache event. Fields an engine did not send are zero (HasParent,
// HasGroup say whether the optional numbers were sent); strings the engine sent as nil are empty.
type Event struct {
	Kind Kind
	// BlockHashes are the engine's hashes of the stored or removed blocks, in chain order.
	BlockHashes []uint64
	// ParentHash is the hash of the block the stored chain continues, when HasParent.
	ParentHash uint64
	HasParent  bool
	// TokenIDs are the tokens of every stored block, block after block (BlockSize per block).
	TokenIDs []uint32
	// BlockSize is the engine's block size, in tokens, as the stored event states it.
	BlockSize int
	// Medium is where the blocks live ("GPU", "CPU", ...; "" when the engine sent nil or nothing).
	Medium string
	// LoraName is the LoRA adapter the stored blocks were computed with ("" for the base model).
	// SGLang sends none; in its place a salted request's events carry metadata, whose cache_salt
	// is CacheSalt.
	LoraName string
	// CacheSalt is the cache salt of every stored block of the event (SGLang's metadata.cache_salt;
	// vLLM names its salt in ExtraKeys instead).
	CacheSalt string
	// ExtraKeys are the stored blocks' extra hash keys (the LoRA name, multimodal identifiers, a
	// cache salt), block after block: block i's are ExtraKeys[ExtraKeyEnds[i-1]:ExtraKeyEnds[i]]
	// (BlockExtraKeys). ExtraKeyEnds has one entry per block the engine listed, and none when it
	// sent no extra_keys.
	ExtraKeys    []ExtraKey
	ExtraKeyEnds []int32
	// RemainingCopies are, for a removal, how many copies of each removed block the engine still
	// holds (vLLM's remaining_copy_counts, one per hash): a block whose count is not 0 is still
	// cached. Empty when the engine sent none.
	RemainingCopies []int64
	// GroupIdx is the KV-cache group of a hybrid model, when HasGroup; SpecKind names its kind
	// ("full_attention", "sliding_window", ...).
	GroupIdx int64
	HasGroup bool
	SpecKind string
	// Locality is "LOCAL", "REMOTE" or "" (not sent).
	Locality string
}

// ExtraKey is one extra hash key of a stored block, as vLLM writes it (vllm/v1/core/kv_cache_utils.py,
// generate_block_hash_extra_keys: the LoRA name, then the block's multimodal inputs, then the
// request's cache salt on its first block, then a digest of prompt embeddings).
type ExtraKey struct {
	Kind ExtraKeyKind
	// Text is a string key, or a pair's identifier.
	Text string
	// Offset is a pair's offset: where the multimodal input starts, relative to the block's first
	// token (negative when it started in an earlier block).
	Offset int64
}

// ExtraKeyKind is the shape of an extra key.
type ExtraKeyKind uint8

// The shapes of extra keys.
const (
	// ExtraString: a string: a LoRA name, a cache salt, or (vLLM before 0.19) a multimodal identifier.
	ExtraString ExtraKeyKind = iota + 1
	// ExtraPair: [identifier, offset], a multimodal input (vLLM 0.19 on).
	ExtraPair
	// ExtraBytes: a byte string: the digest of the block's prompt embeddings.
	ExtraBytes
	// ExtraOther: anything else (a number, a nested list).
	ExtraOther
)

// BlockExtraKeys returns the extra keys of stored block i (nil when it has none or the engine listed
// fewer blocks).
func (ev *Event) BlockExtraKeys(i int) []ExtraKey {
	if i < 0 || i >= len(ev.ExtraKeyEnds) {
		return nil
	}
	lo := int32(0)
	if i > 0 {
		lo = ev.ExtraKeyEnds[i-1]
	}
	return ev.ExtraKeys[lo:ev.ExtraKeyEnds[i]]
}

// HasExtraKeys reports whether any stored block carries an extra key.
func (ev *Event) HasExtraKeys() bool { return len(ev.ExtraKeys) > 0 }

// Reason says why a payload or an event could not be read. The values are metric labels.
type Reason string

// Reasons a decode fails.
const (
	// Malformed: the payload is not a msgpack batch [ts, events, dp_rank]; nothing of it is read.
	Malformed Reason = "malformed"
	// UnknownTag: an event whose tag names no known event.
	UnknownTag Reason = "unknown_tag"
	// WrongType: a field of the wrong msgpack type or out of range (a negative token id, ...).
	WrongType Reason = "wrong_type"
	// MissingField: an event without a field its kind requires.
	MissingField Reason = "missing_field"
)

// Skipped is an event of a batch that could not be read, with why.
type Skipped struct {
	Index  int // its position in the batch's events
	Reason Reason
	Detail string // what was wrong, for a log line
}

// Batch is one decoded payload. Decoding into the same Batch again reuses its memory.
type Batch struct {
	// TS is the engine's timestamp of the batch, in seconds since the epoch.
	TS float64
	// DPRank is the data-parallel rank the batch comes from, when HasDPRank.
	DPRank    int64
	HasDPRank bool
	// Events are the events that could be read, in order; Skipped lists the others.
	Events  []Event
	Skipped []Skipped
}

// Blocks returns the number of blocks the batch's readable events name (stored and removed).
func (b *Batch) Blocks() int {
	n := 0
	for i := range b.Events {
		n += len(b.Events[i].BlockHashes)
	}
	return n
}
