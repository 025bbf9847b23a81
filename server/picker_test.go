package server

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/testing/protocmp"
	"sigs.k8s.io/gateway-api-inference-extension/test/integration"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
)

const pickerBlockSize = 16

// pickerFleet is a real state, log and dispatcher with model "m": decode workers 1 and 2 and, when
// asked for, prefill worker 3, each at its own endpoint; and a picker over them on a loopback gRPC
// port.
type pickerFleet struct {
	t     *testing.T
	state *kvstate.State
	log   *kvstate.MemLog
	port  int
	freed *freedCounter
	d     *app.Dispatcher
	// events is the id of each worker's next KV event.
	events map[uint64]uint64
}

func pickerEndpoint(id uint64) string { return fmt.Sprintf("10.0.0.%d:8000", id) }

func newPickerFleet(t *testing.T, cfg policy.Config, withPrefill bool, mutate ...func(*PickerOptions)) *pickerFleet {
	t.Helper()
	state := kvstate.NewState()
	f := &pickerFleet{t: t, state: state, log: kvstate.NewMemLog(state), freed: newFreedCounter(), events: map[uint64]uint64{}}
	for _, w := range []struct {
		id   uint64
		role kvstate.Role
	}{{1, kvstate.RoleDecode}, {2, kvstate.RoleDecode}, {3, kvstate.RolePrefill}} {
		if w.role == kvstate.RolePrefill && !withPrefill {
			continue
		}
		f.append(kvstate.WorkerUp{Info: kvstate.WorkerInfo{
			Key: kvstate.WorkerKey{ID: w.id}, Model: "m", Role: w.role, BlockSize: pickerBlockSize, TotalKVBlocks: 100000,
			MaxNumBatchedTokens: 8192, Endpoint: pickerEndpoint(w.id), KVEventsEnabled: true, SupportsBypass: true,
		}})
	}
	kernel := policy.NewKernel(policy.StateView(state), cfg)
	d := app.New(state, f.log, kernel, app.Options{Outcomes: f.freed})
	f.d = d
	po := PickerOptions{Dispatcher: d, MaxPromptTokens: 1 << 20, Headers: PickerHeaders{Session: "x-session-id"}}
	for _, m := range mutate {
		m(&po)
	}
	picker := NewPicker(po)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(srv, picker)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	f.port = lis.Addr().(*net.TCPAddr).Port
	return f
}

func (f *pickerFleet) append(c kvstate.Change) {
	f.t.Helper()
	if _, err := f.log.Append(context.Background(), c); err != nil {
		f.t.Fatalf("Append(%T) = %v", c, err)
	}
}

// cache stores the first n blocks of tokens on worker id's device tier.
func (f *pickerFleet) cache(id uint64, tokens []uint32, n int) {
	f.t.Helper()
	local := blockhash.Locals(nil, tokens, pickerBlockSize, blockhash.Salt("", ""))[:n]
	seq := blockhash.Sequence(nil, local)
	blocks := make([]kvstate.Block, n)
	for i, h := range local {
		// The engine's hash follows the prefix, as vLLM's does: a block stored again (the
		// history of a conversation's next turn) has the hash it had.
		blocks[i] = kvstate.Block{Hash: seq[i] ^ id, Local: h}
	}
	f.append(kvstate.KVEvents{Worker: kvstate.WorkerKey{ID: id}, Events: []kvstate.Event{
		{ID: f.events[id], Tier: kvstate.TierDevice, Kind: kvstate.EventStored, Blocks: blocks},
	}})
	f.events[id]++ // each worker's events are numbered from 0, as an engine's are
}

// stream opens an ext_proc stream with the Gateway API Inference Extension's own test client.
func (f *pickerFleet) stream(ctx context.Context) extprocv3.ExternalProcessor_ProcessClient {
	f.t.Helper()
	client, conn := integration.ExtProcServerClient(f.t, ctx, f.port, logr.Discard())
	f.t.Cleanup(func() { conn.Close() })
	return client
}

// freedCounter counts each request's bookings and frees, from the dispatcher's outcomes, and
// keeps the last booking's outcome.
type freedCounter struct {
	mu            sync.Mutex
	booked, freed map[string]int
	last          app.BookedOutcome
}

func newFreedCounter() *freedCounter {
	return &freedCounter{booked: map[string]int{}, freed: map[string]int{}}
}

func (c *freedCounter) Booked(_ context.Context, o app.BookedOutcome) {
	c.mu.Lock()
	c.booked[o.RequestID]++
	c.last = o
	c.mu.Unlock()
}

// lastBooked returns the outcome of the last booking.
func (c *freedCounter) lastBooked() app.BookedOutcome {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.last
}
func (c *freedCounter) PrefillDone(context.Context, app.EndedOutcome) {}
func (c *freedCounter) Freed(_ context.Context, o app.EndedOutcome) {
	c.mu.Lock()
	c.freed[o.RequestID]++
	c.mu.Unlock()
}

func pickerTokens(n int, seed uint32) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = seed*7919 + uint32(i)*31 + 7
	}
	return t
}

func completionsBody(t *testing.T, tokens []uint32) string {
	t.Helper()
	b, err := json.Marshal(map[string]any{"model": "m", "prompt": tokens, "max_tokens": 16})
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func postHeaders(path string) map[string]string {
	return map[string]string{":path": path, ":method": "POST", "content-type": "application/json", "x-request-id": "client-id"}
}

// withMode marks the first request of a stream with the proxy's processing modes, as Envoy does.
func withMode(reqs []*extprocv3.ProcessingRequest, mode extprocfilterv3.ProcessingMode_BodySendMode) []*extprocv3.ProcessingRequest {
	reqs[0].ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: mode}
	return reqs
}

// pickedWant is what the protocol's reference picker answers a full-duplex request sent to dest
// (the Gateway API Inference Extension's own builder), plus the removal of the P/D header that a
// request which is not disaggregated must not carry.
func pickedWant(dest, body string) []*extprocv3.ProcessingResponse {
	want := integration.NewRequestBufferedResponse(dest, []byte(body))
	want[0].GetRequestHeaders().Response.HeaderMutation.RemoveHeaders = []string{DefaultPrefillHeader}
	return want
}

func TestPickerRoutesByCachedPrefix(t *testing.T) {
	f := newPickerFleet(t, policy.DefaultConfig(), false)
	tokens := pickerTokens(64*pickerBlockSize, 1)
	f.cache(2, tokens, 64)
	body := completionsBody(t, tokens)
	half := len(body) / 2
	got, err := integration.StreamedRequest(t, f.stream(t.Context()),
		withMode(integration.ReqRaw(postHeaders("/v1/completions"), body[:half], body[half:]), extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED), 2)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(pickedWant(pickerEndpoint(2), body), got, protocmp.Transform()); diff != "" {
		t.Errorf("responses (-want +got):\n%s", diff)
	}
}

func TestPickerHonoursTheCandidateSubset(t *testing.T) {
	f := newPickerFleet(t, policy.DefaultConfig(), false)
	tokens := pickerTokens(64*pickerBlockSize, 2)
	f.cache(2, tokens, 64)
	body := completionsBody(t, tokens)
	for _, tc := range []struct {
		name   string
		subset []string
		want   typev3.StatusCode // 0: picked worker 1
	}{
		{"worker 1 only", []string{pickerEndpoint(1)}, 0},
		{"worker 1 among strangers", []string{"10.9.9.9:1", pickerEndpoint(1) + ",10.9.9.8:1"}, 0},
		{"empty", []string{}, typev3.StatusCode_ServiceUnavailable},
		{"no worker of the model", []string{"10.9.9.9:1"}, typev3.StatusCode_ServiceUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reqs := integration.ReqRaw(postHeaders("/v1/completions"), body)
			reqs[0].MetadataContext = &corev3.Metadata{FilterMetadata: integration.GenerateRequestMetadata(tc.subset)}
			got, err := integration.StreamedRequest(t, f.stream(t.Context()), reqs, 2)
			if err != nil {
				t.Fatal(err)
			}
			if tc.want == 0 {
				if diff := cmp.Diff(pickedWant(pickerEndpoint(1), body), got, protocmp.Transform()); diff != "" {
					t.Errorf("responses (-want +got):\n%s", diff)
				}
				return
			}
			if len(got) != 1 || got[0].GetImmediateResponse().GetStatus().GetCode() != tc.want {
				t.Fatalf("responses = %v, want one immediate %v", got, tc.want)
			}
		})
	}
}

func TestPickerDisaggregatesThroughTheP2DHeader(t *testing.T) {
	cfg := policy.DefaultConfig()
	cfg.ConditionalDisagg.Enabled = true
	f := newPickerFleet(t, cfg, true)
	tokens := pickerTokens(256*pickerBlockSize, 3) // 4096 tokens, nothing cached: remote prefill
	body := completionsBody(t, tokens)
	got, err := integration.StreamedRequest(t, f.stream(t.Context()), integration.ReqRaw(postHeaders("/v1/completions"), body), 2)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("got %d responses, want 2: %v", len(got), got)
	}
	set := map[string]string{}
	for _, h := range got[0].GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		set[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
	}
	if set[DefaultPrefillHeader] != pickerEndpoint(3) {
		t.Errorf("%s = %q, want the prefill worker %s", DefaultPrefillHeader, set[DefaultPrefillHeader], pickerEndpoint(3))
	}
	if d := set[DefaultDestinationHeader]; d != pickerEndpoint(1) && d != pickerEndpoint(2) {
		t.Errorf("%s = %q, want a decode worker", DefaultDestinationHeader, d)
	}
}

func TestPickerBufferedMode(t *testing.T) {
	f := newPickerFleet(t, policy.DefaultConfig(), false)
	tokens := pickerTokens(32*pickerBlockSize, 4)
	f.cache(1, tokens, 32)
	body := completionsBody(t, tokens)
	stream := f.stream(t.Context())
	reqs := withMode(integration.ReqRaw(postHeaders("/v1/completions"), body), extprocfilterv3.ProcessingMode_BUFFERED)
	got, err := integration.StreamedRequest(t, stream, reqs, 2)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].GetRequestHeaders() == nil {
		t.Fatalf("responses = %v, want the headers' then the body's", got)
	}
	want := pickedWant(pickerEndpoint(1), body)[0]
	common := want.GetRequestHeaders().GetResponse()
	wantBody := &extprocv3.ProcessingResponse{
		Response:        &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: common}},
		DynamicMetadata: want.DynamicMetadata,
	}
	if diff := cmp.Diff(wantBody, got[1], protocmp.Transform()); diff != "" {
		t.Errorf("body response (-want +got):\n%s", diff)
	}
}

func TestPickerRefusals(t *testing.T) {
	f := newPickerFleet(t, policy.DefaultConfig(), false)
	for _, tc := range []struct {
		name    string
		headers map[string]string
		body    []string
		code    typev3.StatusCode
		message string
	}{
		{"not JSON", postHeaders("/v1/completions"), []string{`{"model": "m", "prompt": [1, 2`}, 400, "not a JSON object"},
		{"no model", postHeaders("/v1/completions"), []string{`{"prompt": [1, 2, 3]}`}, 400, "model: must be set"},
		{"several prompts", postHeaders("/v1/completions"), []string{`{"model": "m", "prompt": [[1], [2]]}`}, 400, "holds 2 prompts"},
		{"token id out of range", postHeaders("/v1/completions"), []string{`{"model": "m", "prompt": [1, -2]}`}, 400, "prompt[1]"},
		{"text without a tokenizer", postHeaders("/v1/completions"), []string{`{"model": "m", "prompt": "hello"}`}, 503, "no tokenizer"},
		{"unknown model", postHeaders("/v1/completions"), []string{`{"model": "other", "prompt": [1, 2, 3]}`}, 404, "other"},
		// Refused at the headers: the picker ends the stream there, so (as Envoy does after an
		// immediate response) the test sends no body it could find closed.
		{"another path", postHeaders("/v1/embeddings"), nil, 404, "routes POST /v1/completions"},
		{"GET", map[string]string{":path": "/v1/completions", ":method": "GET"}, nil, 404, "got GET"},
		{"chat of images", postHeaders("/v1/chat/completions"), []string{`{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}`}, 400, "messages[0].content"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := integration.StreamedRequest(t, f.stream(t.Context()), integration.ReqRaw(tc.headers, tc.body...), 1)
			if err != nil {
				t.Fatal(err)
			}
			imm := got[0].GetImmediateResponse()
			if imm.GetStatus().GetCode() != tc.code || !strings.Contains(string(imm.GetBody()), tc.message) {
				t.Fatalf("answer = %v %s, want %v with %q", imm.GetStatus().GetCode(), imm.GetBody(), tc.code, tc.message)
			}
			var e struct {
				Error struct {
					Message, Type string
					Code          int
				}
			}
			if err := json.Unmarshal(imm.GetBody(), &e); err != nil || e.Error.Code != int(tc.code) || e.Error.Type == "" {
				t.Errorf("body %s is not an OpenAI error object of code %d: %v", imm.GetBody(), tc.code, err)
			}
		})
	}
	if n := f.state.Load().Bookings(); n != 0 {
		t.Errorf("%d bookings after refusals, want 0", n)
	}
}

// TestPickerFreesEveryBookingOnce drives 10,000 requests through the picker, a third of them
// cancelled at a random phase (before the body ends, after the pick, after the response headers,
// mid-response), and checks that every booked request was freed exactly once and none remains.
func TestPickerFreesEveryBookingOnce(t *testing.T) {
	f := newPickerFleet(t, policy.DefaultConfig(), false)
	const requests, workers = 10000, 16
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			conn, err := grpc.NewClient(fmt.Sprintf("127.0.0.1:%d", f.port), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				errs <- err
				return
			}
			defer conn.Close()
			client := extprocv3.NewExternalProcessorClient(conn)
			for i := w; i < requests; i += workers {
				if err := f.oneRequest(client, rng, uint32(i)); err != nil {
					errs <- fmt.Errorf("request %d: %w", i, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// A cancelled stream's Free runs as the picker notices the cancellation: wait for the effect.
	deadline := time.Now().Add(30 * time.Second)
	for f.state.Load().Bookings() != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := f.state.Load().Bookings(); n != 0 {
		t.Fatalf("%d bookings remain", n)
	}
	f.freed.mu.Lock()
	defer f.freed.mu.Unlock()
	if len(f.freed.booked) < requests/2 {
		t.Errorf("only %d of %d requests were booked", len(f.freed.booked), requests)
	}
	for id, n := range f.freed.booked {
		if n != 1 || f.freed.freed[id] != 1 {
			t.Errorf("request %s booked %d times, freed %d times; want 1 and 1", id, n, f.freed.freed[id])
		}
	}
	if len(f.freed.freed) != len(f.freed.booked) {
		t.Errorf("%d requests freed, %d booked", len(f.freed.freed), len(f.freed.booked))
	}
}

// oneRequest sends one request and, for two thirds, its whole response; the others are cancelled
// at a random phase.
func (f *pickerFleet) oneRequest(client extprocv3.ExternalProcessorClient, rng *rand.Rand, seed uint32) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, err := client.Process(ctx)
	if err != nil {
		return err
	}
	body := completionsBody(f.t, pickerTokens(4*pickerBlockSize, seed%64))
	reqs := integration.ReqRaw(postHeaders("/v1/completions"), body[:len(body)/2], body[len(body)/2:])
	cancelAt := -1 // phase: 0 mid-body, 1 after the pick, 2 after response headers, 3 mid-response
	if rng.IntN(3) == 0 {
		cancelAt = rng.IntN(4)
	}
	send := func(r *extprocv3.ProcessingRequest) error { return stream.Send(r) }
	if err := send(reqs[0]); err != nil {
		return err
	}
	if err := send(reqs[1]); err != nil {
		return err
	}
	if cancelAt == 0 {
		return nil
	}
	if err := send(reqs[2]); err != nil {
		return err
	}
	for range 2 { // the headers' and the body's answers
		if _, err := stream.Recv(); err != nil {
			return err
		}
	}
	if cancelAt == 1 {
		return nil
	}
	if err := send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("200")}}},
	}}}); err != nil {
		return err
	}
	if _, err := stream.Recv(); err != nil {
		return err
	}
	if cancelAt == 2 {
		return nil
	}
	chunks := []string{`data: {"choices":[{"text":"a"}]}` + "\n\n", `data: {"choices":[{"text":"b"}]}` + "\n\n", "data: [DONE]\n\n"}
	for i, c := range chunks {
		if cancelAt == 3 && i == 1 {
			return nil
		}
		if err := send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
			Body: []byte(c), EndOfStream: i == len(chunks)-1,
		}}}); err != nil {
			return err
		}
		if _, err := stream.Recv(); err != nil {
			return err
		}
	}
	return stream.CloseSend()
}

// TestPickerTracesTheRequest: a picked request's span is a child of the trace context its HTTP
// headers carry, holds the decision, and ends when the booking is freed, with its cause.
func TestPickerTracesTheRequest(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	f := newPickerFleet(t, policy.DefaultConfig(), false, func(o *PickerOptions) { o.Tracer = tp.Tracer(TracerName) })
	tokens := pickerTokens(8*pickerBlockSize, 9)
	f.cache(1, tokens, 8)
	headers := postHeaders("/v1/completions")
	const traceID, parentID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	headers["traceparent"] = "00-" + traceID + "-" + parentID + "-01"
	reqs := integration.ReqRaw(headers, completionsBody(t, tokens))
	reqs = append(reqs,
		&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("200")}}}}}},
		&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
			Body: []byte("{}"), EndOfStream: true}}})
	if _, err := integration.StreamedRequest(t, f.stream(t.Context()), reqs, 4); err != nil {
		t.Fatal(err)
	}
	var spans tracetest.SpanStubs
	deadline := time.Now().Add(10 * time.Second)
	for len(spans) == 0 && time.Now().Before(deadline) { // the span ends as the picker frees: wait for it
		spans = exp.GetSpans()
		time.Sleep(5 * time.Millisecond)
	}
	if len(spans) != 1 {
		t.Fatalf("%d spans, want the pick's", len(spans))
	}
	s := spans[0]
	if s.Name != SpanPick || s.SpanContext.TraceID().String() != traceID || s.Parent.SpanID().String() != parentID {
		t.Errorf("span %s in trace %s under %s, want %s in trace %s under %s", s.Name, s.SpanContext.TraceID(), s.Parent.SpanID(), SpanPick, traceID, parentID)
	}
	got := map[attribute.Key]string{}
	for _, a := range s.Attributes {
		got[a.Key] = a.Value.Emit()
	}
	want := map[attribute.Key]string{AttrModel: "m", AttrMode: "aggregated", AttrDecodeWorker: "1/0", AttrOverlapBlocks: "8", AttrFreeCause: FreedCompleted, AttrHTTPStatus: "200"}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("attribute %s = %q, want %q (all: %v)", k, got[k], v, got)
		}
	}
	if len(s.Events) != 1 || s.Events[0].Name != "prefill_complete" {
		t.Errorf("events %v, want prefill_complete", s.Events)
	}
}

// TestPickerSessionAffinity: requests carrying the same session header land on the decode worker
// of the session's first request, even where another worker caches the later prompt better.
func TestPickerSessionAffinity(t *testing.T) {
	cfg := policy.DefaultConfig()
	cfg.SessionAffinityTTL = time.Minute
	f := newPickerFleet(t, cfg, false)
	first, second := pickerTokens(32*pickerBlockSize, 11), pickerTokens(32*pickerBlockSize, 12)
	f.cache(1, first, 32)
	f.cache(2, second, 32)
	pick := func(tokens []uint32, session string) string {
		t.Helper()
		headers := postHeaders("/v1/completions")
		if session != "" {
			headers["x-session-id"] = session
		}
		got, err := integration.StreamedRequest(t, f.stream(t.Context()), integration.ReqRaw(headers, completionsBody(t, tokens)), 2)
		if err != nil || len(got) != 2 {
			t.Fatalf("responses = %v, %v", got, err)
		}
		return got[0].GetDynamicMetadata().GetFields()[destinationNamespace].GetStructValue().GetFields()[DefaultDestinationHeader].GetStringValue()
	}
	if got := pick(first, "chat-1"); got != pickerEndpoint(1) {
		t.Fatalf("the session's first request went to %s, want %s (it caches the prompt)", got, pickerEndpoint(1))
	}
	if got := pick(second, "chat-1"); got != pickerEndpoint(1) {
		t.Errorf("the session's second request went to %s, want the session's %s", got, pickerEndpoint(1))
	}
	if got := pick(second, ""); got != pickerEndpoint(2) {
		t.Errorf("without the session the second prompt went to %s, want %s (it caches it)", got, pickerEndpoint(2))
	}
}

// TestPickerRequestTrailers: a full-duplex body that ends with trailers is picked at the trailers,
// its body sent back without end_of_stream, and the trailers answered.
func TestPickerRequestTrailers(t *testing.T) {
	f := newPickerFleet(t, policy.DefaultConfig(), false)
	body := completionsBody(t, pickerTokens(4*pickerBlockSize, 13))
	reqs := integration.ReqRaw(postHeaders("/v1/completions"), body)
	reqs[1].GetRequestBody().EndOfStream = false
	reqs = append(reqs, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}})
	got, err := integration.StreamedRequest(t, f.stream(t.Context()), reqs, 3)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || got[0].GetRequestHeaders() == nil || got[2].GetRequestTrailers() == nil {
		t.Fatalf("responses = %v, want the headers', the body's and the trailers'", got)
	}
	sr := got[1].GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	if string(sr.GetBody()) != body || sr.GetEndOfStream() {
		t.Errorf("body sent back = %d bytes, end_of_stream %v; want the body, without end_of_stream", len(sr.GetBody()), sr.GetEndOfStream())
	}
}
