package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
	"github.com/kvrouter/kvrouter/server/config"
)

const defaultTestTimeout = 10 * time.Second

// testEnv is an in-process server on bufconn with clients for every service.
type testEnv struct {
	t        *testing.T
	state    *kvstate.State
	presence *kvstate.Presence
	log      kvstate.Log
	srv      *Server
	registry *prometheus.Registry
	conn     *grpc.ClientConn
	router   kvrouterv1.RouterServiceClient
	workers  kvrouterv1.WorkerServiceClient
	admin    kvrouterv1.AdminServiceClient
	ctx      context.Context
}

// withRouting changes the routing configuration of a test server.
func withRouting(change func(*policy.Config)) func(*Options) {
	return func(o *Options) {
		cfg := o.Dispatcher.Config()
		change(&cfg)
		o.Dispatcher = app.New(o.State, o.Log, policy.NewKernel(policy.StateView(o.State), cfg), app.Options{})
	}
}

func newTestEnv(t *testing.T, mutate ...func(*Options)) *testEnv {
	t.Helper()
	state := kvstate.NewState()
	log := kvstate.NewMemLog(state)
	registry := prometheus.NewRegistry()
	opts := Options{
		State: state, Log: log, Registry: registry,
		Dispatcher:      app.New(state, log, policy.NewKernel(policy.StateView(state), policy.DefaultConfig()), app.Options{}),
		Logger:          slog.New(slog.NewTextHandler(io.Discard, nil)),
		Config:          []config.Entry{{Key: "listen", Value: ":50051", Source: config.SourceDefault}, {Key: "overlap_score_credit", Value: "0.5", Source: config.SourceFlag}},
		MaxPromptTokens: 1000, MaxRecvMsgBytes: 4 << 20, MaxConcurrentStreams: 100,
	}
	for _, m := range mutate {
		m(&opts)
	}
	if opts.Presence == nil {
		opts.Presence = kvstate.NewPresence()
	}
	srv := New(opts)
	conn := serveBufconn(t, srv)
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	t.Cleanup(cancel)
	return &testEnv{
		t: t, state: state, presence: opts.Presence, log: opts.Log, srv: srv, registry: registry, conn: conn, ctx: ctx,
		router: kvrouterv1.NewRouterServiceClient(conn), workers: kvrouterv1.NewWorkerServiceClient(conn), admin: kvrouterv1.NewAdminServiceClient(conn),
	}
}

// serveBufconn serves srv on an in-memory listener until the test ends, and returns a client
// connection to it.
func serveBufconn(tb testing.TB, srv *Server) *grpc.ClientConn {
	tb.Helper()
	lis := bufconn.Listen(1 << 20)
	go srv.Serve(lis)
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatalf("grpc.NewClient() = %v", err)
	}
	tb.Cleanup(func() {
		conn.Close()
		srv.Stop()
	})
	return conn
}

// eventually waits until cond holds (kvtest.Eventually, with the tests' timeout).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	kvtest.Eventually(t, defaultTestTimeout, what, cond)
}

// wantStatus fails unless err carries code and exactly msg.
func wantStatus(t *testing.T, err error, code codes.Code, msg string) {
	t.Helper()
	st, _ := status.FromError(err)
	if st.Code() != code || st.Message() != msg {
		t.Errorf("got status %v %q, want %v %q", st.Code(), st.Message(), code, msg)
	}
}

// publisher drives one Publish stream.
type publisher struct {
	t      *testing.T
	stream grpc.BidiStreamingClient[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse]
}

func (e *testEnv) publish() *publisher {
	e.t.Helper()
	s, err := e.workers.Publish(e.ctx)
	if err != nil {
		e.t.Fatalf("Publish() = %v", err)
	}
	return &publisher{t: e.t, stream: s}
}

func (p *publisher) send(m *kvrouterv1.PublishRequest) {
	p.t.Helper()
	if err := p.stream.Send(m); err != nil {
		p.t.Fatalf("Send() = %v", err)
	}
}

func (p *publisher) recv() *kvrouterv1.PublishResponse {
	p.t.Helper()
	m, err := p.stream.Recv()
	if err != nil {
		p.t.Fatalf("Recv() = %v", err)
	}
	return m
}

// closeErr half-closes the stream and returns the status it ended with.
func (p *publisher) endErr() error {
	p.t.Helper()
	for {
		if _, err := p.stream.Recv(); err != nil {
			if err == io.EOF {
				return nil
			}
			return err
		}
	}
}

func hello(id uint64, role kvrouterv1.WorkerRole, blockSize uint32) *kvrouterv1.PublishRequest {
	return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
		WorkerId: id, Model: "m", Role: role, BlockSize: blockSize, TotalKvBlocks: 100, MaxNumBatchedTokens: 8192,
		Endpoint: "10.0.0.1:8000", SupportsBypass: true, KvEventsEnabled: true,
	}}}
}

func events(evs ...*kvrouterv1.KvEvent) *kvrouterv1.PublishRequest {
	return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: evs}}}
}

// stored is a device-tier stored event of blocks of block size 4 whose tokens are (first+i)*4+k.
func stored(id uint64, parent *uint64, first, n int) *kvrouterv1.KvEvent {
	st := &kvrouterv1.BlocksStored{ParentHash: parent}
	for i := first; i < first+n; i++ {
		st.Blocks = append(st.Blocks, &kvrouterv1.StoredBlock{BlockHash: uint64(1000 + i), TokenIds: blockTokens(i)})
	}
	return &kvrouterv1.KvEvent{EventId: id, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}
}

func blockTokens(i int) []uint32 {
	return []uint32{uint32(i*4 + 1), uint32(i*4 + 2), uint32(i*4 + 3), uint32(i*4 + 4)}
}

func promptTokens(blocks int) []uint32 {
	var out []uint32
	for i := range blocks {
		out = append(out, blockTokens(i)...)
	}
	return out
}

func ack(id uint64) *kvrouterv1.PublishResponse {
	return &kvrouterv1.PublishResponse{Message: &kvrouterv1.PublishResponse_Ack{Ack: &kvrouterv1.Ack{EventId: id}}}
}

func registered(last *uint64) *kvrouterv1.PublishResponse {
	return &kvrouterv1.PublishResponse{Message: &kvrouterv1.PublishResponse_Registered{Registered: &kvrouterv1.Registered{LastEventId: last}}}
}

func wantMsg(t *testing.T, got, want proto.Message) {
	t.Helper()
	if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
		t.Errorf("message mismatch (-want +got):\n%s", diff)
	}
}

// connect registers an aggregated worker with block size 4 and returns its open stream.
func (e *testEnv) connect(id uint64) *publisher {
	p := e.publish()
	p.send(hello(id, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4))
	wantMsg(e.t, p.recv(), registered(nil))
	return p
}

// cachedBlocks returns the worker's device-tier block count as ListWorkers reports it (-1 if absent).
func (e *testEnv) cachedBlocks(id uint64) int64 {
	e.t.Helper()
	resp, err := e.admin.ListWorkers(e.ctx, &kvrouterv1.ListWorkersRequest{})
	if err != nil {
		e.t.Fatalf("ListWorkers() = %v", err)
	}
	for _, w := range resp.GetWorkers() {
		if w.GetWorker().GetWorkerId() == id {
			return int64(w.GetCachedBlocks().GetDevice())
		}
	}
	return -1
}

func TestHealthAndReflectionNames(t *testing.T) {
	e := newTestEnv(t)
	h := healthpb.NewHealthClient(e.conn)
	for _, name := range append([]string{""}, serviceNames...) {
		resp, err := h.Check(e.ctx, &healthpb.HealthCheckRequest{Service: name})
		if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("Health.Check(%q) = %v, %v; want SERVING", name, resp.GetStatus(), err)
		}
	}
}

func TestRouteValidation(t *testing.T) {
	e := newTestEnv(t)
	p := e.connect(1)
	defer p.stream.CloseSend()
	valid := func() *kvrouterv1.RouteRequest {
		return &kvrouterv1.RouteRequest{RequestId: "r", Model: "m", TokenIds: promptTokens(2)}
	}
	nan, neg := math.NaN(), -1.0
	tests := []struct {
		name   string
		mutate func(*kvrouterv1.RouteRequest)
		code   codes.Code
		msg    string
	}{
		{"empty model", func(r *kvrouterv1.RouteRequest) { r.Model = "" }, codes.InvalidArgument, "model: must not be empty"},
		{"unknown model", func(r *kvrouterv1.RouteRequest) { r.Model = "other" }, codes.NotFound, `no worker serves this model: "other"`},
		{"empty token_ids", func(r *kvrouterv1.RouteRequest) { r.TokenIds = nil }, codes.InvalidArgument, "token_ids: must not be empty"},
		{"huge token_ids", func(r *kvrouterv1.RouteRequest) { r.TokenIds = make([]uint32, 1001) }, codes.InvalidArgument, "token_ids: has 1001 tokens, more than the maximum of 1000 (max_prompt_tokens)"},
		{"empty request id", func(r *kvrouterv1.RouteRequest) { r.RequestId = "" }, codes.InvalidArgument, "request_id: must not be empty"},
		{"long request id", func(r *kvrouterv1.RouteRequest) { r.RequestId = strings.Repeat("x", 513) }, codes.InvalidArgument, "request_id: must be at most 512 bytes (got 513)"},
		{"long model", func(r *kvrouterv1.RouteRequest) { r.Model = strings.Repeat("m", 257) }, codes.InvalidArgument, "model: must be at most 256 bytes (got 257)"},
		{"long session id", func(r *kvrouterv1.RouteRequest) { r.SessionId = strings.Repeat("s", 513) }, codes.InvalidArgument, "session_id: must be at most 512 bytes (got 513)"},
		{"NaN override", func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{OverlapScoreCredit: &nan}
		}, codes.InvalidArgument, "config_override.overlap_score_credit: must be a finite, non-negative number (got NaN)"},
		{"negative override", func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{RouterTemperature: &neg}
		}, codes.InvalidArgument, "config_override.router_temperature: must be a finite, non-negative number (got -1)"},
		{"rank without worker", func(r *kvrouterv1.RouteRequest) {
			rank := uint32(1)
			r.Hints = &kvrouterv1.RoutingHints{DecodeDpRank: &rank}
		}, codes.InvalidArgument, "hints.decode_dp_rank: needs hints.decode_worker_id"},
		{"multimodal object ends before it starts", func(r *kvrouterv1.RouteRequest) {
			r.MultimodalObjects = []*kvrouterv1.MultimodalObject{{MmHash: 1, Start: 0, End: 2}, {MmHash: 2, Start: 5, End: 5}}
		}, codes.InvalidArgument, "multimodal_objects[1].end: must be greater than start 5 (got 5)"},
		{"multimodal object past the prompt", func(r *kvrouterv1.RouteRequest) {
			r.MultimodalObjects = []*kvrouterv1.MultimodalObject{{MmHash: 1, Start: 4, End: 9}}
		}, codes.InvalidArgument, "multimodal_objects[0].end: must be at most the number of token_ids 8 (got 9)"},
		{"overlapping multimodal objects", func(r *kvrouterv1.RouteRequest) {
			r.MultimodalObjects = []*kvrouterv1.MultimodalObject{{MmHash: 1, Start: 5, End: 8}, {MmHash: 2, Start: 0, End: 2}, {MmHash: 3, Start: 1, End: 6}}
		}, codes.InvalidArgument, "multimodal_objects[2]: tokens [1, 6) overlap those of multimodal_objects[1], [0, 2)"},
		{"too many multimodal objects", func(r *kvrouterv1.RouteRequest) {
			r.MultimodalObjects = make([]*kvrouterv1.MultimodalObject, 257)
		}, codes.InvalidArgument, "multimodal_objects: must hold at most 256 inputs (got 257)"},
		{"block hashes without block_size", func(r *kvrouterv1.RouteRequest) { r.TokenIds, r.BlockHashes = nil, []uint64{1, 2} },
			codes.InvalidArgument, "block_size: must be set with block_hashes (the block size they were hashed with)"},
		{"prompt_tokens with token ids", func(r *kvrouterv1.RouteRequest) { r.PromptTokens = 8 },
			codes.InvalidArgument, "prompt_tokens: must be set only with block_size and block_hashes (token_ids count themselves)"},
		{"block hashes and token ids", func(r *kvrouterv1.RouteRequest) { hashed(r); r.TokenIds = promptTokens(2) },
			codes.InvalidArgument, "token_ids: must be empty with block_size and block_hashes (fold it into the hashes)"},
		{"block hashes and a LoRA name", func(r *kvrouterv1.RouteRequest) { hashed(r); r.LoraName = "l" },
			codes.InvalidArgument, "lora_name: must be empty with block_size and block_hashes (fold it into the hashes)"},
		{"block hashes and a cache namespace", func(r *kvrouterv1.RouteRequest) { hashed(r); r.CacheNamespace = "n" },
			codes.InvalidArgument, "cache_namespace: must be empty with block_size and block_hashes (fold it into the hashes)"},
		{"block hashes and multimodal objects", func(r *kvrouterv1.RouteRequest) {
			hashed(r)
			r.MultimodalObjects = []*kvrouterv1.MultimodalObject{{MmHash: 1, Start: 0, End: 2}}
		}, codes.InvalidArgument, "multimodal_objects: must be empty with block_size and block_hashes (fold it into the hashes)"},
		{"block hashes without prompt_tokens", func(r *kvrouterv1.RouteRequest) { hashed(r); r.PromptTokens = 0 },
			codes.InvalidArgument, "prompt_tokens: must be at least 1 with block_hashes"},
		{"a block size but no hash, and no tokens", func(r *kvrouterv1.RouteRequest) { hashed(r); r.BlockHashes, r.PromptTokens = nil, 0 },
			codes.InvalidArgument, "prompt_tokens: must be at least 1 with block_hashes"},
		{"prompt_tokens short of the hashes", func(r *kvrouterv1.RouteRequest) { hashed(r); r.PromptTokens = 7 },
			codes.InvalidArgument, "prompt_tokens: must be in [8, 12): 2 block_hashes of block_size 4 and a partial block (got 7)"},
		{"prompt_tokens past a partial block", func(r *kvrouterv1.RouteRequest) { hashed(r); r.PromptTokens = 12 },
			codes.InvalidArgument, "prompt_tokens: must be in [8, 12): 2 block_hashes of block_size 4 and a partial block (got 12)"},
		{"prompt_tokens over max_prompt_tokens", func(r *kvrouterv1.RouteRequest) {
			hashed(r)
			r.BlockHashes, r.PromptTokens = make([]uint64, 250), 1001
		}, codes.InvalidArgument, "prompt_tokens: is 1001, more than the maximum of 1000 (max_prompt_tokens)"},
		{"block hashes of another block size", func(r *kvrouterv1.RouteRequest) { hashed(r); r.BlockSize, r.BlockHashes = 8, r.BlockHashes[:1] },
			codes.FailedPrecondition, `block size differs from the model's: block_size 8, but model "m" has blocks of 4 tokens: hash the prompt with the model's block size`},
		{"pin to unknown worker", func(r *kvrouterv1.RouteRequest) {
			w := uint64(9)
			r.Hints = &kvrouterv1.RoutingHints{DecodeWorkerId: &w}
		}, codes.NotFound, "pinned worker not found: aggregated hop has no worker 9"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := valid()
			tt.mutate(req)
			_, err := e.router.Route(e.ctx, req)
			wantStatus(t, err, tt.code, tt.msg)
			if n := e.state.Load().Bookings(); n != 0 {
				t.Errorf("a rejected Route left %d bookings, want 0", n)
			}
		})
	}
}

// hashed makes r's prompt of 8 token ids (promptTokens(2)) a prompt keyed by its caller: its two
// blocks' local hashes for model m's block size of 4.
func hashed(r *kvrouterv1.RouteRequest) {
	r.BlockHashes = blockhash.Locals(nil, promptTokens(2), 4, blockhash.Salt("", ""))
	r.BlockSize, r.PromptTokens, r.TokenIds = 4, 8, nil
}

func TestRouteBadInputDetails(t *testing.T) {
	e := newTestEnv(t)
	_, err := e.router.Route(e.ctx, &kvrouterv1.RouteRequest{RequestId: "r", Model: "m"})
	st, _ := status.FromError(err)
	var got []*errdetails.BadRequest_FieldViolation
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			got = br.GetFieldViolations()
		}
	}
	wantMsg(t, &errdetails.BadRequest{FieldViolations: got}, &errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: "token_ids", Description: "must not be empty"}}})
}

func TestBookingLifecycle(t *testing.T) {
	e := newTestEnv(t)
	p := e.connect(1)
	defer p.stream.CloseSend()
	req := &kvrouterv1.RouteRequest{RequestId: "r1", Model: "m", TokenIds: promptTokens(3)}
	resp, err := e.router.Route(e.ctx, req)
	if err != nil {
		t.Fatalf("Route() = %v", err)
	}
	if !resp.GetBooked() || resp.GetMode() != kvrouterv1.RouteMode_ROUTE_MODE_AGGREGATED {
		t.Errorf("Route() booked %v mode %v, want booked AGGREGATED", resp.GetBooked(), resp.GetMode())
	}
	if got, want := e.gauge("kvrouter_booked_blocks", "", ""), float64(len(req.GetTokenIds())/4); got != want {
		t.Errorf("kvrouter_booked_blocks = %v with the one booking, want its %v blocks", got, want)
	}
	_, err = e.router.Route(e.ctx, req)
	wantStatus(t, err, codes.AlreadyExists, "request id is already booked")
	if _, err := e.router.MarkPrefillComplete(e.ctx, &kvrouterv1.MarkPrefillCompleteRequest{RequestId: "r1"}); err != nil {
		t.Errorf("MarkPrefillComplete() = %v", err)
	}
	if _, err := e.router.MarkPrefillComplete(e.ctx, &kvrouterv1.MarkPrefillCompleteRequest{RequestId: "r1"}); err != nil {
		t.Errorf("second MarkPrefillComplete() = %v, want it harmless", err)
	}
	if _, err := e.router.Free(e.ctx, &kvrouterv1.FreeRequest{RequestId: "r1"}); err != nil {
		t.Errorf("Free() = %v", err)
	}
	if got := e.gauge("kvrouter_booked_blocks", "", ""); got != 0 {
		t.Errorf("kvrouter_booked_blocks = %v once freed, want 0", got)
	}
	_, err = e.router.Free(e.ctx, &kvrouterv1.FreeRequest{RequestId: "r1"})
	wantStatus(t, err, codes.NotFound, `request_id "r1": request is not booked (never booked, already freed, or expired)`)
	_, err = e.router.MarkPrefillComplete(e.ctx, &kvrouterv1.MarkPrefillCompleteRequest{RequestId: "nope"})
	wantStatus(t, err, codes.NotFound, `request_id "nope": request is not booked (never booked, already freed, or expired)`)
	_, err = e.router.Free(e.ctx, &kvrouterv1.FreeRequest{})
	wantStatus(t, err, codes.InvalidArgument, "request_id: must not be empty")
}

func TestPublishHelloValidation(t *testing.T) {
	tests := []struct {
		name   string
		first  *kvrouterv1.PublishRequest
		code   codes.Code
		msg    string
		before func(e *testEnv)
	}{
		{name: "events before hello", first: events(stored(0, nil, 0, 1)),
			code: codes.FailedPrecondition, msg: "the first message on a Publish stream must be a hello (got events)"},
		{name: "worker id 0", first: hello(0, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, 4),
			code: codes.InvalidArgument, msg: "hello.worker_id: must not be 0"},
		{name: "block size 0", first: hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, 0),
			code: codes.InvalidArgument, msg: "hello.block_size: must be > 0"},
		{name: "unspecified role", first: hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_UNSPECIFIED, 4),
			code: codes.InvalidArgument, msg: "hello.role: must be PREFILL, DECODE or AGGREGATED (got WORKER_ROLE_UNSPECIFIED)"},
		{name: "long model name", first: func() *kvrouterv1.PublishRequest {
			h := hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, 4)
			h.GetHello().Model = strings.Repeat("m", 257)
			return h
		}(), code: codes.InvalidArgument, msg: "hello.model: must be at most 256 bytes (got 257)"},
		{name: "long endpoint", first: func() *kvrouterv1.PublishRequest {
			h := hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, 4)
			h.GetHello().Endpoint = strings.Repeat("e", 1025)
			return h
		}(), code: codes.InvalidArgument, msg: "hello.endpoint: must be at most 1024 bytes (got 1025)"},
		{name: "no endpoint", first: func() *kvrouterv1.PublishRequest {
			h := hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, 4)
			h.GetHello().Endpoint = ""
			return h
		}(), code: codes.InvalidArgument, msg: "hello.endpoint: must be set to the address frontends reach the worker at (or set hello.no_endpoint for a fleet whose frontends find workers by worker_id)"},
		{name: "endpoint and no_endpoint", first: func() *kvrouterv1.PublishRequest {
			h := hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, 4)
			h.GetHello().NoEndpoint = true
			return h
		}(), code: codes.InvalidArgument, msg: "hello.no_endpoint: must not be set with hello.endpoint"},
		{name: "hello too large to decode", first: func() *kvrouterv1.PublishRequest {
			h := hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, 4)
			h.GetHello().Endpoint = strings.Repeat("e", 1<<20)
			return h
		}(), code: codes.InvalidArgument, msg: "hello: must be at most 2304 bytes encoded (got 1048598): its model at most 256 bytes, its endpoint at most 1024"},
		{name: "block size differs from the model's", first: hello(2, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, 8),
			before: func(e *testEnv) { e.connect(1) },
			code:   codes.FailedPrecondition, msg: `block size differs from the model's: model "m" uses block_size 4, the worker registered 8`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newTestEnv(t)
			if tt.before != nil {
				tt.before(e)
			}
			before := len(e.state.Models())
			p := e.publish()
			p.send(tt.first)
			wantStatus(t, p.endErr(), tt.code, tt.msg)
			if got := len(e.state.Models()); got != before {
				t.Errorf("models after a rejected hello = %d, want %d", got, before)
			}
		})
	}
}

// TestPublishHelloWithoutEndpoint: a worker that says it has no endpoint registers, and routing
// decisions name it by worker id with an empty endpoint.
func TestPublishHelloWithoutEndpoint(t *testing.T) {
	e := newTestEnv(t)
	p := e.publish()
	h := hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4)
	h.GetHello().Endpoint, h.GetHello().NoEndpoint = "", true
	p.send(h)
	wantMsg(t, p.recv(), registered(nil))
	resp, err := e.router.Route(e.ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: []uint32{1, 2, 3, 4}, QueryOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if d := resp.GetDecode(); d.GetWorkerId() != 1 || d.GetEndpoint() != "" {
		t.Errorf("decode = %v, want worker 1 with no endpoint", d)
	}
}

func TestPublishSecondHello(t *testing.T) {
	e := newTestEnv(t)
	p := e.connect(1)
	p.send(hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4)) // identical: answered again
	wantMsg(t, p.recv(), registered(nil))
	changed := hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4)
	changed.GetHello().TotalKvBlocks = 200
	p.send(changed)
	wantStatus(t, p.endErr(), codes.FailedPrecondition,
		`hello: a second hello on a stream must repeat the first (worker 1/0 model "m" role aggregated block_size 4 total_kv_blocks 100 max_num_batched_tokens 8192) and must not set fresh_start; open a new stream to re-register`)
	if w := e.state.Worker(kvstate.WorkerKey{ID: 1}); w.Info.TotalKVBlocks != 100 {
		t.Errorf("total_kv_blocks after a rejected hello = %d, want 100", w.Info.TotalKVBlocks)
	}
}

func TestPublishEventValidation(t *testing.T) {
	unspecified := stored(1, nil, 1, 1)
	unspecified.StorageTier = kvrouterv1.StorageTier_STORAGE_TIER_UNSPECIFIED
	wrongRank := stored(1, nil, 1, 1)
	wrongRank.DpRank = 3
	shortBlock := stored(1, nil, 1, 1)
	shortBlock.GetStored().Blocks[0].TokenIds = []uint32{1, 2}
	both := stored(1, nil, 1, 1)
	h := uint64(5)
	both.GetStored().Blocks[0].TokensHash = &h
	neither := stored(1, nil, 1, 1)
	neither.GetStored().Blocks[0].TokenIds = nil
	mmWithHash := stored(1, nil, 1, 1)
	mmWithHash.GetStored().Blocks[0].TokenIds, mmWithHash.GetStored().Blocks[0].TokensHash = nil, &h
	mmWithHash.GetStored().Blocks[0].MmHashes = []uint64{7}
	mmTooMany := stored(1, nil, 1, 1)
	mmTooMany.GetStored().Blocks[0].MmHashes = make([]uint64, 65)
	noData := &kvrouterv1.KvEvent{EventId: 1, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE}
	emptyRemoved := &kvrouterv1.KvEvent{EventId: 1, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Removed{Removed: &kvrouterv1.BlocksRemoved{}}}
	tests := []struct {
		name  string
		batch *kvrouterv1.PublishRequest
		msg   string
	}{
		{"non-monotonic ids", events(stored(2, nil, 1, 1), stored(1, nil, 2, 1)), "events.events[1].event_id: must be greater than the previous event's id 2 within a batch (got 1)"},
		{"repeated id in a batch", events(stored(1, nil, 1, 1), stored(1, nil, 2, 1)), "events.events[1].event_id: must be greater than the previous event's id 1 within a batch (got 1)"},
		{"unspecified tier", events(unspecified), "events.events[0].storage_tier: must be DEVICE, HOST, DISK or EXTERNAL (got STORAGE_TIER_UNSPECIFIED)"},
		{"wrong rank", events(wrongRank), "events.events[0].dp_rank: must equal the stream's registered dp_rank 0 (got 3)"},
		{"short block", events(shortBlock), "events.events[0].stored.blocks[0].token_ids: must hold exactly block_size 4 tokens (got 2)"},
		{"tokens and hash", events(both), "events.events[0].stored.blocks[0]: must set exactly one of token_ids and tokens_hash (both are set)"},
		{"neither tokens nor hash", events(neither), "events.events[0].stored.blocks[0]: must set exactly one of token_ids and tokens_hash (neither is set)"},
		{"multimodal hashes with tokens_hash", events(mmWithHash), "events.events[0].stored.blocks[0].mm_hashes: must be empty with tokens_hash, which already holds them"},
		{"too many multimodal hashes", events(mmTooMany), "events.events[0].stored.blocks[0].mm_hashes: must hold at most 64 hashes (got 65)"},
		{"no data", events(noData), "events.events[0]: must set one of stored, removed, cleared"},
		{"empty removed", events(emptyRemoved), "events.events[0].removed.block_hashes: must not be empty"},
		{"empty batch", events(), "events.events: must not be empty"},
		{"valid event before a bad one is not applied", events(stored(1, nil, 1, 1), unspecified), "events.events[1].event_id: must be greater than the previous event's id 1 within a batch (got 1)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newTestEnv(t)
			p := e.connect(1)
			p.send(events(stored(0, nil, 0, 1)))
			wantMsg(t, p.recv(), ack(0))
			p.send(tt.batch)
			wantStatus(t, p.endErr(), codes.InvalidArgument, tt.msg)
			if got := e.cachedBlocks(1); got != 1 {
				t.Errorf("cached blocks after a rejected batch = %d, want 1", got)
			}
			if st := e.state.Worker(kvstate.WorkerKey{ID: 1}).Status(); st.LastEventID != 0 {
				t.Errorf("last event id after a rejected batch = %d, want 0", st.LastEventID)
			}
		})
	}
}

func TestPublishDropsAndCounts(t *testing.T) {
	e := newTestEnv(t)
	p := e.connect(1)
	defer p.stream.CloseSend()
	p.send(events(stored(0, nil, 0, 2)))
	wantMsg(t, p.recv(), ack(0))

	// A stored event whose parent is unknown is dropped and counted; its id is consumed.
	unknown := uint64(424242)
	p.send(events(stored(1, &unknown, 5, 1)))
	wantMsg(t, p.recv(), ack(1))
	// Removing a block the worker does not hold is counted, nothing else.
	p.send(events(&kvrouterv1.KvEvent{EventId: 2, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
		Data: &kvrouterv1.KvEvent_Removed{Removed: &kvrouterv1.BlocksRemoved{BlockHashes: []uint64{99999}}}}))
	wantMsg(t, p.recv(), ack(2))
	// A replayed batch (ids already applied) is dropped; the ack does not move, so none is sent,
	// and the next real event is acked.
	p.send(events(stored(1, nil, 0, 2), stored(2, nil, 0, 2)))
	p.send(events(stored(3, nil, 0, 3)))
	wantMsg(t, p.recv(), ack(3))

	if got := e.cachedBlocks(1); got != 3 {
		t.Errorf("cached blocks = %d, want 3", got)
	}
	for outcome, want := range map[string]float64{"applied": 4, "parent_not_found": 1, "unknown_removed": 1, "duplicate": 2} {
		if m := e.counter("kvrouter_kv_events_total", "outcome", outcome); m != want {
			t.Errorf("kvrouter_kv_events_total{outcome=%q} = %v, want %v", outcome, m, want)
		}
	}
}

// counter returns the value of the counter name{label=value}, or 0 if it was never incremented.
func (e *testEnv) counter(name, label, value string) float64 {
	e.t.Helper()
	if m := e.metric(name, label, value); m != nil {
		return m.GetCounter().GetValue()
	}
	return 0
}

// gauge returns the value of the gauge name{label=value}, or -1 if there is none.
func (e *testEnv) gauge(name, label, value string) float64 {
	e.t.Helper()
	if m := e.metric(name, label, value); m != nil {
		return m.GetGauge().GetValue()
	}
	return -1
}

// metric finds the sample name{label=value} in the registry (label "": the sample of a metric
// without labels).
func (e *testEnv) metric(name, label, value string) *dto.Metric {
	e.t.Helper()
	mfs, err := e.registry.Gather()
	if err != nil {
		e.t.Fatalf("Gather() = %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if label == "" {
				return m // a metric without labels
			}
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					return m
				}
			}
		}
	}
	return nil
}

func TestPublishGapResyncAndDump(t *testing.T) {
	e := newTestEnv(t)
	p := e.connect(1)
	p.send(events(stored(0, nil, 0, 1), stored(1, nil, 0, 2)))
	wantMsg(t, p.recv(), ack(1))
	p.send(events(stored(3, nil, 0, 3))) // 2 is missing
	wantMsg(t, p.recv(), &kvrouterv1.PublishResponse{Message: &kvrouterv1.PublishResponse_Resync{Resync: &kvrouterv1.ResyncRequest{
		Reason: "gap: expected event 2, got 3", ExpectedEventId: 2}}})
	if got := e.cachedBlocks(1); got != 0 {
		t.Errorf("cached blocks after a gap = %d, want 0 (the worker's state is reset)", got)
	}
	// A reconnect while the dump is awaited is asked again.
	p.stream.CloseSend()
	if err := p.endErr(); err != nil {
		t.Fatalf("stream end = %v", err)
	}
	p = e.publish()
	p.send(hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4))
	last := uint64(1)
	wantMsg(t, p.recv(), registered(&last))
	wantMsg(t, p.recv(), &kvrouterv1.PublishResponse{Message: &kvrouterv1.PublishResponse_Resync{Resync: &kvrouterv1.ResyncRequest{
		Reason: "a dump is still awaited after an event id gap", ExpectedEventId: 2}}})
	p.send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Dump{Dump: &kvrouterv1.KvDump{
		ThroughEventId: 3, Events: []*kvrouterv1.KvEvent{stored(0, nil, 0, 4)}}}})
	wantMsg(t, p.recv(), ack(3))
	p.send(events(stored(4, nil, 0, 5)))
	wantMsg(t, p.recv(), ack(4))
	if got := e.cachedBlocks(1); got != 5 {
		t.Errorf("cached blocks after the dump = %d, want 5", got)
	}
	p.stream.CloseSend()
}

func TestRouteAfterPublish(t *testing.T) {
	e := newTestEnv(t)
	a, b := e.connect(1), e.connect(2)
	defer a.stream.CloseSend()
	defer b.stream.CloseSend()
	a.send(events(stored(0, nil, 0, 8)))
	wantMsg(t, a.recv(), ack(0))
	b.send(events(stored(0, nil, 0, 2)))
	wantMsg(t, b.recv(), ack(0))
	resp, err := e.router.Route(e.ctx, &kvrouterv1.RouteRequest{RequestId: "r", Model: "m", TokenIds: promptTokens(8), Explain: true,
		Annotations: []string{"keep", policy.BypassAnnotation, policy.BypassAnnotation + ":true",
			policy.PrefillContinueAnnotation, policy.PrefillContinueAnnotation + ":1"}})
	if err != nil {
		t.Fatalf("Route() = %v", err)
	}
	if got := resp.GetDecode().GetWorkerId(); got != 1 {
		t.Errorf("Route() chose worker %d, want 1", got)
	}
	if got := resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice(); got != 8 {
		t.Errorf("decode overlap = %d, want 8", got)
	}
	overlaps := map[uint64]uint64{}
	for _, c := range resp.GetDiagnostics().GetCandidates() {
		overlaps[c.GetWorker().GetWorkerId()] = c.GetOverlapBlocks().GetDevice()
	}
	if diff := cmp.Diff(map[uint64]uint64{1: 8, 2: 2}, overlaps); diff != "" {
		t.Errorf("candidate overlaps mismatch (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"keep"}, resp.GetAnnotations()); diff != "" {
		t.Errorf("annotations mismatch (-want +got):\n%s", diff)
	}
	if got := e.counter("kvrouter_route_decisions_total", "mode", "aggregated"); got != 1 {
		t.Errorf("kvrouter_route_decisions_total{aggregated} = %v, want 1", got)
	}
}

// TestRouteWithMultimodalInputs stores blocks holding an image's tokens and routes prompts of the
// same tokens with that image, another image and none: only the first matches past the image.
func TestRouteWithMultimodalInputs(t *testing.T) {
	e := newTestEnv(t)
	p := e.connect(1)
	defer p.stream.CloseSend()
	cat, dog := blockhash.MultimodalHash("cat.png"), blockhash.MultimodalHash("dog.png")
	ev := stored(0, nil, 0, 6)
	for _, i := range []int{2, 3} { // the image fills tokens [9, 16): blocks 2 and 3
		ev.GetStored().Blocks[i].MmHashes = []uint64{cat}
	}
	p.send(events(ev))
	wantMsg(t, p.recv(), ack(0))
	for _, tt := range []struct {
		name    string
		objects []*kvrouterv1.MultimodalObject
		want    uint64
	}{
		{"same image", []*kvrouterv1.MultimodalObject{{MmHash: cat, Start: 9, End: 16}}, 6},
		{"same image, other placement in the same blocks", []*kvrouterv1.MultimodalObject{{MmHash: cat, Start: 8, End: 13}}, 6},
		{"other image", []*kvrouterv1.MultimodalObject{{MmHash: dog, Start: 9, End: 16}}, 2},
		{"no image", nil, 2},
		{"image in one block only", []*kvrouterv1.MultimodalObject{{MmHash: cat, Start: 9, End: 12}}, 3},
	} {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := e.router.Route(e.ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: promptTokens(6), QueryOnly: true, MultimodalObjects: tt.objects})
			if err != nil {
				t.Fatalf("Route() = %v", err)
			}
			if got := resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice(); got != tt.want {
				t.Errorf("overlap = %d blocks, want %d", got, tt.want)
			}
			// The same prompt keyed by its caller overlaps as much.
			var objs []blockhash.MultimodalObject
			for _, o := range tt.objects {
				objs = append(objs, blockhash.MultimodalObject{Hash: o.GetMmHash(), Start: o.GetStart(), End: o.GetEnd()})
			}
			resp, err = e.router.Route(e.ctx, &kvrouterv1.RouteRequest{Model: "m", QueryOnly: true, BlockSize: 4, PromptTokens: 24,
				BlockHashes: blockhash.LocalsMultimodal(nil, promptTokens(6), 4, blockhash.Salt("", ""), objs)})
			if err != nil {
				t.Fatalf("Route(hashed) = %v", err)
			}
			if got := resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice(); got != tt.want {
				t.Errorf("hashed: overlap = %d blocks, want %d", got, tt.want)
			}
		})
	}
}

func TestAdmin(t *testing.T) {
	e := newTestEnv(t)
	p := e.connect(7)
	p.send(events(stored(0, nil, 0, 3)))
	wantMsg(t, p.recv(), ack(0))
	p.send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Load{Load: &kvrouterv1.LoadReport{KvUsedBlocks: 12, WaitingRequests: 2}}})
	// A load report has no ack: wait for it to be applied.
	eventually(t, "the load report to be applied", func() bool {
		st := e.state.Worker(kvstate.WorkerKey{ID: 7}).Status()
		return st.KVUsedBlocks == 12 && st.WaitingRequests == 2
	})
	if _, err := e.router.Route(e.ctx, &kvrouterv1.RouteRequest{RequestId: "r", Model: "m", TokenIds: promptTokens(3)}); err != nil {
		t.Fatalf("Route() = %v", err)
	}
	resp, err := e.admin.ListWorkers(e.ctx, &kvrouterv1.ListWorkersRequest{Model: "m"})
	if err != nil {
		t.Fatalf("ListWorkers() = %v", err)
	}
	zero := uint64(0)
	want := &kvrouterv1.ListWorkersResponse{Workers: []*kvrouterv1.WorkerStatus{{
		Worker: &kvrouterv1.WorkerTarget{WorkerId: 7, Endpoint: "10.0.0.1:8000"}, Model: "m",
		Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 4, TotalKvBlocks: 100, MaxNumBatchedTokens: 8192,
		SupportsBypass: true, KvEventsEnabled: true, Connected: true, LastEventId: &zero,
		CachedBlocks: &kvrouterv1.TierBlocks{Device: 3},
		Load:         &kvrouterv1.WorkerLoad{ActiveBlocks: 3, ActiveRequests: 1, KvUsedBlocks: 12, WaitingRequests: 2},
	}}}
	wantMsg(t, resp, want)
	cfg, err := e.admin.GetConfig(e.ctx, &kvrouterv1.GetConfigRequest{})
	if err != nil {
		t.Fatalf("GetConfig() = %v", err)
	}
	wantMsg(t, cfg, &kvrouterv1.GetConfigResponse{Entries: []*kvrouterv1.ConfigEntry{
		{Key: "listen", Value: ":50051", Source: kvrouterv1.ConfigSource_CONFIG_SOURCE_DEFAULT},
		{Key: "overlap_score_credit", Value: "0.5", Source: kvrouterv1.ConfigSource_CONFIG_SOURCE_FLAG},
	}})
	st, err := e.admin.GetState(e.ctx, &kvrouterv1.GetStateRequest{})
	if err != nil {
		t.Fatalf("GetState() = %v", err)
	}
	wantMsg(t, st, &kvrouterv1.GetStateResponse{Log: "embedded", LogPosition: e.log.Position(), Digest: fmt.Sprintf("%016x", e.state.Digest()),
		Workers: 1, IndexBlocks: 3, Bookings: 1, SharedStateComplete: true})
	p.stream.CloseSend()
}

// TestShutdownEndsStreams: shutdown turns health NOT_SERVING and ends Publish streams with UNAVAILABLE
// so workers reconnect to another replica.
func TestShutdownEndsStreams(t *testing.T) {
	e := newTestEnv(t)
	p := e.connect(1)
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	done := make(chan struct{})
	go func() {
		e.srv.Shutdown(ctx, 0)
		close(done)
	}()
	wantStatus(t, p.endErr(), codes.Unavailable, "router is shutting down; reconnect to another replica")
	<-done
	st := e.srv.health
	resp, err := st.Check(ctx, &healthpb.HealthCheckRequest{Service: ""})
	if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Errorf("health after shutdown = %v, %v; want NOT_SERVING", resp.GetStatus(), err)
	}
}

// TestErrorMapping: every domain error becomes its status code, with a stable reason; context errors
// pass through; anything else is INTERNAL.
func TestErrorMapping(t *testing.T) {
	for _, d := range domainErrors {
		st, _ := status.FromError(toStatus(fmt.Errorf("wrapped: %w", d.err)))
		var reason string
		for _, det := range st.Details() {
			if ei, ok := det.(*errdetails.ErrorInfo); ok {
				reason = ei.GetReason()
			}
		}
		if st.Code() != d.code || reason != d.reason {
			t.Errorf("toStatus(%v) = %v %q, want %v %q", d.err, st.Code(), reason, d.code, d.reason)
		}
	}
	if got := status.Code(toStatus(context.DeadlineExceeded)); got != codes.DeadlineExceeded {
		t.Errorf("toStatus(DeadlineExceeded) = %v", got)
	}
	if got := status.Code(toStatus(kvstate.ErrLogUnavailable)); got != codes.Unavailable {
		t.Errorf("toStatus(ErrLogUnavailable) = %v, want Unavailable", got)
	}
	if got := status.Code(toStatus(errors.New("boom"))); got != codes.Internal {
		t.Errorf("toStatus(unknown) = %v, want Internal", got)
	}
}
