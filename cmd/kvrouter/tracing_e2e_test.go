package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
)

// otlpStub is an OTLP/gRPC trace receiver on loopback: it keeps every span exported to it.
type otlpStub struct {
	coltracepb.UnimplementedTraceServiceServer
	addr string
	mu   sync.Mutex
	got  []*tracepb.ResourceSpans
}

func (s *otlpStub) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.got = append(s.got, req.GetResourceSpans()...)
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

// startOTLPStub serves an otlpStub on addr until the test ends.
func startOTLPStub(t *testing.T, addr string) (*otlpStub, error) {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	stub := &otlpStub{addr: lis.Addr().String()}
	srv := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(srv, stub)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return stub, nil
}

// exportedSpan is a span the stub received, with its resource's attributes.
type exportedSpan struct {
	*tracepb.Span
	resource []*commonpb.KeyValue
}

func (s *otlpStub) spans() []exportedSpan {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []exportedSpan
	for _, rs := range s.got {
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				out = append(out, exportedSpan{sp, rs.GetResource().GetAttributes()})
			}
		}
	}
	return out
}

// waitSpan waits for a span named name and returns it.
func (s *otlpStub) waitSpan(t *testing.T, name string) exportedSpan {
	t.Helper()
	var found exportedSpan
	if !kvtest.Poll(defaultTestTimeout, 50*time.Millisecond, func() bool {
		for _, sp := range s.spans() {
			if sp.GetName() == name {
				found = sp
				return true
			}
		}
		return false
	}) {
		t.Fatalf("no span %s received within %v; received %d spans", name, defaultTestTimeout, len(s.spans()))
	}
	return found
}

// attrMap returns attributes as Go values, for kvrouter.* keys only when prefix is set.
func attrMap(kvs []*commonpb.KeyValue, prefix string) map[string]any {
	out := map[string]any{}
	for _, kv := range kvs {
		if !strings.HasPrefix(kv.GetKey(), prefix) {
			continue
		}
		switch v := kv.GetValue().GetValue().(type) {
		case *commonpb.AnyValue_StringValue:
			out[kv.GetKey()] = v.StringValue
		case *commonpb.AnyValue_IntValue:
			out[kv.GetKey()] = v.IntValue
		case *commonpb.AnyValue_BoolValue:
			out[kv.GetKey()] = v.BoolValue
		case *commonpb.AnyValue_DoubleValue:
			out[kv.GetKey()] = v.DoubleValue
		default:
			out[kv.GetKey()] = kv.GetValue().String()
		}
	}
	return out
}

// startTraced runs `kvrouter serve` with env added to the environment (without KVROUTER_*) and
// waits until it is SERVING; it gets SIGTERM at cleanup and must exit 0.
func startTraced(t *testing.T, env []string, args ...string) *serverProcess {
	t.Helper()
	cmd, addr, logs := kvrouterCommand(t, buildBinary(t), env, args...)
	p := &serverProcess{addr: addr, logs: logs, cmd: cmd}
	exited := runUntilCleanup(t, cmd, logs, nil)
	waitServing(t, healthpb.NewHealthClient(dial(t, addr)), exited, logs, "")
	return p
}

// The traced calls: worker 7 of model "traced" stores two blocks (block size 4) of tokens no
// attribute may hold, then a Route of those blocks and a tail carries a W3C traceparent.
const (
	tracedTraceID = "5af7183fb1d4cf5f6e8a4b1d2c3e4f50"
	tracedParent  = "a1b2c3d4e5f60718"
	firstToken    = 913570
)

func tracedTokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(firstToken + i)
	}
	return out
}

// publishAndRouteTraced publishes worker 7's batch (its stream closed after the ack) and routes.
func publishAndRouteTraced(t *testing.T, addr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	conn := dial(t, addr)
	stream, err := kvrouterv1.NewWorkerServiceClient(conn).Publish(ctx)
	if err != nil {
		t.Fatalf("Publish() = %v", err)
	}
	send := func(m *kvrouterv1.PublishRequest) *kvrouterv1.PublishResponse {
		t.Helper()
		if err := stream.Send(m); err != nil {
			t.Fatalf("Send() = %v", err)
		}
		resp, err := stream.Recv()
		if err != nil {
			t.Fatalf("Recv() = %v", err)
		}
		return resp
	}
	send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: &kvrouterv1.WorkerHello{
		Endpoint: "10.0.0.1:8000",
		WorkerId: 7, Model: "traced", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 4, TotalKvBlocks: 64, KvEventsEnabled: true}}})
	tokens := tracedTokens(8)
	resp := send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{{
		EventId: 0, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: &kvrouterv1.BlocksStored{
			Blocks: []*kvrouterv1.StoredBlock{{BlockHash: 71, TokenIds: tokens[:4]}, {BlockHash: 72, TokenIds: tokens[4:]}}}}}}}}})
	if resp.GetAck() == nil {
		t.Fatalf("events answered %v, want an ack", resp)
	}
	_ = stream.CloseSend()
	for {
		if _, err := stream.Recv(); err != nil {
			break
		}
	}
	rctx := metadata.AppendToOutgoingContext(ctx, "traceparent", "00-"+tracedTraceID+"-"+tracedParent+"-01")
	route, err := kvrouterv1.NewRouterServiceClient(conn).Route(rctx, &kvrouterv1.RouteRequest{RequestId: "traced-1", Model: "traced", TokenIds: tracedTokens(10)})
	if err != nil {
		t.Fatalf("Route() = %v", err)
	}
	if got := route.GetDecode().GetWorkerId(); got != 7 {
		t.Fatalf("Route() chose worker %d, want 7", got)
	}
}

// routeCallLog waits for the Route call's "finished call" log line and returns its fields. The
// server writes the line before it answers, but the line may reach logs after the answer reaches
// the test (lockedBuffer.waitFor), so it is waited for.
func routeCallLog(t *testing.T, logs *lockedBuffer) map[string]any {
	t.Helper()
	var found map[string]any
	logs.waitFor(t, "finished call line for Route", func(out string) bool {
		for line := range strings.Lines(out) {
			var m map[string]any
			if json.Unmarshal([]byte(line), &m) == nil && m["msg"] == "finished call" && m["grpc.method"] == "Route" {
				found = m
				return true
			}
		}
		return false
	})
	return found
}

// tracingEnv is the environment of a traced router exporting to stub.
func tracingEnv(stub *otlpStub) []string {
	return []string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + stub.addr, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc", "OTEL_BSP_SCHEDULE_DELAY=100",
		"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=", "OTEL_SDK_DISABLED=", "OTEL_TRACES_EXPORTER=", "OTEL_TRACES_SAMPLER=", "OTEL_SERVICE_NAME=", "OTEL_RESOURCE_ATTRIBUTES="}
}

// TestTracesOverOTLP: with OTEL_EXPORTER_OTLP_ENDPOINT set, the real binary exports the spans of
// Route and Publish to an OTLP receiver, with the documented attributes and never a token id; the
// Route span continues the caller's trace, and the call's log line names it.
func TestTracesOverOTLP(t *testing.T) {
	stub, err := startOTLPStub(t, "127.0.0.1:0")
	if err != nil {
		t.Fatalf("OTLP stub: %v", err)
	}
	p := startTraced(t, tracingEnv(stub), "--log-level", "debug", "--replica-id", "traced-replica")
	p.logs.waitLine(t, `"msg":"tracing on: exporting spans with OTLP over gRPC"`)
	publishAndRouteTraced(t, p.addr)

	route := stub.waitSpan(t, "kvrouter.v1.RouterService/Route")
	if got := hex.EncodeToString(route.GetTraceId()); got != tracedTraceID {
		t.Errorf("Route span trace id = %s, want the traceparent's %s", got, tracedTraceID)
	}
	if got := hex.EncodeToString(route.GetParentSpanId()); got != tracedParent {
		t.Errorf("Route span parent = %s, want the traceparent's %s", got, tracedParent)
	}
	want := map[string]any{
		"kvrouter.model": "traced", "kvrouter.request_id": "traced-1", "kvrouter.query_only": false, "kvrouter.prompt_tokens": int64(10),
		"kvrouter.mode": "aggregated", "kvrouter.reason": "no_prefill_workers", "kvrouter.booked": true,
		"kvrouter.decode_worker": "7/0", "kvrouter.overlap_blocks": int64(2), "kvrouter.cached_tokens": float64(8),
	}
	if diff := cmp.Diff(want, attrMap(route.GetAttributes(), "kvrouter.")); diff != "" {
		t.Errorf("Route span attributes mismatch (-want +got):\n%s", diff)
	}
	res := attrMap(route.resource, "service.")
	if res["service.name"] != "kvrouter" || res["service.instance.id"] != "traced-replica" {
		t.Errorf("resource %v, want service.name kvrouter and service.instance.id traced-replica", res)
	}

	batch := stub.waitSpan(t, "kvrouter.publish.events")
	got := attrMap(batch.GetAttributes(), "kvrouter.")
	if ms, ok := got["kvrouter.append_ms"].(float64); !ok || ms < 0 {
		t.Errorf("kvrouter.append_ms = %v, want a duration in ms", got["kvrouter.append_ms"])
	}
	delete(got, "kvrouter.append_ms")
	want = map[string]any{
		"kvrouter.worker_id": int64(7), "kvrouter.dp_rank": int64(0), "kvrouter.model": "traced", "kvrouter.events": int64(1),
		"kvrouter.blocks": int64(2), "kvrouter.applied": int64(1), "kvrouter.last_event_id": int64(0),
		"kvrouter.shared_log": false, "kvrouter.buffered": false,
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("publish span attributes mismatch (-want +got):\n%s", diff)
	}
	stream := stub.waitSpan(t, "kvrouter.v1.WorkerService/Publish")
	if links := batch.GetLinks(); len(links) != 1 || string(links[0].GetSpanId()) != string(stream.GetSpanId()) {
		t.Errorf("publish span links %v, want one link to the stream's span %x", links, stream.GetSpanId())
	}
	stub.waitSpan(t, "kvrouter.publish.hello")

	for _, sp := range stub.spans() {
		for _, kv := range append(append([]*commonpb.KeyValue{}, sp.GetAttributes()...), sp.resource...) {
			if tok := tokenIn(kv.GetValue()); tok != "" {
				t.Errorf("span %s attribute %s = %v holds token id %s", sp.GetName(), kv.GetKey(), kv.GetValue(), tok)
			}
		}
	}

	line := routeCallLog(t, p.logs)
	if line["trace_id"] != tracedTraceID || line["span_id"] != hex.EncodeToString(route.GetSpanId()) {
		t.Errorf("Route call log trace_id %v span_id %v, want %s and the Route span's %x", line["trace_id"], line["span_id"], tracedTraceID, route.GetSpanId())
	}
}

// tokenIn returns the token id (as text) a value holds, or "".
func tokenIn(v *commonpb.AnyValue) string {
	for i := range 10 {
		tok := fmt.Sprint(firstToken + i)
		switch x := v.GetValue().(type) {
		case *commonpb.AnyValue_IntValue:
			if x.IntValue == int64(firstToken+i) {
				return tok
			}
		case *commonpb.AnyValue_DoubleValue:
			if x.DoubleValue == float64(firstToken+i) {
				return tok
			}
		case *commonpb.AnyValue_StringValue:
			if strings.Contains(x.StringValue, tok) {
				return tok
			}
		case *commonpb.AnyValue_ArrayValue:
			for _, e := range x.ArrayValue.GetValues() {
				if t := tokenIn(e); t != "" {
					return t
				}
			}
		}
	}
	return ""
}

// TestTracesFlushedAtStop: spans still buffered when the router stops are exported before it exits.
func TestTracesFlushedAtStop(t *testing.T) {
	stub, err := startOTLPStub(t, "127.0.0.1:0")
	if err != nil {
		t.Fatalf("OTLP stub: %v", err)
	}
	env := append(tracingEnv(stub), "OTEL_BSP_SCHEDULE_DELAY=600000") // the last value wins
	p := startTraced(t, env)
	publishAndRouteTraced(t, p.addr)
	time.Sleep(200 * time.Millisecond)
	if n := len(stub.spans()); n != 0 {
		t.Fatalf("%d spans exported before the batch delay, want 0 (is OTEL_BSP_SCHEDULE_DELAY read?)", n)
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM) // cleanup still checks the exit status
	stub.waitSpan(t, "kvrouter.v1.RouterService/Route")
}

// TestTracingOff: without an endpoint, or with the SDK disabled, no exporter runs: the log says
// so, nothing reaches a receiver (on the exporter's default port too, when it is free), and the
// call log carries no trace id although the call came with a traceparent.
func TestTracingOff(t *testing.T) {
	for _, tt := range []struct {
		name string
		env  func(stub *otlpStub) []string
		why  string
	}{
		{"no endpoint", func(*otlpStub) []string {
			return []string{"OTEL_EXPORTER_OTLP_ENDPOINT=", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=", "OTEL_BSP_SCHEDULE_DELAY=100"}
		}, "OTEL_EXPORTER_OTLP_ENDPOINT is not set"},
		{"sdk disabled", func(stub *otlpStub) []string {
			return append(tracingEnv(stub), "OTEL_SDK_DISABLED=true")
		}, "OTEL_SDK_DISABLED is true"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// The exporter's default endpoint is localhost:4317: listen there when it is free.
			stub, err := startOTLPStub(t, "127.0.0.1:4317")
			if err != nil {
				t.Logf("127.0.0.1:4317 is taken (%v): the receiver listens elsewhere", err)
				if stub, err = startOTLPStub(t, "127.0.0.1:0"); err != nil {
					t.Fatalf("OTLP stub: %v", err)
				}
			}
			p := startTraced(t, tt.env(stub), "--log-level", "debug")
			p.logs.waitLine(t, `"msg":"tracing off: `+tt.why+`"`)
			publishAndRouteTraced(t, p.addr)
			line := routeCallLog(t, p.logs)
			if id, ok := line["trace_id"]; ok {
				t.Errorf("Route call log has trace_id %v with tracing off", id)
			}
			time.Sleep(500 * time.Millisecond) // five batch delays
			if n := len(stub.spans()); n != 0 {
				t.Errorf("receiver got %d spans with tracing off, want 0", n)
			}
		})
	}
}

// TestTracesLinkLogApplies: in Redis mode, every replica's apply of a traced Publish batch is a
// kvrouter.log.apply span linked to the batch's span on the replica that appended it (the Redis
// entry carries the batch's traceparent).
func TestTracesLinkLogApplies(t *testing.T) {
	stub, err := startOTLPStub(t, "127.0.0.1:0")
	if err != nil {
		t.Fatalf("OTLP stub: %v", err)
	}
	redis := redistest.Start(t)
	appender := startTraced(t, tracingEnv(stub), "--redis-addr", redis.Addr, "--replica-id", "appender")
	startTraced(t, tracingEnv(stub), "--redis-addr", redis.Addr, "--replica-id", "follower")
	publishAndRouteTraced(t, appender.addr)

	batch := stub.waitSpan(t, "kvrouter.publish.events")
	if got := attrMap(batch.GetAttributes(), "kvrouter.")["kvrouter.shared_log"]; got != true {
		t.Errorf("publish span kvrouter.shared_log = %v, want true", got)
	}
	// linkedApplies returns the replicas whose apply spans link to the batch's span.
	linkedApplies := func() map[string]int {
		out := map[string]int{}
		for _, sp := range stub.spans() {
			if sp.GetName() != "kvrouter.log.apply" {
				continue
			}
			for _, l := range sp.GetLinks() {
				if string(l.GetTraceId()) == string(batch.GetTraceId()) && string(l.GetSpanId()) == string(batch.GetSpanId()) {
					out[fmt.Sprint(attrMap(sp.resource, "service.")["service.instance.id"])]++
					if id, _ := attrMap(sp.GetAttributes(), "kvrouter.")["kvrouter.log_entry"].(string); !strings.Contains(id, "-") {
						t.Errorf("apply span kvrouter.log_entry = %q, want a stream id", id)
					}
				}
			}
		}
		return out
	}
	want := map[string]int{"appender": 1, "follower": 1}
	var got map[string]int
	if !kvtest.Poll(defaultTestTimeout, 50*time.Millisecond, func() bool {
		got = linkedApplies()
		return cmp.Equal(want, got)
	}) {
		t.Errorf("apply spans linked to the publish batch, by replica: %v, want %v", got, want)
	}
}
