package kvstate

import (
	"math/bits"
	"math/rand/v2"
	"unsafe"
)

// flatMap is a hash table from uint64 keys to pointer-free values, stored flat so that finding a key
// costs about one cache miss and the garbage collector never scans it.
//
// Why not a Go map: the prefix index probes one key per prompt block, and at millions of blocks every
// probe misses the CPU caches. A Go map probe touches a control word and then a slot in another cache
// line, and the index used to follow a pointer from there to a node and another to its holder list:
// three or four misses a block. Here a key and its value sit side by side in one array, found by
// linear probing from the key's home slot.
//
// The table is split into segments (extendible hashing): the top bits of a key's hash pick a directory
// entry, which names the segment holding the key. A segment grows by rebuilding itself about 1.33×
// larger, and once it reaches maxSegmentSlots it splits in two instead. So no insert rebuilds more than
// one bounded segment (tens of microseconds), however large the table, where a single big table would
// stall every reader for a whole rehash. Growing in small steps keeps the table 60–80% full, which is
// what makes it smaller than a Go map.
//
// Key 0 marks an empty slot; the key 0 itself is kept aside. A pointer returned by get or upsert is
// valid until the next upsert or delete on the same table.
type flatMap[V any] struct {
	seed    uint64
	dir     []dirEntry[V] // indexed by the top depth bits of a key's hash
	depth   uint8
	segs    []*segment[V] // every segment once, for iteration
	n       int           // keys held, including the zero key
	hasZero bool
	zero    V
}

// dirEntry caches its segment's slots so a probe reads the directory and then the slot, without
// going through the segment header.
type dirEntry[V any] struct {
	slots []flatEntry[V]
	seg   *segment[V]
}

type segment[V any] struct {
	depth  uint8  // local depth: every key here has the same top depth bits of its hash,
	prefix uint64 // and these are the bits
	n      int
	slots  []flatEntry[V]
}

type flatEntry[V any] struct {
	key uint64 // 0: empty
	val V
}

const (
	minSegmentSlots = 8
	maxSegmentSlots = 4096
)

// roomFor is the number of slots a segment of n keys is rebuilt with: 60% full, so segments run
// between 60% and 80% full. Measured in one interleaved run of the peer benchmark (3 rounds):
// rebuilding to 50% full inserted 17% faster into a growing index (fewer rebuilds) but took 52.6
// bytes per (block, worker) instead of 47.4; 59% made no difference.
func roomFor(n int) int { return max(n*5/3, minSegmentSlots) }

// restoreRoomFor is the number of slots a segment of a restored table gets for n keys: 75% full.
func restoreRoomFor(n int) int { return max(n*4/3, minSegmentSlots) }

// hashKey mixes a key with the table's seed: engine block hashes can be small or patterned, and a
// per-table seed keeps crafted keys from piling onto one slot.
func hashKey(k, seed uint64) uint64 {
	hi, lo := bits.Mul64(k^seed, 0x9E3779B97F4A7C15)
	return hi ^ lo
}

// home is the slot where a key with hash h starts probing in a segment of n slots (Lemire's
// fast range: any n works, so segments can grow in steps smaller than doubling).
func home(h uint64, n int) int { return int((h & 0xFFFFFFFF) * uint64(n) >> 32) }

func newFlatMap[V any]() *flatMap[V] {
	m := &flatMap[V]{seed: rand.Uint64()}
	s := &segment[V]{slots: newSlots[V](minSegmentSlots)}
	m.dir = []dirEntry[V]{{slots: s.slots, seg: s}}
	m.segs = []*segment[V]{s}
	return m
}

// newFlatMapSized returns an empty table with room for n keys (restoring a snapshot, whose counts
// are known): enough segments, each 75% full at n, so that filling it rebuilds almost nothing (a
// segment holding 7% more keys than the average, 3 standard deviations at the segment size
// chosen, rebuilds once) and the table takes no more memory than it must. A restore's cost is
// mostly the first write to each fresh page of its tables (newSlots), so every byte saved counts:
// sized 60% full, as a rebuild leaves a segment, they took 25% more memory, and a 10M-block cold
// start about a third more time, with the shared load gate (docs/benchmarks/history.md, "Cold start
// from the snapshots of a sharded log"). 75% is within the 60 - 80% that segments run at anyway, so
// lookups probe no further than usual.
func newFlatMapSized[V any](n int) *flatMap[V] {
	m := &flatMap[V]{seed: rand.Uint64()}
	for m.depth < 24 && restoreRoomFor(n>>m.depth) > maxSegmentSlots*3/4 {
		m.depth++
	}
	m.dir = make([]dirEntry[V], 1<<m.depth)
	for p := range uint64(len(m.dir)) {
		s := &segment[V]{depth: m.depth, prefix: p, slots: newSlots[V](restoreRoomFor(n >> m.depth))}
		m.segs = append(m.segs, s)
		m.point(s)
	}
	return m
}

func (m *flatMap[V]) len() int { return m.n }

func (m *flatMap[V]) dirIndex(h uint64) int { return int(h >> (63 - m.depth) >> 1) }

// get returns the value of key, or nil.
func (m *flatMap[V]) get(key uint64) *V {
	if key == 0 {
		if m.hasZero {
			return &m.zero
		}
		return nil
	}
	h := hashKey(key, m.seed)
	slots := m.dir[m.dirIndex(h)].slots
	for i := home(h, len(slots)); ; {
		switch slots[i].key {
		case key:
			return &slots[i].val
		case 0:
			return nil
		}
		if i++; i == len(slots) {
			i = 0
		}
	}
}

// touch reads the cache line where key's probe starts, so that a caller probing several keys can
// start their cache misses together before it uses any of them. The caller must use the result
// (fold it into a field): the compiler drops a load whose value is never used.
func (m *flatMap[V]) touch(key uint64) uint64 {
	h := hashKey(key, m.seed)
	slots := m.dir[m.dirIndex(h)].slots
	return slots[home(h, len(slots))].key
}

// upsert returns the value of key, adding the key with a zero value if it was absent.
func (m *flatMap[V]) upsert(key uint64) (v *V, existed bool) {
	if key == 0 {
		if !m.hasZero {
			m.hasZero, m.n = true, m.n+1
			var zero V
			m.zero = zero
			return &m.zero, false
		}
		return &m.zero, true
	}
	h := hashKey(key, m.seed)
	for {
		d := &m.dir[m.dirIndex(h)]
		slots := d.slots
		i := home(h, len(slots))
		for {
			switch slots[i].key {
			case key:
				return &slots[i].val, true
			case 0:
				s := d.seg
				if 5*(s.n+1) > 4*len(slots) { // over 80% full: make room, then probe again
					m.grow(s)
					goto again
				}
				s.n++
				m.n++
				slots[i].key = key
				return &slots[i].val, false
			}
			if i++; i == len(slots) {
				i = 0
			}
		}
	again:
	}
}

// delete removes key, if present. It shifts the entries that follow back into the gap, so lookups
// never need tombstones.
func (m *flatMap[V]) delete(key uint64) bool {
	if key == 0 {
		if !m.hasZero {
			return false
		}
		var zero V
		m.hasZero, m.zero, m.n = false, zero, m.n-1
		return true
	}
	h := hashKey(key, m.seed)
	d := &m.dir[m.dirIndex(h)]
	slots := d.slots
	i := home(h, len(slots))
	for slots[i].key != key {
		if slots[i].key == 0 {
			return false
		}
		if i++; i == len(slots) {
			i = 0
		}
	}
	for j := i; ; {
		if j++; j == len(slots) {
			j = 0
		}
		k := slots[j].key
		if k == 0 {
			break
		}
		// The entry at j may move back to the gap at i unless its home lies cyclically in (i, j].
		hj := home(hashKey(k, m.seed), len(slots))
		if i <= j && i < hj && hj <= j || i > j && (i < hj || hj <= j) {
			continue
		}
		slots[i] = slots[j]
		i = j
	}
	slots[i] = flatEntry[V]{}
	d.seg.n--
	m.n--
	return true
}

// clone returns a copy of the table: its segments' slots are copied as they are (they hold no
// pointers), so copying costs about a memory copy of the table.
func (m *flatMap[V]) clone() *flatMap[V] {
	c := &flatMap[V]{seed: m.seed, depth: m.depth, n: m.n, hasZero: m.hasZero, zero: m.zero,
		dir: make([]dirEntry[V], len(m.dir)), segs: make([]*segment[V], len(m.segs))}
	for i, s := range m.segs {
		cs := &segment[V]{depth: s.depth, prefix: s.prefix, n: s.n, slots: append([]flatEntry[V](nil), s.slots...)}
		c.segs[i] = cs
		c.point(cs)
	}
	return c
}

// clear removes every key.
func (m *flatMap[V]) clear() { *m = *newFlatMap[V]() }

// all calls f for every key and its value, in no particular order. f must not change the table.
func (m *flatMap[V]) all(f func(key uint64, v *V)) {
	if m.hasZero {
		f(0, &m.zero)
	}
	for _, s := range m.segs {
		for i := range s.slots {
			if s.slots[i].key != 0 {
				f(s.slots[i].key, &s.slots[i].val)
			}
		}
	}
}

// grow makes room in s: it rebuilds s about 1.33× larger, or splits it in two once it is at its
// largest.
func (m *flatMap[V]) grow(s *segment[V]) {
	if size := roomFor(s.n); size <= maxSegmentSlots || s.depth >= 63 {
		m.rebuild(s, max(size, len(s.slots)+1))
		return
	}
	if s.depth == m.depth { // the directory must double first
		dir := make([]dirEntry[V], 2*len(m.dir))
		for i, e := range m.dir {
			dir[2*i], dir[2*i+1] = e, e
		}
		m.dir, m.depth = dir, m.depth+1
	}
	// Keys whose next hash bit is 0 stay in s; the others move to t.
	bit := 63 - s.depth
	var lo, hi int
	for _, e := range s.slots {
		if e.key != 0 {
			if hashKey(e.key, m.seed)>>bit&1 == 0 {
				lo++
			} else {
				hi++
			}
		}
	}
	t := &segment[V]{depth: s.depth + 1, prefix: s.prefix<<1 | 1, slots: newSlots[V](roomFor(hi))}
	old := s.slots
	s.depth, s.prefix = s.depth+1, s.prefix<<1
	s.slots, s.n = newSlots[V](roomFor(lo)), 0
	for _, e := range old {
		if e.key != 0 {
			if hashKey(e.key, m.seed)>>bit&1 == 0 {
				s.insert(e, m.seed)
			} else {
				t.insert(e, m.seed)
			}
		}
	}
	m.segs = append(m.segs, t)
	m.point(s)
	m.point(t)
}

// rebuild moves s's entries into size slots and points the directory at them.
func (m *flatMap[V]) rebuild(s *segment[V], size int) {
	old := s.slots
	s.slots, s.n = newSlots[V](size), 0
	for _, e := range old {
		if e.key != 0 {
			s.insert(e, m.seed)
		}
	}
	m.point(s)
}

// point makes the directory entries of s's hash prefix name s.
func (m *flatMap[V]) point(s *segment[V]) {
	shift := m.depth - s.depth
	for i := s.prefix << shift; i < (s.prefix+1)<<shift; i++ {
		m.dir[i] = dirEntry[V]{slots: s.slots, seg: s}
	}
}

// newSlots allocates n empty slots and writes to each of their memory pages in order.
//
// Why: a large allocation comes straight from the OS, untouched, and the first write to each page
// traps into the kernel. Filling a table writes its slots in random order, one trap per page at
// random; in this VM that cost 1.4 s of a 2.1 s fill of 10M blocks, against 34 ms to touch the
// same pages in order first (BenchmarkColdStart).
func newSlots[V any](n int) []flatEntry[V] {
	slots := make([]flatEntry[V], n)
	const page = 4096
	step := max(1, page/int(unsafe.Sizeof(flatEntry[V]{})))
	for i := 0; i < n; i += step {
		slots[i].key = 0
	}
	return slots
}

// insert places an entry known to be absent.
func (s *segment[V]) insert(e flatEntry[V], seed uint64) {
	i := home(hashKey(e.key, seed), len(s.slots))
	for s.slots[i].key != 0 {
		if i++; i == len(s.slots) {
			i = 0
		}
	}
	s.slots[i] = e
	s.n++
}
