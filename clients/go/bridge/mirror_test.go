package bridge

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// TestMirrorClearedDropsEveryTier: a cleared event drops the rank's blocks in every tier, whichever
// tier it names, as the router does (§4.3), so a dump sent after it holds nothing the router
// dropped. A stored event after the clear starts afresh.
func TestMirrorClearedDropsEveryTier(t *testing.T) {
	storedIn := func(tier kvrouterv1.StorageTier, hashes ...uint64) *kvrouterv1.KvEvent {
		st := &kvrouterv1.BlocksStored{}
		for _, h := range hashes {
			st.Blocks = append(st.Blocks, &kvrouterv1.StoredBlock{BlockHash: h, TokensHash: &h})
		}
		return &kvrouterv1.KvEvent{StorageTier: tier, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}
	}
	clearedIn := func(tier kvrouterv1.StorageTier) *kvrouterv1.KvEvent {
		return &kvrouterv1.KvEvent{StorageTier: tier, Data: &kvrouterv1.KvEvent_Cleared{Cleared: &kvrouterv1.CacheCleared{}}}
	}
	held := []*kvrouterv1.KvEvent{
		storedIn(kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, 1, 2),
		storedIn(kvrouterv1.StorageTier_STORAGE_TIER_HOST, 3),
		storedIn(kvrouterv1.StorageTier_STORAGE_TIER_DISK, 4, 5),
	}
	tests := []struct {
		name  string
		after []*kvrouterv1.KvEvent
		want  []*kvrouterv1.KvEvent
	}{
		{name: "cleared naming the device tier", after: []*kvrouterv1.KvEvent{clearedIn(kvrouterv1.StorageTier_STORAGE_TIER_DEVICE)}},
		{name: "cleared naming the host tier", after: []*kvrouterv1.KvEvent{clearedIn(kvrouterv1.StorageTier_STORAGE_TIER_HOST)}},
		{name: "cleared naming the external tier, which holds nothing", after: []*kvrouterv1.KvEvent{clearedIn(kvrouterv1.StorageTier_STORAGE_TIER_EXTERNAL)}},
		{
			name:  "stored after the clear",
			after: []*kvrouterv1.KvEvent{clearedIn(kvrouterv1.StorageTier_STORAGE_TIER_DEVICE), storedIn(kvrouterv1.StorageTier_STORAGE_TIER_HOST, 6)},
			want:  []*kvrouterv1.KvEvent{storedIn(kvrouterv1.StorageTier_STORAGE_TIER_HOST, 6)},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newMirror()
			m.apply(held)
			if got := m.blocks(); got != 5 {
				t.Fatalf("mirror.blocks() before the clear = %d, want 5", got)
			}
			m.apply(tc.after)
			if diff := cmp.Diff(tc.want, m.dump(), protocmp.Transform()); diff != "" {
				t.Errorf("mirror.dump() after %s (-want +got):\n%s", tc.name, diff)
			}
		})
	}
}
