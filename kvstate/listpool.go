package kvstate

// listPool holds small lists of T for the entries of a flatMap, which cannot hold a slice: an entry
// keeps a handle instead, 0 for no list, else 1 + the list's index here. Freed indexes are reused.
// The index uses it for the holder words beyond a block's first, Load for a block's holders beyond
// its first; both are rare, so the pool stays small.
type listPool[T any] struct {
	lists [][]T
	free  []uint32
}

// get returns the list of handle h (nil for 0).
func (p *listPool[T]) get(h uint32) []T {
	if h == 0 {
		return nil
	}
	return p.lists[h-1]
}

// add appends v to the list of handle *h, first taking a list for it if *h is 0.
func (p *listPool[T]) add(h *uint32, v T) {
	if *h == 0 {
		var i uint32
		if n := len(p.free); n > 0 {
			i, p.free = p.free[n-1], p.free[:n-1]
		} else {
			p.lists = append(p.lists, nil)
			i = uint32(len(p.lists) - 1)
		}
		p.lists[i] = p.lists[i][:0]
		*h = i + 1
	}
	p.lists[*h-1] = append(p.lists[*h-1], v)
}

// set makes l (a prefix of what get returned) the list of handle *h, and gives the list back, with
// *h set to 0, when l is empty.
func (p *listPool[T]) set(h *uint32, l []T) {
	p.lists[*h-1] = l
	if len(l) == 0 {
		p.free = append(p.free, *h-1)
		*h = 0
	}
}

// clone returns a deep copy of the pool.
func (p *listPool[T]) clone() listPool[T] {
	c := listPool[T]{lists: make([][]T, len(p.lists)), free: append([]uint32(nil), p.free...)}
	for i, l := range p.lists {
		c.lists[i] = append([]T(nil), l...)
	}
	return c
}
