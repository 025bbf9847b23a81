package replication_test

import (
	"context"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/replication"
)

// BenchmarkRedisShardsColdStart measures a replica's cold start from the snapshots of a sharded
// log: shards=N models, each shard's snapshot (in 1 MiB pieces, as the snapshot writer stores it) holding the ~1.06M-block fill of fillStates (64
// workers of its model), so N=10 is 10.6M blocks. The shards are registered through
// replication.Shards, so on the 3-master cluster their tags spread over the masters. A new replica
// serving all models is timed from the start of its Run until every shard's Log is ready (snapshot
// read and restored, stream read to its end); its shards' digests must equal the states the
// snapshots were made from. Metrics: coldstart-ms, blocks (in all shards).
//
// proc=same starts the replica in the benchmark's process, which has filled and encoded the states
// before: it reuses memory that process touched and freed, which is cheaper to write than fresh
// memory (on these VMs, several times so). proc=fresh starts it as a new process, as a replica
// starts: this test binary run again with only TestColdStartChild, which prints its cold start and
// digests; the time is taken from that process's own start of Run, as proc=same takes it.
func BenchmarkRedisShardsColdStart(b *testing.B) {
	for _, target := range redisTargets {
		b.Run("redis="+target.name, func(b *testing.B) {
			addrs := target.start(b)
			client := clientsOf(b, addrs)
			for _, shards := range []int{1, 10} {
				for _, proc := range []string{"same", "fresh"} {
					b.Run(fmt.Sprintf("shards=%d/proc=%s", shards, proc), func(b *testing.B) { benchShardsColdStart(b, client, addrs, shards, proc) })
				}
			}
		})
	}
}

// seedFillPieced stores st as the snapshot of the log under prefix, as the snapshot writer stores
// it: in pieces of 1 MiB (the default snapshot_chunk_bytes) and a manifest.
func seedFillPieced(b *testing.B, rdb redis.UniversalClient, prefix string, st *kvstate.State) {
	b.Helper()
	ctx := context.Background()
	opts := replication.Options{Prefix: prefix}
	data := st.EncodeSnapshot(nil, kvstate.SnapshotHeader{Position: "0-0"})
	const piece = 1 << 20
	id := strings.NewReplacer("{", "", "}", "", ":", "").Replace(prefix)
	pieces := (len(data) + piece - 1) / piece
	for i := range pieces {
		if err := rdb.Set(ctx, keysOf(opts.Prefix).SnapshotChunk(id, i), data[i*piece:min(len(data), (i+1)*piece)], 0).Err(); err != nil {
			b.Fatal(err)
		}
	}
	if err := rdb.Set(ctx, keysOf(opts.Prefix).Snapshot(), fmt.Sprintf("KVRCHUNKS1 %s %d %d", id, pieces, len(data)), 0).Err(); err != nil {
		b.Fatal(err)
	}
}

// Environment of TestColdStartChild, the replica a proc=fresh cold start runs.
const (
	coldStartAddrs  = "KVROUTER_COLDSTART_ADDRS"  // comma-separated Redis addresses
	coldStartPrefix = "KVROUTER_COLDSTART_PREFIX" // the sharded log's prefix
)

// TestColdStartChild is the replica of BenchmarkRedisShardsColdStart's proc=fresh: it runs only when
// the benchmark starts it, starts a sharded log on the Redis and prefix it is given, and prints
// "coldstart-ms <ms> <model>=<digest> ..." once the log is ready.
func TestColdStartChild(t *testing.T) {
	addrs, prefix := os.Getenv(coldStartAddrs), os.Getenv(coldStartPrefix)
	if addrs == "" {
		t.Skip("run by BenchmarkRedisShardsColdStart (proc=fresh) only")
	}
	rdb := clientsOf(t, strings.Split(addrs, ","))()
	s := replication.NewShards(redisStore(rdb), replication.ShardsOptions{Poll: time.Hour, Log: replication.Options{Prefix: prefix, Replica: "cold", Logger: quietLogger}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	start := time.Now()
	go func() { _ = s.Run(ctx); close(done) }()
	<-s.Ready()
	took := time.Since(start)
	line := fmt.Sprintf("coldstart-ms %.1f", millis(took))
	for _, sh := range s.Shards() {
		line += fmt.Sprintf(" %s=%x", sh.Model, sh.State.Digest())
	}
	fmt.Println(line)
	cancel()
	<-done
}

// coldStartChild runs TestColdStartChild in a new process and returns its cold start and its
// shards' digests.
func coldStartChild(b *testing.B, addrs []string, prefix string) (time.Duration, map[string]uint64) {
	cmd := exec.Command(os.Args[0], "-test.run", "^TestColdStartChild$", "-test.v")
	cmd.Env = append(os.Environ(), coldStartAddrs+"="+strings.Join(addrs, ","), coldStartPrefix+"="+prefix)
	out, err := cmd.CombinedOutput()
	if err != nil {
		b.Fatalf("the cold-start process: %v\n%s", err, out)
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || f[0] != "coldstart-ms" {
			continue
		}
		ms, err := strconv.ParseFloat(f[1], 64)
		if err != nil {
			b.Fatalf("the cold-start process printed %q", line)
		}
		digests := map[string]uint64{}
		for _, kv := range f[2:] {
			model, hex, _ := strings.Cut(kv, "=")
			d, err := strconv.ParseUint(hex, 16, 64)
			if err != nil {
				b.Fatalf("the cold-start process printed %q", line)
			}
			digests[model] = d
		}
		return time.Duration(ms * float64(time.Millisecond)), digests
	}
	b.Fatalf("the cold-start process printed no cold start:\n%s", out)
	return 0, nil
}

func benchShardsColdStart(b *testing.B, client func() redis.UniversalClient, addrs []string, shards int, proc string) {
	rdb := client()
	ctx := context.Background()
	prefix := fmt.Sprintf("kvr:{coldstart%d}", benchPrefixes.Add(1))
	// A sharded log that never runs: it registers the shards and tells their prefixes.
	registrar := replication.NewShards(redisStore(rdb), replication.ShardsOptions{Log: replication.Options{Prefix: prefix}})
	want := map[string]uint64{}
	blocks := 0
	for i := range shards {
		model := fmt.Sprintf("m%d", i)
		if _, err := registrar.Open(ctx, model); err != nil {
			b.Fatal(err)
		}
		st := kvstate.NewState()
		fillStatesOf(b, model, st)
		seedFillPieced(b, rdb, registrar.Prefix(model), st)
		want[model] = st.Digest()
		blocks += int(st.IndexBlocks())
	}
	runtime.GC()
	var took time.Duration
	if proc == "fresh" {
		for b.Loop() {
			d, got := coldStartChild(b, addrs, prefix)
			took += d
			if !maps.Equal(got, want) {
				b.Fatalf("the new process holds shards %x, want %x", got, want)
			}
		}
		b.ReportMetric(millis(took)/float64(b.N), "coldstart-ms")
		b.ReportMetric(float64(blocks), "blocks")
		return
	}
	for b.Loop() {
		s := replication.NewShards(redisStore(client()), replication.ShardsOptions{Poll: time.Hour,
			Log: replication.Options{Prefix: prefix, Replica: "cold", Logger: quietLogger}})
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
