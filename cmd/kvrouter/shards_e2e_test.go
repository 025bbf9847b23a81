package main

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
)

// registryKey is the registry of the shards of replicas started with the default prefix and
// --redis-shard-by-model.
const registryKey = "kvr:{default}:shards"

// TestShardedReplicas runs kvrouter processes with the log sharded by model: replica A serves every
// model and replica B only m1. Workers of m1 and m2 publish to A; B routes m1 by the cache A's
// workers published, holds m1's shard only (as A holds it), refuses a worker of m2 with
// FAILED_PRECONDITION MODEL_NOT_SERVED and knows no m2 to route. On a 3-master cluster the two
// models' shards live on different masters.
func TestShardedReplicas(t *testing.T) { onEveryRedis(t, testShardedReplicas) }

func testShardedReplicas(t *testing.T, r redisTarget) {
	bin := buildBinary(t)
	sharded := append(append([]string(nil), r.flags...), "--redis-shard-by-model", "--redis-reseed-window", "1s")
	a := startProcess(t, bin, append(sharded, "--replica-id", "a")...)
	b := startProcess(t, bin, append(sharded, "--replica-id", "b", "--redis-models", "m1")...)
	w1, w2 := newFleetWorker(t, 1, a.addr), newFleetWorker(t, 2, a.addr)
	w1.modelName, w2.modelName = "m1", "m2"
	f := startFleetWith(t, []*fleetWorker{w1, w2}, 10*time.Millisecond)
	time.Sleep(300 * time.Millisecond)
	f.pause()
	if err := f.waitAllAcked(defaultTestTimeout); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout) // outlives the polls
	defer cancel()

	var onA, onB replicaState
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
		var errA, errB error
		onA, errA = readReplica(ctx, t, a.addr)
		onB, errB = readReplica(ctx, t, b.addr)
		return errA == nil && errB == nil && len(onA.state.GetShards()) == 2 && len(onB.state.GetShards()) == 1 &&
			onB.state.GetShards()[0].GetDigest() == onA.state.GetShards()[0].GetDigest()
	}) {
		t.Fatalf("replica B never held m1's shard as replica A does:\nA: %v\nB: %v", onA.state, onB.state)
	}
	if got := []string{onA.state.GetShards()[0].GetModel(), onA.state.GetShards()[1].GetModel(), onB.state.GetShards()[0].GetModel()}; !slices.Equal(got, []string{"m1", "m2", "m1"}) {
		t.Errorf("shards: A %v, B %v; want A m1 and m2, B m1", got[:2], got[2:])
	}
	_, acked, _, _, _ := w1.status()
	if got := int64(onB.blocks[1]); got != acked+1 || onB.blocks[2] != 0 {
		t.Errorf("replica B holds %d blocks of worker 1 (acked %d) and %d of worker 2 (m2, not served); want all of 1's, none of 2's", got, acked+1, onB.blocks[2])
	}

	router := kvrouterv1.NewRouterServiceClient(dial(t, b.addr))
	resp, err := router.Route(ctx, &kvrouterv1.RouteRequest{Model: "m1", TokenIds: w1.prompt(), QueryOnly: true, Explain: true})
	if err != nil || resp.GetDecode().GetWorkerId() != 1 {
		t.Errorf("Route(m1) on B = %v, %v; want worker 1", resp, err)
	}
	if _, err := router.Route(ctx, &kvrouterv1.RouteRequest{Model: "m2", TokenIds: w2.prompt(), QueryOnly: true}); status.Code(err) != codes.NotFound {
		t.Errorf("Route(m2) on B = %v, want NOT_FOUND (B serves m1 only)", err)
	}

	stream, err := kvrouterv1.NewWorkerServiceClient(dial(t, b.addr)).Publish(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
		WorkerId: 3, Model: "m2", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 4, TotalKvBlocks: 100, KvEventsEnabled: true, Endpoint: "w3"}}}); err != nil {
		t.Fatal(err)
	}
	_, err = stream.Recv()
	if st, _ := status.FromError(err); st.Code() != codes.FailedPrecondition || reasonOf(st) != "MODEL_NOT_SERVED" {
		t.Errorf("a worker of m2 on B = %v (reason %q), want FAILED_PRECONDITION MODEL_NOT_SERVED", err, reasonOf(st))
	}

	registry, err := r.client.HGetAll(ctx, registryKey).Result()
	if err != nil || len(registry) != 2 {
		t.Fatalf("registry %s = %v, %v; want m1 and m2", registryKey, registry, err)
	}
	if cluster, ok := r.client.(*redis.ClusterClient); ok {
		m1, m2 := masterOf(ctx, t, cluster, registry["m1"]+":log"), masterOf(ctx, t, cluster, registry["m2"]+":log")
		if m1 == m2 {
			t.Errorf("the shards of m1 (%s) and m2 (%s) are both on master %s", registry["m1"], registry["m2"], m1)
		}
	}
}

// reasonOf returns the ErrorInfo reason a status carries, or "".
func reasonOf(st *status.Status) string {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}

// masterOf returns the id of the cluster master holding key.
func masterOf(ctx context.Context, t *testing.T, c *redis.ClusterClient, key string) string {
	t.Helper()
	slot, err := c.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	slots, err := c.ClusterSlots(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range slots {
		if int64(r.Start) <= slot && slot <= int64(r.End) && len(r.Nodes) > 0 {
			return r.Nodes[0].ID
		}
	}
	t.Fatalf("no master holds slot %d", slot)
	return ""
}

// TestUpgradeToShardedLayout is the upgrade path of docs/operations.md ("Sharding the shared log by
// model"): a deployment on one log gets a sharded deployment beside it on the same Redis and
// prefix (the two layouts share no key), the old replica stops, and its workers move to the new
// one: each registers in its model's shard, which holds nothing of it yet, and sends a dump, so the
// new deployment holds every event the workers had acked and routes by them. The old log is left
// untouched, for a rollback, until the operator deletes it.
func TestUpgradeToShardedLayout(t *testing.T) {
	bin := buildBinary(t)
	srv := redistest.Start(t)
	rdb := srv.Client()
	old := startProcess(t, bin, "--redis-addr", srv.Addr, "--replica-id", "old")
	next := startProcess(t, bin, "--redis-addr", srv.Addr, "--replica-id", "new", "--redis-shard-by-model")
	workers := []*fleetWorker{newFleetWorker(t, 1, old.addr, next.addr), newFleetWorker(t, 2, old.addr, next.addr)}
	workers[0].modelName, workers[1].modelName = "llama", "qwen"
	f := startFleetWith(t, workers, 10*time.Millisecond)
	time.Sleep(500 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout)
	defer cancel()
	if st, err := readReplica(ctx, t, next.addr); err != nil || len(st.state.GetShards()) != 0 || st.state.GetWorkers() != 0 || st.state.GetLog() != "redis" {
		t.Fatalf("the new deployment, before any worker moved: %v, %v; want a redis log with no shard and no worker", st.state, err)
	}

	old.kill() // the old deployment is deleted: its workers reconnect to the new one
	oldLength, err := rdb.XLen(ctx, defaultStream).Result()
	if err != nil || oldLength == 0 {
		t.Fatalf("the old log: %d entries, %v", oldLength, err)
	}
	time.Sleep(500 * time.Millisecond) // the workers publish on, to the new deployment
	f.pause()
	if err := f.waitAllAcked(defaultTestTimeout); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.waitConverged(defaultTestTimeout, next.addr); err != nil {
		t.Fatalf("the new deployment lacks acked events: %v", err)
	}
	st, _ := readReplica(ctx, t, next.addr)
	var models []string
	for _, sh := range st.state.GetShards() {
		models = append(models, sh.GetModel())
	}
	if !slices.Equal(models, []string{"llama", "qwen"}) {
		t.Errorf("the new deployment holds shards %v, want llama and qwen", models)
	}
	for _, w := range workers {
		if _, _, reconnects, dumps, _ := w.status(); reconnects == 0 || dumps == 0 {
			t.Errorf("worker %d: %d reconnects, %d dumps; want it to move over with a dump", w.id, reconnects, dumps)
		}
		resp, err := kvrouterv1.NewRouterServiceClient(dial(t, next.addr)).Route(ctx, &kvrouterv1.RouteRequest{Model: w.model(), TokenIds: w.prompt(), QueryOnly: true})
		if err != nil || resp.GetDecode().GetWorkerId() != w.id {
			t.Errorf("Route(%s) on the new deployment = %v, %v; want worker %d", w.model(), resp, err, w.id)
		}
	}
	if n, err := rdb.XLen(ctx, defaultStream).Result(); err != nil || n != oldLength {
		t.Errorf("the old log went from %d to %d entries (%v): the new deployment must leave it alone", oldLength, n, err)
	}
	if prefix, err := rdb.HGet(ctx, registryKey, "llama").Result(); err != nil || prefix != fmt.Sprintf("kvr:{default/%s}", "llama") {
		t.Errorf("registry entry of llama = %q, %v; want kvr:{default/llama}", prefix, err)
	}
}
