package bridge

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"

	"github.com/kvrouter/kvrouter/clients/go/enginefeed"
)

// TestMirrorClearedDropsEveryTier: a cleared event drops the rank's blocks in every tier, as the
// router does (§4.3), so a dump sent after it holds nothing the router dropped. A stored event
// after the clear starts afresh.
func TestMirrorClearedDropsEveryTier(t *testing.T) {
	cleared := enginefeed.Event{Kind: enginefeed.AllBlocksCleared}
	tests := []struct {
		name  string
		after []enginefeed.Event
		want  []*kvrouterv1.KvEvent
	}{
		{name: "cleared", after: []enginefeed.Event{cleared}},
		{
			name:  "stored after the clear",
			after: []enginefeed.Event{cleared, chain(0, 1, "CPU")},
			want: []*kvrouterv1.KvEvent{{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_HOST, Data: &kvrouterv1.KvEvent_Stored{Stored: &kvrouterv1.BlocksStored{
				Blocks: []*kvrouterv1.StoredBlock{{BlockHash: 100, TokensHash: ptr(want(0, "", ""))}}}}}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr := translator{m: newMirror(), blockSize: 4}
			translate := func(events ...enginefeed.Event) {
				for _, ev := range events {
					if _, d := tr.translate(&ev, nil); d.reason != "" {
						t.Fatalf("translate(%v) dropped %+v", ev.Kind, d)
					}
				}
			}
			translate(chain(0, 2, "GPU"), chain(2, 1, "CPU"), chain(3, 2, "DISK"))
			if got := tr.m.blocks(); got != 5 {
				t.Fatalf("mirror.blocks() before the clear = %d, want 5", got)
			}
			translate(tc.after...)
			if diff := cmp.Diff(tc.want, tr.m.dump(), protocmp.Transform()); diff != "" {
				t.Errorf("mirror.dump() after %s (-want +got):\n%s", tc.name, diff)
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }
