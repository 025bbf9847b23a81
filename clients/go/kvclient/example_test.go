package kvclient_test

import (
	"context"
	"fmt"
	"log"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// A worker publishes the blocks it cached; a frontend then routes a prompt that starts with them,
// and the router picks that worker. Do frees the booking when the request is done. (It prints
// "worker 1, 2 cached blocks"; docs/clients.md runs the same program against a real router.)
func Example() {
	conn, err := grpc.NewClient("127.0.0.1:50051", grpc.WithTransportCredentials(insecure.NewCredentials()), kvclient.WithKeepalive())
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	ctx := context.Background()

	// The worker: worker 1 of model "demo", blocks of 4 tokens, caching tokens 1..8.
	pub, err := kvclient.NewPublisher(kvclient.PublisherOptions{
		Hello: &kvrouterv1.WorkerHello{Endpoint: "10.0.0.1:8000", WorkerId: 1, Model: "demo", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED,
			BlockSize: 4, TotalKvBlocks: 1024, KvEventsEnabled: true, FreshStart: true},
		Conns:      []grpc.ClientConnInterface{conn},
		HashTokens: true, // send 8 bytes a block instead of its tokens
	})
	if err != nil {
		log.Fatal(err)
	}
	stored := &kvrouterv1.BlocksStored{Blocks: []*kvrouterv1.StoredBlock{
		{BlockHash: 101, TokenIds: []uint32{1, 2, 3, 4}},
		{BlockHash: 102, TokenIds: []uint32{5, 6, 7, 8}},
	}}
	if err := pub.Publish(ctx, &kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
		Data: &kvrouterv1.KvEvent_Stored{Stored: stored}}); err != nil {
		log.Fatal(err)
	}
	if err := pub.Flush(ctx); err != nil { // wait for the router's ack
		log.Fatal(err)
	}

	// The frontend.
	router := kvclient.NewRouter(conn, kvclient.RouterOptions{})
	err = router.Do(ctx, &kvrouterv1.RouteRequest{Model: "demo", TokenIds: []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9}},
		func(ctx context.Context, b *kvclient.Booking) error {
			fmt.Printf("worker %d, %d cached blocks\n", b.GetDecode().GetWorkerId(), b.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice())
			return nil // ... send the request to the worker, stream the answer ...
		})
	if err != nil {
		log.Fatal(err)
	}
	if err := pub.Close(ctx); err != nil {
		log.Fatal(err)
	}
}
