package kvstate

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Errors of registration and booking changes; a change failing with one of them changes nothing.
var (
	// ErrUnknownWorker: a change names a worker rank that is not registered.
	ErrUnknownWorker = errors.New("worker is not registered")
	// ErrWorkerConflict: a worker re-registers with a different model, role or capacity.
	ErrWorkerConflict = errors.New("worker is registered with a different configuration")
	// ErrBlockSizeMismatch: a worker's block size differs from its model's.
	ErrBlockSizeMismatch = errors.New("block size differs from the model's")
	// ErrStaleDump: a dump reflects fewer events than already applied (and no resync is pending).
	ErrStaleDump = errors.New("dump is older than the applied events")
	// ErrSuperseded: a change comes from a stream that no longer holds its worker rank: a newer
	// stream registered the rank since (on any replica).
	ErrSuperseded = errors.New("a newer stream registered this worker")
)

// Worker is a registered worker rank. Its Info and Slot never change; a re-registration with new
// details replaces the Worker value, keeping the slot and the event numbering.
type Worker struct {
	Info WorkerInfo
	// Slot is the worker's dense index in the prefix index and the load bookkeeping.
	Slot  uint32
	track *workerTrack
}

// workerTrack is a worker's mutable bookkeeping, shared by every Worker value of the same rank.
type workerTrack struct {
	mu    sync.Mutex
	epoch uint64 // registration epoch: bumped by every new stream's WorkerUp
	// epochEnds is closed when epoch changes (or the worker goes): the stream registered at epoch
	// learns that it no longer holds the rank. Replica-local, like streams.
	epochEnds      chan struct{}
	lastEventID    uint64
	hasLastEvent   bool
	awaitingResync bool
	kvUsedBlocks   uint64
	waiting        uint64
}

// WorkerStatus is a point-in-time view of a worker's bookkeeping, for operators.
type WorkerStatus struct {
	Epoch           uint64
	LastEventID     uint64
	HasLastEvent    bool
	AwaitingResync  bool
	KVUsedBlocks    uint64
	WaitingRequests uint64
}

// Status returns the worker's current bookkeeping.
func (w *Worker) Status() WorkerStatus {
	t := w.track
	t.mu.Lock()
	defer t.mu.Unlock()
	return WorkerStatus{
		Epoch: t.epoch, LastEventID: t.lastEventID, HasLastEvent: t.hasLastEvent, AwaitingResync: t.awaitingResync,
		KVUsedBlocks: t.kvUsedBlocks, WaitingRequests: t.waiting,
	}
}

// Model is one served model: its block size, its prefix index and its workers.
type Model struct {
	Name      string
	BlockSize uint32
	Index     *Index
	workers   atomic.Pointer[[]*Worker] // copy-on-write, sorted by key
}

// Workers returns the model's workers sorted by key. The slice is shared: do not modify it.
func (m *Model) Workers() []*Worker {
	if p := m.workers.Load(); p != nil {
		return *p
	}
	return nil
}

// State is everything the router knows, as built by applying changes. Reads are safe at any time;
// changes must come through Apply, one at a time per worker and per request (a Log guarantees that).
type State struct {
	mu      sync.RWMutex // guards models, workers and slots
	models  map[string]*Model
	workers map[WorkerKey]*Worker
	slots   []*Worker // by slot; nil = free
	load    *Load

	capMu      sync.Mutex
	capChanged chan struct{} // closed and replaced when routing capacity may have freed

	sessMu   sync.RWMutex
	sessions map[sessionKey]sessionBinding

	rep replicated // see ApplyReplicated

	// epochHigh is the largest registration epoch this state ever applied, removed workers'
	// included (replicated: it is in snapshots); issued is the largest incarnation this replica
	// handed out (Stamp), local. Together they keep a worker id from ever getting an epoch twice.
	epochHigh atomic.Uint64
	issued    atomic.Uint64

	restores atomic.Uint64 // snapshots restored (Restores)
	expired  atomic.Uint64 // bookings ended by BookingsExpired (ExpiredBookings)
	budget   *indexBudget  // the indexes' size and cap
}

// sessionKey names a session: session ids belong to the model they were routed for, so the same id
// used by two models binds two sessions, each to a decode worker of its own model.
type sessionKey struct {
	model, id string
}

// sessionBinding is the decode worker a session's turns go to, until it expires.
type sessionBinding struct {
	worker  WorkerKey
	expires int64
}

// Session returns the decode worker model's session id is bound to, if the binding has not expired
// at now (unix nanoseconds).
func (s *State) Session(model, id string, now int64) (WorkerKey, bool) {
	s.sessMu.RLock()
	defer s.sessMu.RUnlock()
	b, ok := s.sessions[sessionKey{model, id}]
	if !ok || b.expires <= now {
		return WorkerKey{}, false
	}
	return b.worker, true
}

// Stamp returns c ready to be appended to a log: a new stream's registration (a WorkerUp with
// neither Epoch nor Incarnation) gets its incarnation, the epoch the worker will hold on every
// replica. Every Log calls it on what it appends; the apply never chooses an epoch, so that one
// chosen here is the same everywhere, whatever order replicas apply registrations in.
//
// The incarnation is larger than every epoch this state applied (so larger than the removed
// incarnation a late removal may name, as long as this replica applied its registration), than the
// last one this replica handed out (two hellos in the same nanosecond differ), and than the wall
// clock (which orders it after registrations this replica never saw, such as those before a
// snapshot reload, unless clocks are off by more than the time between them; even then a repeat
// needs the very same nanosecond).
func (s *State) Stamp(c Change) Change {
	u, ok := c.(WorkerUp)
	if !ok || u.Epoch != 0 || u.Incarnation != 0 {
		return c
	}
	for {
		last := s.issued.Load()
		next := max(uint64(time.Now().UnixNano()), s.epochHigh.Load()+1, last+1)
		if s.issued.CompareAndSwap(last, next) {
			u.Incarnation = next
			return u
		}
	}
}

// noteEpoch records that epoch was applied.
func (s *State) noteEpoch(epoch uint64) { raise(&s.epochHigh, epoch) }

// raise sets a to v unless it holds more already.
func raise(a *atomic.Uint64, v uint64) {
	for cur := a.Load(); cur < v && !a.CompareAndSwap(cur, v); cur = a.Load() {
	}
}

// Sessions returns the number of session bindings held (expired ones included until swept).
func (s *State) Sessions() int {
	s.sessMu.RLock()
	defer s.sessMu.RUnlock()
	return len(s.sessions)
}

// oldestSessionExpiry returns the earliest binding expiry, and false when there is no binding.
func (s *State) oldestSessionExpiry() (int64, bool) {
	s.sessMu.RLock()
	defer s.sessMu.RUnlock()
	var min int64
	found := false
	for _, b := range s.sessions {
		if !found || b.expires < min {
			min, found = b.expires, true
		}
	}
	return min, found
}

func (s *State) expireSessions(before int64) int {
	s.sessMu.Lock()
	defer s.sessMu.Unlock()
	n := 0
	for id, b := range s.sessions {
		if b.expires < before {
			delete(s.sessions, id)
			n++
		}
	}
	return n
}

// NewState returns an empty state.
func NewState() *State {
	return &State{models: make(map[string]*Model), workers: make(map[WorkerKey]*Worker), load: NewLoad(), budget: &indexBudget{}}
}

// Model returns the named model, or nil if no worker serves it.
func (s *State) Model(name string) *Model {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.models[name]
}

// Models returns every model, sorted by name.
func (s *State) Models() []*Model {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]*Model, 0, len(s.models))
	for _, m := range s.models {
		out = append(out, m)
	}
	slices.SortFunc(out, func(a, b *Model) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

// Worker returns the registered worker rank, or nil.
func (s *State) Worker(key WorkerKey) *Worker {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.workers[key]
}

// Load returns the load bookkeeping.
func (s *State) Load() *Load { return s.load }

// ExpiredBookings returns how many bookings this state ended because nobody freed them within the
// booking expiry (BookingsExpired). Expiry is the last resort for a request whose caller, proxy or
// router replica died before its Free: each one is a request the router counted as load for the
// whole expiry. Each replica counts the expiries it applied, and they all apply the same log, so
// a fleet's count is one replica's, not the sum of them.
func (s *State) ExpiredBookings() uint64 { return s.expired.Load() }

// EpochEnds returns a channel that is closed once the worker rank is no longer registered at epoch:
// a newer stream registered it, or it was removed. It is closed already when that happened before.
func (s *State) EpochEnds(key WorkerKey, epoch uint64) <-chan struct{} {
	w := s.Worker(key)
	if w == nil {
		return closedChan
	}
	t := w.track
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.epoch != epoch {
		return closedChan
	}
	if t.epochEnds == nil {
		t.epochEnds = make(chan struct{})
	}
	return t.epochEnds
}

var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// Holds reports why the stream registered at epoch no longer holds the worker rank: nil while it
// does, ErrSuperseded when a newer stream registered the rank, ErrUnknownWorker when it was removed.
func (s *State) Holds(key WorkerKey, epoch uint64) error {
	w := s.Worker(key)
	if w == nil {
		return fmt.Errorf("%w: %v was removed", ErrUnknownWorker, key)
	}
	w.track.mu.Lock()
	defer w.track.mu.Unlock()
	return w.track.checkEpochLocked(key, epoch)
}

// endEpochLocked closes the channel of the track's current epoch; the caller holds t.mu.
func (t *workerTrack) endEpochLocked() {
	if t.epochEnds != nil {
		close(t.epochEnds)
		t.epochEnds = nil
	}
}

// CapacityChanged returns a channel that is closed at the next change that may free routing
// capacity: a prefill done, a free, an expiry, a worker joining or leaving. Waiting requests retry then.
func (s *State) CapacityChanged() <-chan struct{} {
	s.capMu.Lock()
	defer s.capMu.Unlock()
	if s.capChanged == nil {
		s.capChanged = make(chan struct{})
	}
	return s.capChanged
}

func (s *State) signalCapacity() {
	s.capMu.Lock()
	defer s.capMu.Unlock()
	if s.capChanged != nil {
		close(s.capChanged)
		s.capChanged = nil
	}
}

// Apply applies one change. On error nothing changed.
func (s *State) Apply(c Change) (Result, error) {
	res, err := s.apply(c)
	if err == nil {
		switch c.(type) {
		case PrefillDone, Freed, BookingsExpired, WorkerUp, WorkerRemoved:
			s.signalCapacity()
		}
	}
	return res, err
}

func (s *State) apply(c Change) (Result, error) {
	switch c := c.(type) {
	case WorkerUp:
		epoch, err := s.workerUp(c)
		return Result{Epoch: epoch}, err
	case WorkerRemoved:
		return s.workerRemoved(c), nil
	case KVEvents:
		return s.kvEvents(c)
	case KVDump:
		return s.kvDump(c)
	case LoadReported:
		w := s.Worker(c.Worker)
		if w == nil {
			return Result{}, ErrUnknownWorker
		}
		w.track.mu.Lock()
		defer w.track.mu.Unlock()
		if err := w.track.checkEpochLocked(c.Worker, c.Epoch); err != nil {
			return Result{}, err
		}
		w.track.kvUsedBlocks, w.track.waiting = c.KVUsedBlocks, c.WaitingRequests
		return Result{}, nil
	case Booked:
		return Result{}, s.book(c.Booking, false)
	case PrefillDone:
		return Result{}, s.load.prefillDone(c.RequestID)
	case Freed:
		return Result{}, s.load.free(c.RequestID)
	case BookingsExpired:
		n := s.load.expire(c.Before)
		s.expired.Add(uint64(n))
		return Result{Expired: n}, nil
	case SessionsExpired:
		return Result{Expired: s.expireSessions(c.Before)}, nil
	}
	return Result{}, fmt.Errorf("kvstate: unknown change %T", c)
}

// checkEpochLocked fails a change sent by the stream registered at epoch (0: unconditional) when a
// newer stream holds the rank. The caller holds t.mu.
func (t *workerTrack) checkEpochLocked(key WorkerKey, epoch uint64) error {
	if epoch != 0 && epoch != t.epoch {
		return fmt.Errorf("%w: worker %v was registered again (registration %d) after this stream's (registration %d)", ErrSuperseded, key, t.epoch, epoch)
	}
	return nil
}

// workerUp applies a registration and returns the rank's epoch after it.
func (s *State) workerUp(c WorkerUp) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	info := c.Info
	old := s.workers[info.Key]
	if c.Epoch != 0 {
		// A re-announcement on a live stream: it changes nothing but the details, and only while
		// that stream holds the rank.
		if old == nil {
			return 0, fmt.Errorf("%w: %v", ErrUnknownWorker, info.Key)
		}
		old.track.mu.Lock()
		err := old.track.checkEpochLocked(info.Key, c.Epoch)
		old.track.mu.Unlock()
		if err != nil {
			return 0, err
		}
	}
	if old != nil && !c.Reset && !old.Info.SameCapacity(info) {
		return 0, WorkerConflict(old.Info)
	}
	m := s.models[info.Model]
	if m != nil && m.BlockSize != info.BlockSize {
		// Only a reset of the model's sole worker may change the model's block size.
		members := m.Workers()
		if !(c.Reset && old != nil && len(members) == 1 && members[0].Info.Key == info.Key) {
			return 0, fmt.Errorf("%w: model %q uses block_size %d, the worker registered %d", ErrBlockSizeMismatch, info.Model, m.BlockSize, info.BlockSize)
		}
	}
	if c.Epoch != 0 {
		w := &Worker{Info: info, Slot: old.Slot, track: old.track}
		s.workers[info.Key] = w
		s.slots[w.Slot] = w
		setMember(m, w)
		return c.Epoch, nil
	}
	if old != nil && !c.Reset && c.Incarnation != 0 {
		old.track.mu.Lock()
		again := old.track.epoch == c.Incarnation
		old.track.mu.Unlock()
		if again {
			// The same registration applied twice (its entry appended again after an append
			// that got no reply): the stream that holds the rank holds it still.
			return c.Incarnation, nil
		}
	}
	// Validated; from here on the change applies whole.
	var previous uint64 // the epoch before: a reset worker's, an entry without incarnation bumps it
	if old != nil && c.Reset {
		old.track.mu.Lock()
		previous = old.track.epoch
		old.track.endEpochLocked() // the old stream's registration is over
		old.track.mu.Unlock()
		s.removeLocked(old)
		old = nil
		m = s.models[info.Model]
	}
	if m == nil {
		m = &Model{Name: info.Model, BlockSize: info.BlockSize, Index: NewIndex()}
		m.Index.budget = s.budget
		s.models[info.Model] = m
	}
	var w *Worker
	if old != nil {
		w = &Worker{Info: info, Slot: old.Slot, track: old.track}
	} else {
		w = &Worker{Info: info, Slot: s.allocSlotLocked(), track: &workerTrack{}}
	}
	w.track.mu.Lock()
	w.track.endEpochLocked()
	if old != nil {
		previous = w.track.epoch
	}
	epoch := c.Incarnation
	if epoch == 0 {
		epoch = previous + 1 // an entry written before incarnations existed
	}
	w.track.epoch = epoch
	w.track.mu.Unlock()
	s.noteEpoch(epoch)
	s.workers[info.Key] = w
	s.slots[w.Slot] = w
	setMember(m, w)
	return epoch, nil
}

// WorkerConflict is the error of a registration that differs from the worker rank's registration
// held: a rank belongs to one model, with one role and capacity, until it is removed or registers
// afresh (fresh_start).
func WorkerConflict(held WorkerInfo) error {
	return fmt.Errorf("%w: worker %v is registered as model %q, role %v, block_size %d, total_kv_blocks %d, max_num_batched_tokens %d",
		ErrWorkerConflict, held.Key, held.Model, held.Role, held.BlockSize, held.TotalKVBlocks, held.MaxNumBatchedTokens)
}

func (s *State) allocSlotLocked() uint32 {
	for i, w := range s.slots {
		if w == nil {
			return uint32(i)
		}
	}
	s.slots = append(s.slots, nil)
	return uint32(len(s.slots) - 1)
}

// setMember inserts or replaces w in the model's sorted worker list (copy-on-write).
func setMember(m *Model, w *Worker) {
	cur := m.Workers()
	next := make([]*Worker, 0, len(cur)+1)
	for _, x := range cur {
		if x.Info.Key != w.Info.Key {
			next = append(next, x)
		}
	}
	next = append(next, w)
	slices.SortFunc(next, func(a, b *Worker) int { return compareKeys(a.Info.Key, b.Info.Key) })
	m.workers.Store(&next)
}

func (s *State) workerRemoved(c WorkerRemoved) Result {
	s.mu.Lock()
	defer s.mu.Unlock()
	w := s.workers[c.Key]
	if w == nil {
		return Result{Skipped: true}
	}
	if c.Epoch != 0 {
		w.track.mu.Lock()
		current := w.track.epoch == c.Epoch
		w.track.mu.Unlock()
		if !current {
			return Result{Skipped: true}
		}
	}
	s.removeLocked(w)
	return Result{}
}

func (s *State) removeLocked(w *Worker) {
	m := s.models[w.Info.Model]
	if m != nil {
		m.Index.ClearWorker(w.Slot)
		cur := m.Workers()
		next := make([]*Worker, 0, len(cur))
		for _, x := range cur {
			if x.Info.Key != w.Info.Key {
				next = append(next, x)
			}
		}
		if len(next) == 0 {
			delete(s.models, m.Name)
		}
		m.workers.Store(&next)
	}
	s.load.dropSlot(w.Slot)
	delete(s.workers, w.Info.Key)
	s.slots[w.Slot] = nil
	w.track.mu.Lock()
	w.track.endEpochLocked()
	w.track.mu.Unlock()
}

// kvEvents applies a worker's events in order: duplicates are dropped, a gap drops the worker's
// blocks and waits for a dump, and stored events with an unknown parent are dropped and counted.
func (s *State) kvEvents(c KVEvents) (Result, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	w := s.workers[c.Worker]
	if w == nil {
		return Result{}, ErrUnknownWorker
	}
	ix := s.models[w.Info.Model].Index
	t := w.track
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.checkEpochLocked(c.Worker, c.Epoch); err != nil {
		return Result{}, err
	}
	var res Result
	for i := range c.Events {
		ev := &c.Events[i]
		switch {
		case t.awaitingResync:
			res.Ignored++
			continue
		case t.hasLastEvent && ev.ID <= t.lastEventID:
			res.Duplicates++
			continue
		}
		expected := uint64(0)
		if t.hasLastEvent {
			expected = t.lastEventID + 1
		}
		if ev.ID != expected {
			res.Gap, res.ExpectedEventID, res.GotEventID = true, expected, ev.ID
			t.awaitingResync = true
			ix.ClearWorker(w.Slot)
			res.Ignored += len(c.Events) - i
			break
		}
		applyEvent(ix, w.Slot, ev, &res)
		t.lastEventID, t.hasLastEvent = ev.ID, true
		res.Applied++
	}
	res.LastEventID, res.HasLastEvent = t.lastEventID, t.hasLastEvent
	return res, nil
}

// applyEvent applies one event. An event the wire layer should never have let through (a tier or
// kind out of range) is dropped and counted, not applied: a bad log entry must not crash a replica.
func applyEvent(ix *Index, slot uint32, ev *Event, res *Result) {
	if ev.Tier >= NumTiers {
		res.Invalid++
		return
	}
	switch ev.Kind {
	case EventStored:
		dups, err := ix.Store(slot, ev.Tier, ev.Parent, ev.HasParent, ev.Blocks)
		switch {
		case errors.Is(err, ErrParentNotFound):
			res.ParentNotFound++
		case errors.Is(err, ErrInvalidBlockSequence):
			res.InvalidSequence++
		}
		res.DuplicateBlocks += dups
	case EventRemoved:
		res.UnknownRemoved += ix.Remove(slot, ev.Tier, ev.Removed)
	case EventCleared:
		// A cleared event drops every tier of the worker rank, whichever tier it names: Dynamo's
		// Cleared (AllBlocksCleared) has no tier (§4.1, §4.3), and host or disk blocks left behind
		// would continue a device prefix the rank no longer holds.
		ix.ClearWorker(slot)
	default:
		res.Invalid++
	}
}

func (s *State) kvDump(c KVDump) (Result, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	w := s.workers[c.Worker]
	if w == nil {
		return Result{}, ErrUnknownWorker
	}
	ix := s.models[w.Info.Model].Index
	t := w.track
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.checkEpochLocked(c.Worker, c.Epoch); err != nil {
		return Result{}, err
	}
	if t.hasLastEvent && !t.awaitingResync && c.ThroughEventID < t.lastEventID {
		return Result{}, fmt.Errorf("%w: dump through event %d, but event %d is already applied", ErrStaleDump, c.ThroughEventID, t.lastEventID)
	}
	var res Result
	ix.ClearWorker(w.Slot)
	for i := range c.Events {
		applyEvent(ix, w.Slot, &c.Events[i], &res)
		res.Applied++
	}
	t.lastEventID, t.hasLastEvent, t.awaitingResync = c.ThroughEventID, true, false
	res.LastEventID, res.HasLastEvent = t.lastEventID, true
	return res, nil
}

// book resolves the hops' workers and records the booking. The state lock is held across, so a
// worker cannot be removed between its resolution and the booking. Strictly, a hop naming an unknown
// worker fails the booking; leniently (replicated apply) the hop is skipped, as the worker's removal
// would have dropped it had the booking come first.
func (s *State) book(b Booking, lenient bool) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	hops := make([]bookedHop, 0, len(b.Hops))
	for _, h := range b.Hops {
		w := s.workers[h.Worker]
		if w == nil {
			if lenient {
				continue
			}
			return fmt.Errorf("%w: %v", ErrUnknownWorker, h.Worker)
		}
		hops = append(hops, bookedHop{slot: w.Slot, blocks: h.Blocks, prefillTokens: h.PrefillTokens})
	}
	if len(hops) > 0 || !lenient {
		if err := s.load.book(b.RequestID, b.At, b.Owner, hops); err != nil {
			return err
		}
	}
	s.bindBookingLocked(b)
	return nil
}

// bindBookingLocked binds the booking's session, if it names one, to its decode worker (the last
// hop). It binds whether or not the load was recorded: a replica that applied the booking before a
// worker's removal or a booking expiry bound it, so every replica does, and the binding expires on
// its own (SessionsExpired). The caller holds s.mu (for reading).
func (s *State) bindBookingLocked(b Booking) {
	if b.Session == "" || len(b.Hops) == 0 {
		return
	}
	decode := b.Hops[len(b.Hops)-1].Worker
	model := b.Model
	if model == "" {
		// Written before bookings named their model: the decode worker's, if it is registered.
		w := s.workers[decode]
		if w == nil {
			return
		}
		model = w.Info.Model
	}
	s.bindSession(sessionKey{model, b.Session}, sessionBinding{worker: decode, expires: b.SessionExpires})
}

// bindSession binds a session to a booking's decode worker, unless it is bound by a booking whose
// binding lasts longer (a later one: the same TTL applies to all). Which of two bookings binds does
// not depend on the order they apply in: a replica applies its own bookings before the log's, and
// the logs of two models (sharded) interleave differently on each replica, yet all end up bound
// alike. Equal expiries go to the larger worker key.
func (s *State) bindSession(key sessionKey, nb sessionBinding) {
	s.sessMu.Lock()
	defer s.sessMu.Unlock()
	if s.sessions == nil {
		s.sessions = make(map[sessionKey]sessionBinding)
	}
	if old, ok := s.sessions[key]; ok && (old.expires > nb.expires || old.expires == nb.expires && compareKeys(old.worker, nb.worker) >= 0) {
		return
	}
	s.sessions[key] = nb
}

func compareKeys(a, b WorkerKey) int {
	if c := cmp.Compare(a.ID, b.ID); c != 0 {
		return c
	}
	return cmp.Compare(a.Rank, b.Rank)
}
