package replication_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
	"github.com/kvrouter/kvrouter/kvstate/replication"
)

// runShards starts a sharded log over rdb for the test's deployment, serving models (none: all),
// until the test ends.
func runShards(t *testing.T, rdb redis.UniversalClient, replica string, models ...string) *replication.Shards {
	t.Helper()
	s, _ := runShardsWith(t, rdb, replication.ShardsOptions{Models: models, Log: replication.Options{Replica: replica}})
	return s
}

// runShardsWith starts a sharded log with opts (the test's deployment, short polls and reads)
// until the test ends, or until stop.
func runShardsWith(t *testing.T, rdb redis.UniversalClient, opts replication.ShardsOptions) (s *replication.Shards, stop func()) {
	t.Helper()
	opts.Log.Prefix, opts.Poll = "kvr:{"+t.Name()+"}", 50*time.Millisecond
	opts.Log.ReadBlock, opts.Log.Logger = 100*time.Millisecond, quietLogger
	s = replication.NewShards(redisStore(rdb), opts)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = s.Run(ctx); close(done) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			<-done
		})
	}
	t.Cleanup(stop)
	return s, stop
}

// shardOf returns model's shard on s, failing the test on error.
func shardOf(t *testing.T, s *replication.Shards, model string) *kvstate.Shard {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	sh, err := s.Open(ctx, model)
	if err != nil {
		t.Fatalf("Open(%q) = %v", model, err)
	}
	return sh
}

// digests returns the digest of each shard s holds, by model.
func digests(s *replication.Shards) map[string]uint64 {
	out := map[string]uint64{}
	for _, sh := range s.Shards() {
		out[sh.Model] = sh.State.Digest()
	}
	return out
}

// publishTo registers worker id of the shard's model and stores n blocks through the shard's log.
func publishTo(t *testing.T, sh *kvstate.Shard, id uint64, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	key := kvstate.WorkerKey{ID: id}
	inf := kvstate.WorkerInfo{Key: key, Model: sh.Model, Role: kvstate.RoleAggregated, BlockSize: 16, TotalKVBlocks: 1000, KVEventsEnabled: true}
	if _, err := sh.Log.Append(ctx, kvstate.WorkerUp{Info: inf}); err != nil {
		t.Fatalf("%s: WorkerUp = %v", sh.Model, err)
	}
	var blocks []kvstate.Block
	for i := range n {
		blocks = append(blocks, kvstate.Block{Hash: id<<32 | uint64(i+1), Local: uint64(i + 1)})
	}
	res, err := sh.Log.Append(ctx, kvstate.KVEvents{Worker: key, Events: []kvstate.Event{{ID: 0, Kind: kvstate.EventStored, Tier: kvstate.TierDevice, Blocks: blocks}}})
	if err != nil || res.Applied != 1 {
		t.Fatalf("%s: KVEvents = %+v, %v", sh.Model, res, err)
	}
}

// TestShardsSpreadOverMasters: on a 3-master cluster, the shards of three models land on three
// different masters, although the models' plain tags would all land on one; and another replica
// finds the same shards (the registry) rather than making its own.
func TestShardsSpreadOverMasters(t *testing.T) {
	if testing.Short() {
		t.Skip("Redis Cluster runs skipped in -short mode")
	}
	c := redistest.StartCluster(t, 3)
	rdb := c.Client()
	a, b := runShards(t, rdb, "a"), runShards(t, rdb, "b")
	// Three model names whose plain tags share a master.
	byMaster := map[string][]string{}
	var models []string
	for i := 0; models == nil; i++ {
		m := fmt.Sprintf("model-%d", i)
		master, err := masterOfKey(rdb, "kvr:{"+t.Name()+"/"+m+"}:log")
		if err != nil {
			t.Fatal(err)
		}
		if byMaster[master] = append(byMaster[master], m); len(byMaster[master]) == 3 {
			models = byMaster[master]
		}
	}
	masters := map[string]string{}
	for _, m := range models {
		shardOf(t, a, m)
		prefix := a.Prefix(m)
		master, err := masterOfKey(rdb, keysOf(prefix).Stream())
		if err != nil {
			t.Fatal(err)
		}
		if other, taken := masters[master]; taken {
			t.Errorf("models %q and %q both have their shard on master %s", other, m, master)
		}
		masters[master] = m
		shardOf(t, b, m)
		if got := b.Prefix(m); got != prefix {
			t.Errorf("replica b's shard of %q is under %q, replica a's under %q", m, got, prefix)
		}
	}
}

// masterOfKey returns the address of the master holding key's slot.
func masterOfKey(rdb redis.UniversalClient, key string) (string, error) {
	ctx := context.Background()
	slot, err := rdb.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		return "", err
	}
	ranges, err := rdb.ClusterSlots(ctx).Result()
	if err != nil {
		return "", err
	}
	for _, r := range ranges {
		if int64(r.Start) <= slot && slot <= int64(r.End) {
			return r.Nodes[0].Addr, nil
		}
	}
	return "", fmt.Errorf("no master holds slot %d", slot)
}

// TestShardsServeSubset: a replica serving one model holds that model's shard only, applies it as
// the replica that wrote it did, and refuses the other models; a replica serving all models finds
// every shard, including those created after it started.
func TestShardsServeSubset(t *testing.T) {
	rdb := redistest.Start(t).Client()
	writer := runShards(t, rdb, "writer")
	one := runShards(t, rdb, "one", "m1")
	all := runShards(t, rdb, "all")

	publishTo(t, shardOf(t, writer, "m1"), 1, 8)
	publishTo(t, shardOf(t, writer, "m2"), 2, 5)
	var appliedMu sync.Mutex
	applied := 0                                                                                          // entries the late replica applied, in any shard (its observers)
	late, _ := runShardsWith(t, rdb, replication.ShardsOptions{Log: replication.Options{Replica: "late"}, // starts after both shards exist
		Observers: kvstate.Observers{Apply: func(time.Duration) { appliedMu.Lock(); applied++; appliedMu.Unlock() }}})
	publishTo(t, shardOf(t, writer, "m3"), 3, 3)

	want := digests(writer)
	if len(want) != 3 {
		t.Fatalf("writer holds shards %v, want m1, m2, m3", want)
	}
	eventually(t, "the replica serving all models holds every shard, as applied by the writer", func() bool {
		return cmp.Equal(want, digests(all)) && cmp.Equal(want, digests(late))
	})
	eventually(t, "the late replica's observers to see the entries of every shard", func() bool {
		appliedMu.Lock()
		defer appliedMu.Unlock()
		return applied >= 6 // two entries (a hello, a batch) in each of the three shards
	})
	eventually(t, "the replica serving m1 applies m1's shard", func() bool {
		return cmp.Equal(map[string]uint64{"m1": want["m1"]}, digests(one))
	})
	time.Sleep(200 * time.Millisecond) // four registry polls (real time, against Redis): m2 and m3 must stay out
	if got := digests(one); len(got) != 1 {
		t.Errorf("the replica serving m1 holds shards %v, want m1 only", got)
	}
	if one.Log("m2") != nil {
		t.Errorf("the replica serving m1 runs a log for m2")
	}
	ctx := context.Background()
	if _, err := one.Open(ctx, "m2"); !errors.Is(err, kvstate.ErrModelNotServed) {
		t.Errorf("Open(m2) on the replica serving m1 = %v, want ErrModelNotServed", err)
	}
	// Each model's state holds only its own worker.
	for m, id := range map[string]uint64{"m1": 1, "m2": 2, "m3": 3} {
		st := shardOf(t, all, m).State
		if st.Worker(kvstate.WorkerKey{ID: id}) == nil || len(st.Model(m).Workers()) != 1 {
			t.Errorf("shard %s: worker %d missing or not alone", m, id)
		}
	}
}

// TestShardsCreatedAtOnce: replicas meeting a new model at the same moment agree on its shard.
func TestShardsCreatedAtOnce(t *testing.T) {
	rdb := redistest.Start(t).Client()
	var replicas []*replication.Shards
	for i := range 4 {
		replicas = append(replicas, runShards(t, rdb, fmt.Sprint("r", i)))
	}
	var wg sync.WaitGroup
	for _, r := range replicas {
		wg.Go(func() { shardOf(t, r, "new-model") })
	}
	wg.Wait()
	for i, r := range replicas {
		if got, want := r.Prefix("new-model"), replicas[0].Prefix("new-model"); got != want {
			t.Errorf("replica %d: shard under %q, replica 0's under %q", i, got, want)
		}
	}
	n, err := rdb.HLen(context.Background(), "kvr:{"+t.Name()+"}:shards").Result()
	if err != nil || n != 1 {
		t.Errorf("registry holds %d shards (%v), want 1", n, err)
	}
}

// TestReadyOnIdleLog: a replica starting on a log with nothing to read (a fresh deployment, or one
// whose entries a snapshot covers) is ready once it has read it, not after a blocking read's wait
// (20 s here, longer than the test waits).
func TestReadyOnIdleLog(t *testing.T) {
	srv := redistest.Start(t)
	// As serve's client: a blocking read ends with its context, so the replica stops at cleanup.
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true})
	defer rdb.Close()
	r := startReplicasNamed(t, rdb, "idle", 1, func(o *replication.Options) { o.ReadBlock = 20 * time.Second })[0]
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	select {
	case <-r.log.Ready():
	case <-ctx.Done():
		t.Fatalf("a replica starting on an empty log was not ready within %v (its blocking reads wait 20 s)", redisTestTimeout)
	}
}

// TestShardsLeases: each shard keeps its workers' leases under its own prefix; when the replica
// holding a worker's stream dies, another replica removes the worker from that model's shard a
// grace period later, and leaves the other shard's worker, whose replica lives, alone.
func TestShardsLeases(t *testing.T) {
	rdb := redistest.Start(t).Client()
	const grace = 300 * time.Millisecond
	a, stopA := runShardsWith(t, rdb, replication.ShardsOptions{WorkerGracePeriod: grace, Log: replication.Options{Replica: "a"}})
	b, _ := runShardsWith(t, rdb, replication.ShardsOptions{WorkerGracePeriod: grace, Log: replication.Options{Replica: "b"}})
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()

	onA, onB := shardOf(t, a, "m1"), shardOf(t, b, "m2")
	publishTo(t, onA, 1, 4)
	publishTo(t, onB, 2, 4)
	a.Liveness("m1").Hold(ctx, kvstate.WorkerKey{ID: 1}, onA.State.Worker(kvstate.WorkerKey{ID: 1}).Status().Epoch)
	releaseB := b.Liveness("m2").Hold(ctx, kvstate.WorkerKey{ID: 2}, onB.State.Worker(kvstate.WorkerKey{ID: 2}).Status().Epoch)
	defer releaseB()
	for m, holder := range map[string]*replication.Shards{"m1": a, "m2": b} {
		key := holder.Prefix(m) + ":leases"
		eventually(t, "a lease under "+key, func() bool { n, err := rdb.ZCard(ctx, key).Result(); return err == nil && n == 1 })
	}

	stopA() // replica a dies with worker 1's stream
	m1 := shardOf(t, b, "m1").State
	eventually(t, "replica b removes worker 1 from m1's shard", func() bool { return m1.Worker(kvstate.WorkerKey{ID: 1}) == nil })
	time.Sleep(2 * grace) // real time: two grace periods on Redis's clock, in which a wrong removal would happen
	if shardOf(t, b, "m2").State.Worker(kvstate.WorkerKey{ID: 2}) == nil {
		t.Errorf("worker 2, held by the live replica b, was removed from m2's shard")
	}
}

// TestShardsRedisRestartedEmpty: Redis restarts empty under running replicas. Each shard's log
// reseeds itself from the replicas' state, and the registry is repaired with the shards where the
// replicas keep them, so that a replica starting afterwards finds every shard, not a new empty one,
// and holds what the others hold.
func TestShardsRedisRestartedEmpty(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client()
	a := runShards(t, rdb, "a")
	for i, m := range []string{"m1", "m2"} {
		publishTo(t, shardOf(t, a, m), uint64(i+1), 8)
	}
	want := digests(a)
	prefixes := map[string]string{"m1": a.Prefix("m1"), "m2": a.Prefix("m2")}
	srv.Restart() // empty: no persistence

	ctx := context.Background()
	eventually(t, "the registry to name the shards again", func() bool {
		got, err := rdb.HGetAll(ctx, "kvr:{"+t.Name()+"}:shards").Result()
		return err == nil && cmp.Equal(prefixes, got)
	})
	late := runShards(t, rdb, "late")
	select {
	case <-late.Ready():
	case <-time.After(redisTestTimeout):
		t.Fatalf("the replica started after the restart was not ready within %v", redisTestTimeout)
	}
	eventually(t, "the late replica to hold both shards as replica a does", func() bool {
		return cmp.Equal(want, digests(late)) && cmp.Equal(want, digests(a))
	})
}

// TestShardsRegisteredElsewhere: a replica finds a worker rank registered under another model, in a
// shard it holds (its state) or in one it does not serve (the rank's worker lease there), so that a
// hello naming another model is refused alike on every replica.
func TestShardsRegisteredElsewhere(t *testing.T) {
	rdb := redistest.Start(t).Client()
	const grace = 5 * time.Second
	all, _ := runShardsWith(t, rdb, replication.ShardsOptions{WorkerGracePeriod: grace, Log: replication.Options{Replica: "all"}})
	only2, _ := runShardsWith(t, rdb, replication.ShardsOptions{WorkerGracePeriod: grace, Models: []string{"m2"}, Log: replication.Options{Replica: "only2"}})
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()
	m1 := shardOf(t, all, "m1")
	publishTo(t, m1, 7, 2)
	key := kvstate.WorkerKey{ID: 7}
	release := all.Liveness("m1").Hold(ctx, key, m1.State.Worker(key).Status().Epoch)
	defer release()
	if held, model, err := all.RegisteredElsewhere(ctx, key, "m2"); err != nil || held != m1 || model != "m1" {
		t.Errorf("on the replica holding m1: RegisteredElsewhere(7, m2) = %v, %q, %v; want m1's shard", held, model, err)
	}
	if held, model, err := only2.RegisteredElsewhere(ctx, key, "m2"); err != nil || held != nil || model != "m1" {
		t.Errorf("on a replica serving m2 only: RegisteredElsewhere(7, m2) = %v, %q, %v; want model m1 (its lease), no shard", held, model, err)
	}
	if _, model, err := only2.RegisteredElsewhere(ctx, kvstate.WorkerKey{ID: 8}, "m2"); err != nil || model != "" {
		t.Errorf("RegisteredElsewhere(8, m2) = %q, %v; want nothing", model, err)
	}
}

// TestNewModelInASettledDeployment: a shard made for a model new to a deployment whose Redis has
// kept its data for longer than the reseed window is complete at once (no replica can hold lost
// state of it), so that adding a model does not make every replica answer UNAVAILABLE, and report
// not ready, for a reseed window. In a new deployment (or one whose Redis lost its data) a new
// model's log keeps the window: a replica holding the lost state may still reseed it.
func TestNewModelInASettledDeployment(t *testing.T) {
	for _, tt := range []struct {
		name      string
		lineage   time.Duration // age of the deployment's lineage when the replica starts (0: none)
		wantFresh bool
	}{
		{"settled deployment", time.Hour, false},
		{"new deployment", 0, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rdb := redistest.Start(t).Client()
			ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
			defer cancel()
			if tt.lineage > 0 {
				v := fmt.Sprintf("0123456789abcdef/%d", time.Now().Add(-tt.lineage).UnixMilli())
				if err := rdb.Set(ctx, "kvr:{"+t.Name()+"}:lineage", v, 0).Err(); err != nil {
					t.Fatal(err)
				}
			}
			s, _ := runShardsWith(t, rdb, replication.ShardsOptions{Log: replication.Options{Replica: "a", ReseedWindow: 5 * time.Second}})
			eventually(t, "the first registry read", func() bool {
				select {
				case <-s.Ready():
					return true
				default:
					return false
				}
			})
			shardOf(t, s, "new-model")
			l := s.Log("new-model")
			eventually(t, "the new model's log to join", func() bool { return l.Generation() != "" })
			if got := l.Incomplete(); got != tt.wantFresh {
				t.Errorf("the new model's log right after it joined: incomplete %v, want %v", got, tt.wantFresh)
			}
		})
	}
}

// TestShardsEndWhileTheDeploymentIsYoung: a replica that holds no shard cannot tell whether a
// booking exists while the deployment's data is younger than the reseed window: Redis lost it
// moments ago, and a replica holding the booking may not have registered its shard again yet. A
// Free for a request it does not find is then ErrLogUnavailable (retry), as in a log's fresh
// generation; after the window it is ErrUnknownRequest. Before, it was ErrUnknownRequest at once,
// and a Free retried on another replica would have found the booking.
func TestShardsEndWhileTheDeploymentIsYoung(t *testing.T) {
	srv := redistest.Start(t)
	const window = 3 * time.Second
	s, _ := runShardsWith(t, srv.Client(), replication.ShardsOptions{Log: replication.Options{Replica: "a", ReseedWindow: window}})
	ctx := context.Background()
	free := kvstate.Freed{RequestID: "r"}
	for _, when := range []string{"in a new deployment", "after Redis restarted empty"} {
		if err := s.EndElsewhere(ctx, free); !errors.Is(err, kvstate.ErrLogUnavailable) {
			t.Fatalf("%s: EndElsewhere(r) = %v, want ErrLogUnavailable", when, err)
		}
		start := time.Now()
		eventually(t, "the deployment past its reseed window", func() bool {
			return errors.Is(s.EndElsewhere(ctx, free), kvstate.ErrUnknownRequest)
		})
		if took := time.Since(start); took < window/3 {
			t.Errorf("%s: ErrUnknownRequest %v after the first call, want about the %v window", when, took, window)
		}
		srv.Restart()
	}
}
