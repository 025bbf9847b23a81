package kvstate

import (
	"encoding/hex"
	"errors"
	"fmt"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// everyChange has one of each change kind, with every field set.
func everyChange() []Change {
	return []Change{
		WorkerUp{Info: WorkerInfo{Key: WorkerKey{ID: 1 << 40, Rank: 3}, Model: "llama-70b", Role: RoleDecode, BlockSize: 64,
			TotalKVBlocks: 123456, MaxNumBatchedTokens: 8192, Endpoint: "10.0.0.1:8000", SupportsBypass: true, KVEventsEnabled: true}, Reset: true,
			Incarnation: 1_790_000_000_123_456_789},
		WorkerUp{Info: WorkerInfo{Key: WorkerKey{ID: 9}, Model: "m", Role: RolePrefill, BlockSize: 16}, Epoch: 3},
		WorkerRemoved{Key: WorkerKey{ID: 9, Rank: 1}, Epoch: 42},
		KVEvents{Worker: WorkerKey{ID: 9}, Epoch: 3, Events: []Event{
			{ID: 0, Tier: TierDevice, Kind: EventStored, Blocks: []Block{{Hash: 1, Local: 2}, {Hash: ^uint64(0), Local: 1 << 63}}},
			{ID: 1, Tier: TierHost, Kind: EventStored, HasParent: true, Parent: 7, Blocks: []Block{{Hash: 3, Local: 4}}},
			{ID: 2, Tier: TierDisk, Kind: EventRemoved, Removed: []uint64{1, 3}},
			{ID: 3, Tier: TierExternal, Kind: EventCleared},
		}},
		KVDump{Worker: WorkerKey{ID: 9}, Epoch: 1 << 33, ThroughEventID: 77, Events: []Event{{Tier: TierDevice, Kind: EventStored, Blocks: []Block{{Hash: 5, Local: 6}}}}},
		LoadReported{Worker: WorkerKey{ID: 9}, Epoch: 3, KVUsedBlocks: 100, WaitingRequests: 2},
		Booked{Booking: Booking{RequestID: "req-1", At: 1_700_000_000_000_000_000, Model: "llama-70b", Owner: "frontend-a", Session: "chat-9", SessionExpires: -5, Hops: []HopBooking{
			{Worker: WorkerKey{ID: 2}, PrefillTokens: 900},
			{Worker: WorkerKey{ID: 9}, Blocks: []uint64{11, 12, 13}},
		}}},
		PrefillDone{RequestID: "req-1", At: 5},
		Freed{RequestID: "req-1", At: -7},
		BookingsExpired{Before: 1234},
		SessionsExpired{Before: -1},
	}
}

func TestEntryRoundTrip(t *testing.T) {
	for _, c := range everyChange() {
		t.Run(fmt.Sprintf("%T", c), func(t *testing.T) {
			got, err := DecodeEntry(EncodeEntry(nil, c))
			if err != nil {
				t.Fatalf("DecodeEntry(EncodeEntry(%T)) = %v", c, err)
			}
			if diff := cmp.Diff([]Change{c}, got); diff != "" {
				t.Errorf("round trip mismatch (-want +got):\n%s", diff)
			}
		})
	}
	all := everyChange()
	got, err := DecodeEntry(EncodeEntry(nil, all...))
	if err != nil || !cmp.Equal(all, got) {
		t.Errorf("batch round trip = %v, %v", err, cmp.Diff(all, got))
	}
}

// TestJoinEntries: joined entries decode to the changes of every entry, in order, as one entry
// holding them all; an entry of another version is refused and dst left as it was.
func TestJoinEntries(t *testing.T) {
	all := everyChange()
	var parts [][]byte
	for i := 0; i < len(all); i += 3 { // entries of one to three changes
		parts = append(parts, EncodeEntry(nil, all[i:min(i+3, len(all))]...))
	}
	joined, err := JoinEntries([]byte("prefix"), parts...)
	if err != nil {
		t.Fatalf("JoinEntries() = %v", err)
	}
	if string(joined[:6]) != "prefix" {
		t.Fatalf("JoinEntries() dropped dst: %q", joined[:6])
	}
	if diff := cmp.Diff(EncodeEntry(nil, all...), joined[6:]); diff != "" {
		t.Errorf("JoinEntries() differs from EncodeEntry of all changes (-want +got):\n%s", diff)
	}
	got, err := DecodeEntry(joined[6:])
	if err != nil || !cmp.Equal(all, got) {
		t.Errorf("DecodeEntry(joined) = %v, %v", err, cmp.Diff(all, got))
	}
	// More than 127 changes: the count takes two bytes.
	many := make([][]byte, 200)
	for i := range many {
		many[i] = EncodeEntry(nil, Freed{RequestID: fmt.Sprint(i)})
	}
	joined, err = JoinEntries(nil, many...)
	if got, derr := DecodeEntry(joined); err != nil || derr != nil || len(got) != 200 || got[199] != (Freed{RequestID: "199"}) {
		t.Errorf("joining 200 entries: %v, %v, %d changes", err, derr, len(got))
	}
	for name, bad := range map[string][]byte{"empty": {}, "version 1": {1, 1, kindFreed}, "newer": {EntryVersion + 1, 0}, "no count": {EntryVersion}} {
		out, err := JoinEntries([]byte("x"), parts[0], bad)
		if !errors.Is(err, ErrCorruptEntry) || string(out) != "x" {
			t.Errorf("JoinEntries(%s) = %q, %v; want dst unchanged and ErrCorruptEntry", name, out, err)
		}
	}
}

// v1Entry is everyChange (as it was before epochs) encoded by the release that wrote version 1.
const v1Entry = "010a0180808080802003096c6c616d612d3730620240c0c40780400d31302e302e302e313a383030300101010209012a03090004000001000201000000000000000200000000000000ffffffffffffffff0000000000000080010101010700000000000000010300000000000000040000000000000002020202010000000000000003000000000000000303030409004d01000001000105000000000000000600000000000000050900640206057265712d318080d0e2c6bfce972f0202000084070900030b000000000000000c000000000000000d000000000000000006636861742d390907057265712d310a08057265712d310d09a4130a01"

// TestDecodeVersion1: entries written by the previous release still decode, with epoch 0.
func TestDecodeVersion1(t *testing.T) {
	data, err := hex.DecodeString(v1Entry)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeEntry(data)
	if err != nil {
		t.Fatalf("DecodeEntry(version 1) = %v", err)
	}
	var want []Change
	for _, c := range everyChange() {
		switch c := c.(type) {
		case WorkerUp:
			if c.Epoch != 0 {
				continue // not in the version 1 entry
			}
			c.Incarnation = 0
			want = append(want, c)
			continue
		case Booked:
			c.Booking.Model, c.Booking.Owner = "", ""
			want = append(want, c)
			continue
		case KVEvents:
			c.Epoch = 0
			want = append(want, c)
			continue
		case KVDump:
			c.Epoch = 0
			want = append(want, c)
			continue
		case LoadReported:
			c.Epoch = 0
			want = append(want, c)
			continue
		}
		want = append(want, c)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("version 1 entry (-want +got):\n%s", diff)
	}
}

// v2Entry is everyChange (as it was before incarnations and booking models) encoded by the release
// that wrote version 2.
const v2Entry = "020b0180808080802003096c6c616d612d3730620240c0c40780400d31302e302e302e313a3830303001010100010900016d0110000000000000030209012a0309000304000001000201000000000000000200000000000000ffffffffffffffff00000000000000800101010107000000000000000103000000000000000400000000000000020202020100000000000000030000000000000003030304090080808080204d0100000100010500000000000000060000000000000005090003640206057265712d318080d0e2c6bfce972f0202000084070900030b000000000000000c000000000000000d000000000000000006636861742d390907057265712d310a08057265712d310d09a4130a01"

// TestDecodeVersion2: entries written by the release before incarnations still decode, with
// incarnation 0 (the epoch is then bumped, as that release did) and bookings without a model.
func TestDecodeVersion2(t *testing.T) {
	data, err := hex.DecodeString(v2Entry)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeEntry(data)
	if err != nil {
		t.Fatalf("DecodeEntry(version 2) = %v", err)
	}
	var want []Change
	for _, c := range everyChange() {
		switch c := c.(type) {
		case WorkerUp:
			c.Incarnation = 0
			want = append(want, c)
			continue
		case Booked:
			c.Booking.Model, c.Booking.Owner = "", ""
			want = append(want, c)
			continue
		}
		want = append(want, c)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("version 2 entry (-want +got):\n%s", diff)
	}
}

// v3Entry is everyChange (as it was before bookings named their owner) encoded by the release that
// wrote version 3.
const v3Entry = "030b0180808080802003096c6c616d612d3730620240c0c40780400d31302e302e302e313a3830303001010100959abbdac2f0d6eb18010900016d011000000000000003000209012a0309000304000001000201000000000000000200000000000000ffffffffffffffff00000000000000800101010107000000000000000103000000000000000400000000000000020202020100000000000000030000000000000003030304090080808080204d0100000100010500000000000000060000000000000005090003640206057265712d318080d0e2c6bfce972f0202000084070900030b000000000000000c000000000000000d000000000000000006636861742d3909096c6c616d612d37306207057265712d310a08057265712d310d09a4130a01"

// TestDecodeVersion3: entries written by the release before owners still decode, with bookings
// owned by no one (no per-credential bound counts them).
func TestDecodeVersion3(t *testing.T) {
	data, err := hex.DecodeString(v3Entry)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeEntry(data)
	if err != nil {
		t.Fatalf("DecodeEntry(version 3) = %v", err)
	}
	var want []Change
	for _, c := range everyChange() {
		if b, ok := c.(Booked); ok {
			b.Booking.Owner = ""
			c = b
		}
		want = append(want, c)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("version 3 entry (-want +got):\n%s", diff)
	}
}

func TestDecodeEntryRejectsCorruption(t *testing.T) {
	good := EncodeEntry(nil, everyChange()...)
	tests := []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"version 0", append([]byte{0}, good[1:]...)},
		{"truncated", good[:len(good)-3]},
		{"trailing bytes", append(append([]byte(nil), good...), 0)},
		{"unknown change kind", []byte{EntryVersion, 1, 99}},
		{"huge count", []byte{EntryVersion, 0xff, 0xff, 0xff, 0xff, 0x0f}},
		{"bad bool", []byte{EntryVersion, 1, kindWorkerRemoved}},
	}
	for _, tt := range tests {
		if _, err := DecodeEntry(tt.data); !errors.Is(err, ErrCorruptEntry) {
			t.Errorf("%s: DecodeEntry() = %v, want ErrCorruptEntry", tt.name, err)
		}
	}
}

// TestDecodeEntryNewerVersion: an entry of a newer version is not corrupt: it is ErrNewerVersion,
// so that a log stops there instead of skipping it.
func TestDecodeEntryNewerVersion(t *testing.T) {
	data := append([]byte{EntryVersion + 1}, EncodeEntry(nil, everyChange()...)[1:]...)
	if _, err := DecodeEntry(data); !errors.Is(err, ErrNewerVersion) || errors.Is(err, ErrCorruptEntry) {
		t.Errorf("DecodeEntry(version %d) = %v, want ErrNewerVersion only", EntryVersion+1, err)
	}
	snap := NewState().EncodeSnapshot(nil, SnapshotHeader{Position: "5-0"})
	snap[0] = SnapshotVersion + 1
	if _, err := NewState().Restore(snap); !errors.Is(err, ErrNewerVersion) || errors.Is(err, ErrCorruptEntry) {
		t.Errorf("Restore(version %d) = %v, want ErrNewerVersion only", SnapshotVersion+1, err)
	}
	if _, err := ReadSnapshotHeader(snap); !errors.Is(err, ErrNewerVersion) {
		t.Errorf("ReadSnapshotHeader(version %d) = %v, want ErrNewerVersion", SnapshotVersion+1, err)
	}
}

// FuzzDecodeEntry: decoding arbitrary bytes never panics, and whatever decodes re-encodes to the
// same bytes.
func FuzzDecodeEntry(f *testing.F) {
	f.Add(EncodeEntry(nil, everyChange()...))
	for _, c := range everyChange() {
		f.Add(EncodeEntry(nil, c))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		changes, err := DecodeEntry(data)
		if err != nil {
			return
		}
		again, err := DecodeEntry(EncodeEntry(nil, changes...))
		if err != nil || !cmp.Equal(changes, again) {
			t.Fatalf("re-encoding a decoded entry changed it: %v", err)
		}
	})
}

// TestEncodedEvents: events appended in parts decode to the same events, followed by more, and hold
// 16 bytes a block and a few an event.
func TestEncodedEvents(t *testing.T) {
	var all []Event
	var enc EncodedEvents
	for part := range 3 {
		var evs []Event
		for i := range 100 {
			id := uint64(part*100 + i)
			ev := Event{ID: id, Tier: Tier(i % NumTiers), Kind: EventStored, Blocks: []Block{{Hash: id, Local: id << 8}, {Hash: id + 1<<40, Local: 7}}}
			if i > 0 {
				ev.HasParent, ev.Parent = true, id-1
			}
			evs = append(evs, ev)
		}
		enc.Append(evs)
		all = append(all, evs...)
	}
	last := []Event{{ID: 300, Kind: EventStored, Blocks: []Block{{Hash: 1, Local: 2}}}}
	got, err := enc.Events(last)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(append(all, last...), got); diff != "" {
		t.Errorf("decoded events (-want +got):\n%s", diff)
	}
	if enc.Len() != 300 || enc.Blocks() != 600 {
		t.Errorf("Len, Blocks = %d, %d; want 300, 600", enc.Len(), enc.Blocks())
	}
	if per := len(enc.data) / enc.Blocks(); per > 16+8 {
		t.Errorf("%d bytes a block (two blocks an event), want at most 24", per)
	}
}
