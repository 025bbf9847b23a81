// Package trace provides the requests a simulated fleet replays: the Mooncake conversation trace
// (real prefix reuse), the Azure LLM inference traces of 2023 (real arrivals and lengths, no reuse),
// and two synthetic generators (shared-prefix groups and multi-turn chat), all deterministic.
//
// # Memory
//
// A prompt is not stored as token ids. A Request holds its prompt as a short list of Segments, each
// a (Key, Len) pair that stands for Len pseudo-random token ids derived from Key and the position in
// the segment (see Segment.AppendTokens). A Mooncake row becomes one segment per 512-token hash id
// (Key = the hash id, the last one truncated to the row's input_length), so the whole trace (12,031
// requests, 145 million prompt tokens, about 580 MB as []uint32) takes about 6 MB of heap, 16
// bytes per 512 tokens. A replay materialises one prompt at a time into a buffer it reuses
// (buf = req.AppendTokens(buf[:0])), so it never holds more than the longest prompt (126,195
// tokens, 0.5 MB, for Mooncake); generating costs about 2 ns a token. Requests of the multi-turn
// generator share one segment array per user, so a conversation's history is stored once.
//
// # Token ids
//
// Token ids lie in [FirstToken, TokenLimit), a vocabulary of the size of Llama 3's with the first
// ids (special tokens) left out. They depend only on the segment's key and the position in the
// segment, never on an engine block size: a 512-token Mooncake block with hash id h has the same
// 512 tokens whatever block size the engine uses, and its j-th sub-block of b tokens is positions
// [j*b, (j+1)*b) of segment h. So two prompts whose segment lists agree share exactly those tokens,
// and a segment with another key gives other tokens (each token differs with probability
// 1 - 1/127,000, independently, so 16 tokens in a row agree by chance with probability below 2^-270).
package trace

import (
	"fmt"
	"slices"
	"time"
)

// FirstToken is the smallest token id a prompt contains.
const FirstToken = 1000

// TokenLimit is one more than the largest token id a prompt contains.
const TokenLimit = 128000

// Request is one inference request of a trace: when it arrives, its prompt, and how many tokens it
// generates.
type Request struct {
	// ID names the request uniquely within its trace, e.g. "mooncake-17" (the 18th row).
	ID string
	// Arrival is the time from the trace's start (its first request) to this request's arrival.
	Arrival time.Duration
	// Segments is the prompt: the concatenation of the segments' tokens. Segments never have a
	// zero length. A request's slice may share its array with other requests': treat it as
	// read-only.
	Segments []Segment
	// OutputTokens is the number of tokens the request generates (the trace's output length).
	OutputTokens int
	// Session names the conversation the request belongs to, or is "" when the trace does not say.
	Session string
}

// Segment is a run of Len deterministic pseudo-random token ids determined by Key. For a Mooncake
// request Key is the trace's hash id of a 512-token block; the other sources draw their keys from
// their seed or row index.
type Segment struct {
	// Key determines the tokens: two segments with the same key have the same token at every
	// position they both have.
	Key uint64
	// Len is the number of tokens, at least 1.
	Len int
}

// InputTokens returns the prompt's length in tokens: the sum of its segments' lengths.
func (r *Request) InputTokens() int {
	n := 0
	for _, s := range r.Segments {
		n += s.Len
	}
	return n
}

// AppendTokens appends the prompt's token ids to dst and returns the extended slice. Pass a
// reused buffer, dst[:0], to replay a trace without allocating.
func (r *Request) AppendTokens(dst []uint32) []uint32 {
	dst = slices.Grow(dst, r.InputTokens())
	for _, s := range r.Segments {
		dst = s.AppendTokens(dst, 0, s.Len)
	}
	return dst
}

// AppendTokenRange appends the prompt's tokens at positions [from, to) to dst and returns the
// extended slice, e.g. one engine block. It panics unless 0 <= from <= to <= r.InputTokens().
func (r *Request) AppendTokenRange(dst []uint32, from, to int) []uint32 {
	if from < 0 || from > to {
		panic(fmt.Sprintf("trace: token range [%d, %d) is invalid", from, to))
	}
	dst = slices.Grow(dst, to-from)
	start := 0 // position of the current segment's first token in the prompt
	for _, s := range r.Segments {
		if from >= to {
			return dst
		}
		end := start + s.Len
		if from < end {
			stop := min(to, end)
			dst = s.AppendTokens(dst, from-start, stop-start)
			from = stop
		}
		start = end
	}
	if from < to {
		panic(fmt.Sprintf("trace: token range ends at %d, after the prompt's %d tokens", to, start))
	}
	return dst
}

// AppendTokens appends the segment's tokens at positions [from, to) to dst and returns the extended
// slice. The tokens depend only on s.Key and the positions, so a caller can get one block of a
// long segment without generating the rest. It panics unless 0 <= from <= to; positions at or
// beyond s.Len are allowed and continue the same sequence.
func (s Segment) AppendTokens(dst []uint32, from, to int) []uint32 {
	if from < 0 || from > to {
		panic(fmt.Sprintf("trace: token range [%d, %d) is invalid", from, to))
	}
	n := len(dst)
	dst = slices.Grow(dst, to-from)[:n+to-from]
	out := dst[n:]
	// A splitmix64 stream seeded by the key: the token at position p is the mix of
	// seed + (p+1)*gamma, reduced to the vocabulary by a multiply-shift.
	z := tokenSeed(s.Key) + uint64(from)*gamma
	for i := range out {
		z += gamma
		out[i] = FirstToken + uint32((mix64(z)>>32)*(TokenLimit-FirstToken)>>32)
	}
	return dst
}

// gamma is splitmix64's increment, the odd integer nearest 2^64 divided by the golden ratio.
const gamma = 0x9e3779b97f4a7c15

// mix64 is splitmix64's finaliser (Stafford's variant 13): a bijection of uint64 whose output bits
// each depend on every input bit.
func mix64(z uint64) uint64 {
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// combine hashes v into the running hash h. For a fixed h it is a bijection of v.
func combine(h, v uint64) uint64 {
	return mix64(h ^ mix64(v+gamma))
}

// Domain tags keep the keys and hashes of different uses apart.
const (
	tagToken uint64 = iota + 0x6b7672_7472616365 // "kvrtrace"
	tagAzure
	tagSharedPrefix
	tagSharedPrefixOrder
	tagMultiTurn
	tagMultiTurnOrder
	tagChain
	tagArrival
)

// tokenSeed is the splitmix64 state a segment's token stream starts from.
func tokenSeed(key uint64) uint64 {
	return combine(tagToken, key)
}

// appendSegment appends a segment of n tokens to segs unless n is 0.
func appendSegment(segs []Segment, key uint64, n int) []Segment {
	if n == 0 {
		return segs
	}
	return append(segs, Segment{Key: key, Len: n})
}
