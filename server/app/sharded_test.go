package app

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
	"github.com/kvrouter/kvrouter/kvstate/replication"
	"github.com/kvrouter/kvrouter/policy"
)

// register registers aggregated worker id of the shard's model through its log, caching the first
// blocks of tokens.
func register(t *testing.T, sh *kvstate.Shard, id uint64, tokens []uint32, blocks int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	key := kvstate.WorkerKey{ID: id}
	if _, err := sh.Log.Append(ctx, kvstate.WorkerUp{Info: kvstate.WorkerInfo{Key: key, Model: sh.Model, Role: kvstate.RoleAggregated,
		BlockSize: testBlockSize, TotalKVBlocks: 1000, MaxNumBatchedTokens: 8192, KVEventsEnabled: true}}); err != nil {
		t.Fatalf("%s: WorkerUp = %v", sh.Model, err)
	}
	local := blockhash.Locals(nil, tokens, testBlockSize, blockhash.Salt("", ""))[:blocks]
	var stored []kvstate.Block
	for i, h := range local {
		stored = append(stored, kvstate.Block{Hash: id<<32 | uint64(i), Local: h})
	}
	if _, err := sh.Log.Append(ctx, kvstate.KVEvents{Worker: key, Events: []kvstate.Event{{ID: 0, Tier: kvstate.TierDevice, Kind: kvstate.EventStored, Blocks: stored}}}); err != nil {
		t.Fatalf("%s: KVEvents = %v", sh.Model, err)
	}
}

// TestShardedRoutesInTheModelsShard: each request decides and books in its model's shard; ending a
// booking finds the shard that holds it; a model with no shard here is unknown, as is a request
// no shard holds.
func TestShardedRoutesInTheModelsShard(t *testing.T) {
	source := &kvtest.MemShards{}
	shard := func(model string) *kvstate.Shard { sh, _ := source.Lookup(model); return sh }
	tokens := prompt(4 * testBlockSize)
	for i, m := range []string{"a", "b"} {
		sh, _ := source.Open(context.Background(), m)
		register(t, sh, uint64(i+1), tokens, 4-2*i)
	}
	s := NewSharded(source, policy.DefaultConfig(), Options{})
	ctx := context.Background()

	for model, worker := range map[string]uint64{"a": 1, "b": 2} {
		req := &Request{Request: policy.Request{ID: "req-" + model, Model: model, Tokens: tokens}}
		dec, err := s.Route(ctx, req)
		if err != nil || !dec.Booked || dec.Decode.Worker.Info.Key.ID != worker {
			t.Fatalf("Route(model %s) = %+v, %v; want booked on worker %d", model, dec, err, worker)
		}
		if got := shard(model).State.Load().BookingIDs(); !slices.Equal(got, []string{req.ID}) {
			t.Errorf("shard %s bookings = %v, want only %s", model, got, req.ID)
		}
	}
	if _, err := s.Route(ctx, &Request{Request: policy.Request{ID: "c", Model: "c", Tokens: tokens}}); !errors.Is(err, policy.ErrUnknownModel) {
		t.Errorf("Route(model c) = %v, want ErrUnknownModel", err)
	}
	if err := s.PrefillComplete(ctx, "req-b"); err != nil {
		t.Errorf("PrefillComplete(req-b) = %v", err)
	}
	if err := s.Free(ctx, "req-a"); err != nil {
		t.Errorf("Free(req-a) = %v", err)
	}
	if a, b := shard("a").State.Load().Bookings(), shard("b").State.Load().Bookings(); a != 0 || b != 1 {
		t.Errorf("bookings after freeing req-a: a %d, b %d; want 0 and 1", a, b)
	}
	if err := s.Free(ctx, "req-a"); !errors.Is(err, kvstate.ErrUnknownRequest) {
		t.Errorf("Free(req-a) again = %v, want ErrUnknownRequest", err)
	}
	if n := s.QueueDepth(); n != 0 {
		t.Errorf("QueueDepth() = %d, want 0", n)
	}
}

// TestShardedRequestIDsAreUnique: a request id booked in one model's shard cannot be booked in
// another's (ALREADY_EXISTS, as when one state holds every model), also by two Routes racing, and
// its Free ends that booking, never another model's. Before, each shard checked only its own
// bookings, and the later Free could end model a's booking when model b's was meant.
func TestShardedRequestIDsAreUnique(t *testing.T) {
	source := &kvtest.MemShards{}
	tokens := prompt(4 * testBlockSize)
	for i, m := range []string{"a", "b"} {
		sh, _ := source.Open(context.Background(), m)
		register(t, sh, uint64(i+1), tokens, 4)
	}
	s := NewSharded(source, policy.DefaultConfig(), Options{})
	ctx := context.Background()
	route := func(id, model string) error {
		_, err := s.Route(ctx, &Request{Request: policy.Request{ID: id, Model: model, Tokens: tokens}})
		return err
	}
	if err := route("dup", "a"); err != nil {
		t.Fatal(err)
	}
	if err := route("dup", "b"); !errors.Is(err, kvstate.ErrAlreadyBooked) {
		t.Fatalf("Route(dup in b) while dup is booked in a = %v, want ErrAlreadyBooked", err)
	}
	// Racing: of 16 Routes of one id spread over both models, one books.
	errs := make(chan error, 16)
	for i := range 16 {
		go func() { errs <- route("race", []string{"a", "b"}[i%2]) }()
	}
	booked := 0
	for range 16 {
		switch err := <-errs; {
		case err == nil:
			booked++
		case !errors.Is(err, kvstate.ErrAlreadyBooked):
			t.Errorf("racing Route = %v", err)
		}
	}
	if booked != 1 {
		t.Errorf("%d of 16 racing Routes of one id booked, want 1", booked)
	}
	if err := s.Free(ctx, "dup"); err != nil {
		t.Fatal(err)
	}
	for _, m := range []string{"a", "b"} {
		sh, _ := source.Lookup(m)
		if sh.State.Load().Booked("dup") {
			t.Errorf("dup still booked in %s after its Free", m)
		}
	}
}

// runShards runs a log sharded by model, replica of the test's deployment on rdb, serving models
// (all when none), until the test ends.
func runShards(t *testing.T, rdb redis.UniversalClient, replica string, models ...string) *replication.Shards {
	t.Helper()
	return runShardsPolling(t, rdb, replica, 20*time.Millisecond, models...)
}

// runShardsPolling is runShards reading the registry of shards every poll.
func runShardsPolling(t *testing.T, rdb redis.UniversalClient, replica string, poll time.Duration, models ...string) *replication.Shards {
	t.Helper()
	s := replication.NewShards(redisstore.New(rdb, redisstore.Options{}), replication.ShardsOptions{Poll: poll, Models: models,
		Log: replication.Options{Prefix: "kvr:{" + t.Name() + "}", Replica: replica, ReadBlock: 100 * time.Millisecond, Logger: slog.New(slog.DiscardHandler),
			ReseedWindow: 300 * time.Millisecond}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = s.Run(ctx); close(done) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return s
}

// registerModels registers worker 1 of model m1 and worker 2 of m2 on s, each caching tokens.
func registerModels(t *testing.T, s *replication.Shards, tokens []uint32) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	for i, m := range []string{"m1", "m2"} {
		sh, err := s.Open(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		register(t, sh, uint64(i+1), tokens, 4)
	}
}

// TestShardedFreeOnAnotherReplica: with a log sharded by model in Redis, a request routed on one
// replica is freed on another at once, while its booking may still be on its way through its
// shard's log, although that replica holds another shard too.
func TestShardedFreeOnAnotherReplica(t *testing.T) {
	rdb := redistest.Start(t).Client()
	a, b := runShards(t, rdb, "a"), runShards(t, rdb, "b")
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	tokens := prompt(4 * testBlockSize)
	registerModels(t, a, tokens)
	kvtest.Eventually(t, testTimeout, "replica b to hold both shards", func() bool {
		for i, m := range []string{"m1", "m2"} {
			if sh, ok := b.Lookup(m); !ok || sh.State.Worker(kvstate.WorkerKey{ID: uint64(i + 1)}) == nil {
				return false
			}
		}
		return true
	})
	onA, onB := NewSharded(a, policy.DefaultConfig(), Options{}), NewSharded(b, policy.DefaultConfig(), Options{})
	for i := range 20 {
		id := "req-" + string(rune('a'+i))
		if _, err := onA.Route(ctx, &Request{Request: policy.Request{ID: id, Model: "m1", Tokens: tokens}}); err != nil {
			t.Fatalf("Route on a = %v", err)
		}
		if err := onB.Free(ctx, id); err != nil {
			t.Fatalf("Free(%s) on b right after its Route on a = %v", id, err)
		}
	}
	m1 := func(s *replication.Shards) *kvstate.State { sh, _ := s.Lookup("m1"); return sh.State }
	kvtest.Eventually(t, testTimeout, "no booking left on either replica", func() bool {
		return m1(a).Load().Bookings() == 0 && m1(b).Load().Bookings() == 0
	})
	// Until the fresh shards are past their reseed window, a request nobody here holds may still
	// exist (a replica that lost state could reseed them): the answer would be LOG_UNAVAILABLE.
	kvtest.Eventually(t, testTimeout, "b's shards past their reseed window", func() bool {
		return !b.Log("m1").Incomplete() && !b.Log("m2").Incomplete()
	})
	if err := onB.Free(ctx, "req-a"); !errors.Is(err, kvstate.ErrUnknownRequest) {
		t.Errorf("Free(req-a) again on b = %v, want ErrUnknownRequest", err)
	}
}

// TestShardedFreeOnAReplicaThatHasNotPickedUpTheShard: a replica reads the registry of shards every
// Poll, so a shard another replica made (or registered again after Redis lost its data) moments
// ago is not held here yet. A Free for a booking in it is UNAVAILABLE while the shard loads, then
// accepted; before, it was NOT_FOUND and the booking stayed on every replica (the fault suite's
// empty Redis with a replica restarting, once in CI).
func TestShardedFreeOnAReplicaThatHasNotPickedUpTheShard(t *testing.T) {
	rdb := redistest.Start(t).Client()
	a, late := runShards(t, rdb, "a"), runShardsPolling(t, rdb, "late", time.Hour)
	<-late.Ready() // it read the registry, empty, and reads it again in an hour
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	tokens := prompt(4 * testBlockSize)
	registerModels(t, a, tokens)
	kvtest.Eventually(t, testTimeout, "the shards past their reseed window", func() bool {
		return !a.Log("m1").Incomplete() && !a.Log("m2").Incomplete()
	})
	onA, onLate := NewSharded(a, policy.DefaultConfig(), Options{}), NewSharded(late, policy.DefaultConfig(), Options{})
	if _, err := onA.Route(ctx, &Request{Request: policy.Request{ID: "r", Model: "m1", Tokens: tokens}}); err != nil {
		t.Fatal(err)
	}
	err := onLate.Free(ctx, "r")
	if !errors.Is(err, kvstate.ErrLogUnavailable) {
		t.Fatalf("Free(r) on a replica that has not picked up m1's shard = %v, want ErrLogUnavailable (retry)", err)
	}
	kvtest.Eventually(t, testTimeout, "Free(r) retried until accepted", func() bool {
		err = onLate.Free(ctx, "r")
		return !errors.Is(err, kvstate.ErrLogUnavailable)
	})
	if err != nil {
		t.Fatalf("Free(r) once m1's shard loaded = %v, want it freed", err)
	}
	m1 := func(s *replication.Shards) *kvstate.State { sh, _ := s.Lookup("m1"); return sh.State }
	kvtest.Eventually(t, testTimeout, "the booking freed on both replicas", func() bool {
		return m1(a).Load().Bookings() == 0 && m1(late).Load().Bookings() == 0
	})
	kvtest.Eventually(t, testTimeout, "the late replica's shards past their reseed window", func() bool {
		_, ok := late.Lookup("m2")
		return ok && !late.Log("m1").Incomplete() && !late.Log("m2").Incomplete()
	})
	if err := onLate.Free(ctx, "junk"); !errors.Is(err, kvstate.ErrUnknownRequest) {
		t.Errorf("Free(junk) = %v, want ErrUnknownRequest", err)
	}
}

// TestShardedEndOnAReplicaNotServingTheModel: a replica configured to serve model m2 only holds no
// state of m1, yet a Free or MarkPrefillComplete for a request routed in m1 on another replica
// ends it there (either may be sent to any replica), and one for a request nobody booked is
// NOT_FOUND. Before, such a replica answered NOT_FOUND, and the booking stayed until it expired.
func TestShardedEndOnAReplicaNotServingTheModel(t *testing.T) {
	rdb := redistest.Start(t).Client()
	all, only2 := runShards(t, rdb, "all"), runShards(t, rdb, "only2", "m2")
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	tokens := prompt(4 * testBlockSize)
	registerModels(t, all, tokens)
	kvtest.Eventually(t, testTimeout, "the shards past their reseed window", func() bool {
		return !all.Log("m1").Incomplete() && !all.Log("m2").Incomplete()
	})
	onAll, onOnly2 := NewSharded(all, policy.DefaultConfig(), Options{}), NewSharded(only2, policy.DefaultConfig(), Options{})
	if _, err := onAll.Route(ctx, &Request{Request: policy.Request{ID: "in-m1", Model: "m1", Tokens: tokens}}); err != nil {
		t.Fatal(err)
	}
	m1 := func() *kvstate.State { sh, _ := all.Lookup("m1"); return sh.State }
	if err := onOnly2.PrefillComplete(ctx, "in-m1"); err != nil {
		t.Fatalf("PrefillComplete(in-m1) on the replica serving m2 only = %v, want it ended in m1", err)
	}
	if err := onOnly2.Free(ctx, "in-m1"); err != nil {
		t.Fatalf("Free(in-m1) on the replica serving m2 only = %v, want it freed in m1", err)
	}
	kvtest.Eventually(t, testTimeout, "the booking freed in m1", func() bool { return m1().Load().Bookings() == 0 })
	if err := onOnly2.Free(ctx, "in-m1"); !errors.Is(err, kvstate.ErrUnknownRequest) {
		t.Errorf("Free(in-m1) again = %v, want ErrUnknownRequest", err)
	}
	if err := onOnly2.Free(ctx, "junk"); !errors.Is(err, kvstate.ErrUnknownRequest) {
		t.Errorf("Free(junk) = %v, want ErrUnknownRequest", err)
	}
}
