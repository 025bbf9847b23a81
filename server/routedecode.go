package server

import (
	"encoding/binary"
	"math/bits"
	"sync"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// routeTokenField is RouteRequest.token_ids, routeHashField its block_hashes.
const (
	routeTokenField = 3
	routeHashField  = 13
)

// unmarshalRoute decodes a RouteRequest exactly as proto.Unmarshal would, with a fast path for its
// token ids.
//
// Profile lesson (docs/benchmarks/history.md, "Route over gRPC: kvload and profiles"): decoding a
// 2,048-token request took a fifth of the server's CPU per Route call. protobuf-go decodes a packed
// repeated field one varint at a time through a generic loop and grows the slice as it goes, about
// a dozen reallocations for 2k tokens. Here the token ids are counted first (one byte below 0x80
// ends each varint), the slice is allocated once, and varints of up to three bytes, every token id
// below 2^21, are decoded inline. Every other field, known or not, is left to proto.Unmarshal,
// merged in wire order.
func unmarshalRoute(b []byte, m *kvrouterv1.RouteRequest) error {
	var rest []byte // the fields other than token_ids, in wire order
	for i := 0; i < len(b); {
		num, typ, n := protowire.ConsumeTag(b[i:])
		if n < 0 {
			return protowire.ParseError(n)
		}
		start := i
		i += n
		switch {
		case num == routeTokenField && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b[i:])
			if n < 0 {
				return protowire.ParseError(n)
			}
			i += n
			var ok bool
			if m.TokenIds, ok = appendPackedUint32(m.TokenIds, v); !ok {
				return protowire.ParseError(-1)
			}
		case num == routeTokenField && typ == protowire.VarintType: // unpacked, as a parser must accept
			v, n := protowire.ConsumeVarint(b[i:])
			if n < 0 {
				return protowire.ParseError(n)
			}
			i += n
			m.TokenIds = append(m.TokenIds, uint32(v))
		case num == routeHashField && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b[i:])
			if n < 0 || len(v)%8 != 0 {
				return protowire.ParseError(-1)
			}
			i += n
			base := len(m.BlockHashes)
			m.BlockHashes = hashPool.grow(m.BlockHashes, len(v)/8)[:base+len(v)/8]
			for k := range len(v) / 8 {
				m.BlockHashes[base+k] = binary.LittleEndian.Uint64(v[8*k:])
			}
		case num == routeHashField && typ == protowire.Fixed64Type: // unpacked
			v, n := protowire.ConsumeFixed64(b[i:])
			if n < 0 {
				return protowire.ParseError(n)
			}
			i += n
			m.BlockHashes = append(m.BlockHashes, v)
		default:
			n := protowire.ConsumeFieldValue(num, typ, b[i:])
			if n < 0 {
				return protowire.ParseError(n)
			}
			i += n
			rest = append(rest, b[start:i]...)
		}
	}
	if len(rest) == 0 {
		return nil
	}
	return proto.UnmarshalOptions{Merge: true}.Unmarshal(rest, m)
}

// appendPackedUint32 appends the varints of a packed repeated uint32 field to dst, truncating each to
// 32 bits as protobuf does. It reports false on a malformed varint.
//
// Varint decoding is a chain: where a varint starts depends on the length of the one before, read
// from memory, so one varint at a time leaves the core waiting. Here the bytes are cut into
// decodeLanes lanes at varint boundaries (a byte below 0x80 ends a varint), and each step decodes
// one varint of every lane: four independent chains. A varint of up to four bytes (every value
// below 2^28) is decoded from four bytes read at once, without a branch on its length: the lowest
// clear top bit marks its last byte, and masking the bytes after it leaves the seven-bit groups to
// pack. Longer varints, and the last few of the buffer, go through protowire.ConsumeVarint.
// Profile lesson (docs/BENCHMARKS.md, "Route over gRPC"): decoding took a fifth of the router's CPU
// per 2,048-token Route; BenchmarkUnmarshalRoute measures this against one chain (about 25% less).
func appendPackedUint32(dst []uint32, b []byte) ([]uint32, bool) {
	if len(b) == 0 {
		return dst, true
	}
	if b[len(b)-1] >= 0x80 {
		return dst, false // the last varint is cut short
	}
	// Lane j holds b[start[j]:start[j+1]], whole varints: each boundary follows a varint's last byte.
	var start [decodeLanes + 1]int
	var left [decodeLanes]int // varints of each lane not decoded yet
	start[decodeLanes] = len(b)
	for j := 1; j < decodeLanes; j++ {
		p := max(j*len(b)/decodeLanes, start[j-1])
		for p < len(b) && p > 0 && b[p-1] >= 0x80 {
			p++
		}
		start[j] = p
	}
	count := 0
	for j := range decodeLanes {
		left[j] = countVarints(b[start[j]:start[j+1]])
		count += left[j]
	}
	base := len(dst)
	dst = tokenPool.grow(dst, count)[:base+count]
	out := dst[base:]
	var at [decodeLanes]int // where each lane's next value goes in out
	for j := 1; j < decodeLanes; j++ {
		at[j] = at[j-1] + left[j-1]
	}
	// Steps while every lane has a varint left and the last lane's four-byte reads stay within b:
	// it keeps its last three varints (at most three bytes) for the loop below.
	steps := left[decodeLanes-1] - 3
	for j := range decodeLanes - 1 {
		steps = min(steps, left[j])
	}
	s0, s1, s2, s3 := start[0], start[1], start[2], start[3]
	o0, o1, o2, o3 := at[0], at[1], at[2], at[3]
	k := 0
	for ; k < steps; k++ {
		x0 := binary.LittleEndian.Uint32(b[s0:])
		x1 := binary.LittleEndian.Uint32(b[s1:])
		x2 := binary.LittleEndian.Uint32(b[s2:])
		x3 := binary.LittleEndian.Uint32(b[s3:])
		t0, t1, t2, t3 := ^x0&0x80808080, ^x1&0x80808080, ^x2&0x80808080, ^x3&0x80808080
		if t0 == 0 || t1 == 0 || t2 == 0 || t3 == 0 {
			break // a varint longer than four bytes: the loop below decodes it
		}
		out[o0+k] = pack7(x0 & (t0 ^ (t0 - 1)))
		out[o1+k] = pack7(x1 & (t1 ^ (t1 - 1)))
		out[o2+k] = pack7(x2 & (t2 ^ (t2 - 1)))
		out[o3+k] = pack7(x3 & (t3 ^ (t3 - 1)))
		s0 += bits.TrailingZeros32(t0)>>3 + 1
		s1 += bits.TrailingZeros32(t1)>>3 + 1
		s2 += bits.TrailingZeros32(t2)>>3 + 1
		s3 += bits.TrailingZeros32(t3)>>3 + 1
	}
	// The rest of each lane. A lane holds as many varints as bytes below 0x80, so its last one
	// ends at the lane's end.
	pos := [decodeLanes]int{s0, s1, s2, s3}
	for j := range decodeLanes {
		s := pos[j]
		for w := at[j] + k; w < at[j]+left[j]; w++ {
			u, n := protowire.ConsumeVarint(b[s:])
			if n < 0 {
				return dst, false
			}
			out[w] = uint32(u)
			s += n
		}
	}
	return dst, true
}

// decodeLanes is how many varint chains appendPackedUint32 decodes side by side.
const decodeLanes = 4

// pack7 packs the seven-bit groups of a varint of at most four bytes whose later bytes are zero.
func pack7(x uint32) uint32 { return x&0x7f | x>>1&0x3f80 | x>>2&0x1fc000 | x>>3&0xfe00000 }

// countVarints counts the varints ending in b: its bytes below 0x80.
func countVarints(b []byte) int {
	count := 0
	j := 0
	for ; j+8 <= len(b); j += 8 {
		count += bits.OnesCount64(^binary.LittleEndian.Uint64(b[j:]) & 0x8080808080808080)
	}
	for _, c := range b[j:] {
		if c < 0x80 {
			count++
		}
	}
	return count
}

// slicePool recycles the repeated fields of Route requests whose length grows with the prompt:
// token ids (tokenPool) and block hashes (hashPool). Slices of min to max elements are pooled:
// short prompts allocate little anyway, and one huge prompt must not pin its memory.
//
// The Route handler gives a request's slices back when it returns (releaseTokens): nothing keeps
// them past its call, since the decision hashes token ids into its own key and copies block hashes
// into it, and a queued request waits in the handler.
type slicePool[T uint32 | uint64] struct {
	pool     sync.Pool
	min, max int
}

// grow returns s with room for n more elements: s itself when it has it, a pooled slice when s is
// nil and n is in the pool's range, else a new one.
func (p *slicePool[T]) grow(s []T, n int) []T {
	if cap(s)-len(s) >= n {
		return s
	}
	if s == nil && n >= p.min && n <= p.max {
		if got, ok := p.pool.Get().(*[]T); ok && cap(*got) >= n {
			return (*got)[:0]
		}
	}
	out := make([]T, len(s), len(s)+n)
	copy(out, s)
	return out
}

// put gives s back when it is of the pooled sizes. In race-detector builds (the default test run)
// its elements are overwritten first, so that code still holding them would route a different
// prompt every time, not only when another call happened to take the slice meanwhile:
// TestRouteTokensPooledAcrossCalls relies on it. Elsewhere that costs Route CPU (about 1 µs, 1.6%
// of a 2k-token call in the profile) for nothing.
func (p *slicePool[T]) put(s []T) {
	if cap(s) < p.min || cap(s) > p.max {
		return
	}
	if raceEnabled {
		for i := range s {
			s[i] = poisonToken
		}
	}
	s = s[:0]
	p.pool.Put(&s)
}

// tokenPool holds token id slices of 1,024 to 128k tokens (512 KB): a 2,048-token prompt's 8 KB
// were more than half the bytes the server allocated per Route call. hashPool holds the block
// hashes of such prompts in blocks of 16.
var (
	tokenPool = slicePool[uint32]{min: 1 << 10, max: 128 << 10}
	hashPool  = slicePool[uint64]{min: (1 << 10) / 16, max: (128 << 10) / 16}
)

// releaseTokens gives the request's token ids and block hashes back to their pools; the request
// must not be used after.
func releaseTokens(req *kvrouterv1.RouteRequest) {
	tokenPool.put(req.TokenIds)
	hashPool.put(req.BlockHashes)
	req.TokenIds, req.BlockHashes = nil, nil
}

// poisonToken fills released slices: no tokenizer has an id this large, and no cached block has
// it for a hash.
const poisonToken = 0xFFFF_FFFF
