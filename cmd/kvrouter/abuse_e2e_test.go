package main

import (
	"sync"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding/gzip"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
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
