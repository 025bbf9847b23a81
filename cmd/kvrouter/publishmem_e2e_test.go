package main

import (
	"context"
	"fmt"
	"sync"
	"testing"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// TestPublishMemoryPerConcurrentMessage: what one Publish message costs the router while eight
// arrive at once on eight streams, at the limits (16,384 blocks of 16 token ids, or one block of a
// million token ids: 4 MB on the wire): its peak RSS growth over eight, within
// publishMessageBudget, the figure docs/operations.md gives operators to size a replica by.
func TestPublishMemoryPerConcurrentMessage(t *testing.T) {
	const publishMessageBudget, n = 24 << 20, 8
	bin := buildBinary(t)
	for _, kind := range []string{"wide", "long"} {
		p := startProcess(t, bin)
		ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout)
		client := kvrouterv1.NewWorkerServiceClient(dial(t, p.addr))
		var streams []kvrouterv1.WorkerService_PublishClient
		for i := range n {
			s, err := client.Publish(ctx)
			if err != nil {
				t.Fatal(err)
			}
			bs := uint32(16)
			if kind == "long" {
				bs = 1_000_000
			}
			s.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
				Endpoint: "10.0.0.1:8000",
				WorkerId: uint64(i + 1), Model: fmt.Sprint(bs), Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: bs, KvEventsEnabled: true}}})
			if r, err := s.Recv(); err != nil || r.GetRegistered() == nil {
				t.Fatalf("registration = %v, %v", r, err)
			}
			streams = append(streams, s)
		}
		msg := func(id int) *kvrouterv1.PublishRequest {
			st := &kvrouterv1.BlocksStored{}
			blocks, tokens := 16_384, 16
			if kind == "long" {
				blocks, tokens = 1, 1_000_000
			}
			for b := range blocks {
				toks := make([]uint32, tokens)
				for k := range toks {
					toks[k] = uint32(100_000 + (b*tokens+k+id*7)%1_000_000)
				}
				st.Blocks = append(st.Blocks, &kvrouterv1.StoredBlock{BlockHash: uint64(id)<<32 | uint64(b), TokenIds: toks})
			}
			return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{{
				EventId: 0, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}}}}}
		}
		msgs := make([]*kvrouterv1.PublishRequest, n)
		for i := range n {
			msgs[i] = msg(i + 1)
		}
		before := peakRSS(t, p.cmd.Process.Pid)
		var wg sync.WaitGroup
		for i, s := range streams {
			wg.Go(func() {
				if err := s.Send(msgs[i]); err != nil {
					t.Errorf("Send = %v", err)
				}
				if r, err := s.Recv(); err != nil || r.GetAck() == nil {
					t.Errorf("%v, %v; want an ack", r, err)
				}
			})
		}
		wg.Wait()
		grew := peakRSS(t, p.cmd.Process.Pid) - before
		t.Logf("%s x%d: peak +%.1f MiB, %.1f MiB a message", kind, n, float64(grew)/(1<<20), float64(grew)/(1<<20)/float64(n))
		if grew/int64(n) > publishMessageBudget {
			t.Errorf("%s: %.1f MiB a message arriving at once, more than the %d MiB docs/operations.md budgets", kind, float64(grew)/(1<<20)/float64(n), publishMessageBudget>>20)
		}
		cancel()
	}
}
