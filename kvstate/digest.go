package kvstate

import (
	"encoding/binary"
	"sort"

	"github.com/zeebo/xxh3"
)

// Digest is a fingerprint of the replicated state: two replicas that applied the same log have the
// same digest. It covers workers (registration, epoch, event numbering, reported load), every
// model's index (each worker's blocks per tier and the nodes they name), bookings, session bindings
// the bookkeeping of replicated apply, and the largest registration epoch applied. It leaves out what is local to a replica: open streams,
// and slot numbers (it names workers by key).
//
// Each element is hashed alone and the hashes are summed, so the order of maps does not matter.
// Computing it walks the whole state: it is for operators and tests, not the routing path.
func (s *State) Digest() uint64 {
	s.mu.RLock()
	keyOf := func(slot uint32) WorkerKey {
		if int(slot) < len(s.slots) && s.slots[slot] != nil {
			return s.slots[slot].Info.Key
		}
		return WorkerKey{ID: ^uint64(0)}
	}
	var sum uint64
	for _, w := range s.workers {
		sum += workerDigest(w)
	}
	for _, m := range s.models {
		sum += hashFields(0x6d, uint64(m.BlockSize)) + xxh3.HashString(m.Name)
		sum += m.Index.digest(keyOf)
	}
	sum += s.load.digest(keyOf)
	s.mu.RUnlock()

	s.sessMu.RLock()
	for k, b := range s.sessions {
		sum += hashFields(0x73, xxh3.HashString(k.model), xxh3.HashString(k.id), b.worker.ID, uint64(b.worker.Rank), uint64(b.expires))
	}
	s.sessMu.RUnlock()

	s.rep.mu.Lock()
	sum += hashFields(0x72, uint64(s.rep.expiredBefore))
	s.rep.mu.Unlock()
	sum += hashFields(0x65, s.epochHigh.Load())
	return sum
}

func workerDigest(w *Worker) uint64 {
	i := w.Info
	st := w.Status()
	return hashFields(0x77, i.Key.ID, uint64(i.Key.Rank), xxh3.HashString(i.Model), uint64(i.Role), uint64(i.BlockSize),
		i.TotalKVBlocks, i.MaxNumBatchedTokens, xxh3.HashString(i.Endpoint), boolU64(i.SupportsBypass), boolU64(i.KVEventsEnabled),
		st.Epoch, st.LastEventID, boolU64(st.HasLastEvent), boolU64(st.AwaitingResync), st.KVUsedBlocks, st.WaitingRequests)
}

// digest covers each worker's blocks (engine hash to node, per tier) and each node's holders.
func (ix *Index) digest(keyOf func(uint32) WorkerKey) uint64 {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	var sum uint64
	for slot, wb := range ix.workers {
		k := keyOf(slot)
		for t, m := range wb.byHash {
			m.all(func(h uint64, key *uint64) {
				sum += hashFields(0x62, k.ID, uint64(k.Rank), uint64(t), h, *key)
			})
		}
	}
	ix.nodes.all(func(key uint64, hs *holderSet) {
		ix.extra.each(hs, func(slot uint32, tier Tier) {
			k := keyOf(slot)
			sum += hashFields(0x6e, key, k.ID, uint64(k.Rank), uint64(tier))
		})
	})
	return sum
}

// digest covers every booking: its time, its owner (when it has one), hops (worker, blocks in
// order, prefill tokens and whether they were released).
func (l *Load) digest(keyOf func(uint32) WorkerKey) uint64 {
	l.mu.RLock()
	defer l.mu.RUnlock()
	var sum uint64
	ids := make([]string, 0, len(l.bookings))
	for id := range l.bookings {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		b := l.bookings[id]
		fields := []uint64{xxh3.HashString(id), uint64(b.at)}
		if b.owner != "" {
			fields = append(fields, xxh3.HashString(b.owner))
		}
		for _, h := range b.hops {
			k := keyOf(h.slot)
			fields = append(fields, k.ID, uint64(k.Rank), h.prefillTokens, boolU64(h.prefillDone), uint64(len(h.blocks)))
			fields = append(fields, h.blocks...)
		}
		sum += hashFields(0x6b, fields...)
	}
	return sum
}

// hashFields hashes a tag and fields as little-endian words.
func hashFields(tag byte, fields ...uint64) uint64 {
	var small [16 * 8]byte
	buf := small[:0]
	if len(fields) > 15 {
		buf = make([]byte, 0, 8*(len(fields)+1))
	}
	buf = binary.LittleEndian.AppendUint64(buf, uint64(tag))
	for _, f := range fields {
		buf = binary.LittleEndian.AppendUint64(buf, f)
	}
	return xxh3.Hash(buf)
}

func boolU64(b bool) uint64 {
	if b {
		return 1
	}
	return 0
}
