package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// peakRSS returns the process's peak resident memory (VmHWM) in bytes.
func peakRSS(t *testing.T, pid int) int64 { return procStatusBytes(t, pid, "VmHWM") }

// currentRSS returns the process's resident memory now (VmRSS).
func currentRSS(t *testing.T, pid int) int64 { return procStatusBytes(t, pid, "VmRSS") }

// procStatusBytes returns a memory figure of /proc/<pid>/status (field VmHWM, VmRSS, ...), in bytes.
func procStatusBytes(t *testing.T, pid int, field string) int64 {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Skipf("no /proc on this machine: %v", err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				t.Fatalf("%s %q: %v", field, v, err)
			}
			return kb << 10
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return 0
}

// TestPublishMemoryBound sends a real kvrouter what raised a replica's memory from 28 to 210 MiB (a
// 15.6 MB event batch, just under the 16 MiB gRPC message limit), then messages as large as the
// Publish limits let through, and checks that its peak memory stays within a bound.
func TestPublishMemoryBound(t *testing.T) {
	bin := buildBinary(t)
	p := startProcess(t, bin)
	ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout)
	defer cancel()
	client := kvrouterv1.NewWorkerServiceClient(dial(t, p.addr))
	open := func(id uint64, blockSize uint32) kvrouterv1.WorkerService_PublishClient {
		s, err := client.Publish(ctx)
		if err != nil {
			t.Fatalf("Publish() = %v", err)
		}
		if err := s.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
			Endpoint: "10.0.0.1:8000",
			WorkerId: id, Model: fmt.Sprintf("m%d", blockSize), Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: blockSize, KvEventsEnabled: true}}}); err != nil {
			t.Fatalf("hello = %v", err)
		}
		if r, err := s.Recv(); err != nil || r.GetRegistered() == nil {
			t.Fatalf("registration = %v, %v", r, err)
		}
		return s
	}
	stored := func(id uint64, blocks, tokens int) *kvrouterv1.PublishRequest {
		st := &kvrouterv1.BlocksStored{}
		for i := range blocks {
			toks := make([]uint32, tokens)
			for k := range toks {
				toks[k] = uint32(100_000 + (i*tokens+k)%1_000_000)
			}
			st.Blocks = append(st.Blocks, &kvrouterv1.StoredBlock{BlockHash: id<<32 | uint64(i), TokenIds: toks})
		}
		return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{{
			EventId: id, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}}}}}
	}

	before := peakRSS(t, p.cmd.Process.Pid)
	huge := stored(0, 250_000, 16) // 15.4 MB
	for i := range 5 {
		s := open(uint64(1+i), 16)
		if err := s.Send(huge); err != nil {
			t.Fatalf("sending the 15 MB batch = %v", err)
		}
		_, err := s.Recv()
		if st, _ := status.FromError(err); st.Code() != codes.ResourceExhausted || !strings.Contains(st.Message(), "max_publish_msg_bytes 4194304") {
			t.Fatalf("the 15 MB batch ended the stream with %v, want RESOURCE_EXHAUSTED naming max_publish_msg_bytes", err)
		}
	}
	// The largest batches the limits accept: 16,384 blocks of 16 tokens, and one block of 1.3M tokens.
	const longBlock = 1_300_000
	wide, long := open(10, 16), open(11, longBlock)
	for i := range 10 {
		for _, c := range []struct {
			s   kvrouterv1.WorkerService_PublishClient
			msg *kvrouterv1.PublishRequest
		}{{wide, stored(uint64(i), 16_384, 16)}, {long, stored(uint64(i), 1, longBlock)}} {
			if err := c.s.Send(c.msg); err != nil {
				t.Fatalf("sending batch %d = %v", i, err)
			}
			if r, err := c.s.Recv(); err != nil || r.GetAck() == nil {
				t.Fatalf("batch %d: %v, %v; want an ack", i, r, err)
			}
		}
	}
	after := peakRSS(t, p.cmd.Process.Pid)
	// Without the limits, one 15.4 MB batch alone adds about 93 MiB here (210 MiB was seen in Redis mode).
	const bound = 64 << 20
	t.Logf("peak RSS %.1f MiB before, %.1f MiB after (+%.1f MiB); bound +%d MiB", float64(before)/(1<<20), float64(after)/(1<<20), float64(after-before)/(1<<20), bound>>20)
	if after-before > bound {
		t.Errorf("peak RSS grew by %.1f MiB, more than %d MiB", float64(after-before)/(1<<20), bound>>20)
	}
}
