// Package blockhash is the block hashing of Dynamo's KV router (§4.2): a block's local hash over its
// tokens (XXH3, seed 1337 salted by LoRA adapter and cache namespace) and the sequence hash chaining
// it to every block before it. The router, its state and the client library all hash with it; it
// depends on nothing but XXH3, so a worker's client imports it without the router's state.
package blockhash

import (
	"encoding/binary"
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
	if cacheNamespace != "" {
		salt += xxh3.HashStringSeed(cacheNamespace, 1)
	}
	return salt
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
