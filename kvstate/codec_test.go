package kvstate

import (
	"errors"
	"fmt"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// everyChange has one of each change kind, with every field set.
func everyChange() []Change {
	return []Change{
		WorkerUp{Info: WorkerInfo{Key: WorkerKey{ID: 1 << 40, Rank: 3}, Model: "llama-70b", Role: RoleDecode, BlockSize: 64,
			TotalKVBlocks: 123456, MaxNumBatchedTokens: 8192, Endpoint: "10.0.0.1:8000", SupportsBypass: true, KVEventsEnabled: true}, Reset: true},
		WorkerRemoved{Key: WorkerKey{ID: 9, Rank: 1}, Epoch: 42},
		KVEvents{Worker: WorkerKey{ID: 9}, Events: []Event{
			{ID: 0, Tier: TierDevice, Kind: EventStored, Blocks: []Block{{Hash: 1, Local: 2}, {Hash: ^uint64(0), Local: 1 << 63}}},
			{ID: 1, Tier: TierHost, Kind: EventStored, HasParent: true, Parent: 7, Blocks: []Block{{Hash: 3, Local: 4}}},
			{ID: 2, Tier: TierDisk, Kind: EventRemoved, Removed: []uint64{1, 3}},
			{ID: 3, Tier: TierExternal, Kind: EventCleared},
		}},
		KVDump{Worker: WorkerKey{ID: 9}, ThroughEventID: 77, Events: []Event{{Tier: TierDevice, Kind: EventStored, Blocks: []Block{{Hash: 5, Local: 6}}}}},
		LoadReported{Worker: WorkerKey{ID: 9}, KVUsedBlocks: 100, WaitingRequests: 2},
		Booked{Booking: Booking{RequestID: "req-1", At: 1_700_000_000_000_000_000, Session: "chat-9", SessionExpires: -5, Hops: []HopBooking{
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

func TestDecodeEntryRejectsCorruption(t *testing.T) {
	good := EncodeEntry(nil, everyChange()...)
	tests := []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"newer version", append([]byte{EntryVersion + 1}, good[1:]...)},
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
