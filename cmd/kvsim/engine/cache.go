// Package engine is kvsim's simulated inference engine. Cache is its paged KV cache, with prefix
// sharing and LRU eviction; the blocks it stores and evicts are the KV events the engine publishes.
package engine

// Cache is one simulated worker's paged KV cache, kept the way vLLM's prefix cache keeps it: a block
// is named by its sequence hash (so equal prompt prefixes share blocks), a block referenced by a
// running request stays, and a block no request references stays cached until space is needed,
// then the least recently released goes first. It holds at most Capacity blocks, ever.
//
// It is not safe for concurrent use: each simulated engine owns its cache.
type Cache struct {
	capacity int
	blocks   map[uint64]*cachedBlock
	free     blockList // unreferenced blocks, the next to evict first
	used     int       // blocks held, referenced or not
}

// cachedBlock is one block of the cache; prev and next link it in the free list while no request
// references it.
type cachedBlock struct {
	hash       uint64
	refs       int
	prev, next *cachedBlock
}

// NewCache returns an empty cache of capacity blocks.
func NewCache(capacity int) *Cache {
	return &Cache{capacity: capacity, blocks: make(map[uint64]*cachedBlock, capacity)}
}

// Capacity returns the most blocks the cache holds.
func (c *Cache) Capacity() int { return c.capacity }

// Used returns the blocks held, referenced or cached for reuse.
func (c *Cache) Used() int { return c.used }

// Referenced returns the blocks some request references: what a worker reports as KV in use.
func (c *Cache) Referenced() int { return c.used - c.free.len }

// Lookup returns how many leading blocks of hashes are cached.
func (c *Cache) Lookup(hashes []uint64) int {
	for i, h := range hashes {
		if _, ok := c.blocks[h]; !ok {
			return i
		}
	}
	return len(hashes)
}

// Contains reports whether a block is cached.
func (c *Cache) Contains(hash uint64) bool {
	_, ok := c.blocks[hash]
	return ok
}

// Allocate references every block of hashes for one request: cached blocks are reused, the others
// are stored, evicting the least recently released unreferenced blocks when the cache is full. It
// returns how many leading blocks were cached (the prefix hit, whose prefill is skipped), the
// hashes it stored (in order) and those it evicted, both appended to the given slices. When the
// blocks cannot all be held (too many are referenced by other requests), it changes nothing and
// returns ok false: the request waits.
func (c *Cache) Allocate(hashes []uint64, stored, evicted []uint64) (hit int, storedOut, evictedOut []uint64, ok bool) {
	hit = c.Lookup(hashes)
	missing, reclaimable := 0, c.free.len
	for _, h := range hashes {
		b, cached := c.blocks[h]
		switch {
		case !cached:
			missing++
		case b.refs == 0:
			reclaimable-- // referenced now: no longer evictable for this request
		}
	}
	if missing > c.capacity-c.used+reclaimable {
		return hit, stored, evicted, false
	}
	for _, h := range hashes {
		if b, cached := c.blocks[h]; cached {
			if b.refs == 0 {
				c.free.remove(b)
			}
			b.refs++
			continue
		}
		if c.used == c.capacity {
			victim := c.free.front()
			c.free.remove(victim)
			delete(c.blocks, victim.hash)
			c.used--
			evicted = append(evicted, victim.hash)
		}
		c.blocks[h] = &cachedBlock{hash: h, refs: 1}
		c.used++
		stored = append(stored, h)
	}
	return hit, stored, evicted, true
}

// Release drops one request's references to its blocks (the hashes it allocated). Blocks nobody
// references stay cached; the request's last blocks are put first in line for eviction, so that a
// shared prefix outlives the tails that follow it, as in vLLM. Releasing a block the request does
// not reference is a bug in the simulator, and panics.
func (c *Cache) Release(hashes []uint64) {
	for i := len(hashes) - 1; i >= 0; i-- {
		b, ok := c.blocks[hashes[i]]
		if !ok || b.refs == 0 {
			panic("engine: Release of a block the request does not reference")
		}
		b.refs--
		if b.refs == 0 {
			c.free.pushBack(b)
		}
	}
}

// Clear drops every unreferenced block and returns their hashes appended to evicted (an engine's
// prefix-cache reset); referenced blocks stay.
func (c *Cache) Clear(evicted []uint64) []uint64 {
	for b := c.free.front(); b != nil; b = c.free.front() {
		c.free.remove(b)
		delete(c.blocks, b.hash)
		c.used--
		evicted = append(evicted, b.hash)
	}
	return evicted
}

// blockList is an intrusive doubly linked list of blocks.
type blockList struct {
	head, tail *cachedBlock
	len        int
}

func (l *blockList) front() *cachedBlock { return l.head }

func (l *blockList) pushBack(b *cachedBlock) {
	b.prev, b.next = l.tail, nil
	if l.tail != nil {
		l.tail.next = b
	} else {
		l.head = b
	}
	l.tail = b
	l.len++
}

func (l *blockList) remove(b *cachedBlock) {
	if b.prev != nil {
		b.prev.next = b.next
	} else {
		l.head = b.next
	}
	if b.next != nil {
		b.next.prev = b.prev
	} else {
		l.tail = b.prev
	}
	b.prev, b.next = nil, nil
	l.len--
}
