package main

import (
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/testing/protocmp"
	"sigs.k8s.io/gateway-api-inference-extension/test/integration"
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
	reqs := integration.ReqRaw(map[string]string{":path": "/v1/completions", ":method": "POST"}, pickerBody)
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
	return got[:2], stream.CloseSend()
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
