//go:build chaos

package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
)

// The fault suite (scripts/chaos.sh): each scenario runs real kvrouter processes and a private Redis
// on loopback, under Publish load from workers that behave as real ones must (fleetWorker) and
// query-only Route load, breaks something as an operator would, and checks what the replicas
// converge to. One line per scenario: Route calls made and failed (on replicas that stayed up),
// acked events missing from any replica, the time from the fault to convergence (load goes on for
// a while after the fault), and whether the digests agree.

// chaosResult is one scenario's line of the report.
type chaosResult struct {
	name           string
	routes, failed int64
	ackedLost      int64
	// bookingsLeft is the most bookings any replica holds once every request the booking load
	// made was freed (-1: the scenario books nothing).
	bookingsLeft int64
	// lostBookings counts the Free calls answered NOT_FOUND for a request the load booked
	// (freeCheck); the notes column shows them.
	lostBookings int
	converged    time.Duration
	digestsEqual bool
	notes        string
	err          error
}

var (
	chaosMu      sync.Mutex
	chaosResults []chaosResult
)

func record(r chaosResult) {
	chaosMu.Lock()
	defer chaosMu.Unlock()
	chaosResults = append(chaosResults, r)
}

func chaosReport() string {
	chaosMu.Lock()
	defer chaosMu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "%-46s %8s %7s %11s %13s %10s %8s  %s\n", "scenario", "routes", "failed", "acked lost", "bookings left", "converged", "digests", "notes")
	for _, r := range chaosResults {
		conv, dig, left := r.converged.Round(10*time.Millisecond).String(), "equal", "-"
		if r.err != nil {
			conv, dig = "NO", "-"
		} else if !r.digestsEqual {
			dig = "DIFFER"
		}
		if r.bookingsLeft >= 0 {
			left = fmt.Sprint(r.bookingsLeft)
		}
		notes := r.notes
		if r.lostBookings > 0 {
			notes += fmt.Sprintf("; %d Free NOT_FOUND for a booked request", r.lostBookings)
		}
		fmt.Fprintf(&b, "%-46s %8d %7d %11d %13s %10s %8s  %s\n", r.name, r.routes, r.failed, r.ackedLost, left, conv, dig, notes)
	}
	return b.String()
}

// TestChaos runs every scenario in turn and writes the report to $KVROUTER_CHAOS_REPORT (and the
// test log). A scenario fails on a failed Route call, a lost acked event, replicas that do not
// converge, or a scenario-specific check.
func TestChaos(t *testing.T) {
	t.Cleanup(func() {
		report := chaosReport()
		t.Log("\n" + report)
		if path := os.Getenv("KVROUTER_CHAOS_REPORT"); path != "" {
			_ = os.WriteFile(path, []byte(report), 0o644)
		}
	})
	bin := buildBinary(t)
	// Every scenario runs on both layouts of the shared log: one log, and a log per model with the
	// fleet's workers spread over two models.
	for _, layout := range []struct {
		name, prefix string
		flags        []string
		models       int
	}{
		{"one_log", "", nil, 1},
		{"sharded_by_model", "sharded: ", []string{"--redis-shard-by-model"}, 2},
	} {
		t.Run(layout.name, func(t *testing.T) {
			chaosFlags = append(append([]string(nil), chaosBaseFlags...), layout.flags...)
			fleetModels = layout.models
			defer func() { chaosFlags, fleetModels = chaosBaseFlags, 1 }()
			runChaosScenarios(t, bin, layout.prefix)
		})
	}
}

// runChaosScenarios runs every scenario in turn, on replicas started with chaosFlags; prefix starts
// their names in the report.
func runChaosScenarios(t *testing.T, bin, prefix string) {
	for _, sc := range []struct {
		name string
		run  func(t *testing.T, bin string) chaosResult
	}{
		{"replica killed (kill -9)", chaosKillReplica(false)},
		{"Redis paused 10 s", chaosRedisPaused},
		{"Redis restarted from AOF", chaosRedisRestart(true)},
		{"Redis restarted empty", chaosRedisRestart(false)},
		{"stream cut, no reconnect", chaosStreamCut},
		{"cluster, replica killed", chaosKillReplica(true)},
		{"two streams, one worker id", chaosDuplicateWorker},
		{"20,000 junk Free calls", chaosJunkFree},
		{"15.6 MB event batch", chaosBigBatch},
		{"replica paused past the grace period", chaosReplicaPaused},
		{"replica cut off from Redis 15 s", chaosReplicaCutOff},
		{"Redis restarted empty, a replica restarts", chaosRedisEmptyReplicaRestarts},
		{"three unfinished 1M-block dumps", chaosDumpsInFlight},
	} {
		t.Run(sc.name, func(t *testing.T) {
			start := time.Now()
			r := sc.run(t, bin)
			r.name = prefix + sc.name
			record(r)
			if r.err != nil {
				t.Errorf("%v", r.err)
			}
			if r.failed > 0 {
				t.Errorf("%d Route calls failed", r.failed)
			}
			if r.ackedLost > 0 {
				t.Errorf("%d acked events missing", r.ackedLost)
			}
			if r.err == nil && !r.digestsEqual {
				t.Error("digests differ")
			}
			if r.bookingsLeft > 0 {
				t.Errorf("%d bookings left after every request was freed", r.bookingsLeft)
			}
			t.Logf("%s: %v", sc.name, time.Since(start).Round(100*time.Millisecond))
		})
	}
}

// chaosBaseFlags are the settings every scenario's replicas run with: a short reseed window, so
// that a new deployment is in steady state (its shared state complete) soon. chaosFlags adds the
// layout's (TestChaos).
var (
	chaosBaseFlags = []string{"--redis-reseed-window", "3s"}
	chaosFlags     = chaosBaseFlags
)

// logLength returns the number of entries in the shared log's streams: the one log's, and every
// shard's of a log sharded by model (the registry under the default prefix names them).
func logLength(ctx context.Context, rdb redis.UniversalClient) int64 {
	n, _ := rdb.XLen(ctx, defaultStream).Result()
	shards, _ := rdb.HGetAll(ctx, "kvr:{default}:shards").Result()
	for _, prefix := range shards {
		m, _ := rdb.XLen(ctx, prefix+":log").Result()
		n += m
	}
	return n
}

// settle pauses the fleet, waits for every event to be acked and every booked request to be freed,
// then for the replicas to converge; it fills the result's load, loss, bookings and convergence
// columns, timed from fault.
func settle(t *testing.T, f *fleet, fault time.Time, addrs ...string) chaosResult {
	f.pause()
	r := chaosResult{bookingsLeft: -1}
	if len(f.bookers) > 0 {
		if pending := f.endBookings(30 * time.Second); pending > 0 {
			r.err = fmt.Errorf("%d Free calls still retried 30 s after the booking load stopped", pending)
		}
	}
	if err := f.waitAllAcked(20 * time.Second); err != nil && r.err == nil {
		r.err = err
	}
	_, states, err := f.waitConverged(20*time.Second, addrs...)
	if r.err == nil {
		r.err = err
	}
	r.converged = time.Since(fault)
	r.routes = f.routes.Load()
	r.failed, _ = f.routeFailures()
	if len(states) == len(addrs) {
		r.ackedLost = f.ackedLost(states)
		r.digestsEqual = true
		for _, s := range states {
			r.digestsEqual = r.digestsEqual && s.state.GetDigest() == states[0].state.GetDigest()
			if len(f.bookers) > 0 {
				r.bookingsLeft = max(r.bookingsLeft, int64(s.state.GetBookings()))
			}
		}
	}
	if n, last := f.routeFailures(); n > 0 {
		t.Logf("last Route failure: %s", last)
	}
	// A Free answered NOT_FOUND for a request the load booked: the booking was lost (documented
	// for bookings made in the moment before Redis lost its data, on a replica other than the one
	// that reseeds), or it is still held and counted in the bookings-left column.
	if n, first := f.wrongFrees(); n > 0 {
		t.Logf("Free answered NOT_FOUND for a booked request:\n%s", strings.Join(first, "\n"))
		r.lostBookings = n
	}
	return r
}

// dumpsAndReconnects summarises the fleet's workers for the notes column.
func dumpsAndReconnects(f *fleet) string {
	var rec, dumps int
	for _, w := range f.workers {
		_, _, r, d, _ := w.status()
		rec, dumps = rec+r, dumps+d
	}
	return fmt.Sprintf("%d reconnects, %d dumps", rec, dumps)
}

// chaosKillReplica: three replicas; one is killed (SIGKILL) under load. Its workers reconnect to the
// others, which converge with every acked event.
func chaosKillReplica(cluster bool) func(t *testing.T, bin string) chaosResult {
	return func(t *testing.T, bin string) chaosResult {
		var flags []string
		if cluster {
			c := redistest.StartCluster(t, 3)
			flags = []string{"--redis-cluster-addrs", strings.Join(c.Addrs, ",")}
		} else {
			flags = []string{"--redis-addr", redistest.Start(t).Addr}
		}
		a := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "a", "--worker-grace-period", "5s")...)
		b := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "b", "--worker-grace-period", "5s")...)
		c := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "c", "--worker-grace-period", "5s")...)
		steady(t, a.addr, b.addr, c.addr)
		f := startFleetOn(t, 6, 20*time.Millisecond, []string{b.addr, a.addr, c.addr}, []string{a.addr, c.addr})
		time.Sleep(1500 * time.Millisecond)
		b.kill()
		fault := time.Now()
		time.Sleep(2 * time.Second)
		r := settle(t, f, fault, a.addr, c.addr)
		r.notes = dumpsAndReconnects(f)
		return r
	}
}

// chaosRedisPaused: Redis frozen (SIGSTOP) for 10 s under load: routing goes on from local state,
// changes wait, and everything converges once it answers again.
func chaosRedisPaused(t *testing.T, bin string) chaosResult {
	srv := redistest.Start(t)
	flags := []string{"--redis-addr", srv.Addr}
	a := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "a")...)
	b := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "b")...)
	steady(t, a.addr, b.addr)
	f := startFleet(t, 4, 20*time.Millisecond, a.addr, b.addr)
	f.bookOn(a.addr, b.addr)
	time.Sleep(time.Second)
	srv.Pause()
	time.Sleep(10 * time.Second)
	srv.Resume()
	fault := time.Now()
	time.Sleep(time.Second)
	r := settle(t, f, fault, a.addr, b.addr)
	r.notes = dumpsAndReconnects(f)
	return r
}

// chaosRedisRestart: Redis killed and restarted, from its append-only file (appendfsync everysec:
// the last second of writes may be gone) or empty; a new replica starts right after. Everything
// acked before and after is held by every replica, the new one included.
func chaosRedisRestart(aof bool) func(t *testing.T, bin string) chaosResult {
	return func(t *testing.T, bin string) chaosResult {
		var srv *redistest.Server
		if aof {
			srv = redistest.Start(t, "--appendonly", "yes", "--appendfsync", "everysec")
		} else {
			srv = redistest.Start(t)
		}
		flags := []string{"--redis-addr", srv.Addr}
		a := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "a")...)
		b := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "b")...)
		steady(t, a.addr, b.addr)
		f := startFleet(t, 4, 20*time.Millisecond, a.addr, b.addr)
		f.bookOn(a.addr, b.addr)
		time.Sleep(1500 * time.Millisecond)
		srv.Restart()
		fault := time.Now()
		c := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "c")...)
		f.routeOn(c.addr)
		time.Sleep(2 * time.Second)
		r := settle(t, f, fault, a.addr, b.addr, c.addr)
		gen := "kept its generation"
		if aof {
			// A killed Redis loses no AOF write (it writes before replying; only an OS crash loses the
			// unsynced second, which TestRewoundLogIsReseeded simulates).
			gen = "kept its generation (AOF)"
		}
		if states, err := readReplica(context.Background(), t, c.addr); err == nil && strings.Contains(states.state.GetLogGeneration(), "/seeded") {
			gen = "reseeded"
		}
		r.notes = gen + ", " + dumpsAndReconnects(f)
		return r
	}
}

// chaosStreamCut: with a 3 s grace period, a worker whose stream lived longer than that is cut and
// never comes back: every replica keeps it for the grace period, then removes it; another worker
// cut at the same time reconnects 1.5 s later and resumes without a dump.
func chaosStreamCut(t *testing.T, bin string) chaosResult {
	const grace = 3 * time.Second
	flags := []string{"--redis-addr", redistest.Start(t).Addr, "--worker-grace-period", grace.String()}
	a := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "a")...)
	b := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "b")...)
	steady(t, a.addr, b.addr)
	f := startFleet(t, 3, 20*time.Millisecond, a.addr, b.addr)
	leaving, returning := newFleetWorker(t, 90, a.addr, b.addr), newFleetWorker(t, 91, b.addr, a.addr)
	lctx, cutLeaving := context.WithCancel(context.Background())
	rctx, cutReturning := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, x := range []struct {
		w   *fleetWorker
		ctx context.Context
	}{{leaving, lctx}, {returning, rctx}} {
		wg.Add(1)
		go func() { defer wg.Done(); x.w.run(x.ctx, 20*time.Millisecond) }()
	}
	time.Sleep(grace + time.Second) // streams longer than the grace period
	cutLeaving()
	cutReturning()
	wg.Wait()
	cut := time.Now()
	var r chaosResult
	time.Sleep(1500 * time.Millisecond)
	for _, addr := range []string{a.addr, b.addr} {
		if listWorkers(t, addr)[90] == nil {
			r.err = fmt.Errorf("worker 90 gone from %s %v after its stream was cut (grace %v)", addr, time.Since(cut), grace)
		}
	}
	f.add(returning)
	removed := time.Duration(0)
	for deadline := cut.Add(grace + 10*time.Second); r.err == nil; time.Sleep(50 * time.Millisecond) {
		if listWorkers(t, a.addr)[90] == nil && listWorkers(t, b.addr)[90] == nil {
			removed = time.Since(cut)
			break
		}
		if time.Now().After(deadline) {
			r.err = fmt.Errorf("worker 90 still registered %v after its stream was cut", time.Since(cut))
		}
	}
	if r.err == nil && removed < grace-200*time.Millisecond {
		r.err = fmt.Errorf("worker 90 removed %v after the cut, before the grace period of %v", removed, grace)
	}
	s := settle(t, f, cut, a.addr, b.addr)
	if r.err == nil {
		r.err = s.err
	}
	s.err = r.err
	_, _, rec, dumps, _ := returning.status()
	if s.err == nil && dumps != 0 {
		s.err = fmt.Errorf("the worker that reconnected within the grace period sent %d dumps, want a plain resume", dumps)
	}
	s.notes = fmt.Sprintf("left: removed %v after the cut; back: %d reconnect, %d dumps", removed.Round(10*time.Millisecond), rec, dumps)
	return s
}

// chaosDuplicateWorker: a second process registers an id already streaming on another replica (with
// fresh_start, as a new process does): the newer takes over, the older is refused for good, and the
// newer's every acked event is held everywhere.
func chaosDuplicateWorker(t *testing.T, bin string) chaosResult {
	flags := []string{"--redis-addr", redistest.Start(t).Addr}
	a := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "a")...)
	b := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "b")...)
	steady(t, a.addr, b.addr)
	f := startFleet(t, 3, 20*time.Millisecond, a.addr, b.addr)
	time.Sleep(time.Second)
	older := f.workers[0]
	newer := newFleetWorker(t, older.id, b.addr, a.addr)
	newer.fresh = true
	f.forget(older)
	f.add(newer)
	fault := time.Now()
	var r chaosResult
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, _, _, _, sup := older.status(); sup != nil {
			if status.Code(sup) != codes.FailedPrecondition || !strings.Contains(sup.Error(), "newer Publish stream") {
				r.err = fmt.Errorf("the older stream ended with %v, want WORKER_SUPERSEDED", sup)
			}
			break
		}
		if time.Now().After(deadline) {
			r.err = fmt.Errorf("the older stream of worker %d was never refused", older.id)
			break
		}
	}
	time.Sleep(time.Second)
	s := settle(t, f, fault, a.addr, b.addr)
	if r.err != nil {
		s.err = r.err
	}
	s.notes = "older stream refused (WORKER_SUPERSEDED), never reconnected"
	return s
}

// chaosJunkFree: 20,000 Free and MarkPrefillComplete calls for request ids nobody booked, 1,000 at a
// time, on both replicas: every one NOT_FOUND, and no entry in the shared stream.
func chaosJunkFree(t *testing.T, bin string) chaosResult {
	srv := redistest.Start(t)
	rdb := srv.Client()
	flags := []string{"--redis-addr", srv.Addr}
	a := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "a")...)
	b := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "b")...)
	steady(t, a.addr, b.addr)
	f := startFleet(t, 2, 20*time.Millisecond, a.addr, b.addr)
	time.Sleep(500 * time.Millisecond)
	ctx := context.Background()
	f.pause()
	if err := f.waitAllAcked(10 * time.Second); err != nil {
		return chaosResult{err: err}
	}
	// A model's log made by the workers' hellos on a new deployment is complete once past its
	// reseed window: until then an unknown request is UNAVAILABLE, not NOT_FOUND.
	steady(t, a.addr, b.addr)
	before := logLength(ctx, rdb)
	routers := []kvrouterv1.RouterServiceClient{kvrouterv1.NewRouterServiceClient(dial(t, a.addr)), kvrouterv1.NewRouterServiceClient(dial(t, b.addr))}
	var wg sync.WaitGroup
	var mu sync.Mutex
	wrong := 0
	start := time.Now()
	for i := range 20_000 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprintf("junk-%d", i)
			var err error
			if i%2 == 0 {
				_, err = routers[i%2].Free(ctx, &kvrouterv1.FreeRequest{RequestId: id})
			} else {
				_, err = routers[i%2].MarkPrefillComplete(ctx, &kvrouterv1.MarkPrefillCompleteRequest{RequestId: id})
			}
			if status.Code(err) != codes.NotFound {
				mu.Lock()
				wrong++
				mu.Unlock()
			}
		}()
		if i%1000 == 999 {
			wg.Wait()
		}
	}
	wg.Wait()
	took := time.Since(start)
	after := logLength(ctx, rdb)
	s := settle(t, f, time.Now(), a.addr, b.addr)
	if wrong > 0 && s.err == nil {
		s.err = fmt.Errorf("%d of 20,000 junk calls did not answer NOT_FOUND", wrong)
	}
	if after != before && s.err == nil {
		s.err = fmt.Errorf("the stream grew from %d to %d entries", before, after)
	}
	s.notes = fmt.Sprintf("all NOT_FOUND in %v; stream %d -> %d entries", took.Round(100*time.Millisecond), before, after)
	return s
}

// chaosBigBatch: a 15.6 MB event batch (just under the 16 MiB message limit) is refused with
// RESOURCE_EXHAUSTED before it is decoded; the replica's peak memory barely moves.
func chaosBigBatch(t *testing.T, bin string) chaosResult {
	flags := []string{"--redis-addr", redistest.Start(t).Addr}
	a := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "a")...)
	b := startProcess(t, bin, append(append(flags, chaosFlags...), "--replica-id", "b")...)
	steady(t, a.addr, b.addr)
	f := startFleet(t, 2, 20*time.Millisecond, a.addr, b.addr)
	time.Sleep(500 * time.Millisecond)
	before := peakRSS(t, a.cmd.Process.Pid)
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	stream, err := kvrouterv1.NewWorkerServiceClient(dial(t, a.addr)).Publish(ctx)
	if err != nil {
		return chaosResult{err: err}
	}
	st := &kvrouterv1.BlocksStored{}
	for i := range 278_000 { // 15.6 MB
		toks := make([]uint32, 16)
		for k := range toks {
			toks[k] = uint32(100_000 + (i*16+k)%1_000_000)
		}
		st.Blocks = append(st.Blocks, &kvrouterv1.StoredBlock{BlockHash: uint64(i), TokenIds: toks})
	}
	batch := &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{{
		StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}}}}}
	_ = stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
		Endpoint: "10.0.0.1:8000",
		WorkerId: 77, Model: "big", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 16, KvEventsEnabled: true}}})
	_ = stream.Send(batch)
	var code codes.Code
	for {
		if _, err := stream.Recv(); err != nil {
			code = status.Code(err)
			break
		}
	}
	grew := peakRSS(t, a.cmd.Process.Pid) - before
	fault := time.Now()
	time.Sleep(500 * time.Millisecond)
	s := settle(t, f, fault, a.addr, b.addr)
	if code != codes.ResourceExhausted && s.err == nil {
		s.err = fmt.Errorf("the 15.6 MB batch ended its stream with %v, want RESOURCE_EXHAUSTED", code)
	}
	s.notes = fmt.Sprintf("%.1f MB refused with %v; peak RSS +%.1f MiB", float64(proto.Size(batch))/1e6, code, float64(grew)/(1<<20))
	return s
}
