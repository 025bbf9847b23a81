package kvclient_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// BenchmarkPublisher measures blocks per second through one Publisher to one replica (the embedded
// log) over loopback TCP: each Publish call is one stored event of 64 blocks of 16 tokens, chained
// onto the previous event, and every message carries one such event. With token ids the router
// hashes 1,024 tokens a message; with tokens_hash the publisher does, and sends 8 bytes a block.
// The timer covers publishing and waiting for the last ack (Close).
func BenchmarkPublisher(b *testing.B) {
	const blocksPerEvent = 64
	for _, hash := range []bool{false, true} {
		b.Run(fmt.Sprintf("batch=64/tokens=%s", map[bool]string{false: "ids", true: "hash"}[hash]), func(b *testing.B) {
			s := startServer(b, 1<<20)
			h := &kvrouterv1.WorkerHello{WorkerId: 100, Model: "bench", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED,
				BlockSize: kvtest.BlockSize, TotalKvBlocks: 1 << 30, MaxNumBatchedTokens: 8192, KvEventsEnabled: true, FreshStart: true}
			// The events are built before the timer starts, as an engine has them at hand.
			events := make([]*kvrouterv1.KvEvent, b.N)
			for i := range events {
				st := &kvrouterv1.BlocksStored{Blocks: make([]*kvrouterv1.StoredBlock, blocksPerEvent)}
				for j := range st.Blocks {
					id := uint64(i*blocksPerEvent + j)
					st.Blocks[j] = &kvrouterv1.StoredBlock{BlockHash: id + 1, TokenIds: kvtest.BlockTokens(nil, 1<<48+id)}
				}
				if i > 0 {
					parent := uint64(i * blocksPerEvent)
					st.ParentHash = &parent
				}
				events[i] = &kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}
			}
			p, err := kvclient.NewPublisher(kvclient.PublisherOptions{Hello: h, Conns: []grpc.ClientConnInterface{s.conn}, HashTokens: hash, MaxBatchEvents: 1})
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			b.ResetTimer()
			start := time.Now()
			for _, ev := range events {
				if err := p.Publish(ctx, ev); err != nil {
					b.Fatal(err)
				}
			}
			if err := p.Close(ctx); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(b.N*blocksPerEvent)/time.Since(start).Seconds(), "blocks/s")
		})
	}
}
