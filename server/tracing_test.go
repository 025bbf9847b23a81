package server

import (
	"context"
	"io"
	"log/slog"
	"net"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
)

// tracedEnv is a test server whose spans land in memory, as they end.
func tracedEnv(t *testing.T, mutate ...func(*Options)) (*testEnv, *tracetest.InMemoryExporter) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return newTestEnv(t, append(mutate, func(o *Options) { o.TracerProvider = tp })...), exp
}

// endedSpan waits for the one ended span named name matching match (nil: any) and returns it.
func endedSpan(t *testing.T, exp *tracetest.InMemoryExporter, name string, match func(tracetest.SpanStub) bool) tracetest.SpanStub {
	t.Helper()
	var found []tracetest.SpanStub
	eventually(t, "span "+name, func() bool {
		found = found[:0]
		for _, s := range exp.GetSpans() {
			if s.Name == name && (match == nil || match(s)) {
				found = append(found, s)
			}
		}
		return len(found) > 0
	})
	if len(found) != 1 {
		t.Fatalf("%d spans named %s match, want 1", len(found), name)
	}
	return found[0]
}

// kvAttrs returns a span's kvrouter.* attributes (kvrouter.append_ms only as present: it is a timing).
func kvAttrs(s tracetest.SpanStub) map[attribute.Key]any {
	out := map[attribute.Key]any{}
	for _, a := range s.Attributes {
		switch {
		case a.Key == AttrAppendMS:
			out[a.Key] = "present"
		case len(a.Key) > 9 && a.Key[:9] == "kvrouter.":
			out[a.Key] = a.Value.AsInterface()
		}
	}
	return out
}

// noSlices fails if any attribute of any span is a list: the only lists a Route carries are its
// token ids, which must never be recorded.
func noSlices(t *testing.T, spans tracetest.SpanStubs) {
	t.Helper()
	for _, s := range spans {
		for _, a := range s.Attributes {
			switch a.Value.Type() {
			case attribute.INT64SLICE, attribute.STRINGSLICE, attribute.FLOAT64SLICE, attribute.BOOLSLICE:
				t.Errorf("span %s has list attribute %s = %v", s.Name, a.Key, a.Value.Emit())
			}
		}
	}
}

// TestRouteSpan: a traced Route's server span continues the caller's trace (W3C traceparent in
// the metadata) and carries the decision; a failed Route carries the request's model and size.
func TestRouteSpan(t *testing.T) {
	e, exp := tracedEnv(t)
	p := e.connect(1)
	defer p.stream.CloseSend()
	p.send(events(stored(0, nil, 0, 3)))
	wantMsg(t, p.recv(), ack(0))

	const traceID, parentID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	ctx := metadata.AppendToOutgoingContext(e.ctx, "traceparent", "00-"+traceID+"-"+parentID+"-01")
	if _, err := e.router.Route(ctx, &kvrouterv1.RouteRequest{RequestId: "r1", Model: "m", TokenIds: promptTokens(4)}); err != nil {
		t.Fatalf("Route() = %v", err)
	}
	s := endedSpan(t, exp, "kvrouter.v1.RouterService/Route", nil)
	if got := s.SpanContext.TraceID().String(); got != traceID {
		t.Errorf("Route span trace id = %s, want the traceparent's %s", got, traceID)
	}
	if got := s.Parent.SpanID().String(); got != parentID || !s.Parent.IsRemote() {
		t.Errorf("Route span parent = %s (remote %v), want the traceparent's %s", got, s.Parent.IsRemote(), parentID)
	}
	if s.SpanKind != trace.SpanKindServer {
		t.Errorf("Route span kind = %v, want server", s.SpanKind)
	}
	want := map[attribute.Key]any{
		AttrModel: "m", AttrRequestID: "r1", AttrQueryOnly: false, AttrPromptTokens: int64(16),
		AttrMode: "aggregated", AttrReason: "no_prefill_workers", AttrBooked: true,
		AttrDecodeWorker: "1/0", AttrOverlapBlocks: int64(3), AttrCachedTokens: float64(12),
	}
	if diff := cmp.Diff(want, kvAttrs(s)); diff != "" {
		t.Errorf("Route span attributes mismatch (-want +got):\n%s", diff)
	}

	exp.Reset()
	if _, err := e.router.Route(e.ctx, &kvrouterv1.RouteRequest{RequestId: "r2", Model: "other", TokenIds: promptTokens(2), QueryOnly: true}); err == nil {
		t.Fatalf("Route(unknown model) succeeded, want NOT_FOUND")
	}
	s = endedSpan(t, exp, "kvrouter.v1.RouterService/Route", nil)
	want = map[attribute.Key]any{AttrModel: "other", AttrRequestID: "r2", AttrQueryOnly: true, AttrPromptTokens: int64(8)}
	if diff := cmp.Diff(want, kvAttrs(s)); diff != "" {
		t.Errorf("failed Route span attributes mismatch (-want +got):\n%s", diff)
	}
	if s.Parent.IsValid() {
		t.Errorf("Route without traceparent has parent %v, want a root span", s.Parent)
	}
	noSlices(t, exp.GetSpans())
}

// TestRouteSpanDisaggregated: the prefill worker and the conditional-disaggregation gate and
// effective ISL are recorded when the decision has them.
func TestRouteSpanDisaggregated(t *testing.T) {
	e, exp := tracedEnv(t, withCD(nil))
	pre := registerRole(e, 1, kvrouterv1.WorkerRole_WORKER_ROLE_PREFILL, true)
	dec := registerRole(e, 2, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, true)
	defer pre.stream.CloseSend()
	defer dec.stream.CloseSend()
	dec.send(events(stored(0, nil, 0, 15)))
	wantMsg(t, dec.recv(), ack(0))
	route := func(id string, tokens []uint32) map[attribute.Key]any {
		t.Helper()
		exp.Reset()
		if _, err := e.router.Route(e.ctx, &kvrouterv1.RouteRequest{RequestId: id, Model: "m", TokenIds: tokens}); err != nil {
			t.Fatalf("Route(%s) = %v", id, err)
		}
		return kvAttrs(endedSpan(t, exp, "kvrouter.v1.RouterService/Route", nil))
	}
	want := map[attribute.Key]any{
		AttrModel: "m", AttrRequestID: "bypass", AttrQueryOnly: false, AttrPromptTokens: int64(64),
		AttrMode: "bypass", AttrReason: "bypass", AttrBooked: true, AttrDecodeWorker: "2/0", AttrOverlapBlocks: int64(15),
		AttrCachedTokens: float64(60), AttrEffectiveISL: float64(4), AttrGate: "bypass_allowed_decode_gate_disabled",
	}
	if diff := cmp.Diff(want, route("bypass", promptTokens(16))); diff != "" {
		t.Errorf("bypass Route span attributes mismatch (-want +got):\n%s", diff)
	}
	// A prompt nobody holds: the policy declines the bypass, prefill goes to worker 1.
	cold := make([]uint32, 64)
	for i := range cold {
		cold[i] = uint32(50000 + i)
	}
	want = map[attribute.Key]any{
		AttrModel: "m", AttrRequestID: "cold", AttrQueryOnly: false, AttrPromptTokens: int64(64),
		AttrMode: "disaggregated", AttrReason: "policy_declined", AttrBooked: true, AttrDecodeWorker: "2/0", AttrOverlapBlocks: int64(0),
		AttrCachedTokens: float64(0), AttrEffectiveISL: float64(64), AttrGate: "bypass_declined_by_policy",
		AttrPrefillWorker: "1/0", AttrPrefillOverlap: int64(0),
	}
	if diff := cmp.Diff(want, route("cold", cold)); diff != "" {
		t.Errorf("disaggregated Route span attributes mismatch (-want +got):\n%s", diff)
	}
}

// TestPublishSpans: each applied hello, event batch and dump has a span of its own trace, linked to
// the stream's span, with the worker, the counts and the append's outcome.
func TestPublishSpans(t *testing.T) {
	e, exp := tracedEnv(t)
	p := e.connect(3)
	p.send(events(stored(0, nil, 0, 3), &kvrouterv1.KvEvent{EventId: 1, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
		Data: &kvrouterv1.KvEvent_Removed{Removed: &kvrouterv1.BlocksRemoved{BlockHashes: []uint64{1002}}}}))
	wantMsg(t, p.recv(), ack(1))
	p.send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Dump{Dump: &kvrouterv1.KvDump{
		ThroughEventId: 7, Events: []*kvrouterv1.KvEvent{stored(0, nil, 0, 4)}}}})
	wantMsg(t, p.recv(), ack(7))
	p.stream.CloseSend()
	if err := p.endErr(); err != nil {
		t.Fatalf("stream end = %v", err)
	}
	stream := endedSpan(t, exp, "kvrouter.v1.WorkerService/Publish", nil)
	epoch := int64(e.state.Worker(kvstate.WorkerKey{ID: 3}).Status().Epoch) // the incarnation the hello got
	worker := map[attribute.Key]any{AttrWorkerID: int64(3), AttrDPRank: int64(0), AttrModel: "m",
		AttrAppendMS: "present", AttrSharedLog: false, AttrBuffered: false}
	with := func(m map[attribute.Key]any) map[attribute.Key]any {
		for k, v := range worker {
			m[k] = v
		}
		return m
	}
	for _, tt := range []struct {
		name string
		want map[attribute.Key]any
	}{
		{SpanPublishHello, with(map[attribute.Key]any{AttrRole: "aggregated", AttrEpoch: epoch})},
		{SpanPublishEvents, with(map[attribute.Key]any{AttrEvents: int64(2), AttrBlocks: int64(4), AttrApplied: int64(2), AttrLastEventID: int64(1)})},
		{SpanPublishDump, with(map[attribute.Key]any{AttrEvents: int64(1), AttrBlocks: int64(4), AttrApplied: int64(1), AttrLastEventID: int64(7)})},
	} {
		s := endedSpan(t, exp, tt.name, nil)
		if diff := cmp.Diff(tt.want, kvAttrs(s)); diff != "" {
			t.Errorf("%s attributes mismatch (-want +got):\n%s", tt.name, diff)
		}
		if s.Parent.IsValid() || s.SpanContext.TraceID() == stream.SpanContext.TraceID() {
			t.Errorf("%s is in the stream's trace (parent %v), want a trace of its own", tt.name, s.Parent)
		}
		if len(s.Links) != 1 || s.Links[0].SpanContext.SpanID() != stream.SpanContext.SpanID() {
			t.Errorf("%s links %v, want one link to the stream's span %v", tt.name, s.Links, stream.SpanContext.SpanID())
		}
	}
	noSlices(t, exp.GetSpans())
}

// TestHealthNotTraced: probes' health checks make no span.
func TestHealthNotTraced(t *testing.T) {
	e, exp := tracedEnv(t)
	if _, err := healthpb.NewHealthClient(e.conn).Check(e.ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("Health.Check() = %v", err)
	}
	if _, err := e.admin.ListWorkers(e.ctx, &kvrouterv1.ListWorkersRequest{}); err != nil {
		t.Fatalf("ListWorkers() = %v", err)
	}
	endedSpan(t, exp, "kvrouter.v1.AdminService/ListWorkers", nil) // the health check's span would have ended before
	for _, s := range exp.GetSpans() {
		if s.Name != "kvrouter.v1.AdminService/ListWorkers" {
			t.Errorf("span %s recorded, want only kvrouter.v1 calls traced", s.Name)
		}
	}
}

// TestUntracedAllocatesNothing: with tracing off, or a span that does not record, tracing a Route
// or starting a Publish message's span allocates nothing.
func TestUntracedAllocatesNothing(t *testing.T) {
	w := &kvstate.Worker{Info: kvstate.WorkerInfo{Key: kvstate.WorkerKey{ID: 1}, Model: "m"}}
	dec := &policy.Decision{Mode: policy.ModeDisaggregated, Decode: policy.Choice{Candidate: policy.Candidate{Worker: w}},
		Prefill: &policy.Choice{Candidate: policy.Candidate{Worker: w}}, CD: &policy.CDDiagnostics{Gate: policy.GateDeniedBusy}}
	req := &kvrouterv1.RouteRequest{RequestId: "r", Model: "m", TokenIds: []uint32{1, 2, 3}}
	never := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.NeverSample()))
	defer never.Shutdown(context.Background())
	unsampled, span := never.Tracer("t").Start(context.Background(), "s")
	defer span.End()
	for name, ctx := range map[string]context.Context{"no span": context.Background(), "unsampled span": unsampled} {
		if n := testing.AllocsPerRun(100, func() { traceRoute(ctx, req, dec) }); n != 0 {
			t.Errorf("traceRoute(%s) allocates %v times, want 0", name, n)
		}
	}
	var change kvstate.Change = kvstate.KVEvents{Worker: w.Info.Key, Events: []kvstate.Event{{ID: 1, Kind: kvstate.EventCleared}}}
	off := publishObserver{}
	if n := testing.AllocsPerRun(100, func() {
		if _, done := off.Appending(context.Background(), nil, w.Info, change); done != nil {
			t.Fatal("Appending() without a tracer returned a function to end a span, want none")
		}
	}); n != 0 {
		t.Errorf("Appending() without a tracer allocates %v times, want 0", n)
	}
	unrecorded := publishObserver{tracer: never.Tracer("t")}
	if _, done := unrecorded.Appending(context.Background(), nil, w.Info, change); done != nil {
		t.Error("Appending() of an unsampled span returned a function to end it, want none (nothing to record)")
	}
}

// routeBench is an in-process server over bufconn holding 16 aggregated workers, worker w caching
// the first 8(w+1) blocks of a 2,048-token prompt (block size 16), and a client for it.
func routeBench(b *testing.B, mutate func(*Options)) (kvrouterv1.RouterServiceClient, []uint32) {
	b.Helper()
	state := kvstate.NewState()
	log := kvstate.NewMemLog(state)
	ctx := context.Background()
	const blockSize, blocks = 16, 128
	prompt := make([]uint32, blockSize*blocks)
	for i := range prompt {
		prompt[i] = uint32(i*7 + 3)
	}
	salt := blockhash.Salt("", "")
	seq := blockhash.Sequence(nil, blockhash.Locals(nil, prompt, blockSize, salt))
	for w := range 16 {
		key := kvstate.WorkerKey{ID: uint64(w + 1)}
		if _, err := log.Append(ctx, kvstate.WorkerUp{Info: kvstate.WorkerInfo{Key: key, Model: "bench", Role: kvstate.RoleAggregated,
			BlockSize: blockSize, TotalKVBlocks: 1 << 16, KVEventsEnabled: true}}); err != nil {
			b.Fatalf("WorkerUp: %v", err)
		}
		ev := kvstate.Event{Kind: kvstate.EventStored, Tier: kvstate.TierDevice}
		for i := range 8 * (w + 1) {
			ev.Blocks = append(ev.Blocks, kvstate.Block{Hash: seq[i], Local: blockhash.Local(prompt[i*blockSize:(i+1)*blockSize], salt)})
		}
		if _, err := log.Append(ctx, kvstate.KVEvents{Worker: key, Events: []kvstate.Event{ev}}); err != nil {
			b.Fatalf("KVEvents: %v", err)
		}
	}
	opts := Options{
		State: state, Log: log, Registry: prometheus.NewRegistry(),
		Dispatcher: app.New(state, log, policy.NewKernel(policy.StateView(state), policy.DefaultConfig()), app.Options{}),
		Logger:     slog.New(slog.NewTextHandler(io.Discard, nil)), MaxPromptTokens: 1 << 16, MaxRecvMsgBytes: 4 << 20, MaxConcurrentStreams: 100,
	}
	if mutate != nil {
		mutate(&opts)
	}
	return kvrouterv1.NewRouterServiceClient(serveBufconn(b, New(opts))), prompt
}

// otlpReceiver is an OTLP/gRPC trace receiver on loopback that counts and drops what it gets.
type otlpReceiver struct {
	coltracepb.UnimplementedTraceServiceServer
	spans atomic.Int64
}

func (r *otlpReceiver) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			r.spans.Add(int64(len(ss.GetSpans())))
		}
	}
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

// otlpProvider is the provider kvrouter serve builds with tracing on (sampler given), exporting
// over OTLP/gRPC to a receiver on loopback in this process.
func otlpProvider(b *testing.B, sampler sdktrace.Sampler) (*sdktrace.TracerProvider, *otlpReceiver) {
	b.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatalf("net.Listen() = %v", err)
	}
	recv := &otlpReceiver{}
	gs := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(gs, recv)
	go gs.Serve(lis)
	exp, err := otlptracegrpc.New(context.Background(), otlptracegrpc.WithEndpoint(lis.Addr().String()), otlptracegrpc.WithInsecure())
	if err != nil {
		b.Fatalf("otlptracegrpc.New() = %v", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithSampler(sampler))
	b.Cleanup(func() {
		_ = tp.Shutdown(context.Background())
		gs.Stop()
	})
	return tp, recv
}

// BenchmarkRouteTracing measures a query-only Route of 2,048 tokens over gRPC (client and server in
// this process, 16 workers), from as many callers as GOMAXPROCS: off (no tracer provider, as
// without OTEL_EXPORTER_OTLP_ENDPOINT), on (every call's span recorded and exported over OTLP/gRPC
// to a receiver on loopback, as with the endpoint set and the default sampler), and unsampled (the
// provider installed, no span sampled: the stats handler's own cost).
func BenchmarkRouteTracing(b *testing.B) {
	for _, v := range []string{"off", "on", "unsampled"} {
		b.Run(v, func(b *testing.B) {
			var mutate func(*Options)
			var recv *otlpReceiver
			var tp *sdktrace.TracerProvider
			switch v {
			case "on":
				tp, recv = otlpProvider(b, sdktrace.ParentBased(sdktrace.AlwaysSample()))
				mutate = func(o *Options) { o.TracerProvider = tp }
			case "unsampled":
				tp, _ := otlpProvider(b, sdktrace.ParentBased(sdktrace.NeverSample()))
				mutate = func(o *Options) { o.TracerProvider = tp }
			}
			client, prompt := routeBench(b, mutate)
			n := routeInParallel(b, client, &kvrouterv1.RouteRequest{Model: "bench", TokenIds: prompt, QueryOnly: true})
			if recv != nil {
				// The batch processor drops spans when its queue is full: report what arrived.
				_ = tp.ForceFlush(context.Background())
				b.ReportMetric(float64(recv.spans.Load())/float64(n), "exported/op")
			}
		})
	}
}

// routeInParallel sends req from as many callers as GOMAXPROCS for the benchmark's b.N calls, each
// answer checked to find routeBench's whole prompt cached, and reports the process's CPU per call
// (cpu-ns/op: on shared cores it varies less than wall time). It returns the calls answered.
func routeInParallel(b *testing.B, client kvrouterv1.RouterServiceClient, req *kvrouterv1.RouteRequest) int64 {
	ctx := context.Background()
	var n atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	cpu := processCPU()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			resp, err := client.Route(ctx, req)
			if err != nil {
				b.Errorf("Route() = %v", err)
				return
			}
			if resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice() != 128 {
				b.Errorf("Route() overlap %v, want 128 blocks", resp.GetDiagnostics().GetDecode().GetOverlapBlocks())
				return
			}
			n.Add(1)
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(processCPU()-cpu)/float64(b.N), "cpu-ns/op")
	return n.Load()
}

// processCPU is the CPU time this process has used (user and system, every goroutine), in ns: on
// shared cores, a benchmark's CPU per call varies less than its wall time.
func processCPU() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// TestTraceLogLinks: a sampled call's traceparent goes into the log entry, an unsampled one's does
// not, and an entry joining several traced calls applies as one span linked to each of them.
func TestTraceLogLinks(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer tp.Shutdown(context.Background())
	var obs kvstate.Observers
	traceLog(tp.Tracer("t"), &obs)

	var parents []string
	var want []trace.SpanContext
	for range 2 {
		ctx, span := tp.Tracer("t").Start(context.Background(), "publish")
		parents = append(parents, obs.TraceParent(ctx))
		want = append(want, span.SpanContext())
		span.End()
	}
	if got := obs.TraceParent(context.Background()); got != "" {
		t.Errorf("TraceParent(untraced) = %q, want \"\"", got)
	}
	never := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.NeverSample()))
	defer never.Shutdown(context.Background())
	unsampled, span := never.Tracer("t").Start(context.Background(), "s")
	span.End()
	if got := obs.TraceParent(unsampled); got != "" {
		t.Errorf("TraceParent(unsampled) = %q, want \"\"", got)
	}

	exp.Reset()
	obs.ApplyTraced(parents[0]+","+parents[1]+",not-a-traceparent", "1700000000000-3")()
	s := endedSpan(t, exp, SpanLogApply, nil)
	var got []trace.SpanContext
	for _, l := range s.Links {
		got = append(got, l.SpanContext.WithRemote(false))
	}
	if diff := cmp.Diff(want, got, cmp.Comparer(func(a, b trace.SpanContext) bool { return a.Equal(b) })); diff != "" {
		t.Errorf("apply span links (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(map[attribute.Key]any{AttrLogEntry: "1700000000000-3"}, kvAttrs(s)); diff != "" {
		t.Errorf("apply span attributes (-want +got):\n%s", diff)
	}
	if s.Parent.IsValid() {
		t.Errorf("apply span has parent %v, want a root", s.Parent)
	}
}
