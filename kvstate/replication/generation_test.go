package replication_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
	"github.com/kvrouter/kvrouter/kvstate/replication"
)

// converged reports whether the replicas follow the same generation, have applied the same stream
// up to the same entry with nothing in flight, and hold the same state.
func converged(rs ...replica) bool {
	for _, r := range rs[1:] {
		if r.log.Generation() != rs[0].log.Generation() || r.log.LastID() != rs[0].log.LastID() ||
			r.state.Digest() != rs[0].state.Digest() {
			return false
		}
	}
	for _, r := range rs {
		if r.log.Generation() == "" || r.log.Pending() != 0 || r.log.BufferedChanges() != 0 || r.log.Degraded() {
			return false
		}
	}
	return true
}

// publishBlocks appends n one-block stored events of the test worker, from event id first on.
func publishBlocks(t *testing.T, ctx context.Context, l *replication.Log, first, n int) kvstate.Result {
	t.Helper()
	var res kvstate.Result
	for i := first; i < first+n; i++ {
		ev := kvstate.Event{ID: uint64(i), Kind: kvstate.EventStored, Blocks: []kvstate.Block{{Hash: uint64(1000 + i), Local: uint64(5000 + i)}}}
		if i > 0 {
			ev.Parent, ev.HasParent = uint64(1000+i-1), true
		}
		var err error
		if res, err = l.Append(ctx, kvstate.KVEvents{Worker: wk, Events: []kvstate.Event{ev}}); err != nil {
			t.Fatalf("Append(event %d) = %v", i, err)
		}
	}
	return res
}

// TestRedisLostIsReseeded restarts Redis empty under two running replicas and starts a third, either
// at once (it creates a fresh generation before the survivors notice) or after they reseeded. Every
// replica ends on one seeded generation with the state from before the loss plus what was appended
// since, and the third replica holds the worker with all its blocks.
func TestRedisLostIsReseeded(t *testing.T) {
	for _, startNewAt := range []string{"at once", "after the reseed"} {
		t.Run(startNewAt, func(t *testing.T) {
			srv := redistest.Start(t)
			rdb := srv.Client()
			ctx, cancel := context.WithTimeout(context.Background(), 3*redisTestTimeout)
			defer cancel()
			rs := startReplicas(t, rdb, 2)
			a, b := rs[0], rs[1]
			if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
				t.Fatal(err)
			}
			publishBlocks(t, ctx, a.log, 0, 20)
			publishBlocks(t, ctx, b.log, 20, 10)
			if _, err := b.log.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: "kept", At: time.Now().UnixNano(),
				Hops: []kvstate.HopBooking{{Worker: wk, Blocks: []uint64{1, 2}, PrefillTokens: 32}}}}); err != nil {
				t.Fatal(err)
			}
			eventually(t, "A and B to converge before the loss", func() bool { return converged(a, b) })
			before := a.log.Generation()

			srv.Restart() // empty: no persistence
			var c replica
			if startNewAt == "at once" {
				c = startReplicasNamed(t, rdb, "c", 1)[0]
			}
			// Appends go on across the loss: fenced until the log is reseeded, then published.
			res := publishBlocks(t, ctx, a.log, 30, 5)
			t.Logf("append right after the loss: buffered %v", res.Buffered)
			if startNewAt != "at once" {
				eventually(t, "a survivor to reseed", func() bool {
					g, _ := rdb.Get(ctx, fmt.Sprintf("kvr:{%s}:generation", t.Name())).Result()
					return strings.Contains(g, "/seeded/")
				})
				c = startReplicasNamed(t, rdb, "c", 1)[0]
			}
			// The worker's stream is on A; B books a request meanwhile.
			publishBlocks(t, ctx, a.log, 35, 5)
			if _, err := b.log.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: "during", At: time.Now().UnixNano(),
				Hops: []kvstate.HopBooking{{Worker: wk, Blocks: []uint64{3}, PrefillTokens: 16}}}}); err != nil {
				t.Fatal(err)
			}

			eventually(t, "A, B and C to converge on the reseeded log", func() bool { return converged(a, b, c) })
			g := c.log.Generation()
			if g == before || !strings.Contains(g, "/seeded/") {
				t.Errorf("generation after the loss = %q (before %q), want a new seeded one", g, before)
			}
			if got := overlapBlocks(c.state, 40); got != 40 {
				t.Errorf("the new replica holds %d of the worker's 40 blocks, want all", got)
			}
			if n := c.state.Load().Bookings(); n != 2 {
				t.Errorf("the new replica holds %d bookings, want the one made before the loss and the one during", n)
			}
			if a.log.GenerationChanges()+b.log.GenerationChanges() < 2 {
				t.Errorf("generation changes: A %d, B %d; want both to have moved", a.log.GenerationChanges(), b.log.GenerationChanges())
			}
			for name, r := range map[string]replica{"A": a, "B": b, "C": c} {
				if r.log.Generation() != g {
					t.Errorf("%s follows %q, want %q", name, r.log.Generation(), g)
				}
			}
		})
	}
}

// overlapBlocks returns how many of the worker's first n chained blocks (publishBlocks) the state's
// index holds on the device tier.
func overlapBlocks(st *kvstate.State, n int) uint64 {
	locals := make([]uint64, n)
	for i := range locals {
		locals[i] = uint64(5000 + i)
	}
	return overlap(st, locals...)
}

// TestOldFreshGenerationIsFollowed: a replica with state that finds a fresh generation older than
// the reseed window (a replica back from a long partition) follows it rather than replacing what the
// deployment built since, and reports its state incomplete only until it has.
func TestOldFreshGenerationIsFollowed(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client()
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	a := startReplicas(t, rdb, 1, func(o *replication.Options) { o.ReseedWindow = time.Second })[0]
	if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatal(err)
	}
	publishBlocks(t, ctx, a.log, 0, 3)
	// Meanwhile, elsewhere: the log was lost and a new, fresh one began an hour ago.
	prefix := fmt.Sprintf("kvr:{%s}", t.Name())
	if err := rdb.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	old := fmt.Sprintf("00000000000000ff/fresh/%d", time.Now().Add(-time.Hour).UnixMilli())
	if err := rdb.Set(ctx, prefix+":generation", old, 0).Err(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "A to follow the old fresh generation", func() bool { return a.log.Generation() == old && !a.log.Incomplete() })
	if a.state.Worker(wk) != nil {
		t.Error("A kept its worker after following another generation, want the generation's (empty) state")
	}
}

// TestLegacyLogIsAdopted: a log written before generations existed (entries without one, no
// generation key) is adopted as it is: a replica reads it whole.
func TestLegacyLogIsAdopted(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client()
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	stream := fmt.Sprintf("kvr:{%s}:log", t.Name())
	for i, c := range []kvstate.Change{
		kvstate.WorkerUp{Info: info},
		kvstate.KVEvents{Worker: wk, Events: []kvstate.Event{{ID: 0, Kind: kvstate.EventStored, Blocks: []kvstate.Block{{Hash: 1000, Local: 5000}}}}},
	} {
		if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{"e", kvstate.EncodeEntry(nil, c), "r", "old-release", "s", fmt.Sprint(i)}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	a := startReplicas(t, rdb, 1)[0]
	eventually(t, "A to read the legacy log", func() bool { return overlapBlocks(a.state, 1) == 1 })
	if g := a.log.Generation(); !strings.HasSuffix(g, "/adopted") {
		t.Errorf("generation = %q, want an adopted one", g)
	}
	publishBlocks(t, ctx, a.log, 1, 2)
	if got := overlapBlocks(a.state, 3); got != 3 {
		t.Errorf("blocks after appending to the adopted log = %d, want 3", got)
	}
}

// TestRewoundLogIsReseeded: Redis comes back from a persistence file that missed its last writes (as
// with appendfsync everysec): the stream and the entry counter lost their last entries, which the
// replicas had applied. The next entry's number shows it; a replica reseeds the log from its state,
// and nothing it had applied is lost, for a replica started afterwards either.
func TestRewoundLogIsReseeded(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client()
	ctx, cancel := context.WithTimeout(context.Background(), 2*redisTestTimeout)
	defer cancel()
	rs := startReplicas(t, rdb, 2)
	a, b := rs[0], rs[1]
	if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatal(err)
	}
	publishBlocks(t, ctx, a.log, 0, 10)
	eventually(t, "A and B to converge", func() bool { return converged(a, b) })
	before := a.log.Generation()

	// The last three writes never reached the disk.
	prefix := fmt.Sprintf("kvr:{%s}", t.Name())
	last, err := rdb.XRevRangeN(ctx, prefix+":log", "+", "-", 3).Result()
	if err != nil || len(last) != 3 {
		t.Fatalf("XREVRANGE = %v, %v", last, err)
	}
	for _, m := range last {
		rdb.XDel(ctx, prefix+":log", m.ID)
	}
	rdb.DecrBy(ctx, prefix+":seq", 3)

	// The next append is numbered like one the replicas applied already.
	for {
		_, err := b.log.Append(ctx, kvstate.KVEvents{Worker: wk, Epoch: 0, Events: []kvstate.Event{{ID: 10, Kind: kvstate.EventStored,
			HasParent: true, Parent: 1009, Blocks: []kvstate.Block{{Hash: 1010, Local: 5010}}}}})
		if err == nil {
			break
		}
		if !errors.Is(err, kvstate.ErrLogUnavailable) {
			t.Fatalf("Append after the rewind = %v", err)
		}
		// The reseed dropped it with the rewound stream: the appender retries, as a worker would.
	}
	// A replica that never read the lost entries must get them too.
	c := startReplicasNamed(t, rdb, "c", 1)[0]
	eventually(t, "A, B and C to converge on a reseeded log", func() bool { return converged(a, b, c) && a.log.Generation() != before })
	for name, r := range map[string]replica{"A": a, "B": b, "C": c} {
		if got := overlapBlocks(r.state, 11); got != 11 {
			t.Errorf("%s holds %d of the worker's 11 blocks after the rewind, want all", name, got)
		}
	}
}

// TestNewerVersionStopsTheLog: an entry written by a newer release (a version this replica does not
// read) is not skipped: every replica stops applying before it, says so (Incomplete, Stats), and
// applies nothing after it, so no replica diverges from those that read it; a change appended after
// it is never acknowledged.
func TestNewerVersionStopsTheLog(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client()
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	rs := startReplicas(t, rdb, 2)
	a, b := rs[0], rs[1]
	if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatal(err)
	}
	publishBlocks(t, ctx, a.log, 0, 3)
	eventually(t, "A and B to converge", func() bool { return converged(a, b) })
	before, digest := b.log.LastID(), b.state.Digest()

	// A newer release appends an entry: the next number of the generation, a version byte above ours.
	prefix := fmt.Sprintf("kvr:{%s}", t.Name())
	n, err := rdb.Incr(ctx, prefix+":seq").Result()
	if err != nil {
		t.Fatal(err)
	}
	future := append([]byte{kvstate.EntryVersion + 1}, kvstate.EncodeEntry(nil, kvstate.WorkerRemoved{Key: wk})[1:]...)
	if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: prefix + ":log", Values: []any{"e", future, "r", "next-release", "s", "0", "g", a.log.Generation(), "n", n}}).Err(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "both replicas to stop before the newer entry", func() bool {
		return a.log.Stats().NewerVersion && b.log.Stats().NewerVersion && a.log.Incomplete() && b.log.Incomplete()
	})

	// A change appended after it is in the stream, but no replica applies it, so none acks it.
	short, cancelShort := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancelShort()
	if res, err := a.log.Append(short, kvstate.KVEvents{Worker: wk, Events: []kvstate.Event{{ID: 3, Kind: kvstate.EventStored, HasParent: true, Parent: 1002,
		Blocks: []kvstate.Block{{Hash: 1003, Local: 5003}}}}}); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Append after the newer entry = %+v, %v; want it never acknowledged (DeadlineExceeded)", res, err)
	}
	if got := b.log.LastID(); got != before {
		t.Errorf("B's last applied entry = %s, want %s (before the newer entry)", got, before)
	}
	if b.state.Digest() != digest || a.state.Digest() != digest {
		t.Error("a replica applied something after the newer entry")
	}
}
