package enginefeed

import (
	"bytes"
	"encoding/binary"

	"github.com/vmihailenco/msgpack/v5"
)

// Style is how an Encoder writes events: the two encodings engines have used.
type Style int

const (
	// Arrays writes each event as a positional array with the tag first (vLLM before June 2026,
	// SGLang before September 2026).
	Arrays Style = iota
	// Maps writes each event as a map with the tag under "type", leaving out the optional fields
	// that are unset, as msgspec's omit_defaults does (vLLM since June 2026).
	Maps
)

// storedFieldsAll is the number of positional BlockStored fields after the tag in vLLM's newest
// array encoding (block_hashes ... kv_cache_spec_sliding_window).
const storedFieldsAll = 11

// mapFieldsAlways counts the fields a map-encoded event always carries after "type": those
// without a default in vLLM's structs.
var mapFieldsAlways = [...]int{BlockStored: 7, BlockRemoved: 2, AllBlocksCleared: 0}

// Encoder writes batches the way engines publish them, so that tests, benchmarks and simulated
// fleets can stand in for a real engine. It is not safe for concurrent use.
type Encoder struct {
	// Style is the event encoding.
	Style Style
	// StoredFields is, with Arrays, how many BlockStored fields follow the tag: 4 writes an engine
	// of April 2025 (block_hashes, parent_block_hash, token_ids, block_size), 11 (or 0) the newest.
	StoredFields int
	// BytesHashes writes block hashes as 32-byte strings whose last 8 bytes are the hash, as vLLM
	// does with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
	BytesHashes bool

	buf bytes.Buffer
	enc *msgpack.Encoder
}

// Encode returns the payload of a batch: [ts, events, data_parallel_rank]. Skipped events are not
// written. The returned slice is valid until the next call.
func (e *Encoder) Encode(b *Batch) []byte {
	if e.enc == nil {
		e.enc = msgpack.NewEncoder(&e.buf)
		e.enc.UseCompactInts(true)
	}
	e.buf.Reset()
	enc := e.enc
	_ = enc.EncodeArrayLen(3)
	_ = enc.EncodeFloat64(b.TS)
	_ = enc.EncodeArrayLen(len(b.Events))
	for i := range b.Events {
		e.encodeEvent(&b.Events[i])
	}
	if b.HasDPRank {
		_ = enc.EncodeInt(b.DPRank)
	} else {
		_ = enc.EncodeNil()
	}
	return e.buf.Bytes()
}

func (e *Encoder) encodeEvent(ev *Event) {
	enc := e.enc
	if e.Style == Maps {
		n := 1 + mapFieldsAlways[ev.Kind] + e.optionalFields(ev)
		_ = enc.EncodeMapLen(n)
		_ = enc.EncodeString("type")
		_ = enc.EncodeString(ev.Kind.String())
		fields := positions[ev.Kind]
		for _, name := range fields {
			if e.isSet(ev, name) {
				_ = enc.EncodeString(name)
				e.encodeField(ev, name)
			}
		}
		if ev.Locality != "" {
			_ = enc.EncodeString("locality")
			_ = enc.EncodeString(ev.Locality)
		}
		return
	}
	fields := positions[ev.Kind]
	if ev.Kind == BlockStored && e.StoredFields >= 4 && e.StoredFields < storedFieldsAll {
		fields = fields[:e.StoredFields]
	}
	_ = enc.EncodeArrayLen(1 + len(fields))
	_ = enc.EncodeString(ev.Kind.String())
	for _, name := range fields {
		e.encodeField(ev, name)
	}
}

// optionalFields counts the map keys written only when set: those msgspec leaves out when they
// hold their default, None.
func (e *Encoder) optionalFields(ev *Event) int {
	n := 0
	for _, name := range positions[ev.Kind] {
		switch name {
		case "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "remaining_copy_counts":
			if e.isSet(ev, name) {
				n++
			}
		}
	}
	if ev.Locality != "" {
		n++
	}
	return n
}

// isSet says whether a map-encoded event carries the field: required fields and those without a
// default always, the others when set.
func (e *Encoder) isSet(ev *Event, name string) bool {
	switch name {
	case "extra_keys":
		return len(ev.ExtraKeyEnds) > 0
	case "group_idx":
		return ev.HasGroup
	case "kv_cache_spec_kind":
		return ev.SpecKind != ""
	case "kv_cache_spec_sliding_window":
		return false
	case "remaining_copy_counts":
		return len(ev.RemainingCopies) > 0
	}
	return true
}

func (e *Encoder) encodeField(ev *Event, name string) {
	enc := e.enc
	optString := func(s string) {
		if s == "" {
			_ = enc.EncodeNil()
			return
		}
		_ = enc.EncodeString(s)
	}
	switch name {
	case "block_hashes":
		_ = enc.EncodeArrayLen(len(ev.BlockHashes))
		for _, h := range ev.BlockHashes {
			e.encodeHash(h)
		}
	case "parent_block_hash":
		if ev.HasParent {
			e.encodeHash(ev.ParentHash)
		} else {
			_ = enc.EncodeNil()
		}
	case "token_ids":
		_ = enc.EncodeArrayLen(len(ev.TokenIDs))
		for _, t := range ev.TokenIDs {
			_ = enc.EncodeUint(uint64(t))
		}
	case "block_size":
		_ = enc.EncodeInt(int64(ev.BlockSize))
	case "lora_id":
		_ = enc.EncodeNil()
	case "medium":
		optString(ev.Medium)
	case "lora_name":
		optString(ev.LoraName)
	case "extra_keys":
		if len(ev.ExtraKeyEnds) == 0 {
			_ = enc.EncodeNil()
			return
		}
		_ = enc.EncodeArrayLen(len(ev.ExtraKeyEnds))
		for i := range ev.ExtraKeyEnds {
			keys := ev.BlockExtraKeys(i)
			if len(keys) == 0 {
				_ = enc.EncodeNil()
				continue
			}
			_ = enc.EncodeArrayLen(len(keys))
			for _, k := range keys {
				switch k.Kind {
				case ExtraString:
					_ = enc.EncodeString(k.Text)
				case ExtraPair:
					_ = enc.EncodeArrayLen(2)
					_ = enc.EncodeString(k.Text)
					_ = enc.EncodeInt(k.Offset)
				case ExtraBytes:
					_ = enc.EncodeBytes([]byte(k.Text))
				default:
					_ = enc.EncodeBool(true)
				}
			}
		}
	case "group_idx":
		if ev.HasGroup {
			_ = enc.EncodeInt(ev.GroupIdx)
		} else {
			_ = enc.EncodeNil()
		}
	case "kv_cache_spec_kind":
		optString(ev.SpecKind)
	case "remaining_copy_counts":
		if len(ev.RemainingCopies) == 0 {
			_ = enc.EncodeNil()
			return
		}
		_ = enc.EncodeArrayLen(len(ev.RemainingCopies))
		for _, c := range ev.RemainingCopies {
			_ = enc.EncodeInt(c)
		}
	default: // kv_cache_spec_sliding_window
		_ = enc.EncodeNil()
	}
}

func (e *Encoder) encodeHash(h uint64) {
	if !e.BytesHashes {
		_ = e.enc.EncodeUint(h)
		return
	}
	var digest [32]byte
	for i := 0; i < 24; i += 8 {
		binary.BigEndian.PutUint64(digest[i:], ^h) // the digest's other bytes, never read
	}
	binary.BigEndian.PutUint64(digest[24:], h)
	_ = e.enc.EncodeBytes(digest[:])
}
