package server

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
	"github.com/kvrouter/kvrouter/server/frontdoor"
	"github.com/kvrouter/kvrouter/server/frontdoor/testmodels"
)

// BenchmarkPicker measures a whole request through the endpoint picker over a loopback gRPC
// stream, as Envoy drives it in full-duplex mode: the headers, the body in 64 KiB pieces, the
// picker's answers, a response of one body chunk, and the Free; p50-µs and p99-µs are the
// latencies of single requests. The bodies are completions prompts of token ids ("body=") and
// chat conversations rendered and tokenized with Llama 3.1's own template and tokenizer
// ("chat="; skipped without scripts/models.sh's files), of about 1 KB, 16 KB and 220 KB, over a
// fleet of 16 workers; "c32" runs 32 requests at a time over 4 connections and reports
// requests/s.
//
//	go test -run '^$' -bench BenchmarkPicker -benchtime 2s ./server/
func BenchmarkPicker(b *testing.B) {
	state := kvstate.NewState()
	log := kvstate.NewMemLog(state)
	for id := uint64(1); id <= 16; id++ {
		if _, err := log.Append(context.Background(), kvstate.WorkerUp{Info: kvstate.WorkerInfo{
			Key: kvstate.WorkerKey{ID: id}, Model: "m", Role: kvstate.RoleAggregated, BlockSize: pickerBlockSize, TotalKVBlocks: 1 << 20,
			MaxNumBatchedTokens: 1 << 20, Endpoint: pickerEndpoint(id), KVEventsEnabled: true,
		}}); err != nil {
			b.Fatal(err)
		}
	}
	d := app.New(state, log, policy.NewKernel(policy.StateView(state), policy.DefaultConfig()), app.Options{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	var models *frontdoor.Models
	if dir := filepath.Join(testmodels.Root(), "llama-3.1"); fileExists(filepath.Join(dir, "tokenizer.json")) {
		if models, err = frontdoor.LoadModels(map[string]string{"m": dir}); err != nil {
			b.Fatal(err)
		}
	}
	srv := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(srv, NewPicker(PickerOptions{Dispatcher: d, MaxPromptTokens: 1 << 20, Models: models}))
	go srv.Serve(lis)
	defer srv.Stop()
	conns := make([]extprocv3.ExternalProcessorClient, 4)
	for i := range conns {
		conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Close()
		conns[i] = extprocv3.NewExternalProcessorClient(conn)
	}
	type input struct {
		name, path string
		body       []byte
	}
	var inputs []input
	for _, size := range []struct {
		name   string
		tokens int
	}{{"1KB", 180}, {"16KB", 2900}, {"220KB", 40000}} {
		inputs = append(inputs, input{"body=" + size.name, "/v1/completions", []byte(completionsBodyOf(pickerTokens(size.tokens, 1)))})
	}
	if models != nil {
		// The conversations of the chat template's own benchmark: a system prompt and turns of
		// mixed-script prose, 1.2 KB, 16 KB and 220 KB of JSON.
		for _, size := range []struct {
			name string
			conv testmodels.Synth
		}{{"1KB", testmodels.Synth{Turns: 2, Lines: 9}}, {"16KB", testmodels.Synth{Turns: 8, Lines: 34, System: true}},
			{"220KB", testmodels.Synth{Turns: 40, Lines: 88, System: true}}} {
			inputs = append(inputs, input{"chat=" + size.name, "/v1/chat/completions", testmodels.ChatBody(b, "m", nil, &size.conv)})
		}
	}
	for _, in := range inputs {
		body, path := in.body, in.path
		b.Run(in.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			lat := make([]time.Duration, 0, b.N)
			for b.Loop() {
				start := time.Now()
				if err := benchExchange(conns[0], path, body); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(start))
			}
			reportLatencies(b, lat)
		})
		b.Run(in.name+"/c32", func(b *testing.B) {
			var mu sync.Mutex
			var next int
			b.SetParallelism(16) // 32 goroutines on 2 cores
			start := time.Now()
			b.RunParallel(func(pb *testing.PB) {
				mu.Lock()
				client := conns[next%len(conns)]
				next++
				mu.Unlock()
				for pb.Next() {
					if err := benchExchange(client, path, body); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
		})
	}
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

func completionsBodyOf(tokens []uint32) string {
	return fmt.Sprintf(`{"model": "m", "max_tokens": 16, "prompt": %s}`, uint32JSON(tokens))
}

func uint32JSON(v []uint32) string {
	out := make([]byte, 0, len(v)*6+2)
	out = append(out, '[')
	for i, t := range v {
		if i > 0 {
			out = append(out, ',')
		}
		out = fmt.Appendf(out, "%d", t)
	}
	return string(append(out, ']'))
}

// benchExchange plays one request and its response through the picker, as Envoy does.
func benchExchange(client extprocv3.ExternalProcessorClient, path string, body []byte) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, err := client.Process(ctx)
	if err != nil {
		return err
	}
	send := func(r *extprocv3.ProcessingRequest) error { return stream.Send(r) }
	if err := send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":path", RawValue: []byte(path)}, {Key: ":method", RawValue: []byte("POST")},
		}}}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED},
	}); err != nil {
		return err
	}
	for off := 0; off < len(body); off += 64 << 10 {
		end := min(off+64<<10, len(body))
		if err := send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
			Body: body[off:end], EndOfStream: end == len(body)}}}); err != nil {
			return err
		}
	}
	answers := 1 + (len(body)+bodyChunkBytes-1)/bodyChunkBytes // the headers', then the body's pieces
	for range answers {
		if _, err := stream.Recv(); err != nil {
			return err
		}
	}
	if err := send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("200")}}}}}}); err != nil {
		return err
	}
	if _, err := stream.Recv(); err != nil {
		return err
	}
	if err := send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
		Body: []byte(`{"choices": []}`), EndOfStream: true}}}); err != nil {
		return err
	}
	if _, err := stream.Recv(); err != nil {
		return err
	}
	return stream.CloseSend()
}

// reportLatencies reports the median and the 99th percentile of lat.
func reportLatencies(b *testing.B, lat []time.Duration) {
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
}
