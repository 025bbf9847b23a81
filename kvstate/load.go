package kvstate

import (
	"errors"
	"sort"
	"sync"
)

// Errors of booking changes. A change that fails with one of them changes nothing.
var (
	// ErrAlreadyBooked: a request id is booked a second time.
	ErrAlreadyBooked = errors.New("request id is already booked")
	// ErrUnknownRequest: prefill-done or free for a request id that is not booked.
	ErrUnknownRequest = errors.New("request is not booked")
)

// SlotLoad is the router-tracked load of one worker.
type SlotLoad struct {
	ActiveBlocks        uint64 // distinct blocks of booked requests
	ActivePrefillTokens uint64 // uncached prompt tokens of booked requests not yet past prefill
	ActiveRequests      uint64
}

// HopBooking is the load one request puts on one worker.
type HopBooking struct {
	Worker        WorkerKey
	Blocks        []uint64 // block keys: sequence hashes (shared) or per-request unique keys
	PrefillTokens uint64   // 0 when prefill is not tracked on this hop
}

// Booking is a routed request's load on its workers, kept until it is freed or expires.
type Booking struct {
	RequestID string
	Hops      []HopBooking
	At        int64 // unix nanoseconds when it was booked; decides expiry
	// Model is the model the request was routed for: a session binds within its model only.
	Model string
	// Session, when set, binds the session (of Model) to the decode worker (the last hop) until
	// SessionExpires.
	Session        string
	SessionExpires int64
	// Owner is the credential that booked the request ("" without credentials): what one caller's
	// bookings hold together is bounded (HeldBlocksOf), so no caller can take every booking's room.
	Owner string
}

type slotCount struct {
	slot  uint32
	count uint32
}

// holders are the workers whose booked requests use one block, with reference counts. Nearly every
// block has a single holder, so the first is kept inline and booking a block allocates nothing.
//
// Profile lessons (docs/benchmarks/history.md, "Profiles and changes"): with a slice per block,
// booking a 32k-token prompt made ~1,750 allocations, one 8-byte slice per new block key; inline,
// it makes ~330 (allocs/op -80%, B/op -30%). Booking and freeing are bound by cache misses on the
// table of blocks, so they probe it in batches like the index does (see probeBatch); and the table
// is a flatMap, like the index's: in a Go map, probing took a third of a 32k-token booking's time.
type holders struct {
	first slotCount // valid while the block is in Load.blocks
	more  uint32    // 0: no further holders (nearly always); else 1 + their index in Load.more
}

type bookedHop struct {
	slot          uint32
	blocks        []uint64
	prefillTokens uint64
	prefillDone   bool
}

type booked struct {
	at    int64
	owner string
	hops  []bookedHop
}

// Load is the router's own bookkeeping of what it routed (Dynamo's active sequences, §3.5): per worker
// the distinct blocks of its booked requests (shared prefixes counted once), their prefill tokens until
// the first token arrives, and the number of requests. It is safe for concurrent use.
type Load struct {
	mu       sync.RWMutex
	blocks   *flatMap[holders]   // block key -> workers holding it, with reference counts
	more     listPool[slotCount] // further holders of the blocks that have them
	warm     uint64              // sink of touch
	slots    map[uint32]*SlotLoad
	bookings map[string]*booked
	// held counts the block keys the bookings hold, every hop's, shared ones each time: what
	// bookings pin in memory (HeldBlocks); heldBy splits it by booking owner (HeldBlocksOf), for
	// the owners that hold any.
	held   int
	heldBy map[string]int
}

// NewLoad returns empty bookkeeping.
func NewLoad() *Load {
	return &Load{
		blocks:   newFlatMap[holders](),
		slots:    make(map[uint32]*SlotLoad),
		bookings: make(map[string]*booked),
		heldBy:   make(map[string]int),
	}
}

// slotLoadLocked returns the slot's load, creating it.
func (l *Load) slotLoadLocked(slot uint32) *SlotLoad {
	s := l.slots[slot]
	if s == nil {
		s = &SlotLoad{}
		l.slots[slot] = s
	}
	return s
}

// book records owner's booking whose hops are already resolved to slots. It takes ownership of the
// hops' block slices: callers must not reuse them.
func (l *Load) book(id string, at int64, owner string, hops []bookedHop) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.bookings[id]; ok {
		return ErrAlreadyBooked
	}
	for _, h := range hops {
		l.hold(owner, len(h.blocks))
		s := l.slotLoadLocked(h.slot)
		s.ActiveRequests++
		s.ActivePrefillTokens += h.prefillTokens
		for start := 0; start < len(h.blocks); start += probeBatch {
			chunk := h.blocks[start:min(start+probeBatch, len(h.blocks))]
			l.warmLocked(chunk)
			for _, b := range chunk {
				l.addBlockLocked(b, h.slot, s)
			}
		}
	}
	l.bookings[id] = &booked{at: at, owner: owner, hops: hops}
	return nil
}

// hold counts n more block keys (fewer when negative) held by owner's bookings. The caller holds
// l.mu.
func (l *Load) hold(owner string, n int) {
	l.held += n
	if owner == "" {
		return
	}
	if m := l.heldBy[owner] + n; m != 0 {
		l.heldBy[owner] = m
	} else {
		delete(l.heldBy, owner)
	}
}

// warmLocked touches the keys' slots back to back so that their cache misses overlap (see
// probeBatch); the caller then probes each again, from cache.
func (l *Load) warmLocked(keys []uint64) {
	for _, k := range keys {
		l.warm ^= l.blocks.touch(k)
	}
}

func (l *Load) addBlockLocked(key uint64, slot uint32, s *SlotLoad) {
	h, existed := l.blocks.upsert(key)
	switch {
	case !existed:
		h.first = slotCount{slot: slot, count: 1}
	case h.first.slot == slot:
		h.first.count++
		return
	default:
		ms := l.more.get(h.more)
		for i := range ms {
			if ms[i].slot == slot {
				ms[i].count++
				return
			}
		}
		l.more.add(&h.more, slotCount{slot: slot, count: 1})
	}
	s.ActiveBlocks++
}

func (l *Load) dropBlockLocked(key uint64, slot uint32, s *SlotLoad) {
	h := l.blocks.get(key)
	if h == nil {
		return
	}
	ms := l.more.get(h.more)
	if h.first.slot == slot {
		if h.first.count--; h.first.count > 0 {
			return
		}
		if last := len(ms) - 1; last >= 0 {
			h.first = ms[last]
			l.more.set(&h.more, ms[:last])
		} else {
			l.blocks.delete(key)
		}
		s.ActiveBlocks--
		return
	}
	for i := range ms {
		if ms[i].slot != slot {
			continue
		}
		if ms[i].count--; ms[i].count > 0 {
			return
		}
		last := len(ms) - 1
		ms[i] = ms[last]
		l.more.set(&h.more, ms[:last])
		s.ActiveBlocks--
		return
	}
}

func (l *Load) releaseHopLocked(owner string, h *bookedHop) {
	l.hold(owner, -len(h.blocks))
	s := l.slotLoadLocked(h.slot)
	s.ActiveRequests--
	if !h.prefillDone {
		s.ActivePrefillTokens -= h.prefillTokens
		h.prefillDone = true
	}
	for start := 0; start < len(h.blocks); start += probeBatch {
		chunk := h.blocks[start:min(start+probeBatch, len(h.blocks))]
		l.warmLocked(chunk)
		for _, b := range chunk {
			l.dropBlockLocked(b, h.slot, s)
		}
	}
}

// prefillDone stops counting the request's prefill tokens. Repeating it is harmless.
func (l *Load) prefillDone(id string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	b, ok := l.bookings[id]
	if !ok {
		return ErrUnknownRequest
	}
	for i := range b.hops {
		h := &b.hops[i]
		if !h.prefillDone {
			l.slotLoadLocked(h.slot).ActivePrefillTokens -= h.prefillTokens
			h.prefillDone = true
		}
	}
	return nil
}

// free releases everything the request booked.
func (l *Load) free(id string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	b, ok := l.bookings[id]
	if !ok {
		return ErrUnknownRequest
	}
	for i := range b.hops {
		l.releaseHopLocked(b.owner, &b.hops[i])
	}
	delete(l.bookings, id)
	return nil
}

// expire frees every booking made before the given time and returns how many it freed.
func (l *Load) expire(before int64) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for id, b := range l.bookings {
		if b.at < before {
			for i := range b.hops {
				l.releaseHopLocked(b.owner, &b.hops[i])
			}
			delete(l.bookings, id)
			n++
		}
	}
	return n
}

// oldest returns the booking time of the oldest booking, and false when there is none.
func (l *Load) oldest() (int64, bool) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	var min int64
	found := false
	for _, b := range l.bookings {
		if !found || b.at < min {
			min, found = b.at, true
		}
	}
	return min, found
}

// dropSlot removes a departed worker's share of every booking. Bookings left with no hop are deleted.
func (l *Load) dropSlot(slot uint32) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for id, b := range l.bookings {
		kept := b.hops[:0]
		for i := range b.hops {
			if b.hops[i].slot == slot {
				l.releaseHopLocked(b.owner, &b.hops[i])
				continue
			}
			kept = append(kept, b.hops[i])
		}
		b.hops = kept
		if len(kept) == 0 {
			delete(l.bookings, id)
		}
	}
	delete(l.slots, slot)
}

// HeldBlocks returns the block keys the bookings hold, every hop's (a block two hops share counts
// twice): about what they pin in memory, 8 bytes each. app.BookingCap bounds it.
func (l *Load) HeldBlocks() int {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.held
}

// HeldBlocksOf returns the block keys owner's bookings hold, counted as HeldBlocks counts them.
func (l *Load) HeldBlocksOf(owner string) int {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.heldBy[owner]
}

// Slot returns the worker's current load.
func (l *Load) Slot(slot uint32) SlotLoad {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if s := l.slots[slot]; s != nil {
		return *s
	}
	return SlotLoad{}
}

// Slots copies the load of each of the given slots into dst (in the same order) under one lock.
func (l *Load) Slots(dst []SlotLoad, slots []uint32) []SlotLoad {
	l.mu.RLock()
	defer l.mu.RUnlock()
	for _, slot := range slots {
		if s := l.slots[slot]; s != nil {
			dst = append(dst, *s)
		} else {
			dst = append(dst, SlotLoad{})
		}
	}
	return dst
}

// ActiveDepths fills o with, per worker, how many leading blocks of the prompt (sequence hashes) are
// already among the worker's active blocks: those blocks are not new load if the request lands there.
func (l *Load) ActiveDepths(seq []uint64, o *Overlaps) {
	o.reset()
	l.mu.RLock()
	defer l.mu.RUnlock()
	var batch [probeBatch]*holders
	for i := range seq {
		j := i % probeBatch
		if j == 0 {
			for k, key := range seq[i:min(i+probeBatch, len(seq))] {
				batch[k] = l.blocks.get(key)
			}
		}
		h := batch[j]
		if h == nil {
			return
		}
		advanced := advanceActive(o, h.first.slot, i)
		for _, sc := range l.more.get(h.more) {
			if advanceActive(o, sc.slot, i) {
				advanced = true
			}
		}
		if !advanced {
			return
		}
	}
}

// advanceActive extends the worker's run of active blocks by block i if the run reached it, and
// reports whether it did.
func advanceActive(o *Overlaps, slot uint32, i int) bool {
	d := o.entry(slot)
	if d[TierDevice] != uint32(i) {
		return false
	}
	d[TierDevice]++
	return true
}

// Bookings returns the number of live bookings.
func (l *Load) Bookings() int {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return len(l.bookings)
}

// Booked reports whether request id has a live booking here.
func (l *Load) Booked(id string) bool {
	l.mu.RLock()
	defer l.mu.RUnlock()
	_, ok := l.bookings[id]
	return ok
}

// BookingTimes returns the time of every live booking (unix nanoseconds), by request id.
func (l *Load) BookingTimes() map[string]int64 {
	l.mu.RLock()
	defer l.mu.RUnlock()
	out := make(map[string]int64, len(l.bookings))
	for id, b := range l.bookings {
		out[id] = b.at
	}
	return out
}

// BookingIDs returns the ids of live bookings, sorted (for digests and tests).
func (l *Load) BookingIDs() []string {
	l.mu.RLock()
	defer l.mu.RUnlock()
	ids := make([]string, 0, len(l.bookings))
	for id := range l.bookings {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}
