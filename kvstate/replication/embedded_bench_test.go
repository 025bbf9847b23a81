package replication_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/memstore"
	"github.com/kvrouter/kvrouter/kvstate/replication"
)

// BenchmarkEmbeddedLog measures what embedded mode would pay to run the replication engine over
// the in-memory store instead of kvstate.MemLog (issue 28, item 1): one worker's KV batches of 64
// and 512 stored blocks (what a Publish stream appends), and bookings (what a booking Route
// appends), through each log in turn, sub-benchmarks side by side so that -count interleaves them.
// ns/op is per append.
func BenchmarkEmbeddedLog(b *testing.B) {
	logs := []struct {
		name string
		open func(b *testing.B, st *kvstate.State) kvstate.Log
	}{
		{"memlog", func(_ *testing.B, st *kvstate.State) kvstate.Log { return kvstate.NewMemLog(st) }},
		{"engine+memstore", func(b *testing.B, st *kvstate.State) kvstate.Log {
			l := replication.New(memstore.New(memstore.Options{Name: "embedded"}).Log("embedded"), st,
				replication.Options{Prefix: "embedded", Replica: "bench", NoFreshWindow: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { _ = l.Run(ctx); close(done) }()
			b.Cleanup(func() { cancel(); <-done })
			<-l.Ready()
			return l
		}},
	}
	for _, batch := range []int{64, 512} {
		for _, lg := range logs {
			b.Run(fmt.Sprintf("events/batch=%d/log=%s", batch, lg.name), func(b *testing.B) {
				st := kvstate.NewState()
				l := lg.open(b, st)
				ctx := context.Background()
				w := register(b, l)
				epoch := st.Worker(w).Status().Epoch
				var hash, id uint64
				blocks := make([]kvstate.Block, batch)
				for b.Loop() {
					parent := hash
					for j := range blocks {
						hash++
						blocks[j] = kvstate.Block{Hash: hash, Local: hash}
					}
					ev := kvstate.Event{ID: id, Kind: kvstate.EventStored, Blocks: blocks, Parent: parent, HasParent: parent != 0}
					res, err := l.Append(ctx, kvstate.KVEvents{Worker: w, Epoch: epoch, Events: []kvstate.Event{ev}})
					if err != nil || res.Applied != 1 {
						b.Fatalf("Append(KVEvents) = %+v, %v", res, err)
					}
					id++
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/block")
			})
		}
	}
	for _, lg := range logs {
		b.Run("bookings/log="+lg.name, func(b *testing.B) {
			st := kvstate.NewState()
			l := lg.open(b, st)
			register(b, l)
			ctx := context.Background()
			i := 0
			for b.Loop() {
				id := fmt.Sprintf("r%d", i)
				at := time.Now().UnixNano()
				if _, err := l.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: id, At: at,
					Hops: []kvstate.HopBooking{{Worker: kvtest.WorkerKey(0), Blocks: []uint64{uint64(i)}, PrefillTokens: 16}}}}); err != nil {
					b.Fatal(err)
				}
				if _, err := l.Append(ctx, kvstate.Freed{RequestID: id}); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}

// register registers one aggregated worker of model "m" through l.
func register(b *testing.B, l kvstate.Log) kvstate.WorkerKey {
	w := kvtest.WorkerKey(0)
	info := kvstate.WorkerInfo{Key: w, Model: "m", Role: kvstate.RoleAggregated, BlockSize: 16, TotalKVBlocks: 1 << 30, KVEventsEnabled: true}
	if _, err := l.Append(context.Background(), kvstate.WorkerUp{Info: info}); err != nil {
		b.Fatal(err)
	}
	return w
}
