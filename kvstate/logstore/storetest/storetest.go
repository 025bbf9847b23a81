// Package storetest is the conformance suite of the shared log's stores (kvstate/logstore): what
// the replication engine relies on a store to do, checked the same way on every store. A store's
// own test calls Run with a function that returns the store under test; kvstate/logstore/memstore
// runs it in memory, kvstate/logstore/redisstore on one Redis server and on a 3-master cluster.
//
// Each case works under a prefix of its own ("kvr:{<test name>}"), so one store may serve them all.
// Cases that wait for time to pass (a lease running out) wait for the effect, up to a bound far
// longer than the time they wait for.
package storetest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

// timeout bounds every case, and every wait inside one.
const timeout = 20 * time.Second

// Run runs every case of the suite against the store newStore returns.
func Run(t *testing.T, newStore func(t *testing.T) logstore.Store) {
	cases := []struct {
		name string
		run  func(t *testing.T, ctx context.Context, s logstore.Store, prefix string)
	}{
		{"Fencing", fencing},
		{"NumberingAndReading", numberingAndReading},
		{"ReadBlocksUntilAppend", readBlocksUntilAppend},
		{"Reseed", reseed},
		{"ReseedRewound", reseedRewound},
		{"SnapshotAndTrim", snapshotAndTrim},
		{"LargeSnapshot", largeSnapshot},
		{"Leases", leases},
		{"Watermarks", watermarks},
		{"BookingIndex", bookingIndex},
		{"WorkerLeases", workerLeases},
		{"Registry", registry},
		{"Clock", clock},
		{"LogsAreApart", logsAreApart},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			defer cancel()
			c.run(t, ctx, newStore(t), "kvr:{"+strings.ReplaceAll(t.Name(), "/", ".")+"}")
		})
	}
}

// bootstrap makes the log's generation.
func bootstrap(t *testing.T, ctx context.Context, l logstore.LogStore) string {
	t.Helper()
	g, err := l.Bootstrap(ctx, "gen1")
	if err != nil {
		t.Fatalf("Bootstrap = %v", err)
	}
	return g
}

// appendOne appends one entry holding data, failing the test on an error.
func appendOne(t *testing.T, ctx context.Context, l logstore.LogStore, gen, data string, index ...logstore.IndexOp) {
	t.Helper()
	if err := l.Append(ctx, gen, []logstore.Entry{{Data: []byte(data), Replica: "r", Seqs: "1", Index: index}})[0]; err != nil {
		t.Fatalf("Append(%q) = %v", data, err)
	}
}

// readAll reads every entry after after, without blocking.
func readAll(t *testing.T, ctx context.Context, l logstore.LogStore, after string) []logstore.Record {
	t.Helper()
	var out []logstore.Record
	for {
		recs, err := l.Read(ctx, after, 100, -1)
		if err != nil {
			t.Fatalf("Read(%s) = %v", after, err)
		}
		if len(recs) == 0 {
			return out
		}
		out = append(out, recs...)
		after = recs[len(recs)-1].ID
	}
}

func datas(recs []logstore.Record) []string {
	out := make([]string, len(recs))
	for i, r := range recs {
		out[i] = string(r.Data)
	}
	return out
}

// fencing: nothing is appended without the log's generation, and an append in another generation
// fails with ErrFenced and appends nothing.
func fencing(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	l := s.Log(prefix)
	if err := l.Append(ctx, "", []logstore.Entry{{Data: []byte("x")}})[0]; !errors.Is(err, logstore.ErrFenced) {
		t.Fatalf("Append before any generation = %v, want ErrFenced", err)
	}
	g := bootstrap(t, ctx, l)
	if !strings.HasPrefix(g, "gen1/fresh/") {
		t.Fatalf("Bootstrap on an empty log = %q, want gen1/fresh/<ms>", g)
	}
	if again, err := l.Bootstrap(ctx, "gen2"); err != nil || again != g {
		t.Fatalf("Bootstrap again = %q, %v; want the existing %q", again, err, g)
	}
	errs := l.Append(ctx, "other", []logstore.Entry{{Data: []byte("a")}, {Data: []byte("b")}})
	for i, err := range errs {
		if !errors.Is(err, logstore.ErrFenced) {
			t.Fatalf("Append in another generation: entry %d = %v, want ErrFenced", i, err)
		}
	}
	appendOne(t, ctx, l, g, "ok")
	if got := datas(readAll(t, ctx, l, "0-0")); !slices.Equal(got, []string{"ok"}) {
		t.Fatalf("log holds %q, want only the entry of its generation", got)
	}
}

// numberingAndReading: entries come back in order, at increasing positions, numbered 1, 2, ...
// in their generation, with every field as appended; Read honours after and count; Head agrees.
func numberingAndReading(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	l := s.Log(prefix)
	g := bootstrap(t, ctx, l)
	var entries []logstore.Entry
	for i := range 5 {
		entries = append(entries, logstore.Entry{Data: []byte{byte(i), 0, 255}, Replica: "rep", Seqs: fmt.Sprintf("%d,%d", 2*i, 2*i+1), TraceParents: fmt.Sprint("tp", i)})
	}
	for i, err := range l.Append(ctx, g, entries) {
		if err != nil {
			t.Fatalf("Append: entry %d = %v", i, err)
		}
	}
	recs := readAll(t, ctx, l, "0-0")
	if len(recs) != 5 {
		t.Fatalf("read %d entries, want 5", len(recs))
	}
	for i, r := range recs {
		want := logstore.Record{ID: r.ID, Generation: g, HasGeneration: true, Number: uint64(i + 1), HasNumber: true,
			Data: entries[i].Data, Replica: "rep", Seqs: entries[i].Seqs, TraceParent: entries[i].TraceParents}
		if diff := cmp.Diff(want, r); diff != "" {
			t.Errorf("entry %d (-want +got):\n%s", i, diff)
		}
		if i > 0 && logstore.ComparePositions(recs[i-1].ID, r.ID) >= 0 {
			t.Errorf("positions %s then %s: not increasing", recs[i-1].ID, r.ID)
		}
	}
	two, err := l.Read(ctx, recs[1].ID, 2, -1)
	if err != nil || len(two) != 2 || two[0].ID != recs[2].ID || two[1].ID != recs[3].ID {
		t.Fatalf("Read(after the 2nd, count 2) = %d entries, %v; want the 3rd and 4th", len(two), err)
	}
	if rest, err := l.Read(ctx, recs[4].ID, 10, -1); err != nil || len(rest) != 0 {
		t.Fatalf("Read(after the last) = %d entries, %v; want none", len(rest), err)
	}
	h, err := l.Head(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := logstore.Head{Generation: g, Count: 5, Length: 5, First: recs[0].ID, Last: recs[4].ID}
	if diff := cmp.Diff(want, h); diff != "" {
		t.Errorf("Head (-want +got):\n%s", diff)
	}
	empty, err := s.Log(prefix + "-empty").Head(ctx)
	if err != nil || empty != (logstore.Head{Last: "0-0"}) {
		t.Errorf("Head of an empty log = %+v, %v; want no generation, first \"\", last 0-0", empty, err)
	}
}

// readBlocksUntilAppend: a blocking Read returns the entry appended while it waits, and one with
// nothing to read returns empty once its block ran out.
func readBlocksUntilAppend(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	l := s.Log(prefix)
	g := bootstrap(t, ctx, l)
	if recs, err := l.Read(ctx, "0-0", 10, 50*time.Millisecond); err != nil || len(recs) != 0 {
		t.Fatalf("Read on an empty log = %d entries, %v; want none after the block", len(recs), err)
	}
	got := make(chan []logstore.Record, 1)
	go func() {
		recs, _ := l.Read(ctx, "0-0", 10, timeout)
		got <- recs
	}()
	// The reader may start before or after the append: either way it returns the entry.
	appendOne(t, ctx, l, g, "late")
	select {
	case recs := <-got:
		if d := datas(recs); !slices.Equal(d, []string{"late"}) {
			t.Fatalf("blocking Read = %q, want [late]", d)
		}
	case <-ctx.Done():
		t.Fatal("a blocking Read did not return the entry appended meanwhile")
	}
}

// reseed: a missing generation is reseeded; a fresh one within the window too, not outside it; a
// seeded one never; a reseed empties the log and its counter and sets the snapshot and bookings.
func reseed(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	l := s.Log(prefix)
	r := logstore.Reseed{New: "s1/seeded/1", Snapshot: []byte("snap-1"), Window: time.Hour, Bookings: map[string]int64{"req-1": 7}}
	if ok, err := l.Reseed(ctx, logstore.Reseed{Expected: "nope", New: "x/seeded/1", Window: time.Hour}); err != nil || ok {
		t.Fatalf("Reseed expecting a generation on a log without one = %v, %v; want false", ok, err)
	}
	if ok, err := l.Reseed(ctx, r); err != nil || !ok {
		t.Fatalf("Reseed of a missing generation = %v, %v; want true", ok, err)
	}
	checkReseeded(t, ctx, l, "s1/seeded/1", "snap-1", "req-1")
	appendOne(t, ctx, l, "s1/seeded/1", "after")
	if ok, err := l.Reseed(ctx, logstore.Reseed{Expected: "s1/seeded/1", New: "s2/seeded/2", Window: time.Hour}); err != nil || ok {
		t.Fatalf("Reseed of a seeded generation = %v, %v; want false", ok, err)
	}

	fresh := s.Log(prefix + "-fresh")
	g := bootstrap(t, ctx, fresh)
	appendOne(t, ctx, fresh, g, "lost")
	if ok, err := fresh.Reseed(ctx, logstore.Reseed{Expected: g, New: "s3/seeded/3", Window: -time.Hour}); err != nil || ok {
		t.Fatalf("Reseed of a fresh generation outside the window = %v, %v; want false", ok, err)
	}
	if ok, err := fresh.Reseed(ctx, logstore.Reseed{Expected: "another", New: "s3/seeded/3", Window: time.Hour}); err != nil || ok {
		t.Fatalf("Reseed expecting another generation = %v, %v; want false", ok, err)
	}
	if ok, err := fresh.Reseed(ctx, logstore.Reseed{Expected: g, New: "s3/seeded/3", Snapshot: []byte("snap-3"), Window: time.Hour}); err != nil || !ok {
		t.Fatalf("Reseed of a fresh generation within the window = %v, %v; want true", ok, err)
	}
	checkReseeded(t, ctx, fresh, "s3/seeded/3", "snap-3", "")
}

// checkReseeded checks that l was reseeded as generation g with snapshot snap, an empty log, and
// booking (if not "") in its booking index.
func checkReseeded(t *testing.T, ctx context.Context, l logstore.LogStore, g, snap, booking string) {
	t.Helper()
	h, err := l.Head(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(logstore.Head{Generation: g, Last: "0-0"}, h); diff != "" {
		t.Errorf("Head after the reseed (-want +got):\n%s", diff)
	}
	data, err := l.ReadSnapshot(ctx)
	if err != nil || string(data) != snap {
		t.Errorf("ReadSnapshot after the reseed = %q, %v; want %q", data, err, snap)
	}
	if pos, err := l.SnapshotPosition(ctx); err != nil || pos != "0-0" {
		t.Errorf("SnapshotPosition after the reseed = %q, %v; want 0-0", pos, err)
	}
	if booking != "" {
		if m, err := l.ReadMarks(ctx, booking); err != nil || !m.Indexed {
			t.Errorf("booking %s indexed after the reseed = %v, %v; want true", booking, m.Indexed, err)
		}
	}
}

// reseedRewound: a log whose counter is below what a replica applied (it rewound) is reseeded by
// that replica in its own generation; one that is not behind is left alone.
func reseedRewound(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	l := s.Log(prefix)
	g := bootstrap(t, ctx, l)
	for i := range 3 {
		appendOne(t, ctx, l, g, fmt.Sprint(i))
	}
	if ok, err := l.Reseed(ctx, logstore.Reseed{Expected: g, New: "r/seeded/1", Window: time.Hour, RewoundBehind: 3}); err != nil || ok {
		t.Fatalf("Reseed of a log holding entry 3, rewound behind 3 = %v, %v; want false", ok, err)
	}
	if ok, err := l.Reseed(ctx, logstore.Reseed{Expected: "other", New: "r/seeded/1", Window: time.Hour, RewoundBehind: 9}); err != nil || ok {
		t.Fatalf("Reseed of another generation, rewound = %v, %v; want false", ok, err)
	}
	if ok, err := l.Reseed(ctx, logstore.Reseed{Expected: g, New: "r/seeded/1", Snapshot: []byte("s"), Window: time.Hour, RewoundBehind: 4}); err != nil || !ok {
		t.Fatalf("Reseed of a log holding 3 entries, rewound behind 4 = %v, %v; want true", ok, err)
	}
	checkReseeded(t, ctx, l, "r/seeded/1", "s", "")
}

// snapshotAndTrim: a snapshot commits only in its generation, and trims the log behind the
// position it is told while keeping every entry from it on.
func snapshotAndTrim(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	l := s.Log(prefix)
	if data, err := l.ReadSnapshot(ctx); err != nil || data != nil {
		t.Fatalf("ReadSnapshot of a new log = %q, %v; want nil", data, err)
	}
	if pos, err := l.SnapshotPosition(ctx); err != nil || pos != "" {
		t.Fatalf("SnapshotPosition of a new log = %q, %v; want \"\"", pos, err)
	}
	g := bootstrap(t, ctx, l)
	for i := range 6 {
		appendOne(t, ctx, l, g, fmt.Sprint(i))
	}
	recs := readAll(t, ctx, l, "0-0")
	err := l.WriteSnapshot(ctx, logstore.Snapshot{Generation: "other", Data: []byte("no"), Position: recs[1].ID})
	if !errors.Is(err, logstore.ErrFenced) {
		t.Fatalf("WriteSnapshot in another generation = %v, want ErrFenced", err)
	}
	if data, _ := l.ReadSnapshot(ctx); data != nil {
		t.Fatalf("a fenced snapshot was stored: %q", data)
	}
	if err := l.WriteSnapshot(ctx, logstore.Snapshot{Generation: g, Data: []byte("first"), Position: recs[1].ID}); err != nil {
		t.Fatalf("WriteSnapshot = %v", err)
	}
	if got := len(readAll(t, ctx, l, "0-0")); got != 6 {
		t.Fatalf("a snapshot without TrimBefore trimmed the log to %d entries", got)
	}
	if err := l.WriteSnapshot(ctx, logstore.Snapshot{Generation: g, Data: []byte("second"), Position: recs[4].ID, TrimBefore: recs[2].ID}); err != nil {
		t.Fatalf("WriteSnapshot = %v", err)
	}
	if data, err := l.ReadSnapshot(ctx); err != nil || string(data) != "second" {
		t.Fatalf("ReadSnapshot = %q, %v; want the latest", data, err)
	}
	if pos, err := l.SnapshotPosition(ctx); err != nil || pos != recs[4].ID {
		t.Fatalf("SnapshotPosition = %q, %v; want %s", pos, err, recs[4].ID)
	}
	if got := datas(readAll(t, ctx, l, "0-0")); !slices.Equal(got, []string{"2", "3", "4", "5"}) {
		t.Fatalf("after trimming behind the 3rd entry the log holds %q, want [2 3 4 5]", got)
	}
	if h, _ := l.Head(ctx); h.First != recs[2].ID || h.Length != 4 || h.Count != 6 {
		t.Fatalf("Head after the trim = %+v; want first %s, length 4, count 6", h, recs[2].ID)
	}
}

// largeSnapshot: a snapshot of several MiB (more than one piece, on a store that writes pieces)
// reads back byte for byte, and a newer one replaces it.
func largeSnapshot(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	l := s.Log(prefix)
	g := bootstrap(t, ctx, l)
	data := make([]byte, 3<<20+123)
	for i := range data {
		data[i] = byte(i * 7)
	}
	for round := range 2 {
		data[0] = byte(round)
		if err := l.WriteSnapshot(ctx, logstore.Snapshot{Generation: g, Data: data, Position: fmt.Sprintf("%d-0", round+1)}); err != nil {
			t.Fatalf("WriteSnapshot(%d bytes) = %v", len(data), err)
		}
		got, err := l.ReadSnapshot(ctx)
		if err != nil || !slices.Equal(got, data) {
			t.Fatalf("ReadSnapshot = %d bytes (equal %v), %v; want the %d written", len(got), slices.Equal(got, data), err, len(data))
		}
	}
}

// leases: one holder at a time; the holder extends; a released or run-out lease goes to another.
func leases(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	l := s.Log(prefix)
	take := func(holder string, ttl time.Duration) bool {
		t.Helper()
		ok, err := l.TakeLease(ctx, "snapshot-lease", holder, ttl)
		if err != nil {
			t.Fatalf("TakeLease(%s) = %v", holder, err)
		}
		return ok
	}
	if !take("a", time.Minute) || take("b", time.Minute) || !take("a", time.Minute) {
		t.Fatal("a takes the lease, b does not while a holds it, a extends it: not so")
	}
	if ok, _ := l.TakeLease(ctx, "reseed-lease", "b", time.Minute); !ok {
		t.Fatal("another lease of the log is held by a's")
	}
	if err := l.ReleaseLease(ctx, "snapshot-lease"); err != nil {
		t.Fatal(err)
	}
	if !take("b", 50*time.Millisecond) {
		t.Fatal("b cannot take a released lease")
	}
	deadline := time.Now().Add(timeout)
	for !take("c", time.Minute) {
		if time.Now().After(deadline) {
			t.Fatalf("a lease of 50 ms still held by b after %v", timeout)
		}
		time.Sleep(10 * time.Millisecond) // real time is the point: the lease runs out on the store's clock
	}
}

// watermarks: announce, set, read back with the tip and the store's clock, delete.
func watermarks(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	l := s.Log(prefix)
	before := time.Now().Add(-time.Minute).UnixMicro()
	now, err := l.WriteMark(ctx, "a", "new")
	if err != nil || now < before {
		t.Fatalf("WriteMark(new) = %d, %v; want the store's time in microseconds", now, err)
	}
	if _, err := l.WriteMark(ctx, "b", "12345"); err != nil {
		t.Fatal(err)
	}
	if _, err := l.WriteMark(ctx, "b", ""); err != nil { // unchanged
		t.Fatal(err)
	}
	if err := l.SetMark(ctx, "c", "gone 5"); err != nil {
		t.Fatal(err)
	}
	g := bootstrap(t, ctx, l)
	appendOne(t, ctx, l, g, "x")
	tip := readAll(t, ctx, l, "0-0")[0].ID
	m, err := l.ReadMarks(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	want := logstore.Marks{Now: m.Now, Tip: tip, Marks: map[string]string{"a": fmt.Sprint("new ", now), "b": "12345", "c": "gone 5"}}
	if diff := cmp.Diff(want, m); diff != "" {
		t.Errorf("ReadMarks (-want +got):\n%s", diff)
	}
	if m.Now < now {
		t.Errorf("ReadMarks' clock %d is before the WriteMark's %d", m.Now, now)
	}
	if err := l.DeleteMark(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if m, _ := l.ReadMarks(ctx, ""); len(m.Marks) != 2 || m.Marks["b"] != "" {
		t.Errorf("after DeleteMark(b) the marks are %v", m.Marks)
	}
	if m, _ := s.Log(prefix+"-empty").ReadMarks(ctx, ""); m.Tip != "0-0" || len(m.Marks) != 0 {
		t.Errorf("ReadMarks of an empty log = %+v; want tip 0-0, no marks", m)
	}
}

// bookingIndex: the index changes with the entries that carry its operations, and only with
// entries that were appended.
func bookingIndex(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	l := s.Log(prefix)
	g := bootstrap(t, ctx, l)
	indexed := func(id string) bool {
		t.Helper()
		m, err := l.ReadMarks(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return m.Indexed
	}
	appendOne(t, ctx, l, g, "book", logstore.IndexOp{Op: logstore.OpBook, ID: "old", Score: 100},
		logstore.IndexOp{Op: logstore.OpBook, ID: "new", Score: 300}, logstore.IndexOp{Op: logstore.OpBook, ID: "gone", Score: 200})
	l.Append(ctx, "fenced", []logstore.Entry{{Data: []byte("x"), Index: []logstore.IndexOp{{Op: logstore.OpBook, ID: "fenced", Score: 1}}}})
	if !indexed("old") || !indexed("new") || !indexed("gone") || indexed("fenced") || indexed("never") {
		t.Fatal("after booking old, new and gone (and a fenced booking): not exactly those are indexed")
	}
	appendOne(t, ctx, l, g, "free", logstore.IndexOp{Op: logstore.OpFree, ID: "gone"})
	appendOne(t, ctx, l, g, "expire", logstore.IndexOp{Op: logstore.OpExpire, Score: 300})
	if indexed("old") || indexed("gone") || !indexed("new") {
		t.Fatal("after freeing gone and expiring those below 300 the index does not hold exactly new")
	}
}

// workerLeases: refreshes set deadlines (onlyNew keeps existing ones); expired leases are claimed
// once, whoever claims; a lease is found by its member's prefix.
func workerLeases(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	l := s.Log(prefix)
	if err := l.RefreshLeases(ctx, []string{"1/0/1", "1/1/1", "2/0/3"}, 1000, false); err != nil {
		t.Fatal(err)
	}
	if err := l.RefreshLeases(ctx, []string{"2/0/3", "3/0/1"}, 5000, true); err != nil {
		t.Fatal(err)
	}
	if err := l.RefreshLeases(ctx, []string{"1/1/1"}, 9000, false); err != nil {
		t.Fatal(err)
	}
	// Deadlines now: 1/0/1 1000, 1/1/1 9000, 2/0/3 1000 (kept by onlyNew), 3/0/1 5000.
	var mu sync.Mutex
	var claimed []string
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			got, err := l.ClaimExpired(ctx, 5001, 100)
			if err != nil {
				t.Error(err)
			}
			mu.Lock()
			claimed = append(claimed, got...)
			mu.Unlock()
		})
	}
	wg.Wait()
	slices.Sort(claimed)
	if want := []string{"1/0/1", "2/0/3", "3/0/1"}; !slices.Equal(claimed, want) {
		t.Fatalf("four claimers of the leases expired before 5001 claimed %q together, want each of %q once", claimed, want)
	}
	if got, err := l.ClaimExpired(ctx, 5001, 100); err != nil || len(got) != 0 {
		t.Fatalf("claiming again = %q, %v; want none", got, err)
	}
	for _, c := range []struct {
		prefix string
		want   bool
	}{{"1/1/", true}, {"1/0/", false}, {"3/", false}, {"1/", true}} {
		if got, err := l.HasLease(ctx, c.prefix); err != nil || got != c.want {
			t.Errorf("HasLease(%q) = %v, %v; want %v", c.prefix, got, err, c.want)
		}
	}
	if err := l.RefreshLeases(ctx, nil, 1, false); err != nil {
		t.Errorf("RefreshLeases of none = %v", err)
	}
	if got, err := l.ClaimExpired(ctx, 10000, 1); err != nil || len(got) != 1 {
		t.Errorf("ClaimExpired(max 1) = %q, %v; want one", got, err)
	}
}

// registry: the first register of a model wins; shards are placed apart from one another and
// from the deployment's own log; the lineage is made once.
func registry(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	d := s.Deployment(prefix)
	if _, ok, err := d.Shard(ctx, "m"); err != nil || ok {
		t.Fatalf("Shard of an unregistered model = %v, %v", ok, err)
	}
	pm, err := d.PlaceShard(ctx, "m")
	if err != nil {
		t.Fatal(err)
	}
	pn, err := d.PlaceShard(ctx, "n/with space")
	if err != nil {
		t.Fatal(err)
	}
	if pm == pn || pm == prefix || pn == prefix {
		t.Fatalf("PlaceShard placed m at %q and n at %q under %q: not apart", pm, pn, prefix)
	}
	if got, created, err := d.Register(ctx, "m", pm); err != nil || !created || got != pm {
		t.Fatalf("first Register(m) = %q, %v, %v", got, created, err)
	}
	if got, created, err := d.Register(ctx, "m", "elsewhere"); err != nil || created || got != pm {
		t.Fatalf("second Register(m) = %q, %v, %v; want the first's %q", got, created, err, pm)
	}
	if _, _, err := d.Register(ctx, "n/with space", pn); err != nil {
		t.Fatal(err)
	}
	all, err := d.Shards(ctx)
	if diff := cmp.Diff(map[string]string{"m": pm, "n/with space": pn}, all); err != nil || diff != "" {
		t.Fatalf("Shards (-want +got), %v:\n%s", err, diff)
	}
	if got, ok, err := d.Shard(ctx, "m"); err != nil || !ok || got != pm {
		t.Fatalf("Shard(m) = %q, %v, %v", got, ok, err)
	}
	lin, now, err := d.Lineage(ctx, "lin1")
	if err != nil || !strings.HasPrefix(lin, "lin1/") || now <= 0 {
		t.Fatalf("Lineage = %q, %d, %v; want lin1/<ms>", lin, now, err)
	}
	if again, _, err := d.Lineage(ctx, "lin2"); err != nil || again != lin {
		t.Fatalf("Lineage again = %q, %v; want %q", again, err, lin)
	}
	if other, _ := s.Deployment(prefix + "-other").Shards(ctx); len(other) != 0 {
		t.Fatalf("another deployment's registry holds %v", other)
	}
}

// clock: the store's clock is this machine's within a minute (tests run on one machine), and
// WriteMark and Now read the same clock.
func clock(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	l := s.Log(prefix)
	now, err := l.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(now); d > time.Minute || d < -time.Minute {
		t.Fatalf("the store's clock is %v off this machine's", d)
	}
	us, err := l.WriteMark(ctx, "a", "")
	if err != nil || us < now.UnixMicro() {
		t.Fatalf("WriteMark's clock %d is before Now's %d (%v)", us, now.UnixMicro(), err)
	}
	if err := s.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	if l.Name() != s.Name() || s.Name() == "" {
		t.Fatalf("the log names its store %q, the store %q", l.Name(), s.Name())
	}
}

// logsAreApart: two prefixes are two logs; two handles on one prefix are one log.
func logsAreApart(t *testing.T, ctx context.Context, s logstore.Store, prefix string) {
	a, b := s.Log(prefix+"/a"), s.Log(prefix+"/b")
	ga := bootstrap(t, ctx, a)
	appendOne(t, ctx, a, ga, "in a")
	if h, _ := b.Head(ctx); h.Generation != "" || h.Length != 0 {
		t.Fatalf("log b sees a's: %+v", h)
	}
	if got := datas(readAll(t, ctx, s.Log(prefix+"/a"), "0-0")); !slices.Equal(got, []string{"in a"}) {
		t.Fatalf("a second handle on log a reads %q", got)
	}
}
