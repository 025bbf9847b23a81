package main

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding/gzip"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// hugeRoute is a Route of 15 million token ids of value 1: 15 MB on the wire, just under the
// 16 MiB message limit, about 15 KB gzip-compressed, and some 60 MB once its token ids are decoded.
func hugeRoute() *kvrouterv1.RouteRequest {
	tokens := make([]uint32, 15_000_000)
	for i := range tokens {
		tokens[i] = 1
	}
	return &kvrouterv1.RouteRequest{Model: "llama", TokenIds: tokens, QueryOnly: true}
}

// sendAtOnce sends req n times at once on conn as name ("" sends no credentials), compressed with
// gzip when compress, and returns each call's error.
func (r *secureRouter) sendAtOnce(conn *grpc.ClientConn, name string, req *kvrouterv1.RouteRequest, n int, compress bool) []error {
	router := kvrouterv1.NewRouterServiceClient(conn)
	var opts []grpc.CallOption
	if compress {
		opts = append(opts, grpc.UseCompressor(gzip.Name))
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			ctx, cancel := r.as(name)
			defer cancel()
			_, errs[i] = router.Route(ctx, req, opts...)
		})
	}
	wg.Wait()
	return errs
}

// TestNoWorkBeforeAuthentication: a caller without credentials is refused on its headers, before the
// router reads, decompresses or decodes a byte of its message. Before, 40 gzip-compressed 16 KB
// Route frames took a router from 23 MiB to 3.7 GiB: each was decompressed to 16 MB and decoded to
// some 80 MB, to be refused only then. Here 20 such frames, compressed and not, at once, move the
// router's peak memory by less than unauthenticatedBound. A caller with credentials gets a Route too
// large for max_prompt_tokens refused before it is decoded, with a status naming the limit.
func TestNoWorkBeforeAuthentication(t *testing.T) {
	const calls, unauthenticatedBound = 20, 32 << 20
	r := startSecureRouter(t)
	conn := r.dial(nil)
	req := hugeRoute()
	pid := r.proc.cmd.Process.Pid
	before := peakRSS(t, pid)
	for _, compress := range []bool{true, false} {
		for i, err := range r.sendAtOnce(conn, "", req, calls, compress) {
			if status.Code(err) != codes.Unauthenticated {
				t.Fatalf("call %d without credentials (gzip %v) = %v, want UNAUTHENTICATED", i, compress, err)
			}
		}
	}
	grew := peakRSS(t, pid) - before
	t.Logf("peak memory grew %.1f MiB", float64(grew)/(1<<20))
	if grew > unauthenticatedBound {
		t.Errorf("%d calls of 15 MB (compressed, then not) without credentials raised the router's peak memory by %d MiB, want under %d MiB",
			2*calls, grew>>20, unauthenticatedBound>>20)
	}
	for i, err := range r.sendAtOnce(conn, "frontend", req, 2, true) {
		st := status.Convert(err)
		var reason string
		for _, d := range st.Details() {
			if info, ok := d.(*errdetails.ErrorInfo); ok {
				reason = info.GetReason()
			}
		}
		if st.Code() != codes.ResourceExhausted || reason != "ROUTE_MESSAGE_TOO_LARGE" {
			t.Errorf("call %d of 15 MB from a frontend = %v (reason %q), want RESOURCE_EXHAUSTED ROUTE_MESSAGE_TOO_LARGE", i, err, reason)
		}
	}
}

// TestRevokedCredentialEndsItsStream: a worker credential removed from the credentials file ends
// its open Publish stream at the reload, with UNAUTHENTICATED, and one whose scope no longer
// covers its worker with PERMISSION_DENIED; a stream of a credential the reload keeps goes on.
// Before, a revoked credential's stream was acked until its connection's maximum age (30 min).
func TestRevokedCredentialEndsItsStream(t *testing.T) {
	r := startSecureRouter(t)
	r.tokens["worker-9"], r.tokens["worker-11"] = newToken(t), newToken(t)
	creds := testCredentials + "  - name: worker-9\n    roles: [worker]\n    token_sha256: {token:worker-9}\n    worker_ids: [9]\n" +
		"  - name: worker-11\n    roles: [worker]\n    token_sha256: {token:worker-11}\n    worker_ids: [11]\n"
	r.writeCredentials(creds)
	open := func(name string, id uint64) grpc.BidiStreamingClient[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse] {
		ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+r.tokens[name]))
		t.Cleanup(cancel)
		var stream grpc.BidiStreamingClient[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse]
		kvtest.Eventually(t, defaultTestTimeout, name+" registered", func() bool { // the reload of creds may be on its way
			var err error
			stream, err = register(ctx, r.dial(nil), id, "llama")
			return err == nil
		})
		return stream
	}
	kept, revoked, narrowed := open("worker-11", 11), open("worker-7", 7), open("worker-9", 9)
	// worker-7 goes; worker-9 now publishes for worker 10 only.
	next := strings.Replace(creds, "  - name: worker-7\n    roles: [worker]\n    token_sha256: {token:worker-7}\n    worker_ids: [7]\n    models: [llama]\n", "", 1)
	next = strings.Replace(next, "worker_ids: [9]", "worker_ids: [10]", 1)
	r.writeCredentials(next)
	for _, s := range []struct {
		name   string
		stream grpc.BidiStreamingClient[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse]
		want   codes.Code
	}{{"worker-7 (removed)", revoked, codes.Unauthenticated}, {"worker-9 (scope narrowed)", narrowed, codes.PermissionDenied}} {
		done := make(chan error, 1)
		go func() {
			for {
				if _, err := s.stream.Recv(); err != nil {
					done <- err
					return
				}
			}
		}()
		select {
		case err := <-done:
			if status.Code(err) != s.want {
				t.Errorf("%s: its stream ended with %v, want %v", s.name, err, s.want)
			}
		case <-time.After(defaultTestTimeout):
			t.Errorf("%s: its stream still open %v after the reload", s.name, defaultTestTimeout)
		}
	}
	if err := kept.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{{
		EventId: 0, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: &kvrouterv1.BlocksStored{
			Blocks: []*kvrouterv1.StoredBlock{{BlockHash: 1, TokenIds: []uint32{1, 2, 3, 4}}}}}}}}}}); err != nil {
		t.Fatalf("worker-11, kept: Send = %v", err)
	}
	if resp, err := kept.Recv(); err != nil || resp.GetAck() == nil {
		t.Errorf("worker-11, kept by the reload: %v, %v; want its event acked", resp, err)
	}
}
