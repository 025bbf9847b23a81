package enginefeed_test

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/clients/go/enginefeed"
)

// pythonArrays is a payload written by another encoder (Debian's python3-msgpack 1.0.3, as
// msgspec writes them: compact integers, float64 timestamps), so that the decoder is not only
// checked against the package's own Encoder:
//
//	msgpack.packb([1789095808.5, [
//	    ["BlockStored", [15760518052499183552, 2], None, [1,2,3,4,5,6,7,8], 4, None, "GPU", None,
//	     [None, None], 0, "full_attention", None],
//	    ["BlockRemoved", [15760518052499183552], "GPU", 0],
//	    ["AllBlocksCleared"]], 0])
const pythonArrays = "93cb41daa8dbe0200000939cab426c6f636b53746f72656492cfdab89baa7b5857c002c098010203040506070804c0a3475055c092c0c000ae66756c6c5f617474656e74696f6ec094ac426c6f636b52656d6f76656491cfdab89baa7b5857c0a34750550091b0416c6c426c6f636b73436c656172656400"

// pythonMaps is the same encoder's map-encoded events:
//
//	msgpack.packb([1789095808.5, [
//	    {"type": "BlockStored", "block_hashes": [b"\0"*24 + (7).to_bytes(8, "big")],
//	     "parent_block_hash": -3, "token_ids": [9,10,11,12], "block_size": 4, "lora_id": None,
//	     "medium": "CPU", "lora_name": "sql-lora", "extra_keys": [["mm", 0]], "group_idx": 0,
//	     "kv_cache_spec_kind": "full_attention", "locality": "LOCAL", "ownership": "x"},
//	    {"type": "BlockRemoved", "block_hashes": [-3], "medium": "CPU"}], 1])
const pythonMaps = "93cb41daa8dbe0200000928da474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c4200000000000000000000000000000000000000000000000000000000000000007b1706172656e745f626c6f636b5f68617368fda9746f6b656e5f69647394090a0b0caa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65a873716c2d6c6f7261aa65787472615f6b6579739192a26d6d00a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6ea86c6f63616c697479a54c4f43414ca96f776e657273686970a17883a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391fda66d656469756da343505501"

// pythonKeyed is vLLM 0.19's extra keys and remaining copy counts, written by the same encoder:
//
//	d = "9b4c0e1f2a3d5b6c7d8e9fa0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0"
//	msgpack.packb([1789095808.5, [
//	    ["BlockStored", [11, 12], None, [1,2,3,4,5,6,7,8], 4, None, "GPU", "sql-lora",
//	     [("sql-lora", (d, -2), "tenant-1"), ("sql-lora", b"\x01\x02")], 0, "full_attention", None],
//	    ["BlockRemoved", [11, 12, 13], "GPU", 0, [1, 0, 0]]], 0], use_bin_type=True)
const pythonKeyed = "93cb41daa8dbe0200000929cab426c6f636b53746f726564920b0cc098010203040506070804c0a3475055a873716c2d6c6f72619293a873716c2d6c6f726192d94039623463306531663261336435623663376438653966613062316332643365346635613662376338643965306631613262336334643565366637613862396330fea874656e616e742d3192a873716c2d6c6f7261c402010200ae66756c6c5f617474656e74696f6ec095ac426c6f636b52656d6f766564930b0c0da3475055009301000000"

// pythonCopiesMap is a map-encoded removal with remaining copy counts:
//
//	msgpack.packb([1789095808.5, [{"type": "BlockRemoved", "block_hashes": [11, 12], "medium": "CPU",
//	    "remaining_copy_counts": [0, 2]}], 0], use_bin_type=True)
const pythonCopiesMap = "93cb41daa8dbe02000009184a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573920b0ca66d656469756da3435055b572656d61696e696e675f636f70795f636f756e747392000200"

// pythonSGLang is SGLang's positional events, written by the same encoder: a salted request's
// BlockStored carries metadata where vLLM has lora_name, and with EAGLE speculative decoding a
// page's token_ids are bigram pairs:
//
//	msgpack.packb([1789095808.5, [
//	    ["BlockStored", [7], None, [1, 2, 3, 4], 4, None, "GPU", {"cache_salt": "tenant-1"}],
//	    ["BlockStored", [8], 7, [[5, 6], [6, 7], [7, 8], [8, 9]], 4, None, "GPU"],
//	    ["BlockRemoved", [7], "GPU"]], 0], use_bin_type=True)
const pythonSGLang = "93cb41daa8dbe02000009398ab426c6f636b53746f7265649107c0940102030404c0a347505581aa63616368655f73616c74a874656e616e742d3197ab426c6f636b53746f7265649108079492050692060792070892080904c0a347505593ac426c6f636b52656d6f7665649107a347505500"

func unhex(t testing.TB, s string) []byte {
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// eventOpts compares events by content: an empty slice and a nil one are the same.
var eventOpts = cmpopts.EquateEmpty()

func TestDecodeEnginePayloads(t *testing.T) {
	minus3 := uint64(1<<64 - 3)
	tests := []struct {
		name    string
		payload string
		want    enginefeed.Batch
	}{
		{
			name:    "positional events (vLLM before June 2026)",
			payload: pythonArrays,
			want: enginefeed.Batch{TS: 1789095808.5, HasDPRank: true, Events: []enginefeed.Event{
				{Kind: enginefeed.BlockStored, BlockHashes: []uint64{15760518052499183552, 2}, TokenIDs: []uint32{1, 2, 3, 4, 5, 6, 7, 8},
					BlockSize: 4, Medium: "GPU", ExtraKeyEnds: []int32{0, 0}, HasGroup: true, SpecKind: "full_attention"},
				{Kind: enginefeed.BlockRemoved, BlockHashes: []uint64{15760518052499183552}, Medium: "GPU", HasGroup: true},
				{Kind: enginefeed.AllBlocksCleared},
			}},
		},
		{
			name:    "map events with bytes and signed hashes and unknown keys (vLLM since June 2026, SGLang)",
			payload: pythonMaps,
			want: enginefeed.Batch{TS: 1789095808.5, DPRank: 1, HasDPRank: true, Events: []enginefeed.Event{
				{Kind: enginefeed.BlockStored, BlockHashes: []uint64{7}, ParentHash: minus3, HasParent: true, TokenIDs: []uint32{9, 10, 11, 12},
					BlockSize: 4, Medium: "CPU", LoraName: "sql-lora",
					ExtraKeys: []enginefeed.ExtraKey{{Kind: enginefeed.ExtraString, Text: "mm"}, {Kind: enginefeed.ExtraOther}}, ExtraKeyEnds: []int32{2},
					HasGroup: true, SpecKind: "full_attention", Locality: "LOCAL"},
				{Kind: enginefeed.BlockRemoved, BlockHashes: []uint64{minus3}, Medium: "CPU"},
			}},
		},
	}
	tests = append(tests, []struct {
		name    string
		payload string
		want    enginefeed.Batch
	}{
		{
			name:    "extra keys and remaining copy counts (vLLM 0.19 on)",
			payload: pythonKeyed,
			want: enginefeed.Batch{TS: 1789095808.5, HasDPRank: true, Events: []enginefeed.Event{
				{Kind: enginefeed.BlockStored, BlockHashes: []uint64{11, 12}, TokenIDs: []uint32{1, 2, 3, 4, 5, 6, 7, 8}, BlockSize: 4, Medium: "GPU", LoraName: "sql-lora",
					ExtraKeys: []enginefeed.ExtraKey{
						{Kind: enginefeed.ExtraString, Text: "sql-lora"}, {Kind: enginefeed.ExtraPair, Text: "9b4c0e1f2a3d5b6c7d8e9fa0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0", Offset: -2},
						{Kind: enginefeed.ExtraString, Text: "tenant-1"}, {Kind: enginefeed.ExtraString, Text: "sql-lora"}, {Kind: enginefeed.ExtraBytes},
					},
					ExtraKeyEnds: []int32{3, 5}, HasGroup: true, SpecKind: "full_attention"},
				{Kind: enginefeed.BlockRemoved, BlockHashes: []uint64{11, 12, 13}, Medium: "GPU", HasGroup: true, RemainingCopies: []int64{1, 0, 0}},
			}},
		},
		{
			name:    "SGLang: metadata with a cache salt, EAGLE bigram tokens",
			payload: pythonSGLang,
			want: enginefeed.Batch{TS: 1789095808.5, HasDPRank: true, Events: []enginefeed.Event{
				{Kind: enginefeed.BlockStored, BlockHashes: []uint64{7}, TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 4, Medium: "GPU", CacheSalt: "tenant-1"},
				{Kind: enginefeed.BlockStored, BlockHashes: []uint64{8}, ParentHash: 7, HasParent: true, TokenIDs: []uint32{5, 6, 7, 8}, BlockSize: 4, Medium: "GPU"},
				{Kind: enginefeed.BlockRemoved, BlockHashes: []uint64{7}, Medium: "GPU"},
			}},
		},
		{
			name:    "remaining copy counts in a map event",
			payload: pythonCopiesMap,
			want: enginefeed.Batch{TS: 1789095808.5, HasDPRank: true, Events: []enginefeed.Event{
				{Kind: enginefeed.BlockRemoved, BlockHashes: []uint64{11, 12}, Medium: "CPU", RemainingCopies: []int64{0, 2}},
			}},
		},
	}...)
	d := enginefeed.NewDecoder()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got enginefeed.Batch
			if err := d.Decode(unhex(t, tt.payload), &got); err != nil {
				t.Fatalf("Decode() = %v", err)
			}
			if diff := cmp.Diff(tt.want, got, eventOpts); diff != "" {
				t.Errorf("Decode() mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// sample is a batch with every kind of event and every optional field set.
func sample() enginefeed.Batch {
	return enginefeed.Batch{TS: 1789095808.25, DPRank: 3, HasDPRank: true, Events: []enginefeed.Event{
		{Kind: enginefeed.BlockStored, BlockHashes: []uint64{1 << 63, 5}, ParentHash: 42, HasParent: true,
			TokenIDs: []uint32{1, 2, 1 << 31, 4, 5, 6, 7, 8}, BlockSize: 4, Medium: "CPU", LoraName: "lora-a",
			ExtraKeys: []enginefeed.ExtraKey{{Kind: enginefeed.ExtraString, Text: "lora-a"}, {Kind: enginefeed.ExtraPair, Text: "cat.png", Offset: -3},
				{Kind: enginefeed.ExtraString, Text: "tenant-1"}, {Kind: enginefeed.ExtraBytes}, {Kind: enginefeed.ExtraOther}},
			ExtraKeyEnds: []int32{0, 5}, GroupIdx: 2, HasGroup: true, SpecKind: "full_attention"},
		{Kind: enginefeed.BlockStored, BlockHashes: []uint64{9}, TokenIDs: []uint32{0, 0, 0, 0}, BlockSize: 4},
		{Kind: enginefeed.BlockRemoved, BlockHashes: []uint64{1 << 63}, Medium: "GPU", GroupIdx: 2, HasGroup: true, RemainingCopies: []int64{1}},
		{Kind: enginefeed.AllBlocksCleared},
	}}
}

func TestEncodeDecodeRoundTrip(t *testing.T) {
	tests := []struct {
		name string
		enc  enginefeed.Encoder
		// lost clears what the encoding cannot carry.
		lost func(*enginefeed.Batch)
	}{
		{name: "arrays, newest fields", enc: enginefeed.Encoder{Style: enginefeed.Arrays}},
		{name: "arrays, bytes hashes", enc: enginefeed.Encoder{Style: enginefeed.Arrays, BytesHashes: true}},
		{name: "maps", enc: enginefeed.Encoder{Style: enginefeed.Maps}},
		{name: "maps, bytes hashes", enc: enginefeed.Encoder{Style: enginefeed.Maps, BytesHashes: true}},
		{name: "arrays of April 2025 (4 stored fields)", enc: enginefeed.Encoder{Style: enginefeed.Arrays, StoredFields: 4},
			lost: func(b *enginefeed.Batch) {
				ev := &b.Events[0]
				ev.Medium, ev.LoraName, ev.ExtraKeys, ev.ExtraKeyEnds, ev.GroupIdx, ev.HasGroup, ev.SpecKind = "", "", nil, nil, 0, false, ""
			}},
	}
	d := enginefeed.NewDecoder()
	var got enginefeed.Batch // reused: decoding again must not keep anything of the last batch
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			want := sample()
			if tt.lost != nil {
				tt.lost(&want)
			}
			in := sample()
			if err := d.Decode(tt.enc.Encode(&in), &got); err != nil {
				t.Fatalf("Decode(Encode()) = %v", err)
			}
			if diff := cmp.Diff(want, got, eventOpts); diff != "" {
				t.Errorf("Decode(Encode()) mismatch (-want +got):\n%s", diff)
			}
			if got.Blocks() != 4 {
				t.Errorf("Blocks() = %d, want 4", got.Blocks())
			}
		})
	}
}

// TestBadPayloads: a payload that is not a batch is refused whole; an event that cannot be read is
// skipped with its reason and the events around it are decoded.
func TestBadPayloads(t *testing.T) {
	good := `["BlockRemoved", [1]]`
	tests := []struct {
		name       string
		payload    string // JSON-like notation, see pack
		raw        []byte // used instead of payload when set
		wantErr    enginefeed.Reason
		wantSkip   enginefeed.Reason
		wantDetail string
	}{
		{name: "not msgpack", raw: []byte{0xc1}, wantErr: enginefeed.Malformed},
		{name: "empty", raw: []byte{}, wantErr: enginefeed.Malformed},
		{name: "a string", payload: `"hello"`, wantErr: enginefeed.Malformed},
		{name: "one field", payload: `[1.5]`, wantErr: enginefeed.Malformed},
		{name: "events not a list", payload: `[1.5, 7, 0]`, wantErr: enginefeed.Malformed},
		{name: "ts not a number", payload: `["x", [], 0]`, wantErr: enginefeed.Malformed},
		{name: "dp rank a string", payload: `[1.5, [], "0"]`, wantErr: enginefeed.Malformed},
		{name: "truncated", raw: unhex(t, pythonArrays)[:40], wantErr: enginefeed.Malformed},
		{name: "trailing bytes", raw: append(unhex(t, pythonArrays), 0x01), wantErr: enginefeed.Malformed},
		{name: "map batch without events", payload: `{"ts": 1.5}`, wantErr: enginefeed.Malformed},
		{name: "unknown tag", payload: `[1.5, [["BlockMoved", [1]], ` + good + `], 0]`, wantSkip: enginefeed.UnknownTag, wantDetail: `"BlockMoved"`},
		{name: "tag not a string", payload: `[1.5, [[7, [1]], ` + good + `], 0]`, wantSkip: enginefeed.WrongType},
		{name: "empty event", payload: `[1.5, [[], ` + good + `], 0]`, wantSkip: enginefeed.MissingField},
		{name: "event neither array nor map", payload: `[1.5, [3, ` + good + `], 0]`, wantSkip: enginefeed.WrongType},
		{name: "token ids a string", payload: `[1.5, [["BlockStored", [1], null, "abcd", 4], ` + good + `], 0]`, wantSkip: enginefeed.WrongType, wantDetail: "token_ids"},
		{name: "negative token id", payload: `[1.5, [["BlockStored", [1], null, [1, -2, 3, 4], 4], ` + good + `], 0]`, wantSkip: enginefeed.WrongType, wantDetail: "[1]: -2 is not a token id"},
		{name: "token id over uint32", payload: `[1.5, [["BlockStored", [1], null, [1, 4294967296, 3, 4], 4], ` + good + `], 0]`, wantSkip: enginefeed.WrongType},
		{name: "hash a float", payload: `[1.5, [["BlockRemoved", [1.5]], ` + good + `], 0]`, wantSkip: enginefeed.WrongType, wantDetail: "block_hashes"},
		{name: "empty bytes hash", payload: `[1.5, [["BlockRemoved", ["bytes:"]], ` + good + `], 0]`, wantSkip: enginefeed.WrongType},
		{name: "stored without block_size", payload: `[1.5, [["BlockStored", [1], null, [1, 2, 3, 4]], ` + good + `], 0]`, wantSkip: enginefeed.MissingField, wantDetail: "block_size"},
		{name: "negative block size", payload: `[1.5, [["BlockStored", [1], null, [1, 2, 3, 4], -4], ` + good + `], 0]`, wantSkip: enginefeed.WrongType},
		{name: "medium a number", payload: `[1.5, [["BlockRemoved", [1], 5], ` + good + `], 0]`, wantSkip: enginefeed.WrongType, wantDetail: "medium"},
		{name: "map without type", payload: `[1.5, [{"block_hashes": [1]}, ` + good + `], 0]`, wantSkip: enginefeed.MissingField},
		{name: "removed map without hashes", payload: `[1.5, [{"type": "BlockRemoved"}, ` + good + `], 0]`, wantSkip: enginefeed.MissingField, wantDetail: "block_hashes"},
	}
	d := enginefeed.NewDecoder()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			raw := tt.raw
			if raw == nil {
				raw = pack(t, tt.payload)
			}
			var b enginefeed.Batch
			err := d.Decode(raw, &b)
			if tt.wantErr != "" {
				e, ok := err.(*enginefeed.Error)
				if !ok || e.Reason != tt.wantErr {
					t.Fatalf("Decode() = %v, want reason %s", err, tt.wantErr)
				}
				if len(b.Events)+len(b.Skipped) != 0 {
					t.Errorf("a refused payload left %d events and %d skipped in the batch", len(b.Events), len(b.Skipped))
				}
				return
			}
			if err != nil {
				t.Fatalf("Decode() = %v, want the bad event skipped", err)
			}
			if len(b.Skipped) != 1 || b.Skipped[0].Index != 0 || b.Skipped[0].Reason != tt.wantSkip {
				t.Fatalf("Skipped = %+v, want event 0 with reason %s", b.Skipped, tt.wantSkip)
			}
			if !strings.Contains(b.Skipped[0].Detail, tt.wantDetail) {
				t.Errorf("Skipped[0].Detail = %q, want it to mention %q", b.Skipped[0].Detail, tt.wantDetail)
			}
			want := []enginefeed.Event{{Kind: enginefeed.BlockRemoved, BlockHashes: []uint64{1}}}
			if diff := cmp.Diff(want, b.Events, eventOpts); diff != "" {
				t.Errorf("the good event after the bad one (-want +got):\n%s", diff)
			}
		})
	}
}

// pack writes a payload given in JSON as msgpack: integers as compact integers, numbers with a
// fraction as float64, strings starting with "bytes:" as a byte string of the rest.
func pack(t *testing.T, js string) []byte {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(js))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("bad test payload %s: %v", js, err)
	}
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	var write func(v any)
	write = func(v any) {
		switch x := v.(type) {
		case nil:
			_ = enc.EncodeNil()
		case json.Number:
			if n, err := x.Int64(); err == nil {
				_ = enc.EncodeInt(n)
			} else if u, err := strconv.ParseUint(string(x), 10, 64); err == nil {
				_ = enc.EncodeUint(u)
			} else {
				f, _ := x.Float64()
				_ = enc.EncodeFloat64(f)
			}
		case string:
			if b, ok := strings.CutPrefix(x, "bytes:"); ok {
				_ = enc.EncodeBytes([]byte(b))
			} else {
				_ = enc.EncodeString(x)
			}
		case []any:
			_ = enc.EncodeArrayLen(len(x))
			for _, e := range x {
				write(e)
			}
		case map[string]any:
			// Keys in the order written: "type" first when present, as msgspec writes it.
			keys := make([]string, 0, len(x))
			for k := range x {
				keys = append(keys, k)
			}
			sort.Slice(keys, func(i, j int) bool { return keys[i] == "type" || (keys[j] != "type" && keys[i] < keys[j]) })
			_ = enc.EncodeMapLen(len(x))
			for _, k := range keys {
				_ = enc.EncodeString(k)
				write(x[k])
			}
		}
	}
	write(v)
	return buf.Bytes()
}

func TestParseFrames(t *testing.T) {
	seq := enginefeed.SeqBytes(258)
	end := enginefeed.SeqBytes(enginefeed.ReplayEnd)
	payload := []byte{0x90}
	m, err := enginefeed.ParseMessage([][]byte{[]byte("kv@pod@model"), seq, payload})
	if err != nil || m.Seq != 258 || string(m.Topic) != "kv@pod@model" {
		t.Fatalf("ParseMessage() = %v, %v", m, err)
	}
	for _, frames := range [][][]byte{{seq, payload}, {[]byte("t"), seq[:7], payload}, {[]byte("t"), seq, payload, payload}} {
		if _, err := enginefeed.ParseMessage(frames); err == nil {
			t.Errorf("ParseMessage(%d frames, seq of %d bytes) = nil error", len(frames), len(frames[1]))
		}
	}

	replays := []struct {
		name    string
		frames  [][]byte
		wantSeq uint64
		wantEnd bool
		wantErr bool
	}{
		{name: "vLLM since June 2026", frames: [][]byte{{}, []byte("kv@a@b"), seq, payload}, wantSeq: 258},
		{name: "vLLM since June 2026, empty topic", frames: [][]byte{{}, {}, seq, payload}, wantSeq: 258},
		{name: "vLLM before, SGLang", frames: [][]byte{{}, seq, payload}, wantSeq: 258},
		{name: "delimiter already stripped", frames: [][]byte{seq, payload}, wantSeq: 258},
		{name: "end, with topic", frames: [][]byte{{}, {}, end, {}}, wantSeq: enginefeed.ReplayEnd, wantEnd: true},
		{name: "end, without topic", frames: [][]byte{{}, end, {}}, wantSeq: enginefeed.ReplayEnd, wantEnd: true},
		{name: "one frame", frames: [][]byte{seq}, wantErr: true},
		{name: "short seq", frames: [][]byte{{}, seq[:4], payload}, wantErr: true},
	}
	for _, tt := range replays {
		t.Run(tt.name, func(t *testing.T) {
			m, end, err := enginefeed.ParseReplay(tt.frames)
			if (err != nil) != tt.wantErr {
				t.Fatalf("ParseReplay() error = %v, want error %v", err, tt.wantErr)
			}
			if err == nil && (m.Seq != tt.wantSeq || end != tt.wantEnd) {
				t.Errorf("ParseReplay() = seq %d end %v, want seq %d end %v", m.Seq, end, tt.wantSeq, tt.wantEnd)
			}
		})
	}
}

// FuzzDecode: no payload makes the decoder panic, and what it accepts it can write back.
func FuzzDecode(f *testing.F) {
	f.Add(unhex(f, pythonArrays))
	f.Add(unhex(f, pythonMaps))
	s := sample()
	f.Add((&enginefeed.Encoder{Style: enginefeed.Maps, BytesHashes: true}).Encode(&s))
	d := enginefeed.NewDecoder()
	f.Fuzz(func(t *testing.T, payload []byte) {
		var b enginefeed.Batch
		if d.Decode(payload, &b) != nil {
			return
		}
		var again enginefeed.Batch
		if err := d.Decode((&enginefeed.Encoder{}).Encode(&b), &again); err != nil {
			t.Fatalf("a decoded batch does not decode after encoding: %v", err)
		}
	})
}

func BenchmarkDecode(b *testing.B) {
	// One stored event of 64 blocks of 16 tokens: the shape of a long prompt's prefill.
	ev := enginefeed.Event{Kind: enginefeed.BlockStored, BlockSize: 16, Medium: "GPU", HasParent: true, ParentHash: 1}
	for i := range 64 {
		ev.BlockHashes = append(ev.BlockHashes, uint64(i)*0x9e3779b97f4a7c15)
		for j := range 16 {
			ev.TokenIDs = append(ev.TokenIDs, uint32(i*16+j+100_000))
		}
	}
	for _, style := range []struct {
		name string
		enc  enginefeed.Encoder
	}{{"arrays", enginefeed.Encoder{Style: enginefeed.Arrays}}, {"maps", enginefeed.Encoder{Style: enginefeed.Maps}}} {
		b.Run(style.name, func(b *testing.B) {
			in := enginefeed.Batch{TS: 1, HasDPRank: true, Events: []enginefeed.Event{ev}}
			payload := append([]byte(nil), style.enc.Encode(&in)...)
			d := enginefeed.NewDecoder()
			var out enginefeed.Batch
			b.SetBytes(int64(len(payload)))
			b.ReportAllocs()
			for b.Loop() {
				if err := d.Decode(payload, &out); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(64*b.N)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}
