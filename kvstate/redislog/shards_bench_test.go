package redislog_test

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/redislog"
)

// BenchmarkRedisShardsColdStart measures a replica's cold start from the snapshots of a sharded
// log: shards=N models, each shard's snapshot holding the ~1.06M-block fill of fillStates (64
// workers of its model), so N=10 is 10.6M blocks. The shards are registered through
// redislog.Shards, so on the 3-master cluster their tags spread over the masters. A new replica
// serving all models is timed from the start of its Run until every shard's Log is ready (snapshot
// read and restored, stream read to its end); its shards' digests must equal the states the
// snapshots were made from. Metrics: coldstart-ms, blocks (in all shards).
func BenchmarkRedisShardsColdStart(b *testing.B) {
	for _, target := range redisTargets {
		b.Run("redis="+target.name, func(b *testing.B) {
			client := clientsOf(b, target.start(b))
			for _, shards := range []int{1, 10} {
				b.Run(fmt.Sprintf("shards=%d", shards), func(b *testing.B) { benchShardsColdStart(b, client, shards) })
			}
		})
	}
}

func benchShardsColdStart(b *testing.B, client func() redis.UniversalClient, shards int) {
	rdb := client()
	ctx := context.Background()
	prefix := fmt.Sprintf("kvr:{coldstart%d}", benchPrefixes.Add(1))
	// A sharded log that never runs: it registers the shards and tells their prefixes.
	registrar := redislog.NewShards(rdb, redislog.ShardsOptions{Log: redislog.Options{Prefix: prefix}})
	want := map[string]uint64{}
	blocks := 0
	for i := range shards {
		model := fmt.Sprintf("m%d", i)
		if _, err := registrar.Open(ctx, model); err != nil {
			b.Fatal(err)
		}
		st := kvstate.NewState()
		fillStatesOf(b, model, st)
		seedFill(b, rdb, registrar.Prefix(model), st)
		want[model] = st.Digest()
		blocks += int(st.IndexBlocks())
	}
	runtime.GC()
	var took time.Duration
	for b.Loop() {
		s := redislog.NewShards(client(), redislog.ShardsOptions{Poll: time.Hour,
			Log: redislog.Options{Prefix: prefix, Replica: "cold", Logger: quietLogger}})
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		start := time.Now()
		go func() { _ = s.Run(runCtx); close(done) }()
		<-s.Ready() // every shard in the registry caught up
		took += time.Since(start)
		b.StopTimer()
		if n := len(s.Shards()); n != shards {
			b.Fatalf("ready with %d shards, want %d", n, shards)
		}
		for _, sh := range s.Shards() {
			if got := sh.State.Digest(); got != want[sh.Model] {
				b.Fatalf("shard %s: digest %x after the cold start, want %x", sh.Model, got, want[sh.Model])
			}
		}
		cancel()
		<-done
		runtime.GC()
		b.StartTimer()
	}
	b.ReportMetric(millis(took)/float64(b.N), "coldstart-ms")
	b.ReportMetric(float64(blocks), "blocks")
}
