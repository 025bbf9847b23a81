// Package blockhash is the block hashing of Dynamo's KV router: a block's local hash over its
// tokens (XXH3, seed 1337 salted by LoRA adapter and cache namespace), with the hashes of the
// multimodal inputs (images, audio) whose placeholder tokens it holds, and the sequence hash
// chaining it to every block before it. The router, its state and the client library all hash with
// it; it depends on nothing but XXH3, so a worker's client imports it without the router's state.
// docs/hashing.md states the rules; testdata/hash_vectors.json pins them for every client.
package blockhash

import (
	"encoding/binary"
	"slices"
	"strconv"
	"unsafe"

	"github.com/zeebo/xxh3"
)

// Seed is the XXH3 seed Dynamo uses for block hashing and for chaining sequence hashes.
const Seed = 1337

// littleEndian reports whether the machine stores integers little-endian, in which case a token
// slice already has the byte layout the hash is defined over and can be hashed without a copy.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// Salt returns the seed for local block hashes of a request or stored block: 1337, plus
// XXH3(lora_name, seed 0) when a LoRA adapter is used, plus XXH3(cache_namespace, seed 1) when a
// cache namespace is set (additions wrap). Empty strings count as absent, so "no LoRA" and "" hash
// alike and requests of different adapters or tenants never share cache entries.
func Salt(loraName, cacheNamespace string) uint64 {
	salt := uint64(Seed)
	if loraName != "" {
		salt += xxh3.HashStringSeed(loraName, 0)
	}
	return salt + NamespaceSalt(cacheNamespace)
}

// NamespaceSalt returns what a cache namespace adds to a salt: XXH3(cache_namespace, seed 1), or 0
// for none, so that Salt(lora, "") + NamespaceSalt(ns) == Salt(lora, ns). A worker that learns a
// chain's namespace from its first block keeps this number for the blocks after it.
func NamespaceSalt(cacheNamespace string) uint64 {
	if cacheNamespace == "" {
		return 0
	}
	return xxh3.HashStringSeed(cacheNamespace, 1)
}

// MultimodalIDSeed is the XXH3 seed MultimodalHash hashes an identifier that is not an engine
// digest with; 0 and 1 salt LoRA names and cache namespaces.
const MultimodalIDSeed = 2

// MultimodalHash returns the hash that names a multimodal input in block hashes, from the identifier
// the engine keys its prefix cache with. vLLM's own identifier of an item is a 64-hex-digit digest
// of its content; its first 16 digits, read as an integer, are the hash (as Dynamo reads them). Any
// other identifier, such as one the frontend chose and passed to the engine (vLLM's
// multi_modal_uuids), is hashed with XXH3, seed MultimodalIDSeed, so that both sides agree on it.
func MultimodalHash(identifier string) uint64 {
	if IsEngineDigest(identifier) {
		h, _ := strconv.ParseUint(identifier[:16], 16, 64) // 16 hex digits always fit
		return h
	}
	return xxh3.HashStringSeed(identifier, MultimodalIDSeed)
}

// IsEngineDigest reports whether a multimodal identifier is an engine's digest of the input's
// content (64 hex digits, as vLLM writes it) rather than a name a frontend chose.
func IsEngineDigest(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

// MultimodalObject is one multimodal input of a prompt: the hash that names its content
// (MultimodalHash) and the token positions [Start, End) its placeholder tokens fill.
type MultimodalObject struct {
	Hash       uint64
	Start, End uint32
}

// carried reports whether the object's tokens overlap the block of tokens [lo, hi).
func (o MultimodalObject) carried(lo, hi uint64) bool {
	return o.Start < o.End && uint64(o.Start) < hi && uint64(o.End) > lo
}

// Local returns the hash of one block's tokens: XXH3 over the tokens as little-endian
// uint32s, seeded with the salt from Salt.
func Local(tokens []uint32, salt uint64) uint64 {
	if len(tokens) == 0 {
		return xxh3.HashSeed(nil, salt)
	}
	if littleEndian {
		return xxh3.HashSeed(unsafe.Slice((*byte)(unsafe.Pointer(&tokens[0])), 4*len(tokens)), salt)
	}
	buf := make([]byte, 4*len(tokens))
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(buf[4*i:], t)
	}
	return xxh3.HashSeed(buf, salt)
}

// LocalMultimodal returns the hash of one block that holds multimodal inputs: XXH3 over its tokens
// as little-endian uint32s followed by the inputs' hashes, sorted ascending, as little-endian
// uint64s, seeded with the salt. mmHashes must be sorted; with none it equals Local.
func LocalMultimodal(tokens []uint32, mmHashes []uint64, salt uint64) uint64 {
	if len(mmHashes) == 0 {
		return Local(tokens, salt)
	}
	n := 4*len(tokens) + 8*len(mmHashes)
	var stack [4*64 + 8*4]byte // a 64-token block with up to 4 inputs hashes without allocating
	buf := stack[:0]
	if n > len(stack) {
		buf = make([]byte, 0, n)
	}
	for _, t := range tokens {
		buf = binary.LittleEndian.AppendUint32(buf, t)
	}
	for _, h := range mmHashes {
		buf = binary.LittleEndian.AppendUint64(buf, h)
	}
	return xxh3.HashSeed(buf, salt)
}

// LocalsMultimodal appends to dst the local hash of every complete block of tokens, as Locals does,
// folding into each block the hashes of the objects whose tokens it holds (LocalMultimodal). A block
// holds an object when their token ranges overlap; an object may span many blocks and a block may
// hold many objects. Objects may come in any order and may overlap; an empty one (Start >= End)
// is held by no block. Without objects it equals Locals.
func LocalsMultimodal(dst []uint64, tokens []uint32, blockSize int, salt uint64, objects []MultimodalObject) []uint64 {
	if len(objects) == 0 || blockSize <= 0 {
		return Locals(dst, tokens, blockSize, salt)
	}
	if !slices.IsSortedFunc(objects, byStart) {
		objects = slices.SortedFunc(slices.Values(objects), byStart)
	}
	var activeBuf [8]int
	var hashBuf [8]uint64
	active, next := activeBuf[:0], 0 // the objects that reach into the current block, and the first not yet reached
	for start := 0; start+blockSize <= len(tokens); start += blockSize {
		lo, hi := uint64(start), uint64(start+blockSize)
		for next < len(objects) && uint64(objects[next].Start) < hi {
			active = append(active, next)
			next++
		}
		hashes, kept := hashBuf[:0], active[:0]
		for _, i := range active {
			if o := objects[i]; uint64(o.End) > lo {
				kept = append(kept, i) // it may reach into the next block too
				if o.carried(lo, hi) {
					hashes = append(hashes, o.Hash)
				}
			}
		}
		active = kept
		slices.Sort(hashes)
		dst = append(dst, LocalMultimodal(tokens[start:start+blockSize], hashes, salt))
	}
	return dst
}

func byStart(a, b MultimodalObject) int {
	switch {
	case a.Start < b.Start:
		return -1
	case a.Start > b.Start:
		return 1
	}
	return 0
}

// Locals appends to dst the local hash of every complete block of tokens and returns the
// extended slice. A tail shorter than blockSize is not hashed, and a blockSize of 0 hashes nothing.
func Locals(dst []uint64, tokens []uint32, blockSize int, salt uint64) []uint64 {
	if blockSize <= 0 {
		return dst
	}
	for start := 0; start+blockSize <= len(tokens); start += blockSize {
		dst = append(dst, Local(tokens[start:start+blockSize], salt))
	}
	return dst
}

// Chain returns the sequence hash of a block from its parent's sequence hash and its own local
// hash: XXH3 over the two as little-endian uint64s, seed 1337. The first block of a prompt has no
// parent; its sequence hash is its local hash.
func Chain(parent, local uint64) uint64 {
	var buf [16]byte
	binary.LittleEndian.PutUint64(buf[:8], parent)
	binary.LittleEndian.PutUint64(buf[8:], local)
	return xxh3.HashSeed(buf[:], Seed)
}

// Sequence appends to dst the chained sequence hash of each local hash and returns the
// extended slice. Two prompts share a sequence hash at block i only if they share blocks 0..i.
func Sequence(dst []uint64, local []uint64) []uint64 {
	for i, h := range local {
		if i > 0 {
			h = Chain(dst[len(dst)-1], h)
		}
		dst = append(dst, h)
	}
	return dst
}
