package replication_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore"
	"github.com/kvrouter/kvrouter/kvstate/logstore/memstore"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
	"github.com/kvrouter/kvrouter/kvstate/replication"
)

const redisTestTimeout = 10 * time.Second

// replica is one router's state and log over a shared Redis.
type replica struct {
	state *kvstate.State
	log   *replication.Log
}

func startReplicas(t *testing.T, rdb redis.UniversalClient, n int, opts ...func(*replication.Options)) []replica {
	return startReplicasNamed(t, rdb, "r", n, opts...)
}

func startReplicasNamed(t *testing.T, rdb redis.UniversalClient, name string, n int, opts ...func(*replication.Options)) []replica {
	t.Helper()
	return startReplicasIn(t, redisStore(rdb), name, n, opts...)
}

// startReplicasIn starts n replicas of the log named after the test in store.
func startReplicasIn(t *testing.T, store logstore.Store, name string, n int, opts ...func(*replication.Options)) []replica {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	prefix := fmt.Sprintf("kvr:{%s}", t.Name())
	var out []replica
	done := make(chan struct{}, n)
	for i := range n {
		st := kvstate.NewState()
		o := replication.Options{Prefix: prefix, Replica: fmt.Sprintf("%s%d", name, i), ReadBlock: 100 * time.Millisecond}
		for _, f := range opts {
			f(&o)
		}
		l := replication.New(store.Log(prefix), st, o)
		go func() { l.Run(ctx); done <- struct{}{} }()
		out = append(out, replica{st, l})
	}
	t.Cleanup(func() {
		cancel()
		for range n {
			<-done
		}
	})
	return out
}

// eventually waits until cond holds (kvtest.Eventually, with the Redis tests' timeout).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	kvtest.Eventually(t, redisTestTimeout, what, cond)
}

var (
	wk   = kvstate.WorkerKey{ID: 7}
	info = kvstate.WorkerInfo{Key: wk, Model: "m", Role: kvstate.RoleAggregated, BlockSize: 16, TotalKVBlocks: 100, KVEventsEnabled: true}
)

func overlap(st *kvstate.State, locals ...uint64) uint64 {
	m := st.Model("m")
	w := st.Worker(wk)
	if m == nil || w == nil {
		return 0
	}
	var o kvstate.Overlaps
	m.Index.Overlaps(blockhash.Sequence(nil, locals), &o)
	return o.Blocks(w.Slot)[kvstate.TierDevice]
}

func runRedisLogSuite(t *testing.T, rdb redis.UniversalClient) { runLogSuite(t, redisStore(rdb)) }

// runLogSuite: two replicas of one log in store agree on workers, events and bookings.
func runLogSuite(t *testing.T, store logstore.Store) {
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	rs := startReplicasIn(t, store, "r", 2)
	a, b := rs[0], rs[1]

	// A worker registers and stores blocks through A; B applies the same entries.
	if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatalf("A.Append(WorkerUp) = %v", err)
	}
	res, err := a.log.Append(ctx, kvstate.KVEvents{Worker: wk, Events: []kvstate.Event{
		{ID: 0, Kind: kvstate.EventStored, Blocks: []kvstate.Block{{Hash: 1, Local: 11}, {Hash: 2, Local: 12}, {Hash: 3, Local: 13}}},
	}})
	if err != nil || !res.HasLastEvent || res.LastEventID != 0 || res.Applied != 1 {
		t.Fatalf("A.Append(KVEvents) = %+v, %v; want event 0 applied", res, err)
	}
	if got := overlap(a.state, 11, 12, 13); got != 3 {
		t.Errorf("A's overlap right after the ack = %d, want 3 (acked means applied)", got)
	}
	eventually(t, "B to see the worker's 3 blocks", func() bool { return overlap(b.state, 11, 12, 13) == 3 })

	// A duplicate batch through B (a worker replaying after reconnecting) is dropped in log order.
	res, err = b.log.Append(ctx, kvstate.KVEvents{Worker: wk, Events: []kvstate.Event{{ID: 0, Kind: kvstate.EventCleared}}})
	if err != nil || res.Duplicates != 1 {
		t.Fatalf("B.Append(replayed event 0) = %+v, %v; want 1 duplicate", res, err)
	}

	// A booking made on B is visible in A's load; a Free sent to A releases it everywhere.
	booking := kvstate.Booking{RequestID: "req", At: time.Now().UnixNano(), Hops: []kvstate.HopBooking{{Worker: wk, Blocks: []uint64{100, 101}, PrefillTokens: 32}}}
	if _, err := b.log.Append(ctx, kvstate.Booked{Booking: booking}); err != nil {
		t.Fatalf("B.Append(Booked) = %v", err)
	}
	if got := b.state.Load().Slot(b.state.Worker(wk).Slot); got.ActiveRequests != 1 {
		t.Errorf("B's load right after booking = %+v, want the booking applied at once", got)
	}
	want := kvstate.SlotLoad{ActiveBlocks: 2, ActivePrefillTokens: 32, ActiveRequests: 1}
	eventually(t, "A to see B's booking", func() bool { return a.state.Load().Slot(a.state.Worker(wk).Slot) == want })
	if _, err := a.log.Append(ctx, kvstate.Freed{RequestID: "req", At: time.Now().UnixNano()}); err != nil {
		t.Fatalf("A.Append(Freed) = %v", err)
	}
	for name, r := range map[string]replica{"A": a, "B": b} {
		eventually(t, name+" to see the request freed", func() bool { return r.state.Load().Bookings() == 0 })
	}

	// Both replicas applied the same stream.
	eventually(t, "both replicas at the same position", func() bool { return a.log.LastID() == b.log.LastID() })
	if diff := cmp.Diff(a.log.Position(), b.log.Position()); diff != "" {
		t.Errorf("positions differ: %s", diff)
	}
}

// TestUnknownRequestIsNotFound: a MarkPrefillComplete or Free for a request no replica booked fails
// with ErrUnknownRequest, as in the embedded log, and appends nothing to the stream, however many
// come. A booking made on one replica and ended on another right away is found: the second replica
// waits for it instead of answering too early.
func TestUnknownRequestIsNotFound(t *testing.T) { onEveryRedis(t, testUnknownRequestIsNotFound) }

func testUnknownRequestIsNotFound(t *testing.T, rdb redis.UniversalClient) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*redisTestTimeout)
	defer cancel()
	// Until the fresh log is past its reseed window, a replica that lost state could still replace
	// it, and a request nobody here holds may exist: the answer would be UNAVAILABLE.
	rs := startReplicas(t, rdb, 2, func(o *replication.Options) { o.ReseedWindow = 300 * time.Millisecond })
	a, b := rs[0], rs[1]
	eventually(t, "the log to be past its reseed window", func() bool { return !a.log.Incomplete() && !b.log.Incomplete() })
	if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatalf("A.Append(WorkerUp) = %v", err)
	}
	eventually(t, "B to see the worker", func() bool { return b.state.Worker(wk) != nil })
	stream := fmt.Sprintf("kvr:{%s}:log", t.Name())
	before, err := rdb.XLen(ctx, stream).Result()
	if err != nil {
		t.Fatalf("XLEN = %v", err)
	}

	// 2,000 junk calls, 100 at a time, on both replicas.
	var wg sync.WaitGroup
	errs := make(chan error, 2000)
	for i := range 2000 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rs[i%2]
			var c kvstate.Change = kvstate.Freed{RequestID: fmt.Sprintf("junk-%d", i), At: time.Now().UnixNano()}
			if i%4 < 2 {
				c = kvstate.PrefillDone{RequestID: fmt.Sprintf("junk-%d", i), At: time.Now().UnixNano()}
			}
			if _, err := r.log.Append(ctx, c); !errors.Is(err, kvstate.ErrUnknownRequest) {
				errs <- fmt.Errorf("Append(%T for an unknown request) = %v, want ErrUnknownRequest", c, err)
			}
		}()
		if i%100 == 99 {
			wg.Wait()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if after, _ := rdb.XLen(ctx, stream).Result(); after != before {
		t.Errorf("the stream grew from %d to %d entries on calls for unknown requests, want no entry", before, after)
	}

	// Booked on A, ended on B at once: B finds it, and the booking is gone on both.
	for i := range 200 {
		id := fmt.Sprintf("req-%d", i)
		if _, err := a.log.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: id, At: time.Now().UnixNano(),
			Hops: []kvstate.HopBooking{{Worker: wk, Blocks: []uint64{uint64(i)}, PrefillTokens: 16}}}}); err != nil {
			t.Fatalf("A.Append(Booked %s) = %v", id, err)
		}
		if _, err := b.log.Append(ctx, kvstate.PrefillDone{RequestID: id, At: time.Now().UnixNano()}); err != nil {
			t.Fatalf("B.Append(PrefillDone %s) right after A booked it = %v, want it found", id, err)
		}
		if _, err := b.log.Append(ctx, kvstate.Freed{RequestID: id, At: time.Now().UnixNano()}); err != nil {
			t.Fatalf("B.Append(Freed %s) = %v", id, err)
		}
	}
	for name, r := range map[string]replica{"A": a, "B": b} {
		eventually(t, name+" to see every booking freed", func() bool { return r.state.Load().Bookings() == 0 })
	}
	if a.state.Digest() != b.state.Digest() {
		t.Error("the replicas' digests differ once every booking was freed")
	}
}

// onEveryRedis runs a test against a private redis-server and against a private 3-master Redis
// Cluster: every key carries the deployment's hash tag, so the layout must work unchanged on both.
func onEveryRedis(t *testing.T, test func(t *testing.T, rdb redis.UniversalClient)) {
	t.Run("single", func(t *testing.T) { test(t, redistest.Start(t).Client()) })
	t.Run("cluster", func(t *testing.T) {
		if testing.Short() {
			t.Skip("Redis Cluster runs skipped in -short mode")
		}
		test(t, redistest.StartCluster(t, 3).Client())
	})
}

func TestRedisLogReplicas(t *testing.T) { onEveryRedis(t, runRedisLogSuite) }

// TestMemoryLogReplicas runs the same suite over the in-memory store, in a synctest bubble: the
// engine reads time through the time package, so its timers, tickers and deadlines all run on the
// bubble's clock, and the test neither sleeps nor depends on the machine's load.
func TestMemoryLogReplicas(t *testing.T) {
	synctest.Test(t, func(t *testing.T) { runLogSuite(t, memstore.New(memstore.Options{})) })
}

// TestRedisOutage: while Redis does not answer, worker changes apply locally and wait in a bounded
// buffer (reported Buffered: not acked), and bookings apply locally: routing goes on. When Redis
// answers again the buffer is published, the replicas converge to the same digest, and a worker
// whose changes overflowed the buffer is asked (once) to resync.
func TestRedisOutage(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.FastClient()
	ctx, cancel := context.WithTimeout(context.Background(), 3*redisTestTimeout)
	defer cancel()
	rs := startReplicas(t, rdb, 2, func(o *replication.Options) { o.MaxBuffered = 3 })
	a, b := rs[0], rs[1]
	stream := fmt.Sprintf("kvr:{%s}:log", t.Name())
	if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatalf("Append(WorkerUp) = %v", err)
	}
	stored := func(id uint64) kvstate.KVEvents {
		ev := kvstate.Event{ID: id, Kind: kvstate.EventStored, Blocks: []kvstate.Block{{Hash: id + 1, Local: 100 + id}}}
		if id > 0 {
			ev.HasParent, ev.Parent = true, id
		}
		return kvstate.KVEvents{Worker: wk, Events: []kvstate.Event{ev}}
	}
	if res, err := a.log.Append(ctx, stored(0)); err != nil || res.Buffered {
		t.Fatalf("Append before the outage = %+v, %v; want durable", res, err)
	}
	eventually(t, "both replicas to apply what came before the outage", func() bool { return caughtUp(ctx, rdb, stream, a, b) })

	srv.Pause()
	for id := uint64(1); id <= 5; id++ { // 3 fit in the buffer, 2 overflow
		res, err := a.log.Append(ctx, stored(id))
		if err != nil || !res.Buffered || res.LastEventID != id {
			t.Fatalf("Append(event %d) during the outage = %+v, %v; want applied locally and Buffered", id, res, err)
		}
	}
	// Buffered counts the 3 kept changes, plus one for the pending resync: nothing of this worker is
	// durable (and acked) until its dump is.
	if !a.log.Degraded() || a.log.Buffered(wk) != 4 || a.log.LostChanges.Load() != 2 {
		t.Errorf("during the outage: degraded %v, buffered %d, lost %d; want true, 4, 2", a.log.Degraded(), a.log.Buffered(wk), a.log.LostChanges.Load())
	}
	if a.log.TakeResync(wk) {
		t.Error("TakeResync during the outage = true, want false until Redis answers and the buffer is published")
	}
	// Routing goes on: a booking on B applies at once.
	if _, err := b.log.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: "during", At: time.Now().UnixNano(), Hops: []kvstate.HopBooking{{Worker: wk, Blocks: []uint64{1}}}}}); err != nil {
		t.Fatalf("booking during the outage = %v", err)
	}
	if b.state.Load().Bookings() != 1 {
		t.Error("a booking during the outage did not apply locally")
	}

	// Real time is the point here and below: Redis, its clock and the replicas' probes run in it,
	// and the outage must outlast several probes (250 ms).
	time.Sleep(300 * time.Millisecond)
	srv.Resume()
	eventually(t, "the buffer to be published and both replicas to catch up", func() bool {
		return !a.log.Degraded() && !b.log.Degraded() && caughtUp(ctx, rdb, stream, a, b)
	})
	if got := a.log.Buffered(wk); got != 1 {
		t.Errorf("Buffered after the flush = %d, want 1: the overflowed changes are still not durable", got)
	}
	if !a.log.TakeResync(wk) || a.log.TakeResync(wk) {
		t.Error("TakeResync after the outage: want true exactly once for the worker whose changes overflowed")
	}
	if da, db := a.state.Digest(), b.state.Digest(); da == db {
		// B misses the two overflowed events until the worker resyncs: the digests must say so.
		t.Errorf("digests equal (%x) although 2 events overflowed on A", da)
	}
	// The worker answers the resync with a dump, which goes through the log to every replica.
	dump := kvstate.KVDump{Worker: wk, ThroughEventID: 5}
	for id := uint64(0); id <= 5; id++ {
		dump.Events = append(dump.Events, stored(id).Events[0])
	}
	if res, err := a.log.Append(ctx, dump); err != nil || res.Buffered {
		t.Fatalf("Append(dump) = %+v, %v", res, err)
	}
	eventually(t, "both replicas to apply the dump", func() bool { return caughtUp(ctx, rdb, stream, a, b) })
	if da, db := a.state.Digest(), b.state.Digest(); da != db {
		t.Errorf("digests after the resync: A %x, B %x; want equal", da, db)
	}
	if got := overlap(b.state, 100, 101, 102, 103, 104, 105); got != 6 {
		t.Errorf("B's overlap after the resync = %d, want 6", got)
	}
	if a.state.Load().Bookings() != 1 {
		t.Error("A never saw the booking B made during the outage")
	}
}

// TestLeasesRemoveAWorkerWhoseReplicaDied: replica A holds a worker's lease; when A stops refreshing
// (its process died), the lease runs out and replica B removes the worker everywhere, exactly once.
// A worker that re-registered since (a newer epoch) is left alone.
func TestLeasesRemoveAWorkerWhoseReplicaDied(t *testing.T) { onEveryRedis(t, testLeases) }

func testLeases(t *testing.T, rdb redis.UniversalClient) {
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	rs := startReplicas(t, rdb, 2)
	a, b := rs[0], rs[1]
	prefix := fmt.Sprintf("kvr:{%s}", t.Name())
	const grace = 300 * time.Millisecond
	leasesA := replication.NewLeases(redisLog(rdb, prefix), a.log, grace, nil)
	leasesB := replication.NewLeases(redisLog(rdb, prefix), b.log, grace, nil)

	other := kvstate.WorkerKey{ID: 8}
	for _, k := range []kvstate.WorkerKey{wk, other} {
		inf := info
		inf.Key = k
		if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: inf}); err != nil {
			t.Fatalf("Append(WorkerUp) = %v", err)
		}
	}
	if _, err := a.log.Append(ctx, kvstate.KVEvents{Worker: wk, Events: []kvstate.Event{
		{ID: 0, Kind: kvstate.EventStored, Blocks: []kvstate.Block{{Hash: 1, Local: 11}}}}}); err != nil {
		t.Fatalf("Append(KVEvents) = %v", err)
	}
	leasesA.Hold(ctx, wk, a.state.Worker(wk).Status().Epoch)
	leasesA.Hold(ctx, other, a.state.Worker(other).Status().Epoch)
	// "other" reconnects to B before A dies: its hello bumps the epoch, and B holds the new lease.
	inf := info
	inf.Key = other
	if _, err := b.log.Append(ctx, kvstate.WorkerUp{Info: inf}); err != nil {
		t.Fatalf("B.Append(WorkerUp) = %v", err)
	}
	leasesB.Hold(ctx, other, b.state.Worker(other).Status().Epoch)

	// A dies: it never refreshes again. B keeps sweeping.
	time.Sleep(grace + 50*time.Millisecond) // real time: A's lease runs out on Redis's clock
	leasesB.Sweep(ctx)
	for name, r := range map[string]replica{"A": a, "B": b} {
		eventually(t, name+" to remove the worker", func() bool { return r.state.Worker(wk) == nil })
		if r.state.Worker(other) == nil {
			t.Errorf("%s removed the worker that re-registered on B", name)
		}
		if m := r.state.Model("m"); m == nil || m.Index.Len() != 0 {
			t.Errorf("%s still indexes the removed worker's blocks", name)
		}
	}
	if n, _ := rdb.ZCard(ctx, prefix+":leases").Result(); n != 1 {
		t.Errorf("leases left = %d, want 1 (the re-registered worker's)", n)
	}
}

// TestDigestConverges: replicas that applied the same log have equal digests, even though one of
// them applied its own bookings first, in another order; and the digest moves when state changes.
func TestDigestConverges(t *testing.T) { onEveryRedis(t, testDigestConverges) }

func testDigestConverges(t *testing.T, rdb redis.UniversalClient) {
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	rs := startReplicas(t, rdb, 2)
	a, b := rs[0], rs[1]
	empty := a.state.Digest()
	mustAppend := func(l *replication.Log, c kvstate.Change) {
		t.Helper()
		if _, err := l.Append(ctx, c); err != nil {
			t.Fatalf("Append(%T) = %v", c, err)
		}
	}
	mustAppend(a.log, kvstate.WorkerUp{Info: info})
	mustAppend(b.log, kvstate.KVEvents{Worker: wk, Events: []kvstate.Event{{ID: 0, Kind: kvstate.EventStored, Blocks: []kvstate.Block{{Hash: 1, Local: 11}, {Hash: 2, Local: 12}}}}})
	for i := range 20 {
		r := rs[i%2]
		mustAppend(r.log, kvstate.Booked{Booking: kvstate.Booking{RequestID: fmt.Sprint("q", i), At: int64(1000 + i),
			Hops: []kvstate.HopBooking{{Worker: wk, Blocks: []uint64{uint64(i), 100}, PrefillTokens: 8}}, Session: "s", SessionExpires: 1 << 40}})
		if i%3 == 0 {
			mustAppend(rs[(i+1)%2].log, kvstate.Freed{RequestID: fmt.Sprint("q", i), At: int64(2000 + i)})
		}
	}
	mustAppend(a.log, kvstate.PrefillDone{RequestID: "q1", At: 3000})
	eventually(t, "both replicas to apply the whole log", func() bool {
		n, err := rdb.XLen(ctx, fmt.Sprintf("kvr:{%s}:log", t.Name())).Result()
		return err == nil && a.log.Pending() == 0 && b.log.Pending() == 0 &&
			a.log.Position() == uint64(n) && b.log.Position() == uint64(n)
	})
	if da, db := a.state.Digest(), b.state.Digest(); da != db || da == empty {
		t.Errorf("digests: A %x, B %x, empty %x; want A == B != empty", da, db, empty)
	}
}

// caughtUp reports whether every replica has applied the whole stream and has nothing in flight.
func caughtUp(ctx context.Context, rdb redis.UniversalClient, stream string, rs ...replica) bool {
	last, err := rdb.XRevRangeN(ctx, stream, "+", "-", 1).Result()
	if err != nil || len(last) == 0 {
		return false
	}
	for _, r := range rs {
		if r.log.Pending() != 0 || r.log.LastID() != last[0].ID {
			return false
		}
	}
	return true
}

// TestSnapshotColdStart: after 100,000 events through replicas A and B, with snapshots written (in
// pieces of 4 KiB) and the stream trimmed behind them, a new replica C loads the snapshot, replays
// the tail, and reaches the same digest as A and B.
func TestSnapshotColdStart(t *testing.T) { onEveryRedis(t, testSnapshotColdStart) }

func testSnapshotColdStart(t *testing.T, rdb redis.UniversalClient) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*redisTestTimeout)
	defer cancel()
	snapEvery := func(o *replication.Options) { o.SnapshotEvery = 200 }
	rs := startReplicasIn(t, redisstore.New(rdb, redisstore.Options{SnapshotChunkBytes: 4096}), "r", 2, snapEvery)
	stream := fmt.Sprintf("kvr:{%s}:log", t.Name())

	const workers, batches, perBatch = 8, 125, 100 // 100,000 stored blocks in 1,000 entries
	for w := range workers {
		inf := info
		inf.Key = kvstate.WorkerKey{ID: uint64(w + 1)}
		if _, err := rs[w%2].log.Append(ctx, kvstate.WorkerUp{Info: inf}); err != nil {
			t.Fatalf("Append(WorkerUp) = %v", err)
		}
	}
	events := 0
	for b := range batches {
		for w := range workers {
			key := kvstate.WorkerKey{ID: uint64(w + 1)}
			evs := make([]kvstate.Event, 0, perBatch)
			for i := range perBatch {
				id := uint64(b*perBatch + i)
				ev := kvstate.Event{ID: id, Kind: kvstate.EventStored, Blocks: []kvstate.Block{{Hash: id, Local: uint64(w)<<32 | id}}}
				if id > 0 {
					ev.HasParent, ev.Parent = true, id-1
				}
				if id%10 == 9 { // some evictions too
					ev = kvstate.Event{ID: id, Kind: kvstate.EventRemoved, Removed: []uint64{id - 9}}
				}
				evs = append(evs, ev)
			}
			res, err := rs[(b+w)%2].log.Append(ctx, kvstate.KVEvents{Worker: key, Events: evs})
			if err != nil || res.Applied != perBatch {
				t.Fatalf("Append(KVEvents) = %+v, %v", res, err)
			}
			events += perBatch
		}
		r := rs[b%2]
		if _, err := r.log.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: fmt.Sprint("b", b), At: time.Now().UnixNano(),
			Hops: []kvstate.HopBooking{{Worker: kvstate.WorkerKey{ID: uint64(b%workers + 1)}, Blocks: []uint64{uint64(b), 7}, PrefillTokens: 3}}}}); err != nil {
			t.Fatalf("Append(Booked) = %v", err)
		}
		if b%3 == 0 {
			if _, err := rs[(b+1)%2].log.Append(ctx, kvstate.Freed{RequestID: fmt.Sprint("b", b), At: time.Now().UnixNano()}); err != nil {
				t.Fatalf("Append(Freed) = %v", err)
			}
		}
	}
	if events != 100_000 {
		t.Fatalf("published %d events, want 100,000", events)
	}
	eventually(t, "A and B to catch up", func() bool { return caughtUp(ctx, rdb, stream, rs...) })
	if rs[0].log.SnapshotWritten.Load() == 0 && rs[1].log.SnapshotWritten.Load() == 0 {
		t.Fatal("no replica wrote a snapshot")
	}
	if n, err := rdb.XLen(ctx, stream).Result(); err != nil || uint64(n) >= rs[0].log.Position() {
		t.Fatalf("the stream holds %d entries of the %d A applied: not trimmed behind the snapshots (%v)", n, rs[0].log.Position(), err)
	}
	checkSnapshotPieces(ctx, t, rdb, fmt.Sprintf("kvr:{%s}", t.Name()))

	c := startReplicasNamed(t, rdb, "c", 1, snapEvery)[0]
	eventually(t, "C to catch up", func() bool { return caughtUp(ctx, rdb, stream, append(rs, c)...) })
	if c.log.SnapshotLoads.Load() != 1 {
		t.Errorf("C loaded %d snapshots, want 1", c.log.SnapshotLoads.Load())
	}
	da, db, dc := rs[0].state.Digest(), rs[1].state.Digest(), c.state.Digest()
	if da != db || db != dc {
		t.Errorf("digests A %x, B %x, C %x; want all equal", da, db, dc)
	}
}

// checkSnapshotPieces checks that the snapshot under prefix is stored in several pieces, each kept
// for good (no expiry), and that they add up to the size the manifest gives. Snapshots are written
// in the background, so a newer one may replace the manifest while it is checked (and give the
// pieces checked an expiry): the check counts only if the manifest is the same after it.
func checkSnapshotPieces(ctx context.Context, t *testing.T, rdb redis.UniversalClient, prefix string) {
	t.Helper()
	var problem string
	ok := kvtest.Poll(redisTestTimeout, 20*time.Millisecond, func() bool {
		manifest, err := rdb.Get(ctx, prefix+":snapshot").Result()
		if err != nil {
			problem = fmt.Sprintf("GET the snapshot manifest: %v", err)
			return false
		}
		problem = snapshotPiecesProblem(ctx, rdb, prefix, manifest)
		again, _ := rdb.Get(ctx, prefix+":snapshot").Result()
		return again == manifest && problem == ""
	})
	if !ok {
		t.Fatal(problem)
	}
}

// snapshotPiecesProblem says what is wrong with the pieces of the snapshot under manifest, or "".
func snapshotPiecesProblem(ctx context.Context, rdb redis.UniversalClient, prefix, manifest string) string {
	var id string
	var pieces, size int
	if n, err := fmt.Sscanf(manifest, "KVRCHUNKS1 %s %d %d", &id, &pieces, &size); n != 3 || err != nil || pieces < 2 {
		return fmt.Sprintf("snapshot manifest %q: want KVRCHUNKS1 <id> <pieces> <bytes> with several pieces (%v)", manifest, err)
	}
	total := 0
	for i := range pieces {
		key := fmt.Sprintf("%s:snapshot:%s:%d", prefix, id, i)
		n, err := rdb.StrLen(ctx, key).Result()
		if err != nil || n == 0 {
			return fmt.Sprintf("piece %s: %d bytes, %v", key, n, err)
		}
		if ttl, err := rdb.PTTL(ctx, key).Result(); err != nil || ttl != -1 {
			return fmt.Sprintf("piece %s expires (PTTL %v, %v); a committed snapshot's pieces must not", key, ttl, err)
		}
		total += int(n)
	}
	if total != size {
		return fmt.Sprintf("the pieces hold %d bytes, the manifest says %d", total, size)
	}
	return ""
}

// TestSnapshotsUnderBookingLoad: snapshots are written while both replicas keep booking and freeing
// each other's requests (frees often reach the log before their bookings), and a replica
// cold-started from one reaches the same digest as the two that lived through it.
func TestSnapshotsUnderBookingLoad(t *testing.T) { onEveryRedis(t, testSnapshotsUnderBookingLoad) }

func testSnapshotsUnderBookingLoad(t *testing.T, rdb redis.UniversalClient) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*redisTestTimeout)
	defer cancel()
	// A free may reach a replica before the booking it frees, which then waits for the booking to
	// arrive; on a loaded machine (a CI run of every package at once) that took longer than the
	// default 100 ms, with or without snapshots.
	snapOften := func(o *replication.Options) { o.SnapshotEvery, o.WatermarkWait = 50, 2*time.Second }
	rs := startReplicas(t, rdb, 2, snapOften)
	stream := fmt.Sprintf("kvr:{%s}:log", t.Name())
	if _, err := rs[0].log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatalf("Append(WorkerUp) = %v", err)
	}
	eventually(t, "both replicas to know the worker", func() bool { return caughtUp(ctx, rdb, stream, rs...) })
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				id := fmt.Sprintf("r%d-%d", r, i)
				if _, err := rs[r].log.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: id, At: time.Now().UnixNano(),
					Hops: []kvstate.HopBooking{{Worker: wk, Blocks: []uint64{uint64(i % 7), 99}, PrefillTokens: 5}}}}); err != nil {
					t.Errorf("Append(Booked) = %v", err)
					return
				}
				if i%2 == 0 { // the other replica frees it, possibly before the booking reaches it
					if _, err := rs[1-r].log.Append(ctx, kvstate.Freed{RequestID: id, At: time.Now().UnixNano()}); err != nil {
						t.Errorf("Append(Freed) = %v", err)
						return
					}
				}
				if i%5 == 0 {
					time.Sleep(100 * time.Microsecond) // paces the load in real time, Redis's
				}
			}
		}()
	}
	eventually(t, "snapshots under load", func() bool { return rs[0].log.SnapshotWritten.Load()+rs[1].log.SnapshotWritten.Load() > 0 })
	c := startReplicasNamed(t, rdb, "c", 1, snapOften)[0]
	time.Sleep(200 * time.Millisecond) // real time: C joins while the load runs against Redis
	close(stop)
	wg.Wait()
	if !kvtest.Poll(redisTestTimeout, 5*time.Millisecond, func() bool { return caughtUp(ctx, rdb, stream, append(rs, c)...) }) {
		last, _ := rdb.XRevRangeN(ctx, stream, "+", "-", 1).Result()
		for i, r := range append(rs, c) {
			t.Logf("replica %d: pending %d, last id %s, degraded %v", i, r.log.Pending(), r.log.LastID(), r.log.Degraded())
		}
		t.Fatalf("timed out waiting for all three to catch up; stream ends at %v", last)
	}
	if c.log.SnapshotLoads.Load() != 1 {
		t.Fatalf("C loaded %d snapshots, want 1", c.log.SnapshotLoads.Load())
	}
	da, db, dc := rs[0].state.Digest(), rs[1].state.Digest(), c.state.Digest()
	if da != db || db != dc {
		t.Errorf("digests A %x, B %x, C %x; want all equal", da, db, dc)
	}
}

// TestSnapshotPiecesLostAndReplaced: a snapshot replaced by a newer one keeps its pieces for a while
// (an expiry is set), for replicas still loading it. A replica cold-starting while a piece of the
// current snapshot is gone (deleted by hand) fails to load it, says so, and loads the next snapshot
// once one is written, reaching the writer's digest.
func TestSnapshotPiecesLostAndReplaced(t *testing.T) {
	rdb := redistest.Start(t).Client()
	ctx, cancel := context.WithTimeout(context.Background(), 3*redisTestTimeout)
	defer cancel()
	small := func(o *replication.Options) { o.SnapshotEvery = 100 }
	store := redisstore.New(rdb, redisstore.Options{SnapshotChunkBytes: 512})
	a := startReplicasIn(t, store, "r", 1, small)[0]
	prefix := fmt.Sprintf("kvr:{%s}", t.Name())
	stream := prefix + ":log"
	if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatalf("Append(WorkerUp) = %v", err)
	}
	next := uint64(0)
	publish := func(n int) { // n stored events of one block each, a chain
		for range n {
			ev := kvstate.Event{ID: next, Kind: kvstate.EventStored, Blocks: []kvstate.Block{{Hash: next + 1, Local: next + 1}}}
			if next > 0 {
				ev.HasParent, ev.Parent = true, next
			}
			if _, err := a.log.Append(ctx, kvstate.KVEvents{Worker: wk, Events: []kvstate.Event{ev}}); err != nil {
				t.Fatalf("Append(KVEvents) = %v", err)
			}
			next++
		}
	}
	manifest := func() string {
		m, err := rdb.Get(ctx, prefix+":snapshot").Result()
		if err != nil {
			return ""
		}
		return m
	}
	publish(300)
	eventually(t, "a first snapshot", func() bool { return manifest() != "" })
	first := manifest()
	var id string
	var pieces int
	if n, _ := fmt.Sscanf(first, "KVRCHUNKS1 %s %d", &id, &pieces); n != 2 || pieces < 2 {
		t.Fatalf("manifest %q: want several pieces", first)
	}
	publish(300)
	eventually(t, "a newer snapshot", func() bool { m := manifest(); return m != "" && m != first })
	for i := range pieces {
		key := fmt.Sprintf("%s:snapshot:%s:%d", prefix, id, i)
		if ttl, err := rdb.PTTL(ctx, key).Result(); err != nil || ttl <= 0 {
			t.Errorf("replaced piece %s: PTTL %v, %v; want an expiry", key, ttl, err)
		}
	}

	// An operator deletes a piece of the current snapshot; a new replica cannot load it. (A is
	// idle once caught up: it writes no snapshot until more is published.)
	eventually(t, "A to catch up", func() bool { return caughtUp(ctx, rdb, stream, a) })
	current := manifest()
	eventually(t, "A's last snapshot to be written", func() bool { // snapshots are written in the background
		m := manifest()
		time.Sleep(150 * time.Millisecond) // real time: the writer works against Redis
		stable := m == manifest()
		current = m
		return stable
	})
	if _, err := fmt.Sscanf(current, "KVRCHUNKS1 %s", &id); err != nil {
		t.Fatal(err)
	}
	if err := rdb.Del(ctx, fmt.Sprintf("%s:snapshot:%s:0", prefix, id)).Err(); err != nil {
		t.Fatal(err)
	}
	c := startReplicasIn(t, store, "c", 1, small)[0]
	time.Sleep(300 * time.Millisecond) // real time in which C would (wrongly) load it from Redis
	if c.log.SnapshotLoads.Load() != 0 {
		t.Fatalf("C loaded a snapshot with a piece missing")
	}
	publish(300) // A writes a newer, whole snapshot
	eventually(t, "C to load the newer snapshot and catch up", func() bool {
		return c.log.SnapshotLoads.Load() == 1 && caughtUp(ctx, rdb, stream, a, c)
	})
	if da, dc := a.state.Digest(), c.state.Digest(); da != dc {
		t.Errorf("digests A %x, C %x; want equal", da, dc)
	}
}

// TestSnapshotsUnderSteadyBookings: a replica whose own bookings never pause (some always in
// flight) still writes snapshots: once one is overdue it holds new bookings off and reads its own
// back first. A replica cold-started from such a snapshot reaches the same digest.
func TestSnapshotsUnderSteadyBookings(t *testing.T) {
	rdb := redistest.Start(t).Client()
	ctx, cancel := context.WithTimeout(context.Background(), 3*redisTestTimeout)
	defer cancel()
	often := func(o *replication.Options) { o.SnapshotEvery = 50 }
	a := startReplicas(t, rdb, 1, often)[0]
	stream := fmt.Sprintf("kvr:{%s}:log", t.Name())
	if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatalf("Append(WorkerUp) = %v", err)
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			id := fmt.Sprint("r", i)
			if _, err := a.log.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: id, At: time.Now().UnixNano(),
				Hops: []kvstate.HopBooking{{Worker: wk, Blocks: []uint64{uint64(i % 5)}, PrefillTokens: 3}}}}); err != nil {
				t.Errorf("Append(Booked) = %v", err)
				return
			}
			if _, err := a.log.Append(ctx, kvstate.Freed{RequestID: id, At: time.Now().UnixNano()}); err != nil {
				t.Errorf("Append(Freed) = %v", err)
				return
			}
		}
	}()
	eventually(t, "snapshots while bookings never pause", func() bool { return a.log.SnapshotWrites.Load() >= 2 })
	close(stop)
	<-done
	c := startReplicasNamed(t, rdb, "c", 1, often)[0]
	eventually(t, "A and C to catch up", func() bool { return caughtUp(ctx, rdb, stream, a, c) })
	if c.log.SnapshotLoads.Load() != 1 {
		t.Fatalf("C loaded %d snapshots, want 1", c.log.SnapshotLoads.Load())
	}
	if da, dc := a.state.Digest(), c.state.Digest(); da != dc {
		t.Errorf("digests A %x, C %x; want equal", da, dc)
	}
}

// TestLateRemovalAfterReRegistration: a worker's lease ran out while the replica holding its stream
// was paused, so another replica removed it, and the worker registered again (through that other
// replica). The paused replica, resumed, appends its own removal of the worker's earlier
// incarnation: it is skipped on every replica, since the new registration has an epoch the worker
// never had. Before incarnations the epoch restarted at 1 and the late removal took the live worker
// away, every grace period.
func TestLateRemovalAfterReRegistration(t *testing.T) {
	rdb := redistest.Start(t).Client()
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	rs := startReplicas(t, rdb, 2)
	a, b := rs[0], rs[1]
	first, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "B to see the worker", func() bool { return b.state.Worker(wk) != nil })
	if res, err := b.log.Append(ctx, kvstate.WorkerRemoved{Key: wk, Epoch: first.Epoch}); err != nil || res.Skipped {
		t.Fatalf("B's removal of the expired lease = %+v, %v", res, err)
	}
	second, err := b.log.Append(ctx, kvstate.WorkerUp{Info: info})
	if err != nil {
		t.Fatal(err)
	}
	if second.Epoch == first.Epoch {
		t.Fatalf("the worker registered again at epoch %d, the epoch of its removed incarnation", second.Epoch)
	}
	if _, err := a.log.Append(ctx, kvstate.WorkerRemoved{Key: wk, Epoch: first.Epoch}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "both replicas to apply the late removal", func() bool { return converged(a, b) })
	for name, r := range map[string]replica{"A": a, "B": b} {
		if w := r.state.Worker(wk); w == nil || w.Status().Epoch != second.Epoch {
			t.Errorf("%s: worker after the late removal = %v, want it registered at epoch %d", name, w, second.Epoch)
		}
	}
}

// TestRacingEndsFollowTheirBookings: Frees sent to the replica that is booking the same request at
// that moment (a client that gave up on its Route and freed it) are published after the booking they
// found, so every other replica ends with no booking either. A Free published ahead of its booking
// would change nothing on the other replicas (an end names a booking that came before it), and the
// booking would stay there until it expired.
func TestRacingEndsFollowTheirBookings(t *testing.T) {
	rdb := redistest.Start(t).Client()
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	rs := startReplicas(t, rdb, 2)
	a, b := rs[0], rs[1]
	if _, err := a.log.Append(ctx, kvstate.WorkerUp{Info: info}); err != nil {
		t.Fatal(err)
	}
	const n = 400
	var wg sync.WaitGroup
	for i := range n {
		id := fmt.Sprintf("r%d", i)
		wg.Go(func() {
			_, err := a.log.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: id, At: time.Now().UnixNano(),
				Hops: []kvstate.HopBooking{{Worker: wk, Blocks: []uint64{uint64(i)}, PrefillTokens: 16}}}})
			if err != nil {
				t.Errorf("Append(Booked %s) = %v", id, err)
			}
		})
		wg.Go(func() {
			for ctx.Err() == nil {
				_, err := a.log.Append(ctx, kvstate.Freed{RequestID: id, At: time.Now().UnixNano()})
				if !errors.Is(err, kvstate.ErrUnknownRequest) {
					if err != nil {
						t.Errorf("Append(Freed %s) = %v", id, err)
					}
					return
				}
			}
		})
	}
	wg.Wait()
	eventually(t, "A and B to converge", func() bool { return converged(a, b) })
	if n := b.state.Load().Bookings(); n != 0 {
		t.Errorf("B holds %d bookings after every one was freed on A, want 0", n)
	}
}
