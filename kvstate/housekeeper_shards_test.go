package kvstate_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// TestHousekeeperShards: over a shard per model, a worker whose stream closed past the grace period
// is removed from its model's shard only (the other shard's log gets nothing), and bookings
// expire in the shard that holds them.
func TestHousekeeperShards(t *testing.T) {
	ctx := context.Background()
	shards := &kvtest.MemShards{}
	presence := kvstate.NewPresence()
	t0 := time.Unix(1_000_000, 0)
	for i, model := range []string{"a", "b"} {
		sh, _ := shards.Open(ctx, model)
		key := kvstate.WorkerKey{ID: uint64(i + 1)}
		wi := kvstate.WorkerInfo{Key: key, Model: model, Role: kvstate.RoleAggregated, BlockSize: 16, TotalKVBlocks: 1000, MaxNumBatchedTokens: 8192}
		res, err := sh.Log.Append(ctx, kvstate.WorkerUp{Info: wi})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := sh.Log.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: "r-" + model, At: t0.UnixNano(), Hops: []kvstate.HopBooking{{Worker: key, PrefillTokens: 10, Blocks: []uint64{0xa}}}}}); err != nil {
			t.Fatal(err)
		}
		presence.Connected(key)
		if model == "b" {
			presence.Disconnected(key, t0.UnixNano(), res.Epoch)
		}
	}
	a, _ := shards.Lookup("a")
	b, _ := shards.Lookup("b")
	aBefore := a.Log.Position()
	now := t0.Add(2 * time.Second)
	h := &kvstate.Housekeeper{Shards: shards, Presence: presence, Grace: time.Second, BookingExpiry: time.Minute,
		Clock: kvstate.ClockFunc(func() time.Time { return now }), Logger: slog.New(slog.DiscardHandler)}
	h.Sweep(ctx)
	if b.State.Worker(kvstate.WorkerKey{ID: 2}) != nil || a.State.Worker(kvstate.WorkerKey{ID: 1}) == nil {
		t.Errorf("after the grace period: worker 2 (model b, disconnected) should be gone and worker 1 (model a) kept")
	}
	if got := a.Log.Position() - aBefore; got != 0 {
		t.Errorf("model a's shard got %d changes from the removal of model b's worker, want 0", got)
	}
	if len(presence.Disconnections()) != 0 {
		t.Errorf("the removed worker's disconnection is still owed: %v", presence.Disconnections())
	}
	now = t0.Add(2 * time.Minute)
	h.Sweep(ctx)
	if n := a.State.Load().Bookings(); n != 0 {
		t.Errorf("model a's shard holds %d bookings past the expiry, want 0", n)
	}
}
