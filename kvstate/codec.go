package kvstate

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
)

// EntryVersion is the version of the log entry encoding. A replica refuses entries of a newer
// version, and must keep reading older ones: the log and the public API evolve separately.
//
// Version 2 adds the registration epoch to WorkerUp (after Reset) and to KVEvents, KVDump and
// LoadReported (after the worker's key); version 1 entries decode with epoch 0 (unconditional).
// Version 3 adds WorkerUp's incarnation (after the epoch) and Booked's model (after the session's
// expiry); older entries decode with incarnation 0 and model "". Version 4 adds Booked's owner
// (after the model); older bookings decode with owner "", which no per-credential bound counts.
const EntryVersion = 4

// ErrCorruptEntry: a log entry could not be decoded.
var ErrCorruptEntry = errors.New("corrupt log entry")

// ErrNewerVersion: a log entry or snapshot is of a newer version than this replica reads (a newer
// release wrote it). Skipping it would diverge from the replicas that apply it, so a log stops
// applying there until this replica is upgraded.
var ErrNewerVersion = errors.New("newer encoding version")

// Change kinds on the wire. Values are part of the log format: never renumber them.
const (
	kindWorkerUp        = 1
	kindWorkerRemoved   = 2
	kindKVEvents        = 3
	kindKVDump          = 4
	kindLoadReported    = 5
	kindBooked          = 6
	kindPrefillDone     = 7
	kindFreed           = 8
	kindBookingsExpired = 9
	kindSessionsExpired = 10
)

// EncodeEntry appends the encoding of a log entry holding changes to dst: a version byte, the number
// of changes, then each change as a kind byte and its fields. Integers are varints, hashes fixed
// 8-byte little-endian (they are uniformly random, so varints would only grow them).
func EncodeEntry(dst []byte, changes ...Change) []byte {
	dst = append(dst, EntryVersion)
	dst = binary.AppendUvarint(dst, uint64(len(changes)))
	for _, c := range changes {
		dst = encodeChange(dst, c)
	}
	return dst
}

// JoinEntries appends to dst one entry holding the changes of entries, in order: what EncodeEntry
// of all their changes would give, without decoding them. Every entry must be of this release's
// version (EncodeEntry's); an entry that is not is an ErrCorruptEntry error, and dst is returned
// as it was. A log joins the changes of many appenders into one store entry this way, so that the
// store's cost (a command, an entry to read back on every replica) is paid once.
func JoinEntries(dst []byte, entries ...[]byte) ([]byte, error) {
	total, size := uint64(0), 0
	for i, e := range entries {
		if len(e) == 0 || e[0] != EntryVersion {
			return dst, fmt.Errorf("%w: joining entry %d: not a version %d entry", ErrCorruptEntry, i, EntryVersion)
		}
		n, k := binary.Uvarint(e[1:])
		if k <= 0 {
			return dst, fmt.Errorf("%w: joining entry %d: bad change count", ErrCorruptEntry, i)
		}
		total += n
		size += len(e) - 1 - k
	}
	dst = slices.Grow(dst, 1+binary.MaxVarintLen64+size)
	dst = append(dst, EntryVersion)
	dst = binary.AppendUvarint(dst, total)
	for _, e := range entries {
		_, k := binary.Uvarint(e[1:])
		dst = append(dst, e[1+k:]...)
	}
	return dst, nil
}

func encodeChange(b []byte, c Change) []byte {
	switch c := c.(type) {
	case WorkerUp:
		b = append(b, kindWorkerUp)
		b = putInfo(b, c.Info)
		b = putBool(b, c.Reset)
		b = binary.AppendUvarint(b, c.Epoch)
		b = binary.AppendUvarint(b, c.Incarnation)
	case WorkerRemoved:
		b = append(b, kindWorkerRemoved)
		b = putKey(b, c.Key)
		b = binary.AppendUvarint(b, c.Epoch)
	case KVEvents:
		b = append(b, kindKVEvents)
		b = putKey(b, c.Worker)
		b = binary.AppendUvarint(b, c.Epoch)
		b = putEvents(b, c.Events)
	case KVDump:
		b = append(b, kindKVDump)
		b = putKey(b, c.Worker)
		b = binary.AppendUvarint(b, c.Epoch)
		b = binary.AppendUvarint(b, c.ThroughEventID)
		b = putEvents(b, c.Events)
	case LoadReported:
		b = append(b, kindLoadReported)
		b = putKey(b, c.Worker)
		b = binary.AppendUvarint(b, c.Epoch)
		b = binary.AppendUvarint(b, c.KVUsedBlocks)
		b = binary.AppendUvarint(b, c.WaitingRequests)
	case Booked:
		bk := c.Booking
		b = append(b, kindBooked)
		b = putString(b, bk.RequestID)
		b = binary.AppendVarint(b, bk.At)
		b = binary.AppendUvarint(b, uint64(len(bk.Hops)))
		for _, h := range bk.Hops {
			b = putKey(b, h.Worker)
			b = putHashes(b, h.Blocks)
			b = binary.AppendUvarint(b, h.PrefillTokens)
		}
		b = putString(b, bk.Session)
		b = binary.AppendVarint(b, bk.SessionExpires)
		b = putString(b, bk.Model)
		b = putString(b, bk.Owner)
	case PrefillDone:
		b = append(b, kindPrefillDone)
		b = putString(b, c.RequestID)
		b = binary.AppendVarint(b, c.At)
	case Freed:
		b = append(b, kindFreed)
		b = putString(b, c.RequestID)
		b = binary.AppendVarint(b, c.At)
	case BookingsExpired:
		b = append(b, kindBookingsExpired)
		b = binary.AppendVarint(b, c.Before)
	case SessionsExpired:
		b = append(b, kindSessionsExpired)
		b = binary.AppendVarint(b, c.Before)
	default:
		panic(fmt.Sprintf("kvstate: EncodeEntry: unknown change %T", c))
	}
	return b
}

func putBool(b []byte, v bool) []byte {
	if v {
		return append(b, 1)
	}
	return append(b, 0)
}

func putString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func putKey(b []byte, k WorkerKey) []byte {
	b = binary.AppendUvarint(b, k.ID)
	return binary.AppendUvarint(b, uint64(k.Rank))
}

func putHashes(b []byte, hs []uint64) []byte {
	b = binary.AppendUvarint(b, uint64(len(hs)))
	for _, h := range hs {
		b = binary.LittleEndian.AppendUint64(b, h)
	}
	return b
}

func putInfo(b []byte, w WorkerInfo) []byte {
	b = putKey(b, w.Key)
	b = putString(b, w.Model)
	b = append(b, byte(w.Role))
	b = binary.AppendUvarint(b, uint64(w.BlockSize))
	b = binary.AppendUvarint(b, w.TotalKVBlocks)
	b = binary.AppendUvarint(b, w.MaxNumBatchedTokens)
	b = putString(b, w.Endpoint)
	b = putBool(b, w.SupportsBypass)
	return putBool(b, w.KVEventsEnabled)
}

func putEvents(b []byte, evs []Event) []byte {
	b = binary.AppendUvarint(b, uint64(len(evs)))
	return putEventBodies(b, evs)
}

// putEventBodies appends the events without their count.
func putEventBodies(b []byte, evs []Event) []byte {
	for _, e := range evs {
		b = binary.AppendUvarint(b, e.ID)
		b = append(b, byte(e.Tier), byte(e.Kind))
		switch e.Kind {
		case EventStored:
			b = putBool(b, e.HasParent)
			if e.HasParent {
				b = binary.LittleEndian.AppendUint64(b, e.Parent)
			}
			b = binary.AppendUvarint(b, uint64(len(e.Blocks)))
			for _, blk := range e.Blocks {
				b = binary.LittleEndian.AppendUint64(b, blk.Hash)
				b = binary.LittleEndian.AppendUint64(b, blk.Local)
			}
		case EventRemoved:
			b = putHashes(b, e.Removed)
		}
	}
	return b
}

// CheckEntryVersion returns an ErrNewerVersion error if data is an entry of a newer version than
// this replica reads, without decoding it.
func CheckEntryVersion(data []byte) error {
	if len(data) > 0 && data[0] > EntryVersion {
		return fmt.Errorf("%w: log entry version %d, this replica reads versions 1 to %d", ErrNewerVersion, data[0], EntryVersion)
	}
	return nil
}

// EncodedEvents holds events in the log's encoding, to be decoded later: 16 bytes a stored block,
// about a dozen an event, where []Event costs some 100 bytes a block with one block per event. A
// dump sent in parts waits in one until its last part (a stream may hold one of a million blocks).
type EncodedEvents struct {
	data   []byte
	n      int
	blocks int
}

// Append adds evs.
func (e *EncodedEvents) Append(evs []Event) {
	e.data = putEventBodies(e.data, evs)
	e.n += len(evs)
	for i := range evs {
		e.blocks += len(evs[i].Blocks)
	}
}

// Len returns how many events it holds, and Blocks how many stored blocks.
func (e *EncodedEvents) Len() int    { return e.n }
func (e *EncodedEvents) Blocks() int { return e.blocks }

// Size returns the bytes it holds (its buffer's capacity).
func (e *EncodedEvents) Size() int { return cap(e.data) }

// Events decodes every event held, followed by more.
func (e *EncodedEvents) Events(more []Event) ([]Event, error) {
	r := &reader{b: e.data, version: EntryVersion}
	out := make([]Event, 0, e.n+len(more))
	for i := 0; i < e.n && r.err == nil; i++ {
		out = append(out, r.event())
	}
	if r.err == nil && len(r.b) != 0 {
		r.fail("%d trailing bytes", len(r.b))
	}
	if r.err != nil {
		return nil, r.err
	}
	return append(out, more...), nil
}

// DecodeEntry decodes a log entry. It never panics: corrupt or truncated input is an error
// wrapping ErrCorruptEntry, and no count is trusted beyond the bytes that remain.
func DecodeEntry(data []byte) ([]Change, error) {
	if err := CheckEntryVersion(data); err != nil {
		return nil, err
	}
	r := &reader{b: data}
	r.version = r.byte()
	if r.err == nil && r.version < 1 {
		return nil, fmt.Errorf("%w: version %d, this replica reads versions 1 to %d", ErrCorruptEntry, r.version, EntryVersion)
	}
	n := r.count(2)
	changes := make([]Change, 0, n)
	for i := 0; i < n && r.err == nil; i++ {
		changes = append(changes, r.change())
	}
	if r.err == nil && len(r.b) != 0 {
		r.fail("%d trailing bytes", len(r.b))
	}
	if r.err != nil {
		return nil, r.err
	}
	return changes, nil
}

// reader decodes with sticky errors: after the first failure every read returns zero values.
type reader struct {
	b       []byte
	err     error
	version byte // of the entry being read
}

// epoch reads a registration epoch, which entries before version 2 do not carry.
func (r *reader) epoch() uint64 { return r.since(2) }

// since reads a varint that entries (or snapshots) of version v and later carry: 0 before.
func (r *reader) since(v byte) uint64 {
	if r.version < v {
		return 0
	}
	return r.uvarint()
}

// stringSince reads a string that entries (or snapshots) of version v and later carry: "" before.
func (r *reader) stringSince(v byte) string {
	if r.version < v {
		return ""
	}
	return r.string()
}

func (r *reader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: "+format, append([]any{ErrCorruptEntry}, args...)...)
	}
	r.b = nil
}

func (r *reader) byte() byte {
	if len(r.b) < 1 {
		r.fail("truncated")
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *reader) uvarint() uint64 {
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail("bad varint")
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) varint() int64 {
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.fail("bad varint")
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) u64() uint64 {
	if len(r.b) < 8 {
		r.fail("truncated")
		return 0
	}
	v := binary.LittleEndian.Uint64(r.b)
	r.b = r.b[8:]
	return v
}

func (r *reader) u32() uint32 {
	v := r.uvarint()
	if v > math.MaxUint32 {
		r.fail("value %d out of range", v)
		return 0
	}
	return uint32(v)
}

// count reads an element count and checks that at least minSize bytes per element remain.
func (r *reader) count(minSize int) int {
	n := r.uvarint()
	if r.err == nil && n > uint64(len(r.b)/minSize) {
		r.fail("count %d exceeds the %d bytes left", n, len(r.b))
		return 0
	}
	return int(n)
}

func (r *reader) bool() bool {
	switch r.byte() {
	case 0:
		return false
	case 1:
		return true
	}
	r.fail("bad bool")
	return false
}

func (r *reader) string() string {
	n := r.count(1)
	if r.err != nil {
		return ""
	}
	s := string(r.b[:n])
	r.b = r.b[n:]
	return s
}

func (r *reader) key() WorkerKey { return WorkerKey{ID: r.uvarint(), Rank: r.u32()} }

func (r *reader) hashes() []uint64 {
	n := r.count(8)
	if n == 0 {
		return nil
	}
	hs := make([]uint64, n)
	for i := range hs {
		hs[i] = r.u64()
	}
	return hs
}

func (r *reader) info() WorkerInfo {
	w := WorkerInfo{Key: r.key(), Model: r.string(), Role: Role(r.byte())}
	w.BlockSize = r.u32()
	w.TotalKVBlocks = r.uvarint()
	w.MaxNumBatchedTokens = r.uvarint()
	w.Endpoint = r.string()
	w.SupportsBypass = r.bool()
	w.KVEventsEnabled = r.bool()
	return w
}

func (r *reader) events() []Event {
	n := r.count(3)
	if n == 0 {
		return nil
	}
	evs := make([]Event, n)
	for i := range evs {
		evs[i] = r.event()
	}
	return evs
}

func (r *reader) event() Event {
	var e Event
	e.ID = r.uvarint()
	e.Tier, e.Kind = Tier(r.byte()), EventKind(r.byte())
	switch e.Kind {
	case EventStored:
		if e.HasParent = r.bool(); e.HasParent {
			e.Parent = r.u64()
		}
		nb := r.count(16)
		if nb > 0 {
			e.Blocks = make([]Block, nb)
			for j := range e.Blocks {
				e.Blocks[j] = Block{Hash: r.u64(), Local: r.u64()}
			}
		}
	case EventRemoved:
		e.Removed = r.hashes()
	case EventCleared:
	default:
		r.fail("unknown event kind %d", e.Kind)
	}
	return e
}

func (r *reader) change() Change {
	switch kind := r.byte(); kind {
	case kindWorkerUp:
		return WorkerUp{Info: r.info(), Reset: r.bool(), Epoch: r.epoch(), Incarnation: r.since(3)}
	case kindWorkerRemoved:
		return WorkerRemoved{Key: r.key(), Epoch: r.uvarint()}
	case kindKVEvents:
		return KVEvents{Worker: r.key(), Epoch: r.epoch(), Events: r.events()}
	case kindKVDump:
		return KVDump{Worker: r.key(), Epoch: r.epoch(), ThroughEventID: r.uvarint(), Events: r.events()}
	case kindLoadReported:
		return LoadReported{Worker: r.key(), Epoch: r.epoch(), KVUsedBlocks: r.uvarint(), WaitingRequests: r.uvarint()}
	case kindBooked:
		b := Booking{RequestID: r.string(), At: r.varint()}
		if n := r.count(3); n > 0 {
			b.Hops = make([]HopBooking, n)
			for i := range b.Hops {
				b.Hops[i] = HopBooking{Worker: r.key(), Blocks: r.hashes(), PrefillTokens: r.uvarint()}
			}
		}
		b.Session, b.SessionExpires = r.string(), r.varint()
		b.Model = r.stringSince(3)
		b.Owner = r.stringSince(4)
		return Booked{Booking: b}
	case kindPrefillDone:
		return PrefillDone{RequestID: r.string(), At: r.varint()}
	case kindFreed:
		return Freed{RequestID: r.string(), At: r.varint()}
	case kindBookingsExpired:
		return BookingsExpired{Before: r.varint()}
	case kindSessionsExpired:
		return SessionsExpired{Before: r.varint()}
	default:
		r.fail("unknown change kind %d", kind)
		return nil
	}
}
