package kvstate

// Change is one state transition. Every change to State arrives as a Change appended to a Log, so
// that every replica applying the same log reaches the same state.
type Change interface {
	isChange()
}

// WorkerUp registers a worker rank, or re-announces it after a reconnect. With Reset, whatever the
// router held for the rank (blocks, event numbering) is dropped first: the worker starts afresh.
//
// A WorkerUp with Epoch zero is a new stream's registration: the rank's registration epoch becomes
// Incarnation, so the stream that held the rank until then is superseded (its later changes fail
// with ErrSuperseded). A non-zero Epoch re-announces the rank on the stream registered at that epoch:
// it applies only while that stream still holds the rank, and keeps the epoch.
//
// Incarnation is chosen by the replica that appends the registration (State.Stamp, which every Log
// calls), never by the apply: it is larger than every epoch that replica's state ever applied and
// than the clock, so a worker id never gets an epoch twice, also after it was removed (when the
// state forgets the rank). A removal names the epoch it removes, so one that arrives late (from a
// replica that was paused or cut off) can never remove a later incarnation of the same worker.
// Entries written before incarnations existed decode with 0: the epoch is then bumped by one.
type WorkerUp struct {
	Info        WorkerInfo
	Reset       bool
	Epoch       uint64
	Incarnation uint64
}

// WorkerRemoved removes a worker rank with its blocks and its share of bookings. With a non-zero
// Epoch it applies only if the worker's registration epoch is still that one: every hello gives the
// rank a new epoch, never one it had before, so a removal that races a reconnect (or arrives after
// the worker was removed and registered again) is skipped, identically on every replica.
type WorkerRemoved struct {
	Key   WorkerKey
	Epoch uint64
}

// KVEvents applies a worker rank's KV events in order (§4.3, §4.4).
//
// Epoch, KVDump's and LoadReported's too, is the registration epoch of the stream that sent the
// change: when it is non-zero and the rank has been registered again since, the change fails with
// ErrSuperseded and nothing of it applies, on every replica alike. Zero applies unconditionally.
type KVEvents struct {
	Worker WorkerKey
	Epoch  uint64
	Events []Event
}

// KVDump replaces everything known of a worker rank's cache with a full dump, reflecting the
// worker's events up to ThroughEventID. Event ids inside the dump are ignored.
type KVDump struct {
	Worker         WorkerKey
	Epoch          uint64
	ThroughEventID uint64
	Events         []Event
}

// LoadReported records a worker's own load report.
type LoadReported struct {
	Worker          WorkerKey
	Epoch           uint64
	KVUsedBlocks    uint64
	WaitingRequests uint64
}

// Booked books a routed request's load on its workers.
type Booked struct {
	Booking Booking
}

// PrefillDone ends the prefill phase of a booked request. At (unix nanoseconds) is when it was
// appended. It is appended only by a replica that holds the booking (it applied the Booked first),
// so in the log it always follows its Booked; one that names no booking changes nothing.
type PrefillDone struct {
	RequestID string
	At        int64
}

// Freed releases a booked request. At, and its place in the log, are as for PrefillDone.
type Freed struct {
	RequestID string
	At        int64
}

// BookingsExpired frees every booking made before Before (unix nanoseconds). Appended by whichever
// replica notices first; applying it twice is harmless.
type BookingsExpired struct {
	Before int64
}

// SessionsExpired forgets session bindings that expired before Before (unix nanoseconds).
type SessionsExpired struct {
	Before int64
}

func (WorkerUp) isChange()        {}
func (WorkerRemoved) isChange()   {}
func (KVEvents) isChange()        {}
func (KVDump) isChange()          {}
func (LoadReported) isChange()    {}
func (Booked) isChange()          {}
func (PrefillDone) isChange()     {}
func (Freed) isChange()           {}
func (BookingsExpired) isChange() {}
func (SessionsExpired) isChange() {}

// Result reports what applying a change did, for the caller that appended it.
type Result struct {
	// LastEventID is the worker's last applied event id after the change (HasLastEvent false: none).
	LastEventID  uint64
	HasLastEvent bool
	// Applied counts events applied; Duplicates counts events dropped because their id was already
	// applied; Ignored counts events dropped while a resync is pending.
	Applied, Duplicates, Ignored int
	// ParentNotFound and InvalidSequence count stored events dropped (§4.3); UnknownRemoved counts
	// removed hashes the worker did not hold; DuplicateBlocks counts blocks stored again.
	ParentNotFound, InvalidSequence, UnknownRemoved, DuplicateBlocks int
	// Invalid counts events dropped because their tier or kind is out of range.
	Invalid int
	// Gap is set when an event id skipped ahead: the worker's blocks were dropped and the router
	// needs a dump. ExpectedEventID is the id that should have come, GotEventID the one that came.
	Gap                         bool
	ExpectedEventID, GotEventID uint64
	// Expired counts bookings freed by BookingsExpired, or bindings forgotten by SessionsExpired.
	Expired int
	// Skipped is set when a conditional change did not apply (WorkerRemoved after a reconnect).
	Skipped bool
	// Epoch is the worker's registration epoch after a WorkerUp: the stream that appended it holds
	// the rank at this epoch.
	Epoch uint64
	// Buffered is set when the change was applied locally but is not durable yet: the shared log
	// was unreachable and the change waits in this replica's bounded buffer. Do not ack it.
	Buffered bool
}
