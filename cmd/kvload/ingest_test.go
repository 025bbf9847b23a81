package main

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"

	"google.golang.org/protobuf/proto"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// TestKvloadIngests runs the ingest streams against an in-process router, alongside Route calls and
// alone (--concurrency 0), and checks the report and the index. The machine is shared and noisy, so
// the acked rate gets loose bounds; what the ingest workers hold at the end is exact: their root
// prefixes and the cap, plus at most the prompt stored before its removal.
func TestKvloadIngests(t *testing.T) {
	const (
		workers, seeded = 4, 2000
		roots, rootLen  = 3, 24 // --shared-max 0.75 of --prompt-blocks 32
		capBlocks       = 1024
		eventBlocks     = 64
	)
	for _, tc := range []struct {
		name    string
		args    []string
		streams int
		rate    float64 // per stream; 0: max
		calls   bool
	}{
		{name: "paced, with Route", args: []string{"--concurrency", "2", "--ingest-rate", "20000"}, streams: 1, rate: 20000, calls: true},
		{name: "two streams, with Route", args: []string{"--concurrency", "2", "--ingest-rate", "10000", "--ingest-streams", "2"}, streams: 2, rate: 10000, calls: true},
		{name: "max, alone", args: []string{"--concurrency", "0", "--ingest-rate", "max"}, streams: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
			defer cancel()
			addr, state := startRouter(t)
			out := filepath.Join(t.TempDir(), "report.json")
			args := append([]string{"--addr", addr, "--workers", "4", "--blocks", "2000", "--prompt-blocks", "32", "--roots", "3",
				"--route-tokens", "500", "--prompts", "3", "--conns", "2", "--warmup", "20", "--duration", "1s",
				"--ingest-cap", "1024", "--ingest-event-blocks", "64", "--ingest-warmup", "200ms", "--json", out}, tc.args...)
			r, stderr := runForReport(ctx, t, args, out)
			in := r.Ingest
			if in == nil {
				t.Fatalf("report has no ingest; stderr:\n%s", stderr)
			}
			if in.Streams != tc.streams || in.EventBlocks != eventBlocks || in.CapBlocks != capBlocks {
				t.Errorf("ingest report %+v, want %d streams of %d-block events, cap %d", in, tc.streams, eventBlocks, capBlocks)
			}
			// Acks are cumulative, whole events: a multiple of the event size, never more than sent.
			if in.Acked <= 0 || in.Acked%eventBlocks != 0 || in.Published%eventBlocks != 0 {
				t.Errorf("acked %d and published %d block events, want positive multiples of %d", in.Acked, in.Published, eventBlocks)
			}
			if tc.rate > 0 {
				want := tc.rate * float64(tc.streams)
				if in.AckedRate < want/3 || in.AckedRate > want*1.5 {
					t.Errorf("acked %.0f block events/s, want near %.0f", in.AckedRate, want)
				}
			}
			if tc.calls != (r.Calls > 0) || len(r.Errors) > 0 {
				t.Errorf("%d Route calls, errors %v; want calls %v and no errors", r.Calls, r.Errors, tc.calls)
			}

			// Bounded: each ingest worker holds its root prefixes and the cap, plus the last prompt
			// if its removal had not come yet; far less than it stored over the run.
			m := state.Model("bench")
			var ingestHeld uint64
			for _, w := range m.Workers() {
				if w.Info.Key.ID <= workers {
					continue
				}
				held := m.Index.BlockCounts(w.Slot).Total()
				ingestHeld += held
				if held < roots*rootLen+capBlocks || held > roots*rootLen+capBlocks+eventBlocks {
					t.Errorf("ingest worker %v holds %d blocks, want %d to %d", w.Info.Key, held, roots*rootLen+capBlocks, roots*rootLen+capBlocks+eventBlocks)
				}
			}
			if ingestHeld == 0 {
				t.Errorf("no ingest worker registered")
			}
			if n, most := m.Index.Len(), seeded+tc.streams*(capBlocks+eventBlocks); n > most {
				t.Errorf("index holds %d distinct blocks, want at most %d", n, most)
			}
			if stored := in.Published / 2; stored < 2*capBlocks {
				t.Logf("only %d blocks stored in the window: the bound above proves little", stored)
			}
		})
	}
}

// TestIngestCodecMatchesProto checks that a batch of pooled events goes out as the very bytes
// proto.Marshal makes of it, whatever the event ids and rank, and that anything else goes through
// the usual codec.
func TestIngestCodecMatchesProto(t *testing.T) {
	c := &config{roots: 2, promptBlocks: 8, sharedMin: 0.25, sharedMax: 0.75, blockSize: 4, seed: 3}
	g := newGenerator(c)
	pool := g.churnPool(g.rootPrefixes(), 2, 5)
	ic := newIngestCodec()
	rm := &kvrouterv1.BlocksRemoved{BlockHashes: []uint64{1, 1 << 40}}
	for _, ev := range []*kvrouterv1.KvEvent{
		{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: pool[0]}},
		{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_HOST, Data: &kvrouterv1.KvEvent_Stored{Stored: pool[1]}},
		{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Removed{Removed: rm}},
	} {
		if err := ic.add(ev); err != nil {
			t.Fatal(err)
		}
	}
	batch := func(rank uint32, ids ...uint64) *kvrouterv1.PublishRequest {
		var evs []*kvrouterv1.KvEvent
		for i, id := range ids {
			ev := &kvrouterv1.KvEvent{EventId: id, DpRank: rank, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE}
			switch i % 3 {
			case 0:
				ev.Data = &kvrouterv1.KvEvent_Stored{Stored: pool[0]}
			case 1:
				ev.StorageTier, ev.Data = kvrouterv1.StorageTier_STORAGE_TIER_HOST, &kvrouterv1.KvEvent_Stored{Stored: pool[1]}
			case 2:
				ev.Data = &kvrouterv1.KvEvent_Removed{Removed: rm}
			}
			evs = append(evs, ev)
		}
		return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: evs}}}
	}
	unpooled := batch(0, 7)
	// An equal payload that is not the pooled one: the codec knows payloads by identity.
	unpooled.GetEvents().GetEvents()[0].Data = &kvrouterv1.KvEvent_Stored{Stored: proto.CloneOf(pool[0])}
	for _, tc := range []struct {
		name string
		msg  *kvrouterv1.PublishRequest
	}{
		{"first events, id 0", batch(0, 0, 1, 2)},
		{"large ids", batch(0, 1<<20, 1<<20+1, 1<<20+2, 1<<20+3)},
		{"dp rank", batch(3, 5, 6, 7)},
		{"unpooled event", unpooled},
		{"hello", &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{WorkerId: 9, Model: "m"}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want, err := proto.MarshalOptions{Deterministic: true}.Marshal(tc.msg)
			if err != nil {
				t.Fatal(err)
			}
			got, err := ic.Marshal(tc.msg)
			if err != nil {
				t.Fatalf("Marshal() = %v", err)
			}
			defer got.Free()
			if !bytes.Equal(got.Materialize(), want) {
				t.Errorf("Marshal() = %x, want proto.Marshal's %x", got.Materialize(), want)
			}
		})
	}
}

func TestRateFlag(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want rateFlag
		str  string
	}{
		{"0", 0, "0"}, {"1000000", 1e6, "1e+06"}, {"2.5e5", 250000, "250000"}, {"max", -1, "max"}, {"-3", -1, "max"}, {"+Inf", -1, "max"},
	} {
		var r rateFlag
		if err := r.Set(tc.in); err != nil || r != tc.want || r.String() != tc.str {
			t.Errorf("Set(%q) = %v, value %v (%s); want %v (%s)", tc.in, err, float64(r), r.String(), float64(tc.want), tc.str)
		}
	}
	for _, bad := range []string{"", "fast", "NaN"} {
		var r rateFlag
		if err := r.Set(bad); err == nil {
			t.Errorf("Set(%q) = nil, want an error", bad)
		}
	}
}
