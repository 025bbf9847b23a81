package replication_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
)

// traceKey carries a test traceparent in a context.
type traceKey struct{}

// TestConcurrentAppendsJoin: worker changes appended while the previous append is in flight are
// joined into one stream entry; each appender still gets its own change's result, every replica
// applies every change, and the traceparents of the joined changes all reach the apply hook.
func TestConcurrentAppendsJoin(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client()
	var (
		applyMu sync.Mutex
		applied []string // traceparent lists seen by replica 1's apply hook
	)
	rs := startReplicas(t, rdb, 2)
	rs[0].log.Observe(kvstate.Observers{TraceParent: func(ctx context.Context) string {
		tp, _ := ctx.Value(traceKey{}).(string)
		return tp
	}})
	rs[1].log.Observe(kvstate.Observers{ApplyTraced: func(traceParents, _ string) func() {
		applyMu.Lock()
		applied = append(applied, traceParents)
		applyMu.Unlock()
		return func() {}
	}})
	ctx, cancel := context.WithTimeout(context.Background(), redisTestTimeout)
	defer cancel()

	const workers = 24
	keys := make([]kvstate.WorkerKey, workers)
	for w := range keys {
		keys[w] = kvstate.WorkerKey{ID: uint64(100 + w)}
		inf := info
		inf.Key = keys[w]
		if _, err := rs[0].log.Append(ctx, kvstate.WorkerUp{Info: inf}); err != nil {
			t.Fatalf("WorkerUp(%v) = %v", keys[w], err)
		}
	}
	stream := keysOf(fmt.Sprintf("kvr:{%s}", t.Name())).Stream()
	before, err := rdb.XLen(ctx, stream).Result()
	if err != nil {
		t.Fatal(err)
	}

	// Writes paused: the first append waits in Redis while the others queue behind it, so the
	// next append joins them.
	if err := rdb.Do(ctx, "CLIENT", "PAUSE", 300, "WRITE").Err(); err != nil {
		t.Fatalf("CLIENT PAUSE = %v", err)
	}
	type result struct {
		res kvstate.Result
		err error
	}
	results := make([]result, workers)
	var wg sync.WaitGroup
	for w, key := range keys {
		wg.Go(func() {
			// Worker w sends events 0 to w: its result is its own.
			c := kvstate.KVEvents{Worker: key}
			for id := range w + 1 {
				c.Events = append(c.Events, kvstate.Event{ID: uint64(id), Kind: kvstate.EventStored, Tier: kvstate.TierDevice,
					Blocks: []kvstate.Block{{Hash: uint64(1000*w + id + 1), Local: uint64(id)}}})
			}
			res, err := rs[0].log.Append(context.WithValue(ctx, traceKey{}, fmt.Sprintf("tp-%d", w)), c)
			results[w] = result{res, err}
		})
	}
	wg.Wait()
	for w, r := range results {
		want := result{res: kvstate.Result{Applied: w + 1, HasLastEvent: true, LastEventID: uint64(w)}}
		if diff := cmp.Diff(want, r, cmp.AllowUnexported(result{}), cmp.Comparer(func(a, b error) bool { return a == b })); diff != "" {
			t.Errorf("worker %d: Append result mismatch (-want +got):\n%s", w, diff)
		}
	}
	after, err := rdb.XLen(ctx, stream).Result()
	if err != nil {
		t.Fatal(err)
	}
	if entries := after - before; entries >= workers {
		t.Errorf("%d concurrent appends made %d stream entries, want them joined into fewer", workers, entries)
	}
	eventually(t, "both replicas apply every change", func() bool {
		return rs[0].state.Digest() == rs[1].state.Digest() && rs[1].state.Worker(keys[workers-1]).Status().HasLastEvent
	})
	for w, key := range keys {
		if got := rs[1].state.Worker(key).Status().LastEventID; got != uint64(w) {
			t.Errorf("replica 1: worker %v last event %d, want %d", key, got, w)
		}
	}
	var traces []string
	eventually(t, "every traceparent reaches replica 1's apply hook", func() bool {
		applyMu.Lock()
		defer applyMu.Unlock()
		traces = traces[:0]
		for _, list := range applied {
			traces = append(traces, strings.Split(list, ",")...)
		}
		return len(traces) >= workers
	})
	var want []string
	for w := range workers {
		want = append(want, fmt.Sprintf("tp-%d", w))
	}
	slices.Sort(want)
	slices.Sort(traces)
	if diff := cmp.Diff(want, traces); diff != "" {
		t.Errorf("traceparents applied (-want +got):\n%s", diff)
	}
}
