package enginefeed

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Error is a payload or event that could not be read, with the reason as a metric label and the
// detail for a log line.
type Error struct {
	Reason Reason
	Detail string
}

func (e *Error) Error() string { return string(e.Reason) + ": " + e.Detail }

func errorf(r Reason, format string, args ...any) *Error {
	return &Error{Reason: r, Detail: fmt.Sprintf(format, args...)}
}

// Decoder decodes payloads. It keeps its buffers between calls, so one Decoder per goroutine
// decodes without allocating beyond what the events hold; it is not safe for concurrent use.
type Decoder struct {
	batch, event       *msgpack.Decoder
	batchBuf, eventBuf bytes.Reader
	payload            []byte // the payload being decoded
}

// NewDecoder returns a Decoder.
func NewDecoder() *Decoder {
	d := &Decoder{batch: msgpack.NewDecoder(nil), event: msgpack.NewDecoder(nil)}
	return d
}

// Decode reads one payload into b, replacing what b held. It returns an *Error with reason
// Malformed when the payload is not a batch at all; an event that cannot be read is listed in
// b.Skipped, with its reason, and the others are decoded.
func (d *Decoder) Decode(payload []byte, b *Batch) error {
	b.TS, b.DPRank, b.HasDPRank = 0, 0, false
	b.Events, b.Skipped = b.Events[:0], b.Skipped[:0]
	if err := checkFraming(payload); err != nil {
		return errorf(Malformed, "%v", err)
	}
	d.payload = payload
	defer func() { d.payload = nil }()
	d.batchBuf.Reset(payload)
	d.batch.Reset(&d.batchBuf)
	if err := d.decodeBatch(b); err != nil {
		b.Events, b.Skipped = b.Events[:0], b.Skipped[:0]
		return err
	}
	if n := d.batchBuf.Len(); n > 0 {
		b.Events, b.Skipped = b.Events[:0], b.Skipped[:0]
		return errorf(Malformed, "%d bytes after the batch", n)
	}
	return nil
}

func (d *Decoder) decodeBatch(b *Batch) error {
	dec := d.batch
	c, err := dec.PeekCode()
	if err != nil {
		return errorf(Malformed, "empty payload")
	}
	switch {
	case isArray(c):
		n, _ := dec.DecodeArrayLen()
		if n < 2 {
			return errorf(Malformed, "the batch has %d fields, want [ts, events, data_parallel_rank]", n)
		}
		for i := 0; i < n; i++ {
			var err error
			switch i {
			case 0:
				b.TS, err = decodeNumber(dec)
			case 1:
				err = d.decodeEvents(b)
			case 2:
				b.DPRank, b.HasDPRank, err = decodeOptionalInt(dec)
			default:
				err = dec.Skip()
			}
			if err != nil {
				return batchError(err, batchFields[min(i, len(batchFields)-1)])
			}
		}
		return nil
	case isMap(c):
		n, _ := dec.DecodeMapLen()
		sawEvents := false
		for i := 0; i < n; i++ {
			key, err := dec.DecodeString()
			if err != nil {
				return errorf(Malformed, "a batch key is not a string")
			}
			switch key {
			case "ts":
				b.TS, err = decodeNumber(dec)
			case "events":
				err, sawEvents = d.decodeEvents(b), true
			case "data_parallel_rank":
				b.DPRank, b.HasDPRank, err = decodeOptionalInt(dec)
			default:
				err = dec.Skip()
			}
			if err != nil {
				return batchError(err, key)
			}
		}
		if !sawEvents {
			return errorf(Malformed, "the batch has no events")
		}
		return nil
	}
	return errorf(Malformed, "the payload is not a msgpack array or map (code 0x%02x)", c)
}

var batchFields = []string{"ts", "events", "data_parallel_rank", "a later field"}

func batchError(err error, field string) error {
	if e, ok := err.(*Error); ok && e.Reason == Malformed {
		return e
	}
	return errorf(Malformed, "batch %s: %v", field, err)
}

// decodeEvents reads the batch's event list: each event is read from its own bytes, so that one
// of the wrong shape is skipped without losing the events after it. The bytes are found by skipping
// the event and reading how far the payload's reader moved (the msgpack decoder reads a bytes.Reader
// directly, without a buffer): no copy, unlike DecodeRaw, which cost a sixth of the bridge's CPU.
func (d *Decoder) decodeEvents(b *Batch) error {
	n, err := d.batch.DecodeArrayLen()
	if err != nil || n < 0 {
		return errorf(Malformed, "events is not an array")
	}
	for i := 0; i < n; i++ {
		start := len(d.payload) - d.batchBuf.Len()
		if err := d.batch.Skip(); err != nil {
			return errorf(Malformed, "event %d: %v", i, err)
		}
		raw := d.payload[start : len(d.payload)-d.batchBuf.Len()]
		ev := b.next()
		if err := d.decodeEvent(raw, ev); err != nil {
			b.Events = b.Events[:len(b.Events)-1]
			e := err.(*Error)
			b.Skipped = append(b.Skipped, Skipped{Index: i, Reason: e.Reason, Detail: e.Detail})
		}
	}
	return nil
}

// next appends an event to b.Events, reusing the memory of one decoded before, and returns it.
func (b *Batch) next() *Event {
	if len(b.Events) < cap(b.Events) {
		b.Events = b.Events[:len(b.Events)+1]
		ev := &b.Events[len(b.Events)-1]
		*ev = Event{BlockHashes: ev.BlockHashes[:0], TokenIDs: ev.TokenIDs[:0], ExtraKeys: ev.ExtraKeys[:0], ExtraKeyEnds: ev.ExtraKeyEnds[:0],
			RemainingCopies: ev.RemainingCopies[:0]}
		return ev
	}
	b.Events = append(b.Events, Event{})
	return &b.Events[len(b.Events)-1]
}

// The fields an event may carry, as bits, to check the required ones.
const (
	fBlockHashes = 1 << iota
	fTokenIDs
	fBlockSize
	fType
)

// positions lists each kind's fields in the order positional (array) events carry them, after the
// tag; fields added by later engine versions are at the end, and events may stop before them.
var positions = [...][]string{
	BlockStored: {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
		"lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"},
	BlockRemoved:     {"block_hashes", "medium", "group_idx", "remaining_copy_counts"},
	AllBlocksCleared: {},
}

// required are the fields each kind cannot do without.
var required = [...]int{
	BlockStored:      fBlockHashes | fTokenIDs | fBlockSize,
	BlockRemoved:     fBlockHashes,
	AllBlocksCleared: 0,
}

func kindOf(tag string) Kind {
	for k, t := range tags {
		if t == tag && t != "" {
			return Kind(k)
		}
	}
	return 0
}

func (d *Decoder) decodeEvent(raw []byte, ev *Event) error {
	d.eventBuf.Reset(raw)
	dec := d.event
	dec.Reset(&d.eventBuf)
	c, _ := dec.PeekCode()
	seen := 0
	switch {
	case isArray(c):
		n, _ := dec.DecodeArrayLen()
		if n == 0 {
			return errorf(MissingField, "an event array without its tag")
		}
		tag, err := decodeTag(dec)
		if err != nil {
			return err
		}
		if ev.Kind = kindOf(tag); ev.Kind == 0 {
			return errorf(UnknownTag, "unknown event tag %q", tag)
		}
		fields := positions[ev.Kind]
		for i := 1; i < n; i++ {
			if i-1 >= len(fields) {
				if err := dec.Skip(); err != nil {
					return errorf(WrongType, "%s field %d: %v", ev.Kind, i, err)
				}
				continue
			}
			bit, err := decodeField(dec, fields[i-1], ev)
			if err != nil {
				return errorf(WrongType, "%s %s: %v", ev.Kind, fields[i-1], err)
			}
			seen |= bit
		}
	case isMap(c):
		n, _ := dec.DecodeMapLen()
		for i := 0; i < n; i++ {
			key, err := dec.DecodeString()
			if err != nil {
				return errorf(WrongType, "an event key is not a string")
			}
			if key == "type" {
				tag, err := decodeTag(dec)
				if err != nil {
					return err
				}
				if ev.Kind = kindOf(tag); ev.Kind == 0 {
					return errorf(UnknownTag, "unknown event tag %q", tag)
				}
				seen |= fType
				continue
			}
			bit, err := decodeField(dec, key, ev)
			if err != nil {
				return errorf(WrongType, "event %s: %v", key, err)
			}
			seen |= bit
		}
		if seen&fType == 0 {
			return errorf(MissingField, "an event map without \"type\"")
		}
	default:
		return errorf(WrongType, "an event is not a msgpack array or map (code 0x%02x)", c)
	}
	if missing := required[ev.Kind] &^ seen; missing != 0 {
		return errorf(MissingField, "%s without %s", ev.Kind, fieldNames(missing))
	}
	if ev.Kind != BlockStored {
		ev.TokenIDs, ev.HasParent, ev.ExtraKeys, ev.ExtraKeyEnds = ev.TokenIDs[:0], false, ev.ExtraKeys[:0], ev.ExtraKeyEnds[:0]
	}
	return nil
}

func fieldNames(bits int) string {
	switch {
	case bits&fBlockHashes != 0:
		return "block_hashes"
	case bits&fTokenIDs != 0:
		return "token_ids"
	default:
		return "block_size"
	}
}

func decodeTag(dec *msgpack.Decoder) (string, error) {
	c, _ := dec.PeekCode()
	if !msgpcode.IsString(c) {
		return "", errorf(WrongType, "the event tag is not a string (code 0x%02x)", c)
	}
	tag, err := dec.DecodeString()
	if err != nil {
		return "", errorf(WrongType, "the event tag: %v", err)
	}
	return tag, nil
}

// decodeField reads the field named name into ev and returns its bit (0 for fields nothing
// requires). Unknown names are skipped: engines add fields.
func decodeField(dec *msgpack.Decoder, name string, ev *Event) (int, error) {
	var err error
	switch name {
	case "block_hashes":
		ev.BlockHashes, err = decodeHashes(dec, ev.BlockHashes[:0])
		return fBlockHashes, err
	case "parent_block_hash":
		if isNilNext(dec) {
			ev.HasParent = false
			return 0, dec.Skip()
		}
		ev.ParentHash, err = decodeHash(dec)
		ev.HasParent = err == nil
		return 0, err
	case "token_ids":
		ev.TokenIDs, err = decodeTokens(dec, ev.TokenIDs[:0])
		return fTokenIDs, err
	case "block_size":
		var n int64
		var ok bool
		n, ok, err = decodeOptionalInt(dec)
		if err == nil && (!ok || n < 0 || n > math.MaxInt32) {
			err = fmt.Errorf("must be a non-negative integer (got %v)", n)
		}
		ev.BlockSize = int(n)
		return fBlockSize, err
	case "medium":
		ev.Medium, err = decodeOptionalString(dec)
	case "lora_name":
		if c, _ := dec.PeekCode(); isMap(c) { // SGLang's metadata takes this position
			ev.CacheSalt, err = decodeMetadata(dec)
			return 0, err
		}
		ev.LoraName, err = decodeOptionalString(dec)
	case "metadata":
		ev.CacheSalt, err = decodeMetadata(dec)
	case "extra_keys":
		ev.ExtraKeys, ev.ExtraKeyEnds, err = decodeExtraKeys(dec, ev.ExtraKeys[:0], ev.ExtraKeyEnds[:0])
	case "group_idx":
		ev.GroupIdx, ev.HasGroup, err = decodeOptionalInt(dec)
	case "remaining_copy_counts":
		ev.RemainingCopies, err = decodeCounts(dec, ev.RemainingCopies[:0])
	case "kv_cache_spec_kind":
		ev.SpecKind, err = decodeOptionalString(dec)
	case "locality":
		ev.Locality, err = decodeOptionalString(dec)
	default: // lora_id (deprecated for lora_name), kv_cache_spec_sliding_window, ownership, newer fields
		err = dec.Skip()
	}
	return 0, err
}

func isNilNext(dec *msgpack.Decoder) bool {
	c, err := dec.PeekCode()
	return err == nil && c == msgpcode.Nil
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

func isInt(c byte) bool {
	return msgpcode.IsFixedNum(c) || (c >= msgpcode.Uint8 && c <= msgpcode.Int64)
}

// isSigned says whether an integer code is a signed one (negative fixnum or int8..int64), whose
// value DecodeInt64 reads; unsigned codes are read with DecodeUint64.
func isSigned(c byte) bool {
	return c >= msgpcode.NegFixedNumLow || (c >= msgpcode.Int8 && c <= msgpcode.Int64)
}

func decodeNumber(dec *msgpack.Decoder) (float64, error) {
	c, _ := dec.PeekCode()
	switch {
	case c == msgpcode.Float || c == msgpcode.Double:
		return dec.DecodeFloat64()
	case isInt(c) && isSigned(c):
		n, err := dec.DecodeInt64()
		return float64(n), err
	case isInt(c):
		n, err := dec.DecodeUint64()
		return float64(n), err
	}
	return 0, fmt.Errorf("not a number (code 0x%02x)", c)
}

// decodeOptionalInt reads an integer or nil (ok false).
func decodeOptionalInt(dec *msgpack.Decoder) (int64, bool, error) {
	c, _ := dec.PeekCode()
	switch {
	case c == msgpcode.Nil:
		return 0, false, dec.Skip()
	case isInt(c) && isSigned(c):
		n, err := dec.DecodeInt64()
		return n, err == nil, err
	case isInt(c):
		n, err := dec.DecodeUint64()
		if err == nil && n > math.MaxInt64 {
			return 0, false, fmt.Errorf("%d is out of range", n)
		}
		return int64(n), err == nil, err
	}
	return 0, false, fmt.Errorf("not an integer (code 0x%02x)", c)
}

func decodeOptionalString(dec *msgpack.Decoder) (string, error) {
	c, _ := dec.PeekCode()
	if c == msgpcode.Nil {
		return "", dec.Skip()
	}
	if !msgpcode.IsString(c) {
		return "", fmt.Errorf("not a string (code 0x%02x)", c)
	}
	return dec.DecodeString()
}

// decodeHash reads a block hash: an integer of either sign, as its 64 bits, or a byte string, as
// its last 8 bytes big-endian (zero-padded on the left when shorter), which is what vLLM sends as
// the integer form of the same hash.
func decodeHash(dec *msgpack.Decoder) (uint64, error) {
	c, _ := dec.PeekCode()
	switch {
	case isInt(c):
		return dec.DecodeUint64() // a signed code keeps its two's-complement bits
	case msgpcode.IsBin(c) || msgpcode.IsString(c):
		b, err := dec.DecodeBytes()
		if err != nil {
			return 0, err
		}
		if len(b) == 0 {
			return 0, fmt.Errorf("an empty byte-string hash")
		}
		var last [8]byte
		if len(b) >= 8 {
			copy(last[:], b[len(b)-8:])
		} else {
			copy(last[8-len(b):], b)
		}
		return binary.BigEndian.Uint64(last[:]), nil
	}
	return 0, fmt.Errorf("a block hash is neither an integer nor bytes (code 0x%02x)", c)
}

func decodeHashes(dec *msgpack.Decoder, dst []uint64) ([]uint64, error) {
	n, err := dec.DecodeArrayLen()
	if err != nil || n < 0 {
		return dst, fmt.Errorf("not an array")
	}
	for i := 0; i < n; i++ {
		h, err := decodeHash(dec)
		if err != nil {
			return dst, fmt.Errorf("[%d]: %v", i, err)
		}
		dst = append(dst, h)
	}
	return dst, nil
}

// decodeMetadata reads SGLang's BlockStored metadata, a map, and returns its cache_salt ("" for none).
func decodeMetadata(dec *msgpack.Decoder) (string, error) {
	if isNilNext(dec) {
		return "", dec.Skip()
	}
	n, err := dec.DecodeMapLen()
	if err != nil || n < 0 {
		return "", fmt.Errorf("not a map")
	}
	salt := ""
	for i := 0; i < n; i++ {
		key, err := dec.DecodeString()
		if err != nil {
			return "", fmt.Errorf("a key is not a string")
		}
		if key != "cache_salt" {
			if err := dec.Skip(); err != nil {
				return "", err
			}
			continue
		}
		if salt, err = decodeOptionalString(dec); err != nil {
			return "", fmt.Errorf("cache_salt: %v", err)
		}
	}
	return salt, nil
}

// decodeTokens reads token_ids: integers, or (SGLang with EAGLE speculative decoding) bigram pairs
// [token, next token], of which the first is the block's token.
func decodeTokens(dec *msgpack.Decoder, dst []uint32) ([]uint32, error) {
	n, err := dec.DecodeArrayLen()
	if err != nil || n < 0 {
		return dst, fmt.Errorf("not an array")
	}
	for i := 0; i < n; i++ {
		c, _ := dec.PeekCode()
		if isArray(c) {
			if m, err := dec.DecodeArrayLen(); err != nil || m != 2 {
				return dst, fmt.Errorf("[%d] is neither a token id nor a pair of them", i)
			}
			t, err := decodeToken(dec)
			if err != nil {
				return dst, fmt.Errorf("[%d][0]: %v", i, err)
			}
			if _, err := decodeToken(dec); err != nil {
				return dst, fmt.Errorf("[%d][1]: %v", i, err)
			}
			dst = append(dst, t)
			continue
		}
		t, err := decodeToken(dec)
		if err != nil {
			return dst, fmt.Errorf("[%d]: %v", i, err)
		}
		dst = append(dst, t)
	}
	return dst, nil
}

// decodeToken reads one token id.
func decodeToken(dec *msgpack.Decoder) (uint32, error) {
	c, _ := dec.PeekCode()
	if !isInt(c) {
		return 0, fmt.Errorf("not an integer (code 0x%02x)", c)
	}
	if isSigned(c) {
		t, err := dec.DecodeInt64()
		if err != nil || t < 0 || t > math.MaxUint32 {
			return 0, fmt.Errorf("%d is not a token id", t)
		}
		return uint32(t), nil
	}
	t, err := dec.DecodeUint64()
	if err != nil || t > math.MaxUint32 {
		return 0, fmt.Errorf("%d is not a token id", t)
	}
	return uint32(t), nil
}

// decodeCounts reads a list of non-negative integers, or nil (no list).
func decodeCounts(dec *msgpack.Decoder, dst []int64) ([]int64, error) {
	if isNilNext(dec) {
		return dst, dec.Skip()
	}
	n, err := dec.DecodeArrayLen()
	if err != nil || n < 0 {
		return dst, fmt.Errorf("not an array")
	}
	for i := 0; i < n; i++ {
		v, ok, err := decodeOptionalInt(dec)
		if err != nil || !ok || v < 0 {
			return dst, fmt.Errorf("[%d] is not a count", i)
		}
		dst = append(dst, v)
	}
	return dst, nil
}

// decodeExtraKeys reads extra_keys: one entry per stored block, nil or a tuple of keys (strings,
// [identifier, offset] pairs, byte strings), appending the keys to keys and each block's end to ends.
func decodeExtraKeys(dec *msgpack.Decoder, keys []ExtraKey, ends []int32) ([]ExtraKey, []int32, error) {
	if isNilNext(dec) {
		return keys, ends, dec.Skip()
	}
	n, err := dec.DecodeArrayLen()
	if err != nil || n < 0 {
		return keys, ends, fmt.Errorf("not an array")
	}
	for i := 0; i < n; i++ {
		if isNilNext(dec) {
			if err := dec.Skip(); err != nil {
				return keys, ends, err
			}
			ends = append(ends, int32(len(keys)))
			continue
		}
		m, err := dec.DecodeArrayLen()
		if err != nil || m < 0 {
			return keys, ends, fmt.Errorf("[%d] is neither nil nor an array", i)
		}
		for j := 0; j < m; j++ {
			k, err := decodeExtraKey(dec)
			if err != nil {
				return keys, ends, fmt.Errorf("[%d][%d]: %v", i, j, err)
			}
			keys = append(keys, k)
		}
		ends = append(ends, int32(len(keys)))
	}
	return keys, ends, nil
}

func decodeExtraKey(dec *msgpack.Decoder) (ExtraKey, error) {
	c, _ := dec.PeekCode()
	switch {
	case msgpcode.IsString(c):
		s, err := dec.DecodeString()
		return ExtraKey{Kind: ExtraString, Text: s}, err
	case msgpcode.IsBin(c):
		return ExtraKey{Kind: ExtraBytes}, dec.Skip()
	case isArray(c):
		n, err := dec.DecodeArrayLen()
		if err != nil {
			return ExtraKey{}, err
		}
		if n == 2 {
			if c, _ := dec.PeekCode(); msgpcode.IsString(c) {
				id, err := dec.DecodeString()
				if err != nil {
					return ExtraKey{}, err
				}
				if c, _ := dec.PeekCode(); isInt(c) {
					off, err := dec.DecodeInt64()
					return ExtraKey{Kind: ExtraPair, Text: id, Offset: off}, err
				}
				return ExtraKey{Kind: ExtraOther}, dec.Skip()
			}
		}
		for range n {
			if err := dec.Skip(); err != nil {
				return ExtraKey{}, err
			}
		}
		return ExtraKey{Kind: ExtraOther}, nil
	}
	return ExtraKey{Kind: ExtraOther}, dec.Skip()
}
