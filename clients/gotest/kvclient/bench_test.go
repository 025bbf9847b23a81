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
//
// The "grow" runs chain every event onto the last, so the router's index grows without bound (4M
// blocks and more): they measure the router's insert under growth as much as the client. The
// "cache=64k" runs are a worker at steady state: every event is a prompt of its own (a chain of 64
// blocks), and once 65,536 blocks are held each message also evicts the oldest prompt, as an engine's
// full cache does; blocks/s counts stored blocks only.
func BenchmarkPublisher(b *testing.B) {
	for _, hash := range []bool{false, true} {
		b.Run(fmt.Sprintf("batch=64/tokens=%s/cache=64k", map[bool]string{false: "ids", true: "hash"}[hash]), func(b *testing.B) {
			benchmarkSteadyPublisher(b, hash)
		})
	}
	const blocksPerEvent = 64
	for _, hash := range []bool{false, true} {
		b.Run(fmt.Sprintf("batch=64/tokens=%s/grow", map[bool]string{false: "ids", true: "hash"}[hash]), func(b *testing.B) {
			s := startServer(b, 1<<20)
			h := &kvrouterv1.WorkerHello{Endpoint: "10.0.0.1:8000", WorkerId: 100, Model: "bench", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED,
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

// benchmarkSteadyPublisher publishes independent 64-block prompts into a worker that holds at most
// 65,536 blocks, evicting the oldest prompt in the same message once full.
func benchmarkSteadyPublisher(b *testing.B, hash bool) {
	const blocksPerEvent, capacityEvents = 64, 1024
	s := startServer(b, 1<<20)
	h := &kvrouterv1.WorkerHello{Endpoint: "10.0.0.1:8000", WorkerId: 100, Model: "bench", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED,
		BlockSize: kvtest.BlockSize, TotalKvBlocks: blocksPerEvent * capacityEvents, MaxNumBatchedTokens: 8192, KvEventsEnabled: true, FreshStart: true}
	hashOf := func(event, block int) uint64 { return uint64(event*blocksPerEvent+block) + 1 }
	// The events are built before the timer starts, as an engine has them at hand.
	stored := make([]*kvrouterv1.KvEvent, b.N)
	evicted := make([]*kvrouterv1.KvEvent, b.N)
	for i := range stored {
		st := &kvrouterv1.BlocksStored{Blocks: make([]*kvrouterv1.StoredBlock, blocksPerEvent)}
		for j := range st.Blocks {
			st.Blocks[j] = &kvrouterv1.StoredBlock{BlockHash: hashOf(i, j), TokenIds: kvtest.BlockTokens(nil, 1<<48+hashOf(i, j))}
		}
		stored[i] = &kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}
		if old := i - capacityEvents; old >= 0 {
			rm := &kvrouterv1.BlocksRemoved{BlockHashes: make([]uint64, blocksPerEvent)}
			for j := range rm.BlockHashes {
				rm.BlockHashes[j] = hashOf(old, j)
			}
			evicted[i] = &kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Removed{Removed: rm}}
		}
	}
	p, err := kvclient.NewPublisher(kvclient.PublisherOptions{Hello: h, Conns: []grpc.ClientConnInterface{s.conn}, HashTokens: hash, MaxBatchEvents: 2})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	b.ResetTimer()
	start := time.Now()
	for i := range stored {
		events := []*kvrouterv1.KvEvent{stored[i]}
		if evicted[i] != nil {
			events = append(events, evicted[i])
		}
		if err := p.Publish(ctx, events...); err != nil {
			b.Fatal(err)
		}
	}
	if err := p.Close(ctx); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(b.N*blocksPerEvent)/time.Since(start).Seconds(), "blocks/s")
	b.StopTimer()
	resp, err := s.admin.ListWorkers(ctx, &kvrouterv1.ListWorkersRequest{Model: "bench"})
	if err != nil || len(resp.GetWorkers()) != 1 {
		b.Fatalf("ListWorkers() = %v, %v", resp, err)
	}
	if got, want := resp.GetWorkers()[0].GetCachedBlocks().GetDevice(), uint64(min(b.N, capacityEvents)*blocksPerEvent); got != want {
		b.Fatalf("the router holds %d blocks, want %d", got, want)
	}
}
