package tokenizer

import (
	"math"
	"math/bits"
	"unsafe"
)

// mergeTable maps a pair of token ids to the merge's rank and the merged token's id: an
// open-addressing hash table, several times faster than a Go map for this one lookup, which the
// BPE does for every adjacent pair it considers.
type mergeTable struct {
	slots []mergeSlot
	shift uint
}

type mergeSlot struct {
	key uint64 // a<<32 | b
	val uint64 // (rank+1)<<32 | merged id; 0 for an empty slot
}

func newMergeTable(n int) mergeTable {
	size := 1 << bits.Len(uint(2*n+1)) // load factor at most 1/2
	return mergeTable{slots: make([]mergeSlot, size), shift: uint(64 - bits.Len(uint(size-1)))}
}

func (m *mergeTable) index(key uint64) uint64 {
	return (key * 0x9E3779B97F4A7C15) >> m.shift
}

func (m *mergeTable) put(a, b, rank, merged uint32) {
	key := uint64(a)<<32 | uint64(b)
	mask := uint64(len(m.slots) - 1)
	for i := m.index(key); ; i = (i + 1) & mask {
		s := &m.slots[i]
		if s.val == 0 || s.key == key {
			s.key, s.val = key, uint64(rank+1)<<32|uint64(merged)
			return
		}
	}
}

// get returns the rank and merged id of the pair (a, b); ok is false when they do not merge.
func (m *mergeTable) get(a, b uint32) (rank, merged uint32, ok bool) {
	key := uint64(a)<<32 | uint64(b)
	mask := uint64(len(m.slots) - 1)
	for i := m.index(key); ; i = (i + 1) & mask {
		s := &m.slots[i]
		if s.val == 0 {
			return 0, 0, false
		}
		if s.key == key {
			return uint32(s.val>>32) - 1, uint32(s.val), true
		}
	}
}

// noMerge is the rank of a pair that does not merge.
const noMerge = math.MaxUint32

// encodeWord appends the ids of one pre-token (its bytes, before the byte-level mapping).
func (t *Tokenizer) encodeWord(st *state, dst []uint32, w string) []uint32 {
	if len(w) == 1 {
		if id := t.byteID[w[0]]; id >= 0 {
			return append(dst, uint32(id))
		}
	}
	cacheable := len(w) <= maxCachedWord
	if cacheable {
		if ids, ok := st.cache.get(w); ok {
			return append(dst, ids...)
		}
	}
	start := len(dst)
	dst = t.merge(&st.bpe, dst, w)
	if cacheable {
		st.cache.put(w, dst[start:])
	}
	return dst
}

// merge appends the ids of w without the cache: itself when ignore_merges and w is a token,
// else its bytes merged by the BPE.
func (t *Tokenizer) merge(sc *bpeScratch, dst []uint32, w string) []uint32 {
	if t.ignoreMerges {
		if id, ok := t.rawVocab[w]; ok {
			return append(dst, id)
		}
	}
	return t.bpe(sc, dst, w)
}

// bpeScratch holds the BPE's buffers between calls.
type bpeScratch struct {
	ids   []uint32
	ranks []uint32
	into  []uint32
	syms  []symbol
	heap  mergeHeap
}

// shortWord is the most symbols merged with the quadratic scan; longer words use the heap.
const shortWord = 48

// bpe appends the ids of w's bytes merged as Hugging Face's BPE merges them: always the pair of
// lowest rank first, the leftmost of equal ranks, until no adjacent pair merges.
func (t *Tokenizer) bpe(sc *bpeScratch, dst []uint32, w string) []uint32 {
	ids := sc.ids[:0]
	haveUnk := false
	for i := 0; i < len(w); i++ {
		id := t.byteID[w[i]]
		if id < 0 {
			// A byte not in the vocab: the unknown token (runs of them fused into one when
			// fuse_unk), or nothing when there is no unknown token, as in Hugging Face.
			if t.unkID < 0 {
				continue
			}
			if t.fuseUnk && haveUnk {
				continue
			}
			haveUnk = true
			ids = append(ids, uint32(t.unkID))
			continue
		}
		haveUnk = false
		ids = append(ids, uint32(id))
	}
	sc.ids = ids
	if len(ids) <= shortWord {
		return t.bpeShort(sc, dst, ids)
	}
	return t.bpeLong(sc, dst, ids)
}

// bpeShort merges a short word by scanning its pairs' ranks for the lowest each time.
func (t *Tokenizer) bpeShort(sc *bpeScratch, dst []uint32, ids []uint32) []uint32 {
	if len(ids) < 2 {
		return append(dst, ids...)
	}
	ranks := sc.ranks[:0]
	into := sc.into[:0]
	for i := 0; i+1 < len(ids); i++ {
		r, m, ok := t.merges.get(ids[i], ids[i+1])
		if !ok {
			r = noMerge
		}
		ranks = append(ranks, r)
		into = append(into, m)
	}
	for {
		best, bi := uint32(noMerge), -1
		for i, r := range ranks {
			if r < best {
				best, bi = r, i
			}
		}
		if bi < 0 {
			break
		}
		ids[bi] = into[bi]
		copy(ids[bi+1:], ids[bi+2:])
		ids = ids[:len(ids)-1]
		copy(ranks[bi:], ranks[bi+1:])
		ranks = ranks[:len(ranks)-1]
		copy(into[bi:], into[bi+1:])
		into = into[:len(into)-1]
		if bi > 0 {
			ranks[bi-1], into[bi-1] = t.pair(ids[bi-1], ids[bi])
		}
		if bi < len(ranks) {
			ranks[bi], into[bi] = t.pair(ids[bi], ids[bi+1])
		}
	}
	sc.ranks, sc.into = ranks, into
	return append(dst, ids...)
}

func (t *Tokenizer) pair(a, b uint32) (rank, merged uint32) {
	r, m, ok := t.merges.get(a, b)
	if !ok {
		return noMerge, 0
	}
	return r, m
}

// symbol is one token of a long word being merged, in a doubly linked list over the word.
type symbol struct {
	id         uint32
	prev, next int32 // -1 at the ends
	dead       bool  // merged into the symbol before it
}

// candidate is a pair that merges: the left symbol's position, the rank, the merged id.
type candidate struct {
	rank, pos, merged uint32
}

// mergeHeap is a binary min-heap of candidates by rank, then position.
type mergeHeap []candidate

func (h mergeHeap) less(i, j int) bool {
	if h[i].rank != h[j].rank {
		return h[i].rank < h[j].rank
	}
	return h[i].pos < h[j].pos
}

func (h *mergeHeap) push(c candidate) {
	*h = append(*h, c)
	s := *h
	for i := len(s) - 1; i > 0; {
		p := (i - 1) / 2
		if !s.less(i, p) {
			break
		}
		s[i], s[p] = s[p], s[i]
		i = p
	}
}

func (h *mergeHeap) pop() candidate {
	s := *h
	top := s[0]
	last := len(s) - 1
	s[0] = s[last]
	s = s[:last]
	for i := 0; ; {
		l, r, m := 2*i+1, 2*i+2, i
		if l < len(s) && s.less(l, m) {
			m = l
		}
		if r < len(s) && s.less(r, m) {
			m = r
		}
		if m == i {
			break
		}
		s[i], s[m] = s[m], s[i]
		i = m
	}
	*h = s
	return top
}

// bpeLong merges a long word with a heap of candidate pairs, in O(n log n): a 200 KB word
// without spaces takes milliseconds, not the minutes a quadratic merge would. Stale candidates
// (a symbol merged away, or a pair no longer adjacent) are skipped when popped, as Hugging Face's
// Word.merge_all skips them; the merges come out in the same order as bpeShort's.
func (t *Tokenizer) bpeLong(sc *bpeScratch, dst []uint32, ids []uint32) []uint32 {
	syms := sc.syms[:0]
	for i, id := range ids {
		syms = append(syms, symbol{id: id, prev: int32(i - 1), next: int32(i + 1)})
	}
	syms[len(syms)-1].next = -1
	h := sc.heap[:0]
	for i := 0; i+1 < len(syms); i++ {
		if r, m, ok := t.merges.get(syms[i].id, syms[i+1].id); ok {
			h.push(candidate{r, uint32(i), m})
		}
	}
	for len(h) > 0 {
		c := h.pop()
		s := &syms[c.pos]
		if s.dead || s.next < 0 {
			continue
		}
		right := &syms[s.next]
		if _, m, ok := t.merges.get(s.id, right.id); !ok || m != c.merged {
			continue
		}
		s.id = c.merged
		right.dead = true
		s.next = right.next
		if s.next >= 0 {
			syms[s.next].prev = int32(c.pos)
		}
		if s.prev >= 0 {
			if r, m, ok := t.merges.get(syms[s.prev].id, s.id); ok {
				h.push(candidate{r, uint32(s.prev), m})
			}
		}
		if s.next >= 0 {
			if r, m, ok := t.merges.get(s.id, syms[s.next].id); ok {
				h.push(candidate{r, c.pos, m})
			}
		}
	}
	for i := int32(0); i >= 0; i = syms[i].next {
		dst = append(dst, syms[i].id)
	}
	sc.syms, sc.heap = syms[:0], h[:0]
	if len(ids) > maxKeptSymbols {
		// A word of megabytes (a body of one run of spaces) needs buffers of 16 bytes a byte; the
		// slot keeps its scratch for the process's life, so it does not keep these.
		sc.ids, sc.syms, sc.heap = nil, nil, nil
	}
	return dst
}

// maxKeptSymbols is the longest word, in bytes, whose merge buffers a state keeps for the next
// call: 64 Ki bytes keep at most about 1.5 MB per state.
const maxKeptSymbols = 64 << 10

// Word cache bounds: a word longer than maxCachedWord bytes is not cached, and a cache that
// reaches maxCacheWords words or fills its arenas is emptied, so hostile input (endless distinct
// words) costs a re-merge, never unbounded memory: a cache holds at most about 2.5 MB.
const (
	maxCachedWord  = 64
	maxCacheWords  = 16384
	maxCacheBytes  = 512 << 10
	maxCacheTokens = 128 << 10
)

// wordCache maps a pre-token's bytes to its ids. Keys and ids live in two arenas that are reused
// when the cache is emptied, so a warm cache allocates nothing.
type wordCache struct {
	m    map[string]uint64 // offset<<32 | count into ids
	keys []byte
	ids  []uint32
}

func newWordCache() wordCache {
	return wordCache{
		m:    make(map[string]uint64, 1024),
		keys: make([]byte, 0, 64<<10),
		ids:  make([]uint32, 0, 16<<10),
	}
}

func (c *wordCache) get(w string) ([]uint32, bool) {
	v, ok := c.m[w]
	if !ok {
		return nil, false
	}
	off, n := uint32(v>>32), uint32(v)
	return c.ids[off : off+n : off+n], true
}

func (c *wordCache) put(w string, ids []uint32) {
	if len(c.m) >= maxCacheWords || len(c.keys)+len(w) > maxCacheBytes || len(c.ids)+len(ids) > maxCacheTokens {
		c.reset()
	}
	// The key's bytes must not move once the map holds them: when the arena is full a new one is
	// started (the old one stays alive through the keys that point into it); it is only
	// overwritten after reset, when the map no longer holds any of its keys.
	if len(c.keys)+len(w) > cap(c.keys) {
		c.keys = make([]byte, 0, min(2*cap(c.keys)+len(w), maxCacheBytes))
	}
	k := len(c.keys)
	c.keys = append(c.keys, w...)
	key := unsafe.String(&c.keys[k], len(w))
	off := len(c.ids)
	c.ids = append(c.ids, ids...)
	c.m[key] = uint64(off)<<32 | uint64(len(ids))
}

func (c *wordCache) reset() {
	clear(c.m)
	c.keys = c.keys[:0]
	c.ids = c.ids[:0]
}
