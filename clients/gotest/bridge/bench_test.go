package bridge_test

import (
	"context"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvrouter/kvrouter/clients/go/bridge"
	"github.com/kvrouter/kvrouter/clients/go/enginefeed"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/server/servertest"
)

// BenchmarkBridge measures blocks per second through one bridge into one replica (in this process,
// over loopback TCP): an engine stand-in publishes pre-encoded batches of one stored event of 64
// blocks of 16 tokens (vLLM's positional encoding), each a prompt of its own, and once 65,536
// blocks are held each batch also evicts the oldest prompt, as an engine's full cache does. The
// time runs from the first batch sent to the router's ack of the last; blocks/s counts stored
// blocks. The bridge decodes, hashes the tokens (the router receives tokens_hash) and publishes.
func BenchmarkBridge(b *testing.B) {
	const blockSize, blocksPerEvent, capacityEvents = 16, 64, 1024
	for _, style := range []struct {
		name string
		enc  enginefeed.Encoder
	}{{"arrays", enginefeed.Encoder{Style: enginefeed.Arrays}}, {"maps", enginefeed.Encoder{Style: enginefeed.Maps}}} {
		b.Run("style="+style.name, func(b *testing.B) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			state := kvstate.NewState()
			srv, lis, err := servertest.Serve(state, kvstate.NewMemLog(state), 1<<20)
			if err != nil {
				b.Fatal(err)
			}
			defer srv.Stop()
			conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()

			// The batches, encoded before the clock starts, as the engine has them at hand.
			payloads := make([][]byte, b.N)
			hashOf := func(event, block int) uint64 { return uint64(event*blocksPerEvent+block) + 1 }
			for i := range payloads {
				st := enginefeed.Event{Kind: enginefeed.BlockStored, BlockSize: blockSize, Medium: "GPU"}
				for j := range blocksPerEvent {
					st.BlockHashes = append(st.BlockHashes, hashOf(i, j))
					for k := range blockSize {
						st.TokenIDs = append(st.TokenIDs, uint32((i*blocksPerEvent+j)*blockSize+k))
					}
				}
				batch := enginefeed.Batch{TS: float64(time.Now().UnixNano()) / 1e9, HasDPRank: true, Events: []enginefeed.Event{st}}
				if old := i - capacityEvents; old >= 0 {
					rm := enginefeed.Event{Kind: enginefeed.BlockRemoved, Medium: "GPU"}
					for j := range blocksPerEvent {
						rm.BlockHashes = append(rm.BlockHashes, hashOf(old, j))
					}
					batch.Events = append(batch.Events, rm)
				}
				payloads[i] = append([]byte(nil), style.enc.Encode(&batch)...)
			}

			endpoint := freeTCP(b)
			pub := zmq4.NewPub(ctx)
			defer pub.Close()
			if err := pub.Listen(endpoint); err != nil {
				b.Fatal(err)
			}
			reg := prometheus.NewRegistry()
			br, err := bridge.New(bridge.Options{
				Hello: &kvrouterv1.WorkerHello{Endpoint: "10.0.0.1:8000", WorkerId: 1, Model: "bench", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED,
					BlockSize: blockSize, TotalKvBlocks: blocksPerEvent * capacityEvents, KvEventsEnabled: true},
				Conns: []grpc.ClientConnInterface{conn}, Endpoint: endpoint, Registerer: reg, DialRetry: 20 * time.Millisecond,
			})
			if err != nil {
				b.Fatal(err)
			}
			runCtx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- br.Run(runCtx, time.Minute) }()
			defer func() {
				stop()
				if err := <-done; err != nil {
					b.Error(err)
				}
			}()
			// Wait for the subscription: a warm-up batch without events, until the bridge counts one.
			warm := enginefeed.Batch{TS: 1, HasDPRank: true}
			seq := uint64(0)
			for metricValue(b, reg, "kvrouter_bridge_batches_total") == 0 {
				_ = pub.SendMulti(zmq4.NewMsgFrom(enginefeed.MessageFrames(enginefeed.Message{Seq: seq, Payload: style.enc.Encode(&warm)})...))
				seq++
				time.Sleep(5 * time.Millisecond)
			}
			first := seq
			b.ResetTimer()
			start := time.Now()
			for i, p := range payloads {
				if err := pub.SendMulti(zmq4.NewMsgFrom(enginefeed.MessageFrames(enginefeed.Message{Seq: first + uint64(i), Payload: p})...)); err != nil {
					b.Fatal(err)
				}
			}
			last := float64(first + uint64(b.N) - 1)
			for metricValue(b, reg, "kvrouter_bridge_acked_seq") < last {
				time.Sleep(time.Millisecond)
			}
			elapsed := time.Since(start)
			b.StopTimer()
			b.ReportMetric(float64(b.N*blocksPerEvent)/elapsed.Seconds(), "blocks/s")
			if resets := metricValue(b, reg, "kvrouter_bridge_resets_total"); resets != 0 {
				b.Fatalf("%v resets during the run: batches were lost", resets)
			}
		})
	}
}
