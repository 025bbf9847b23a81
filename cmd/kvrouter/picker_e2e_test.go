package main

import (
	"bytes"
	"context"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/testing/protocmp"
	"sigs.k8s.io/gateway-api-inference-extension/test/integration"

	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
	"github.com/kvrouter/kvrouter/server/frontdoor/testmodels"
)

// pickerBody is the completions request the picker tests send: llama, whose worker 7 serveLlama
// registers at endpoint w7.
const pickerBody = `{"model": "llama", "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 4}`

// pickOnce sends pickerBody through the endpoint picker at addr as credential name ("" sends no
// token), as Envoy does in full-duplex mode, and returns the picker's two answers (the headers'
// and the body's). With respond, it then plays a whole response through the stream, which ends
// the booking.
func pickOnce(t *testing.T, r *secureRouter, addr, name string, respond bool) ([]*extprocv3.ProcessingResponse, error) {
	t.Helper()
	return pick(t, r, addr, name, "/v1/completions", pickerBody, respond)
}

// pick is pickOnce with the request's path and body.
func pick(t *testing.T, r *secureRouter, addr, name, path, body string, respond bool) ([]*extprocv3.ProcessingResponse, error) {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(credentials.NewTLS(r.clientTLS(nil))))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := r.as(name)
	defer cancel()
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		return nil, err
	}
	reqs := integration.ReqRaw(map[string]string{":path": path, ":method": "POST"}, body)
	reqs[0].ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		ResponseBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED}
	if respond {
		reqs = append(reqs,
			&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
				Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("200")}}}}}},
			&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
				Body: []byte(`{"choices": [{"text": "ok"}]}`), EndOfStream: true}}})
	}
	for _, req := range reqs {
		if err := stream.Send(req); err != nil {
			_, err = stream.Recv() // a refused stream's status
			return nil, err
		}
	}
	// The requests are sent: the helper only collects the answers.
	want := 2
	if respond {
		want = 4
	}
	got, err := integration.StreamedRequest(t, stream, nil, want)
	if err != nil {
		return nil, err
	}
	return got[:min(2, len(got))], stream.CloseSend() // a refusal is one answer
}

// TestPickerPort runs `kvrouter serve --picker-listen` with TLS and credentials and drives its
// endpoint picker with the Gateway API Inference Extension's request builders: the picker's port
// holds callers to the main port's rules (a token of the frontend role), and a request of the
// protocol is sent to the registered worker's endpoint.
func TestPickerPort(t *testing.T) {
	pickerAddr := freePort(t)
	r := startSecureRouter(t, "--picker-listen", pickerAddr)
	r.serveLlama()
	_, err := pickOnce(t, r, pickerAddr, "", false)
	wantCode(t, "a picker call without a token", err, codes.Unauthenticated)
	_, err = pickOnce(t, r, pickerAddr, "worker-7", false)
	wantCode(t, "a picker call with a worker's token", err, codes.PermissionDenied)
	got, err := pickOnce(t, r, pickerAddr, "frontend", true)
	if err != nil {
		t.Fatalf("a picker call with a frontend's token = %v", err)
	}
	want := integration.NewRequestBufferedResponse("w7", []byte(pickerBody))
	want[0].GetRequestHeaders().Response.HeaderMutation.RemoveHeaders = []string{"x-prefiller-host-port"}
	if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
		t.Errorf("responses (-want +got):\n%s", diff)
	}
}

// TestPickerModels runs `kvrouter serve --picker-models` with Llama 3.1's real tokenizer files:
// a chat request and a completions text are tokenized and picked, a model without files is
// answered 503 naming it, and a directory that does not load stops the start with status 1,
// naming the model and the file.
func TestPickerModels(t *testing.T) {
	dir := testmodels.Dir(t, "llama-3.1")
	pickerAddr := freePort(t)
	r := startSecureRouter(t, "--picker-listen", pickerAddr, "--picker-models", "llama="+dir)
	r.serveLlama()
	for _, tc := range []struct{ name, path, body string }{
		{"chat", "/v1/chat/completions", `{"model": "llama", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, wörld!"}]}`},
		{"completions text", "/v1/completions", `{"model": "llama", "prompt": "Once upon a time", "max_tokens": 4}`},
	} {
		got, err := pick(t, r, pickerAddr, "frontend", tc.path, tc.body, true)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if ir := got[0].GetImmediateResponse(); ir != nil {
			t.Fatalf("%s: refused %d %s", tc.name, ir.GetStatus().GetCode(), ir.GetBody())
		}
		want := integration.NewRequestBufferedResponse("w7", []byte(tc.body))
		want[0].GetRequestHeaders().Response.HeaderMutation.RemoveHeaders = []string{"x-prefiller-host-port"}
		if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
			t.Errorf("%s: responses (-want +got):\n%s", tc.name, diff)
		}
	}
	got, err := pick(t, r, pickerAddr, "frontend", "/v1/completions", `{"model": "qwen", "prompt": "hi"}`, false)
	if err != nil {
		t.Fatal(err)
	}
	ir := got[0].GetImmediateResponse()
	if ir.GetStatus().GetCode() != typev3.StatusCode_ServiceUnavailable || !strings.Contains(string(ir.GetBody()), `model \"qwen\" has no tokenizer`) {
		t.Errorf("a model without files: %d %s; want 503 naming it", ir.GetStatus().GetCode(), ir.GetBody())
	}

	var stderr bytes.Buffer
	empty := t.TempDir()
	code := run(t.Context(), []string{"serve", "--picker-listen", freePort(t), "--picker-models", "broken=" + empty}, func(string) string { return "" }, io.Discard, &stderr)
	if want := `picker_models: model "broken" (` + empty + `): tokenizer: open ` + filepath.Join(empty, "tokenizer.json"); code != 1 || !strings.Contains(stderr.String(), want) {
		t.Errorf("run() with a model directory without files = %d, %q; want 1 and %q", code, stderr.String(), want)
	}
}

// TestPickerReplicaDiesMidStream kills (SIGKILL) the replica whose endpoint picker holds a picked
// request's stream, before the response comes: nobody is left to free that booking, so replica B,
// which shares the log, expires it after booking_expiry, and counts it in
// kvrouter_bookings_expired_total. The booking is held until then, and not one expiry longer.
func TestPickerReplicaDiesMidStream(t *testing.T) {
	s := redistest.Start(t)
	bin := buildBinary(t)
	const expiry = 2 * time.Second
	pickerAddr := freePort(t)
	flags := []string{"--redis-addr", s.Addr, "--booking-expiry", expiry.String()}
	a := startProcess(t, bin, append(flags, "--replica-id", "a", "--picker-listen", pickerAddr)...)
	b := startProcess(t, bin, append(flags, "--replica-id", "b")...)
	ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout)
	defer cancel()

	w := &worker{t: t, id: 1, acked: -1}
	w.connect(ctx, b.addr) // model m, endpoint w: the worker outlives A
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool { return len(listWorkers(t, a.addr)) == 1 }) {
		t.Fatal("replica A never saw the worker registered on B")
	}

	conn, err := grpc.NewClient("passthrough:///"+pickerAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	body := `{"model": "m", "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 4}`
	reqs := integration.ReqRaw(map[string]string{":path": "/v1/completions", ":method": "POST"}, body)
	reqs[0].ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		ResponseBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED}
	for _, req := range reqs {
		if err := stream.Send(req); err != nil {
			t.Fatalf("sending the request to A's picker: %v", err)
		}
	}
	got, err := integration.StreamedRequest(t, stream, nil, 2)
	if err != nil {
		t.Fatalf("A's picker: %v", err)
	}
	if ir := got[0].GetImmediateResponse(); ir != nil {
		t.Fatalf("A's picker refused the request: %d %s", ir.GetStatus().GetCode(), ir.GetBody())
	}
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool { return metricValue(t, b, "kvrouter_bookings") == 1 }) {
		t.Fatalf("replica B never held the picked request's booking (kvrouter_bookings = %v)", metricValue(t, b, "kvrouter_bookings"))
	}

	a.kill() // mid-stream: the response never comes, and A cannot free the booking
	killed := time.Now()
	if !kvtest.Poll(defaultTestTimeout, 50*time.Millisecond, func() bool {
		return metricValue(t, b, "kvrouter_bookings") == 0 && metricValue(t, b, "kvrouter_bookings_expired_total") == 1
	}) {
		t.Fatalf("after A died, B holds %v bookings and counted %v expired; want 0 and 1\n%s",
			metricValue(t, b, "kvrouter_bookings"), metricValue(t, b, "kvrouter_bookings_expired_total"), b.logs)
	}
	// The booking was made before the kill, so it ends at most an expiry and a sweep (1 s) after.
	if took := time.Since(killed); took > expiry+defaultTestTimeout/2 {
		t.Errorf("the booking expired %v after A died; want about booking_expiry (%v)", took, expiry)
	}
	if !strings.Contains(b.logs.String(), "expired bookings that were never freed") {
		t.Errorf("B's log does not say it expired a booking:\n%s", b.logs)
	}
}
