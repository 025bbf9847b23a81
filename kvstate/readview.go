package kvstate

// ReadView is a read-only handle on a State: the reads a routing decision makes (a model's block
// size, its workers and its prompt overlaps, and the booked load) and nothing else. The state behind
// it is unexported, so code that holds only a ReadView, such as policy's decision kernel, cannot
// reach Apply, the prefix index's Store and Remove, or any other change: the compiler keeps the
// kernel read-only, not a convention. A ReadView is one pointer wide, so it (and the readers it
// hands out) fit in an interface value without allocating.
type ReadView struct{ s *State }

// ReadView returns the read-only view of s.
func (s *State) ReadView() ReadView { return ReadView{s} }

// Model returns the read-only view of the named model, and false when no worker serves it.
func (v ReadView) Model(name string) (ModelReader, bool) {
	m := v.s.Model(name)
	return ModelReader{m}, m != nil
}

// Load returns the read-only view of the booked load.
func (v ReadView) Load() LoadReader { return LoadReader{v.s.Load()} }

// ModelReader is a read-only handle on a Model: its block size, a copy of its workers and overlap
// queries on its prefix index, whose Store and Remove it does not offer.
type ModelReader struct{ m *Model }

// Name returns the model's name.
func (r ModelReader) Name() string { return r.m.Name }

// BlockSize returns the model's block size in tokens; it never changes while the model exists.
func (r ModelReader) BlockSize() uint32 { return r.m.BlockSize }

// AppendWorkers appends the model's workers, sorted by key, to dst and returns it. It copies, where
// Model.Workers shares the model's own slice, so that a reader cannot change the model's list.
func (r ModelReader) AppendWorkers(dst []*Worker) []*Worker { return append(dst, r.m.Workers()...) }

// Overlaps fills o with every worker's overlap with the prompt whose sequence hashes are seq
// (Index.Overlaps).
func (r ModelReader) Overlaps(seq []uint64, o *Overlaps) { r.m.Index.Overlaps(seq, o) }

// LoadReader is a read-only handle on a Load: the per-worker loads and active-block depths a
// decision reads.
type LoadReader struct{ l *Load }

// Slots copies the load of each of the given slots into dst, in the same order (Load.Slots).
func (r LoadReader) Slots(dst []SlotLoad, slots []uint32) []SlotLoad { return r.l.Slots(dst, slots) }

// ActiveDepths fills o with each worker's run of the prompt's leading blocks among its active
// blocks (Load.ActiveDepths).
func (r LoadReader) ActiveDepths(seq []uint64, o *Overlaps) { r.l.ActiveDepths(seq, o) }

// BookedAt returns when request id was booked (unix nanoseconds, as Booking.At) and on how many
// hops (2: prefilled remotely, then decoded; 1: one worker does both), and false when it is not
// booked. The dispatcher's outcome hook reads it to tell how long a booking lived and where it was
// prefilled, on any replica, since the booking carries both. A hop whose worker was removed is
// gone from the booking, so a remote prefill whose prefill worker left counts as one hop.
func (l *Load) BookedAt(id string) (at int64, hops int, ok bool) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	b := l.bookings[id]
	if b == nil {
		return 0, 0, false
	}
	return b.at, len(b.hops), true
}
