package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
)

// The contract suite: one table of calls, each with the answer the contract promises (status code,
// ErrorInfo reason, and the worker routed to), run unchanged against every layout of the state:
// embedded, one Redis log, and the log sharded by model on one Redis server and on a 3-master
// Redis Cluster. One call, one answer, in every layout.
//
// Each layout runs three replicas: A and B serve every model; C, in the sharded layouts, serves
// none of the models the calls use (--redis-models), and is sent only what any replica must answer
// (MarkPrefillComplete, Free). In embedded mode A, B and C are one process.

// contractOutcome is what a call answered: its status code and ErrorInfo reason, and for a Route the
// decode worker and mode, for a query the annotations.
type contractOutcome struct {
	Code, Reason string
	Decode       uint64
	Mode         string
	Annotations  []string
	Message      string // only when the row asks for it (contains)
}

// contractReplicas are the layout's replicas.
type contractReplicas struct {
	a, b, c             kvrouterv1.RouterServiceClient
	workersA, workersB  kvrouterv1.WorkerServiceClient
	addrA, addrB, addrC string
	sharded, separateC  bool
}

// contractPrompts: two prompts of four 4-token blocks each.
var (
	contractP1 = []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}
	contractP2 = []uint32{101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116}
)

// contractRows are the calls, in order (later rows see earlier rows' bookings and sessions), with
// the outcome every layout must give.
var contractRows = []struct {
	name string
	call func(ctx context.Context, r *contractReplicas) contractOutcome
	want contractOutcome
	// contains, when set, is a part of the status message the row checks (the rest of the message
	// may name replica-specific details).
	contains string
}{
	{name: "route for a model no worker serves", want: contractOutcome{Code: "NotFound", Reason: "UNKNOWN_MODEL"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			return routeOutcome(r.b.Route(ctx, &kvrouterv1.RouteRequest{Model: "nope", TokenIds: contractP1, QueryOnly: true}))
		}},
	{name: "a query goes to the worker caching the prompt", want: contractOutcome{Code: "OK", Decode: 11, Mode: "ROUTE_MODE_AGGREGATED"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			return routeOutcome(r.b.Route(ctx, &kvrouterv1.RouteRequest{Model: "ma", TokenIds: contractP1, QueryOnly: true}))
		}},
	{name: "a booking", want: contractOutcome{Code: "OK", Decode: 11, Mode: "ROUTE_MODE_AGGREGATED"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			return routeOutcome(r.a.Route(ctx, &kvrouterv1.RouteRequest{RequestId: "r1", Model: "ma", TokenIds: contractP1}))
		}},
	{name: "the same request id again", want: contractOutcome{Code: "AlreadyExists", Reason: "ALREADY_BOOKED"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			return routeOutcome(r.a.Route(ctx, &kvrouterv1.RouteRequest{RequestId: "r1", Model: "ma", TokenIds: contractP1}))
		}},
	{name: "the same request id in another model", want: contractOutcome{Code: "AlreadyExists", Reason: "ALREADY_BOOKED"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			return routeOutcome(r.a.Route(ctx, &kvrouterv1.RouteRequest{RequestId: "r1", Model: "mb", TokenIds: contractP1}))
		}},
	{name: "prefill complete on any replica", want: contractOutcome{Code: "OK"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			_, err := r.c.MarkPrefillComplete(ctx, &kvrouterv1.MarkPrefillCompleteRequest{RequestId: "r1"})
			return statusOutcome(err)
		}},
	{name: "free on any replica", want: contractOutcome{Code: "OK"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			_, err := r.c.Free(ctx, &kvrouterv1.FreeRequest{RequestId: "r1"})
			return statusOutcome(err)
		}},
	{name: "free again", want: contractOutcome{Code: "NotFound", Reason: "UNKNOWN_REQUEST"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			_, err := r.c.Free(ctx, &kvrouterv1.FreeRequest{RequestId: "r1"})
			return statusOutcome(err)
		}},
	{name: "the freed id books again, in another model", want: contractOutcome{Code: "OK", Decode: 21, Mode: "ROUTE_MODE_AGGREGATED"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			out := routeOutcome(r.a.Route(ctx, &kvrouterv1.RouteRequest{RequestId: "r1", Model: "mb", TokenIds: contractP1}))
			if out.Code == "OK" {
				_, _ = r.a.Free(ctx, &kvrouterv1.FreeRequest{RequestId: "r1"})
			}
			return out
		}},
	{name: "free of an id nobody booked", want: contractOutcome{Code: "NotFound", Reason: "UNKNOWN_REQUEST"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			_, err := r.b.Free(ctx, &kvrouterv1.FreeRequest{RequestId: "junk"})
			return statusOutcome(err)
		}},
	{name: "prefill complete of an id nobody booked, on any replica", want: contractOutcome{Code: "NotFound", Reason: "UNKNOWN_REQUEST"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			_, err := r.c.MarkPrefillComplete(ctx, &kvrouterv1.MarkPrefillCompleteRequest{RequestId: "junk"})
			return statusOutcome(err)
		}},
	{name: "a session's first turn binds it", want: contractOutcome{Code: "OK", Decode: 12, Mode: "ROUTE_MODE_AGGREGATED"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			return routeOutcome(r.a.Route(ctx, &kvrouterv1.RouteRequest{RequestId: "s1", Model: "ma", TokenIds: contractP2, SessionId: "chat"}))
		}},
	{name: "the same session id in another model", want: contractOutcome{Code: "OK", Decode: 21, Mode: "ROUTE_MODE_AGGREGATED"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			return routeOutcome(r.a.Route(ctx, &kvrouterv1.RouteRequest{RequestId: "s2", Model: "mb", TokenIds: contractP2, SessionId: "chat"}))
		}},
	{name: "the session's next turn in the first model keeps its worker", want: contractOutcome{Code: "OK", Decode: 12, Mode: "ROUTE_MODE_AGGREGATED"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			// P1 is cached on worker 11: without the session's binding, the turn would go there.
			return routeOutcome(r.a.Route(ctx, &kvrouterv1.RouteRequest{Model: "ma", TokenIds: contractP1, SessionId: "chat", QueryOnly: true}))
		}},
	{name: "a worker id registered in another model", want: contractOutcome{Code: "FailedPrecondition", Reason: "WORKER_CONFLICT"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			return statusOutcome(helloErr(ctx, r.workersB, &kvrouterv1.WorkerHello{Endpoint: "10.0.0.1:8000", WorkerId: 11, Model: "mb",
				Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 4, TotalKvBlocks: 1000, KvEventsEnabled: true}))
		}},
	{name: "a route without a model", want: contractOutcome{Code: "InvalidArgument", Message: "model: must not be empty"},
		contains: "model: must not be empty",
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			return routeOutcome(r.b.Route(ctx, &kvrouterv1.RouteRequest{TokenIds: contractP1, QueryOnly: true}))
		}},
	{name: "a client's router markers are stripped", want: contractOutcome{Code: "OK", Decode: 11, Mode: "ROUTE_MODE_AGGREGATED", Annotations: []string{"keep"}},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			return routeOutcome(r.b.Route(ctx, &kvrouterv1.RouteRequest{Model: "ma", TokenIds: contractP1, QueryOnly: true,
				Annotations: []string{"x-prefill-continue", "keep", "x-bypass-remote-prefill:true"}}))
		}},
	{name: "a prompt its caller hashed goes where its token ids go", want: contractOutcome{Code: "OK", Decode: 11, Mode: "ROUTE_MODE_AGGREGATED"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			return hashedOutcome(r.b.Route(ctx, hashedRoute("ma", contractP1[:15], nil)))
		}},
	{name: "a hashed prompt books and frees like any other", want: contractOutcome{Code: "OK"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			req := hashedRoute("ma", contractP1, nil)
			req.RequestId, req.QueryOnly = "h1", false
			if out := routeOutcome(r.a.Route(ctx, req)); out.Code != "OK" || out.Decode != 11 {
				return contractOutcome{Code: fmt.Sprintf("booking a hashed prompt: %+v, want OK on 11", out)}
			}
			_, err := r.c.Free(ctx, &kvrouterv1.FreeRequest{RequestId: "h1"})
			return statusOutcome(err)
		}},
	{name: "a prompt hashed with another block size", want: contractOutcome{Code: "FailedPrecondition", Reason: "BLOCK_SIZE_MISMATCH",
		Message: `block_size 8, but model "ma" has blocks of 4 tokens`},
		contains: `block_size 8, but model "ma" has blocks of 4 tokens`,
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			req := hashedRoute("ma", contractP1, nil)
			req.BlockHashes, req.BlockSize = blockhash.Locals(nil, contractP1, 8, blockhash.Salt("", "")), 8
			return routeOutcome(r.b.Route(ctx, req))
		}},
	{name: "an infinite decode busy threshold", want: contractOutcome{Code: "InvalidArgument", Message: "must be a finite number >= 0"},
		contains: "must be a finite number >= 0",
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			inf := math.Inf(1)
			return routeOutcome(r.b.Route(ctx, &kvrouterv1.RouteRequest{Model: "ma", TokenIds: contractP1, QueryOnly: true,
				ConfigOverride: &kvrouterv1.RouterConfigOverride{ConditionalDisagg: &kvrouterv1.ConditionalDisaggOverride{DecodeBusyThreshold: &inf}}}))
		}},
	{name: "a worker that left gets no more requests, on any replica", want: contractOutcome{Code: "NotFound", Reason: "UNKNOWN_MODEL"},
		call: contractLeave},
	{name: "an image prompt goes to the worker caching that image, on any replica", want: contractOutcome{Code: "OK", Decode: 41, Mode: "ROUTE_MODE_AGGREGATED"},
		call: contractImage},
	{name: "an image prompt its caller hashed goes to the worker caching that image", want: contractOutcome{Code: "OK", Decode: 41, Mode: "ROUTE_MODE_AGGREGATED"},
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			img := blockhash.MultimodalHash("contract-image.png")
			return hashedOutcome(r.b.Route(ctx, hashedRoute("md", contractP1, []blockhash.MultimodalObject{{Hash: img, Start: 6, End: 12}})))
		}},
	{name: "a multimodal input past the prompt", want: contractOutcome{Code: "InvalidArgument", Message: "multimodal_objects[0].end: must be at most the number of token_ids 16 (got 17)"},
		contains: "multimodal_objects[0].end: must be at most the number of token_ids 16 (got 17)",
		call: func(ctx context.Context, r *contractReplicas) contractOutcome {
			return routeOutcome(r.b.Route(ctx, &kvrouterv1.RouteRequest{Model: "ma", TokenIds: contractP1, QueryOnly: true,
				MultimodalObjects: []*kvrouterv1.MultimodalObject{{MmHash: 1, Start: 8, End: 17}}}))
		}},
}

// hashedRoute is a query for prompt keyed by its caller, as a client that hashes its own prompts
// sends it: the local hashes of its complete 4-token blocks, with its multimodal inputs folded in.
func hashedRoute(model string, prompt []uint32, objects []blockhash.MultimodalObject) *kvrouterv1.RouteRequest {
	return &kvrouterv1.RouteRequest{Model: model, QueryOnly: true, BlockSize: 4, PromptTokens: uint32(len(prompt)),
		BlockHashes: blockhash.LocalsMultimodal(nil, prompt, 4, blockhash.Salt("", ""), objects)}
}

// hashedOutcome is routeOutcome for a hashedRoute, which must have found every complete block of
// its prompt cached on the worker it chose: the worker alone could be a tie-break's luck.
func hashedOutcome(resp *kvrouterv1.RouteResponse, err error) contractOutcome {
	out := routeOutcome(resp, err)
	if got := resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice(); err == nil && got != resp.GetDiagnostics().GetPromptBlocks() {
		out.Code = fmt.Sprintf("a hashed prompt overlapped %d of its %d blocks on %d", got, resp.GetDiagnostics().GetPromptBlocks(), out.Decode)
	}
	return out
}

// contractImage registers on A two workers of model md: 41 caches P1 with an image in its tokens
// [6, 12) (blocks 1 and 2 carry its hash), 42 caches P1's tokens as plain text. It returns what B
// answers for P1 with that image, once B holds both workers, after checking that P1 without the
// image goes to 42 (and so that the image's blocks are keyed apart on every replica).
func contractImage(ctx context.Context, r *contractReplicas) contractOutcome {
	img := blockhash.MultimodalHash("contract-image.png")
	for _, w := range []struct {
		id uint64
		mm []uint64
	}{{41, []uint64{img}}, {42, nil}} {
		stream, err := r.workersA.Publish(ctx) // open until the test ends
		if err != nil {
			return statusOutcome(err)
		}
		if err := stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
			WorkerId: w.id, Model: "md", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 4, TotalKvBlocks: 1000,
			KvEventsEnabled: true, Endpoint: fmt.Sprintf("w%d", w.id)}}}); err != nil {
			return statusOutcome(err)
		}
		if _, err := stream.Recv(); err != nil {
			return statusOutcome(err)
		}
		st := &kvrouterv1.BlocksStored{}
		for i := range 4 {
			b := &kvrouterv1.StoredBlock{BlockHash: w.id*1000 + uint64(i), TokenIds: contractP1[4*i : 4*i+4]}
			if i == 1 || i == 2 {
				b.MmHashes = w.mm
			}
			st.Blocks = append(st.Blocks, b)
		}
		if err := stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{{
			StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}}}}}); err != nil {
			return statusOutcome(err)
		}
		if _, err := stream.Recv(); err != nil {
			return statusOutcome(err)
		}
	}
	image := &kvrouterv1.RouteRequest{Model: "md", TokenIds: contractP1, QueryOnly: true,
		MultimodalObjects: []*kvrouterv1.MultimodalObject{{MmHash: img, Start: 6, End: 12}}}
	plain := &kvrouterv1.RouteRequest{Model: "md", TokenIds: contractP1, QueryOnly: true}
	var out contractOutcome
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
		out = routeOutcome(r.b.Route(ctx, image))
		return out.Decode == 41 && routeOutcome(r.b.Route(ctx, plain)).Decode == 42
	}) {
		if p := routeOutcome(r.b.Route(ctx, plain)); p.Decode != 42 {
			return contractOutcome{Code: fmt.Sprintf("P1 without its image went to %d (%s), want 42", p.Decode, p.Code)}
		}
	}
	return out
}

// contractLeave registers worker 31, the only one of model mc, on A, waits until B routes to it,
// has it leave, and returns what B answers for mc once the removal reached it (or after
// defaultTestTimeout): the leave's stream must end with OK.
func contractLeave(ctx context.Context, r *contractReplicas) contractOutcome {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := r.workersA.Publish(sctx)
	if err != nil {
		return statusOutcome(err)
	}
	if err := stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
		WorkerId: 31, Model: "mc", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 4, TotalKvBlocks: 1000,
		KvEventsEnabled: true, Endpoint: "w31"}}}); err != nil {
		return statusOutcome(err)
	}
	if _, err := stream.Recv(); err != nil {
		return statusOutcome(err)
	}
	query := &kvrouterv1.RouteRequest{Model: "mc", TokenIds: contractP1, QueryOnly: true}
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool { _, err := r.b.Route(ctx, query); return err == nil }) {
		return contractOutcome{Code: "B never routed to worker 31 before its leave"}
	}
	if err := stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Leave{Leave: &kvrouterv1.WorkerLeave{Reason: "contract"}}}); err != nil {
		return statusOutcome(err)
	}
	if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
		return contractOutcome{Code: fmt.Sprintf("the leave's stream ended with %v, want OK", err)}
	}
	var out contractOutcome
	kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
		out = routeOutcome(r.b.Route(ctx, query))
		return out.Code != "OK"
	})
	return out
}

// TestContractInEveryLayout runs contractRows on every layout.
func TestContractInEveryLayout(t *testing.T) {
	bin := buildBinary(t)
	common := []string{"--session-affinity-ttl", "10m", "--redis-reseed-window", "1s"}
	layouts := []struct {
		name  string
		start func(t *testing.T) (flags []string)
		shard bool
	}{
		{"embedded", nil, false},
		{"one Redis log", func(t *testing.T) []string { return []string{"--redis-addr", redistest.Start(t).Addr} }, false},
		{"sharded, one Redis server", func(t *testing.T) []string { return []string{"--redis-addr", redistest.Start(t).Addr} }, true},
		{"sharded, 3-master cluster", func(t *testing.T) []string {
			if testing.Short() {
				t.Skip("Redis Cluster runs skipped in -short mode")
			}
			return []string{"--redis-cluster-addrs", strings.Join(redistest.StartCluster(t, 3).Addrs, ",")}
		}, true},
	}
	for _, layout := range layouts {
		t.Run(layout.name, func(t *testing.T) {
			r := &contractReplicas{sharded: layout.shard}
			if layout.start == nil {
				a := startProcess(t, bin, append(common[:2:2], "--replica-id", "a")...)
				r.addrA, r.addrB, r.addrC = a.addr, a.addr, a.addr
			} else {
				flags := append(layout.start(t), common...)
				var cflags []string
				if layout.shard {
					flags = append(flags, "--redis-shard-by-model")
					cflags = []string{"--redis-models", "unused"} // a replica that serves none of the calls' models
				}
				a := startProcess(t, bin, append(flags, "--replica-id", "a")...)
				b := startProcess(t, bin, append(flags, "--replica-id", "b")...)
				c := startProcess(t, bin, append(append(flags, cflags...), "--replica-id", "c")...)
				r.addrA, r.addrB, r.addrC, r.separateC = a.addr, b.addr, c.addr, true
				steady(t, a.addr, b.addr, c.addr)
			}
			connA, connB, connC := dial(t, r.addrA), dial(t, r.addrB), dial(t, r.addrC)
			r.a, r.b, r.c = kvrouterv1.NewRouterServiceClient(connA), kvrouterv1.NewRouterServiceClient(connB), kvrouterv1.NewRouterServiceClient(connC)
			r.workersA, r.workersB = kvrouterv1.NewWorkerServiceClient(connA), kvrouterv1.NewWorkerServiceClient(connB)
			ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout)
			defer cancel()
			// Workers, all streaming to A: model ma has 11 (caching P1) and 12 (caching the
			// first block of P2), model mb has 21 (caching P1).
			for _, w := range []struct {
				id     uint64
				model  string
				prompt []uint32
				blocks int
			}{{11, "ma", contractP1, 4}, {12, "ma", contractP2, 1}, {21, "mb", contractP1, 4}} {
				contractWorker(ctx, t, r.workersA, w.id, w.model, w.prompt, w.blocks)
			}
			if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
				ws := listWorkers(t, r.addrB)
				return len(ws) == 3 && ws[11].GetCachedBlocks().GetDevice() == 4 && ws[12].GetCachedBlocks().GetDevice() == 1 && ws[21].GetCachedBlocks().GetDevice() == 4
			}) {
				t.Fatalf("B never held the three workers: %v", listWorkers(t, r.addrB))
			}
			for _, row := range contractRows {
				got := row.call(ctx, r)
				want := row.want
				if row.contains != "" {
					if strings.Contains(got.Message, row.contains) {
						got.Message = row.contains
					}
				} else {
					got.Message = ""
				}
				if diff := cmp.Diff(want, got); diff != "" {
					t.Errorf("%s (-want +got):\n%s", row.name, diff)
				}
			}
		})
	}
}

// contractWorker registers an aggregated worker of model on a stream left open until the test ends,
// caching the first blocks of prompt (block size 4), and waits for the ack.
func contractWorker(ctx context.Context, t *testing.T, workers kvrouterv1.WorkerServiceClient, id uint64, model string, prompt []uint32, blocks int) {
	t.Helper()
	sctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	stream, err := workers.Publish(sctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
		WorkerId: id, Model: model, Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 4, TotalKvBlocks: 1000,
		KvEventsEnabled: true, Endpoint: fmt.Sprintf("w%d", id)}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatalf("worker %d: registration = %v", id, err)
	}
	st := &kvrouterv1.BlocksStored{}
	for i := range blocks {
		st.Blocks = append(st.Blocks, &kvrouterv1.StoredBlock{BlockHash: id*1000 + uint64(i), TokenIds: prompt[4*i : 4*i+4]})
	}
	if err := stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{{
		StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}}}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatalf("worker %d: ack = %v", id, err)
	}
}

// helloErr opens a Publish stream with hello and returns the status it ends with (nil when the
// worker registered; the stream is then closed).
func helloErr(ctx context.Context, workers kvrouterv1.WorkerServiceClient, hello *kvrouterv1.WorkerHello) error {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := workers.Publish(sctx)
	if err != nil {
		return err
	}
	if err := stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: hello}}); err != nil {
		return err
	}
	_, err = stream.Recv()
	return err
}

// routeOutcome is a Route call's outcome.
func routeOutcome(resp *kvrouterv1.RouteResponse, err error) contractOutcome {
	out := statusOutcome(err)
	if err == nil {
		out.Decode, out.Mode, out.Annotations = resp.GetDecode().GetWorkerId(), resp.GetMode().String(), resp.GetAnnotations()
	}
	return out
}

// statusOutcome is a call's status code, ErrorInfo reason and message.
func statusOutcome(err error) contractOutcome {
	st := status.Convert(err)
	out := contractOutcome{Code: st.Code().String(), Message: st.Message()}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			out.Reason = info.GetReason()
		}
	}
	return out
}
