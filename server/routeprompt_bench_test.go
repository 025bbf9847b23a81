package server

import (
	"testing"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// BenchmarkRoutePrompt measures a query-only Route of 2,048 tokens over gRPC (client and server in
// this process, 16 workers), from as many callers as GOMAXPROCS, with the prompt sent as its token
// ids and as the block hashes a caller keyed it with (block_hashes): the second saves the server
// decoding 2,048 varints and hashing 128 blocks, and the wire 3 KB. cpu-ns/op is the whole
// process's CPU per call, the client's encoding included; the caller's own hashing is not (it
// keys each prompt once, before the loop).
func BenchmarkRoutePrompt(b *testing.B) {
	client, prompt := routeBench(b, nil)
	hashed := &kvrouterv1.RouteRequest{Model: "bench", QueryOnly: true, BlockSize: 16, PromptTokens: uint32(len(prompt)),
		BlockHashes: blockhash.Locals(nil, prompt, 16, blockhash.Salt("", ""))}
	for _, tc := range []struct {
		name string
		req  *kvrouterv1.RouteRequest
	}{
		{"ids", &kvrouterv1.RouteRequest{Model: "bench", TokenIds: prompt, QueryOnly: true}},
		{"hashed", hashed},
	} {
		b.Run("prompt="+tc.name, func(b *testing.B) { routeInParallel(b, client, tc.req) })
	}
}
