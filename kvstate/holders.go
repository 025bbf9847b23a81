package kvstate

import "math/bits"

// holderWord is a set of up to 64 workers holding a block in one tier: the workers in slots
// word*64 … word*64+63 whose bits are set.
type holderWord struct {
	bits uint64
	meta uint32 // word<<2 | tier
}

func wordOf(slot uint32, tier Tier) (meta uint32, bit uint64) {
	return slot>>6<<2 | uint32(tier), 1 << (slot & 63)
}

func (w holderWord) word() uint32 { return w.meta >> 2 }
func (w holderWord) tier() Tier   { return Tier(w.meta & 3) }

// holderSet is the set of (worker, tier) pairs holding one block, as bitsets over worker slots.
//
// Why bitsets: the overlap walk intersects, block after block, the set of workers still running with
// the block's holders. As words, that is a few AND instructions a block, where a list of holders took
// a loop over every holder (about 30 on a shared system prompt). The first word is kept inline, so a
// fleet of up to 64 workers with blocks in one tier never needs more; further words (more workers, or
// the same block in another tier) live in the index's extraWords pool.
type holderSet struct {
	// The first word, empty only when the whole set is. Its fields are spelled out so that the set
	// takes 16 bytes, not 24 (a holderWord is padded to 16).
	bits  uint64
	meta  uint32
	extra uint32 // 0: no more words; else 1 + the index of the set's further words in extraWords
}

func (h *holderSet) first() holderWord { return holderWord{bits: h.bits, meta: h.meta} }

func (h *holderSet) setFirst(w holderWord) { h.bits, h.meta = w.bits, w.meta }

// extraWords holds the holder words beyond the first of every block that has them.
type extraWords struct{ listPool[holderWord] }

func (p *extraWords) words(h *holderSet) []holderWord { return p.get(h.extra) }

// add adds the worker in slot to the holders in tier; it reports false if it was there already.
func (p *extraWords) add(h *holderSet, slot uint32, tier Tier) bool {
	meta, bit := wordOf(slot, tier)
	if h.bits == 0 || h.meta == meta {
		h.meta = meta
		added := h.bits&bit == 0
		h.bits |= bit
		return added
	}
	ws := p.words(h)
	for i := range ws {
		if ws[i].meta == meta {
			added := ws[i].bits&bit == 0
			ws[i].bits |= bit
			return added
		}
	}
	p.listPool.add(&h.extra, holderWord{bits: bit, meta: meta})
	return true
}

// remove takes the worker in slot off the holders in tier; it reports whether it was there. The set
// stays compact: a word that empties is dropped, and the first word is refilled from the others.
func (p *extraWords) remove(h *holderSet, slot uint32, tier Tier) bool {
	meta, bit := wordOf(slot, tier)
	ws := p.words(h)
	if h.meta == meta {
		if h.bits&bit == 0 {
			return false
		}
		if h.bits &^= bit; h.bits == 0 && len(ws) > 0 {
			h.setFirst(ws[len(ws)-1])
			p.set(&h.extra, ws[:len(ws)-1])
		}
		return true
	}
	for i := range ws {
		if ws[i].meta == meta {
			if ws[i].bits&bit == 0 {
				return false
			}
			if ws[i].bits &^= bit; ws[i].bits == 0 {
				ws[i] = ws[len(ws)-1]
				p.set(&h.extra, ws[:len(ws)-1])
			}
			return true
		}
	}
	return false
}

// release returns the set's further words to the pool; the block is gone.
func (p *extraWords) release(h *holderSet) {
	if h.extra != 0 {
		p.set(&h.extra, p.words(h)[:0])
	}
}

// each calls f for every (slot, tier) in the set.
func (p *extraWords) each(h *holderSet, f func(slot uint32, tier Tier)) {
	eachInWord(h.first(), f)
	for _, w := range p.words(h) {
		eachInWord(w, f)
	}
}

func eachInWord(w holderWord, f func(slot uint32, tier Tier)) {
	for b := w.bits; b != 0; b &= b - 1 {
		f(w.word()<<6|uint32(bits.TrailingZeros64(b)), w.tier())
	}
}

// count returns the number of (slot, tier) pairs in the set.
func (p *extraWords) count(h *holderSet) int {
	n := bits.OnesCount64(h.bits)
	for _, w := range p.words(h) {
		n += bits.OnesCount64(w.bits)
	}
	return n
}
