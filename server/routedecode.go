package server

import (
	"encoding/binary"
	"math/bits"
	"sync"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// routeTokenField is RouteRequest.token_ids.
const routeTokenField = 3

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
// from memory. Here the ends of the varints (the bytes below 0x80) are found eight bytes at a time
// first, so each varint's start comes from a bit mask held in a register, and the loads of
// successive varints no longer wait on each other. A varint of up to four bytes (every value below
// 2^28) is then decoded from four bytes read at once, without a branch on its length.
func appendPackedUint32(dst []uint32, b []byte) ([]uint32, bool) {
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
	dst = growUint32(dst, count)
	start := 0
	for j = 0; j+8 <= len(b); j += 8 {
		for ends := ^binary.LittleEndian.Uint64(b[j:]) & 0x8080808080808080; ends != 0; ends &= ends - 1 {
			end := j + bits.TrailingZeros64(ends)/8
			n := end - start + 1
			var v uint32
			if n <= 4 && start+4 <= len(b) {
				x := binary.LittleEndian.Uint32(b[start:])
				v = (x&0x7f | x>>1&0x3f80 | x>>2&0x1fc000 | x>>3&0xfe00000) & (1<<(7*n) - 1)
			} else {
				u, m := protowire.ConsumeVarint(b[start:])
				if m != n {
					return dst, false
				}
				v = uint32(u)
			}
			dst = append(dst, v)
			start = end + 1
		}
	}
	for start < len(b) { // the varints ending in the last few bytes
		u, m := protowire.ConsumeVarint(b[start:])
		if m < 0 {
			return dst, false
		}
		dst = append(dst, uint32(u))
		start += m
	}
	return dst, true
}

func growUint32(s []uint32, n int) []uint32 {
	if cap(s)-len(s) >= n {
		return s
	}
	if s == nil && n >= minPooledTokens && n <= maxPooledTokens {
		if p, ok := tokenPool.Get().(*[]uint32); ok && cap(*p) >= n {
			return (*p)[:0]
		}
	}
	out := make([]uint32, len(s), len(s)+n)
	copy(out, s)
	return out
}

// tokenPool recycles the token id slices of Route requests: a 2,048-token prompt's 8 KB were more
// than half the bytes the server allocated per Route call. The Route handler gives a request's
// slice back when it returns (releaseTokens): nothing keeps a request's token ids past its call,
// since the decision hashes them into block hashes, and a queued request waits in the handler.
var tokenPool sync.Pool

// Slices of minPooledTokens to maxPooledTokens are pooled: short prompts allocate little anyway, and
// one huge prompt must not pin its memory (128k tokens: 512 KB).
const (
	minPooledTokens = 1 << 10
	maxPooledTokens = 128 << 10
)

// releaseTokens gives the request's token ids back to tokenPool; the request must not be used after.
// The ids are overwritten first (a fraction of a microsecond for 2k tokens), so that code still
// holding them would route a different prompt every time, not only when another call happened to
// take the slice meanwhile: TestRouteTokensPooledAcrossCalls relies on it.
func releaseTokens(req *kvrouterv1.RouteRequest) {
	if t := req.TokenIds; cap(t) >= minPooledTokens && cap(t) <= maxPooledTokens {
		for i := range t {
			t[i] = poisonToken
		}
		t = t[:0]
		tokenPool.Put(&t)
	}
	req.TokenIds = nil
}

// poisonToken fills released token slices: no tokenizer has an id this large.
const poisonToken = 0xFFFF_FFFF
