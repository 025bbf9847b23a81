package kvstate

import (
	"encoding/binary"
	"fmt"
	"slices"
)

// SnapshotVersion is the version of the snapshot encoding; like log entries, a replica refuses a
// newer one and keeps reading older ones. Version 2 adds, after the position, the log generation and
// the number of the last entry applied. Version 3 names each session's model (before its id), drops
// the early ends of bookings (version 2's tombstones, read and ignored), and adds the largest
// registration epoch applied (after the expiry cutoff). Version 4 adds each booking's owner (after
// its time).
const SnapshotVersion = 4

// DefaultSnapshotEvery is how many applied changes a shared log lets pass between two snapshots
// unless configured otherwise (kvrouter serve's snapshot_every). A cold start replays about this
// many block events after the snapshot it loads at most, while a snapshot of a 1M-block state costs
// its writer about half a second of a core to encode and 40 MB written to Redis
// (docs/benchmarks/history.md, "Snapshots of 1.06M blocks"): so snapshots are coarse.
const DefaultSnapshotEvery = 1_000_000

// SnapshotHeader is what a snapshot says of itself: the log position it reflects (a stream id) and
// the generation of the log it belongs to ("" in version 1 snapshots, written before generations).
type SnapshotHeader struct {
	Position   string
	Generation string
	// Entry is the number of the last entry the snapshot reflects (entries are numbered from 1 in a
	// generation; 0: none, or a log written before entries were numbered).
	Entry uint64
}

// EncodeSnapshot appends the replicated state, with its header, to dst. The caller must keep the
// state still while it runs: no change applied (the log tailer is the caller) and no booking applied
// locally (the caller holds whatever lock keeps them out). Freeze does the same in two steps, the
// long one without any lock.
func (s *State) EncodeSnapshot(dst []byte, h SnapshotHeader) []byte {
	return s.Freeze(h).Encode(dst)
}

// FrozenState is a copy of the replicated state taken by Freeze, to be encoded as a snapshot later.
type FrozenState struct {
	head   []byte // header and workers, encoded
	models []frozenModel
	tail   []byte   // bookings, sessions and the bookkeeping of replicated apply, encoded
	index  []uint64 // worker slot -> position in the snapshot's worker list
}

type frozenModel struct {
	name      string
	blockSize uint32
	index     *Index // a private copy
}

// Freeze copies the replicated state for a snapshot, under the same conditions as EncodeSnapshot
// (the caller keeps changes and local bookings out while it runs), and returns it to be encoded
// without holding anything.
//
// Why: encoding a 1M-block state takes 0.5-0.9 s, and the replica writing a snapshot used to hold
// its local bookings (Route calls that book) off for all of it. The indexes are flat, pointer-free
// tables (flatMap), so copying one is a few memory copies, tens of milliseconds per million blocks;
// everything else in the state is small and is encoded here at once. The copy costs the index's
// memory once more until it is encoded.
func (s *State) Freeze(h SnapshotHeader) *FrozenState {
	s.mu.RLock()
	defer s.mu.RUnlock()
	f := &FrozenState{}
	b := append([]byte(nil), SnapshotVersion)
	b = putString(b, h.Position)
	b = putString(b, h.Generation)
	b = binary.AppendUvarint(b, h.Entry)
	// Workers in slot order: restoring them in this order gives the same slots.
	var workers []*Worker
	for _, w := range s.slots {
		if w != nil {
			workers = append(workers, w)
		}
	}
	f.index = make([]uint64, len(s.slots)) // slot -> position in the snapshot's worker list
	b = binary.AppendUvarint(b, uint64(len(workers)))
	for i, w := range workers {
		f.index[w.Slot] = uint64(i)
		st := w.Status()
		b = putInfo(b, w.Info)
		b = binary.AppendUvarint(b, st.Epoch)
		b = binary.AppendUvarint(b, st.LastEventID)
		b = putBool(b, st.HasLastEvent)
		b = putBool(b, st.AwaitingResync)
		b = binary.AppendUvarint(b, st.KVUsedBlocks)
		b = binary.AppendUvarint(b, st.WaitingRequests)
	}

	f.head = b

	// Indexes: copied here, encoded by Encode.
	for _, m := range s.models {
		f.models = append(f.models, frozenModel{name: m.Name, blockSize: m.BlockSize, index: m.Index.clone()})
	}
	index := f.index

	// Bookings.
	b = nil
	l := s.load
	l.mu.RLock()
	b = binary.AppendUvarint(b, uint64(len(l.bookings)))
	for id, bk := range l.bookings {
		b = putString(b, id)
		b = binary.AppendVarint(b, bk.at)
		b = putString(b, bk.owner)
		b = binary.AppendUvarint(b, uint64(len(bk.hops)))
		for _, h := range bk.hops {
			b = binary.AppendUvarint(b, index[h.slot])
			b = putHashes(b, h.blocks)
			b = binary.AppendUvarint(b, h.prefillTokens)
			b = putBool(b, h.prefillDone)
		}
	}
	l.mu.RUnlock()

	// Sessions and the bookkeeping of replicated apply.
	s.sessMu.RLock()
	b = binary.AppendUvarint(b, uint64(len(s.sessions)))
	for k, sb := range s.sessions {
		b = putString(b, k.model)
		b = putString(b, k.id)
		b = putKey(b, sb.worker)
		b = binary.AppendVarint(b, sb.expires)
	}
	s.sessMu.RUnlock()
	s.rep.mu.Lock()
	b = binary.AppendVarint(b, s.rep.expiredBefore)
	s.rep.mu.Unlock()
	b = binary.AppendUvarint(b, s.epochHigh.Load())
	f.tail = b
	return f
}

// Encode appends the snapshot of the frozen state to dst. It takes no lock.
func (f *FrozenState) Encode(dst []byte) []byte {
	// Room for it all at once: growing a 40 MB buffer by doubling spent a fifth of the encode
	// copying. A block takes its key and a holder count, a (block, worker) pair its engine hash,
	// its key and its holder entry (a varint of a byte or two).
	size := len(f.head) + len(f.tail)
	for _, m := range f.models {
		size += len(m.name) + 16 + m.index.nodes.len()*10
		for _, wb := range m.index.workers {
			for _, t := range wb.byHash {
				size += t.len() * 18
			}
		}
	}
	b := slices.Grow(dst, size)
	b = append(b, f.head...)
	b = binary.AppendUvarint(b, uint64(len(f.models)))
	for _, m := range f.models {
		b = putString(b, m.name)
		b = binary.AppendUvarint(b, uint64(m.blockSize))
		b = m.index.encode(b, f.index)
	}
	return append(b, f.tail...)
}

// Restore replaces the state with a snapshot and returns its header. A stream registered at an
// epoch the snapshot holds goes on (EpochEnds stays open); the others end. On error the state is
// unchanged.
func (s *State) Restore(data []byte) (SnapshotHeader, error) {
	fresh, h, err := decodeSnapshot(data)
	if err != nil {
		return SnapshotHeader{}, err
	}
	s.restores.Add(1)
	s.mu.Lock()
	for k, old := range s.workers {
		old.track.mu.Lock()
		if w := fresh.workers[k]; w != nil {
			if w.track.epoch == old.track.epoch {
				w.track.epochEnds, old.track.epochEnds = old.track.epochEnds, nil // the same registration goes on
			}
		}
		old.track.endEpochLocked() // a stream whose registration the snapshot does not hold is over
		old.track.mu.Unlock()
	}
	s.models, s.workers, s.slots = fresh.models, fresh.workers, fresh.slots
	var used int64
	for _, m := range s.models {
		m.Index.budget = s.budget
		used += int64(m.Index.nodes.len())
	}
	s.budget.used.Store(used)
	// The load is swapped field by field: routers hold the *Load.
	s.load.mu.Lock()
	s.load.blocks, s.load.more, s.load.slots, s.load.bookings = fresh.load.blocks, fresh.load.more, fresh.load.slots, fresh.load.bookings
	s.load.held, s.load.heldBy = fresh.load.held, fresh.load.heldBy
	s.load.mu.Unlock()
	s.mu.Unlock()
	s.sessMu.Lock()
	s.sessions = fresh.sessions
	s.sessMu.Unlock()
	s.rep.mu.Lock()
	s.rep.expiredBefore = fresh.rep.expiredBefore
	s.rep.mu.Unlock()
	// The epochs applied are the snapshot's; those this replica applied beyond them stay out of
	// what it hands out (Stamp), so it never issues one of them again.
	raise(&s.issued, s.epochHigh.Load())
	s.epochHigh.Store(fresh.epochHigh.Load())
	s.signalCapacity()
	return h, nil
}

// ReadSnapshotHeader reads a snapshot's header without decoding the rest.
func ReadSnapshotHeader(data []byte) (SnapshotHeader, error) {
	r := &reader{b: data}
	h := r.snapshotHeader()
	return h, r.err
}

func (r *reader) snapshotHeader() SnapshotHeader {
	v := r.byte()
	if r.err == nil && v > SnapshotVersion {
		r.err, r.b = fmt.Errorf("%w: snapshot version %d, this replica reads versions 1 to %d", ErrNewerVersion, v, SnapshotVersion), nil
		return SnapshotHeader{}
	}
	if r.err == nil && v < 1 {
		r.fail("snapshot version %d, this replica reads versions 1 to %d", v, SnapshotVersion)
		return SnapshotHeader{}
	}
	r.version = v
	h := SnapshotHeader{Position: r.string()}
	if v >= 2 {
		h.Generation, h.Entry = r.string(), r.uvarint()
	}
	return h
}

// Restores returns how many snapshots this state was restored from: a stream that registered before
// a restore may find its registration gone with it.
func (s *State) Restores() uint64 { return s.restores.Load() }

func decodeSnapshot(data []byte) (*State, SnapshotHeader, error) {
	r := &reader{b: data}
	h := r.snapshotHeader()
	s := NewState()
	nw := r.count(8)
	workers := make([]*Worker, nw)
	for i := range workers {
		info := r.info()
		t := &workerTrack{epoch: r.uvarint(), lastEventID: r.uvarint(), hasLastEvent: r.bool(), awaitingResync: r.bool(),
			kvUsedBlocks: r.uvarint(), waiting: r.uvarint()}
		w := &Worker{Info: info, Slot: uint32(i), track: t}
		workers[i] = w
		s.workers[info.Key] = w
		s.slots = append(s.slots, w)
	}
	worker := func() *Worker {
		i := r.uvarint()
		if r.err == nil && i >= uint64(len(workers)) {
			r.fail("worker %d of %d", i, len(workers))
		}
		if r.err != nil {
			return nil
		}
		return workers[i]
	}
	nm := r.count(2)
	for range nm {
		m := &Model{Name: r.string(), BlockSize: r.u32(), Index: NewIndex()}
		nn := r.count(9)
		m.Index.nodes = newFlatMapSized[holderSet](nn)
		// A worker holds a block in a tier through at least one of its engine hashes, so it has at
		// least as many engine hashes in the tier as the holders counted here. (It may have more,
		// and some may name a block the index no longer has: two engine hashes can name the same
		// block, and removing one drops the worker from it.) Checking each engine hash's block
		// against the index instead took a random read of the index per (block, worker): most of
		// a 10M-block cold start.
		held := make([][NumTiers]int, len(workers))
		// Blocks are read a batch at a time and their slots touched before any is inserted, so that
		// the cache misses of a batch overlap (see probeBatch): inserting into a table far larger
		// than the caches was most of a cold start.
		const batch = 16
		var (
			keys  [batch]uint64
			ends  [batch]int
			refs  []uint64
			warm  uint64
			nodes = m.Index.nodes
		)
		for done := 0; done < nn && r.err == nil; {
			k := 0
			refs = refs[:0]
			for ; k < batch && done+k < nn && r.err == nil; k++ {
				keys[k] = r.u64()
				nr := r.count(1)
				for range nr {
					v := r.uvarint()
					if r.err == nil && v>>2 >= uint64(len(workers)) {
						r.fail("ref to worker %d of %d", v>>2, len(workers))
					}
					refs = append(refs, v)
				}
				ends[k] = len(refs)
				warm ^= nodes.touch(keys[k])
			}
			if r.err != nil {
				break
			}
			start := 0
			for j := range k {
				hs, _ := nodes.upsert(keys[j])
				for _, v := range refs[start:ends[j]] {
					if m.Index.extra.add(hs, uint32(v>>2), Tier(v&3)) {
						held[v>>2][v&3]++
					}
				}
				start = ends[j]
				if hs.bits == 0 {
					r.fail("block %#x without holders", keys[j])
					break
				}
			}
			done += k
		}
		m.Index.warm = warm
		nwb := r.count(NumTiers)
		for range nwb {
			w := worker()
			wb := &workerBlocks{}
			for t := range wb.byHash {
				nh := r.count(16)
				if w != nil && r.err == nil && nh < held[w.Slot][t] {
					r.fail("worker %v has %d engine hashes in tier %d for %d blocks it holds", w.Info.Key, nh, t, held[w.Slot][t])
				}
				wb.byHash[t] = newFlatMapSized[uint64](nh)
				for range nh {
					h, key := r.u64(), r.u64()
					v, _ := wb.byHash[t].upsert(h)
					*v = key
				}
			}
			if w != nil {
				m.Index.workers[w.Slot] = wb
			}
		}
		s.models[m.Name] = m
	}
	// Model membership follows from the workers.
	for _, w := range workers {
		if m := s.models[w.Info.Model]; m != nil {
			setMember(m, w)
		} else if r.err == nil {
			r.fail("worker %v of unknown model %q", w.Info.Key, w.Info.Model)
		}
	}
	nb := r.count(3)
	for range nb {
		id, at, owner := r.string(), r.varint(), r.stringSince(4)
		nh := r.count(3)
		hops := make([]bookedHop, 0, nh)
		for range nh {
			w := worker()
			h := bookedHop{blocks: r.hashes(), prefillTokens: r.uvarint(), prefillDone: r.bool()}
			if w != nil {
				h.slot = w.Slot
			}
			hops = append(hops, h)
		}
		if r.err != nil {
			break
		}
		prefill := make([]uint64, len(hops)) // book counts prefill tokens; done ones are then released
		for i, h := range hops {
			prefill[i] = h.prefillTokens
		}
		if err := s.load.book(id, at, owner, hops); err != nil {
			r.fail("booking %q: %v", id, err)
			break
		}
		for i, h := range s.load.bookings[id].hops {
			if h.prefillDone {
				s.load.slotLoadLocked(h.slot).ActivePrefillTokens -= prefill[i]
			}
		}
	}
	ns := r.count(4)
	if ns > 0 {
		s.sessions = make(map[sessionKey]sessionBinding, ns)
	}
	for range ns {
		model := r.stringSince(3)
		id := r.string()
		b := sessionBinding{worker: r.key(), expires: r.varint()}
		if r.version < 3 {
			// Written before sessions named their model: the decode worker's, if it is registered.
			w := s.workers[b.worker]
			if w == nil {
				continue
			}
			model = w.Info.Model
		}
		s.sessions[sessionKey{model, id}] = b
	}
	s.rep.expiredBefore = r.varint()
	if r.version < 3 {
		// Version 2's tombstones (early ends of bookings): an end never precedes its booking in
		// the log, so there is nothing to keep.
		for nt := r.count(4); nt > 0 && r.err == nil; nt-- {
			r.string()
			r.bool()
			r.bool()
			r.varint()
		}
		for _, w := range workers {
			s.noteEpoch(w.track.epoch)
		}
	} else {
		s.noteEpoch(r.uvarint())
	}
	if r.err == nil && len(r.b) != 0 {
		r.fail("%d trailing bytes", len(r.b))
	}
	if r.err != nil {
		return nil, SnapshotHeader{}, r.err
	}
	return s, h, nil
}

// encode appends every node with its holders, then each worker's engine hashes per tier; index maps
// slots to positions in the snapshot's worker list. The caller owns ix (a clone): no lock is taken.
func (ix *Index) encode(b []byte, index []uint64) []byte {
	b = binary.AppendUvarint(b, uint64(ix.nodes.len()))
	ix.nodes.all(func(key uint64, hs *holderSet) {
		b = binary.LittleEndian.AppendUint64(b, key)
		b = binary.AppendUvarint(b, uint64(ix.extra.count(hs)))
		ix.extra.each(hs, func(slot uint32, tier Tier) {
			b = binary.AppendUvarint(b, index[slot]<<2|uint64(tier))
		})
	})
	b = binary.AppendUvarint(b, uint64(len(ix.workers)))
	for slot, wb := range ix.workers {
		b = binary.AppendUvarint(b, index[slot])
		for _, byHash := range wb.byHash {
			b = binary.AppendUvarint(b, uint64(byHash.len()))
			byHash.all(func(h uint64, key *uint64) {
				b = binary.LittleEndian.AppendUint64(b, h)
				b = binary.LittleEndian.AppendUint64(b, *key)
			})
		}
	}
	return b
}
