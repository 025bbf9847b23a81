package server

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// TestUnmarshalRouteMatchesProto: unmarshalRoute decodes every encoding of a RouteRequest the way
// proto.Unmarshal does, token ids of every varint length included, and fails where it fails.
func TestUnmarshalRouteMatchesProto(t *testing.T) {
	full := &kvrouterv1.RouteRequest{
		RequestId: "r-1", Model: "llama", TokenIds: []uint32{0, 1, 127, 128, 16383, 16384, 2097151, 2097152, 1<<28 - 1, 1 << 28, 1<<32 - 1},
		LoraName: "lora", CacheNamespace: "ns", QueryOnly: true, Annotations: []string{"a", "b"}, Explain: true, SessionId: "s",
		Hints: &kvrouterv1.RoutingHints{AllowedWorkerIds: []uint64{1, 2}},
	}
	packed, err := proto.Marshal(full)
	if err != nil {
		t.Fatal(err)
	}
	tokens := func(ids ...uint32) []byte { // one packed token_ids field
		var v []byte
		for _, id := range ids {
			v = protowire.AppendVarint(v, uint64(id))
		}
		b := protowire.AppendTag(nil, routeTokenField, protowire.BytesType)
		return protowire.AppendBytes(b, v)
	}
	unpacked := func(ids ...uint64) []byte {
		var b []byte
		for _, id := range ids {
			b = protowire.AppendTag(b, routeTokenField, protowire.VarintType)
			b = protowire.AppendVarint(b, id)
		}
		return b
	}
	model := func(s string) []byte {
		return protowire.AppendString(protowire.AppendTag(nil, 2, protowire.BytesType), s)
	}
	cat := func(parts ...[]byte) []byte {
		var b []byte
		for _, p := range parts {
			b = append(b, p...)
		}
		return b
	}
	hashes := func(hs ...uint64) []byte { // one packed block_hashes field
		var v []byte
		for _, h := range hs {
			v = protowire.AppendFixed64(v, h)
		}
		return protowire.AppendBytes(protowire.AppendTag(nil, routeHashField, protowire.BytesType), v)
	}
	r := rand.New(rand.NewPCG(5, 6))
	var many []uint32
	var many64 []uint64
	for range 5000 {
		many = append(many, uint32(r.Uint64()>>r.IntN(64)))
		many64 = append(many64, r.Uint64())
	}
	tests := []struct {
		name string
		wire []byte
	}{
		{"empty", nil},
		{"every field", packed},
		{"many tokens of every length", tokens(many...)},
		{"token fields split and interleaved with others, last model wins", cat(tokens(1, 2), model("a"), tokens(300), unpacked(4, 5), model("b"), tokens())},
		{"unpacked, with a 64-bit varint truncated to 32 bits", unpacked(7, 1<<40|9)},
		{"unknown field kept", cat(tokens(1), protowire.AppendVarint(protowire.AppendTag(nil, 99, protowire.VarintType), 5))},
		{"truncated packed varint", cat(protowire.AppendTag(nil, routeTokenField, protowire.BytesType), []byte{2, 0x80, 0x80})},
		{"packed length past the end", cat(protowire.AppendTag(nil, routeTokenField, protowire.BytesType), []byte{9, 1})},
		{"truncated tag", []byte{0x80}},
		{"truncated other field", model("abc")[:3]},
		{"bad UTF-8 in a string", model("\xff")},
		{"wrong wire type for model", protowire.AppendVarint(protowire.AppendTag(nil, 2, protowire.VarintType), 1)},
		{"block hashes, packed, split, interleaved and unpacked", cat(hashes(1, 1<<63, 42), model("a"), hashes(), hashes(7),
			protowire.AppendFixed64(protowire.AppendTag(nil, routeHashField, protowire.Fixed64Type), 9))},
		{"block hashes of a prompt", hashes(many64...)},
		{"packed block hashes cut inside a hash", cat(protowire.AppendTag(nil, routeHashField, protowire.BytesType), []byte{9, 1, 2, 3, 4, 5, 6, 7, 8, 9})},
		{"block hashes as varints", protowire.AppendVarint(protowire.AppendTag(nil, routeHashField, protowire.VarintType), 3)},
		{"unpacked block hash truncated", cat(protowire.AppendTag(nil, routeHashField, protowire.Fixed64Type), []byte{1, 2, 3})},
	}
	// Packed fields as long as prompts, where appendPackedUint32 decodes four lanes side by side:
	// vocabulary-like ids, a long varint (five to ten bytes) somewhere in them, and corruptions: a
	// flipped top bit (which merges or splits varints, up to an overlong one), a cut, a ten-byte
	// varint whose last byte overflows 64 bits.
	for i := range 300 {
		ids := make([]uint64, r.IntN(3000))
		vocab := []int{100, 32000, 128256, 1 << 28, 1 << 31}[i%5]
		for k := range ids {
			ids[k] = uint64(r.IntN(vocab))
			if r.IntN(500) == 0 {
				ids[k] = r.Uint64() >> r.IntN(30)
			}
		}
		var v []byte
		for _, id := range ids {
			v = protowire.AppendVarint(v, id)
		}
		switch {
		case len(v) > 0 && i%3 == 1:
			v[r.IntN(len(v))] ^= 0x80
		case len(v) > 0 && i%7 == 2:
			v = v[:r.IntN(len(v))]
		case len(v) > 20 && i%11 == 3:
			k := r.IntN(len(v) - 10)
			copy(v[k:], []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02})
		}
		b := protowire.AppendTag(nil, routeTokenField, protowire.BytesType)
		tests = append(tests, struct {
			name string
			wire []byte
		}{fmt.Sprintf("prompt %d: %d ids below %d, %d bytes", i, len(ids), vocab, len(v)), protowire.AppendBytes(b, v)})
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			want := &kvrouterv1.RouteRequest{}
			wantErr := proto.Unmarshal(tc.wire, want)
			got := &kvrouterv1.RouteRequest{}
			gotErr := unmarshalRoute(tc.wire, got)
			if (gotErr != nil) != (wantErr != nil) {
				t.Fatalf("unmarshalRoute error = %v, proto.Unmarshal error = %v", gotErr, wantErr)
			}
			if wantErr != nil {
				return
			}
			if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
				t.Errorf("unmarshalRoute differs from proto.Unmarshal (-proto +ours):\n%s", diff)
			}
		})
	}
}

// FuzzUnmarshalRoute: on any bytes, unmarshalRoute agrees with proto.Unmarshal.
func FuzzUnmarshalRoute(f *testing.F) {
	b, _ := proto.Marshal(&kvrouterv1.RouteRequest{Model: "m", TokenIds: []uint32{1, 200, 70000, 1 << 30}, QueryOnly: true})
	f.Add(b)
	f.Add([]byte{0x1a, 0x02, 0x80, 0x01})
	b, _ = proto.Marshal(&kvrouterv1.RouteRequest{Model: "m", BlockHashes: []uint64{1, 1 << 63}, BlockSize: 16, PromptTokens: 40})
	f.Add(b)
	f.Fuzz(func(t *testing.T, wire []byte) {
		want := &kvrouterv1.RouteRequest{}
		wantErr := proto.Unmarshal(wire, want)
		got := &kvrouterv1.RouteRequest{}
		gotErr := unmarshalRoute(wire, got)
		if (gotErr != nil) != (wantErr != nil) {
			t.Fatalf("unmarshalRoute error = %v, proto.Unmarshal error = %v", gotErr, wantErr)
		}
		if wantErr == nil && !proto.Equal(want, got) {
			t.Fatalf("unmarshalRoute = %v, proto.Unmarshal = %v", got, want)
		}
	})
}

// BenchmarkUnmarshalRoute decodes a 2,048-token request with ids like a 128k-token vocabulary's:
// proto.Unmarshal against unmarshalRoute.
func BenchmarkUnmarshalRoute(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 2))
	req := &kvrouterv1.RouteRequest{Model: "bench", QueryOnly: true}
	for range 2048 {
		req.TokenIds = append(req.TokenIds, uint32(r.IntN(128256)))
	}
	wire, err := proto.Marshal(req)
	if err != nil {
		b.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		f    func([]byte, *kvrouterv1.RouteRequest) error
	}{
		{"proto", func(w []byte, m *kvrouterv1.RouteRequest) error { return proto.Unmarshal(w, m) }},
		{"unmarshalRoute", unmarshalRoute},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(int64(len(wire)))
			b.ReportAllocs()
			for b.Loop() {
				if err := tc.f(wire, &kvrouterv1.RouteRequest{}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestRouteTokensPooledAcrossCalls: Route calls recycle their token id slices (tokenPool) and block
// hashes (hashPool). Eight callers route the cached prompts of four workers at random, as token ids
// or as block hashes, long enough to be pooled; each answer must name the worker holding that
// prompt and count all its blocks, so a slice reused while a call still used it would show as a
// wrong worker or a short overlap.
func TestRouteTokensPooledAcrossCalls(t *testing.T) {
	e := newTestEnv(t, func(o *Options) { o.MaxPromptTokens = 1 << 20 })
	const workers, blocks = 4, 400 // 1,600 tokens a prompt, over tokenPool.min (and 400 hashes, over hashPool.min)
	prompts := make([][]uint32, workers)
	for w := range workers {
		p := e.connect(uint64(w + 1))
		st := &kvrouterv1.BlocksStored{}
		for i := range blocks {
			toks := []uint32{uint32(w*100_000 + i*4 + 1), uint32(w*100_000 + i*4 + 2), uint32(w*100_000 + i*4 + 3), uint32(w*100_000 + i*4 + 4)}
			st.Blocks = append(st.Blocks, &kvrouterv1.StoredBlock{BlockHash: uint64(w*100_000 + i + 1), TokenIds: toks})
			prompts[w] = append(prompts[w], toks...)
		}
		p.send(events(&kvrouterv1.KvEvent{EventId: 0, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}))
		wantMsg(t, p.recv(), ack(0))
	}
	var wg sync.WaitGroup
	for c := range 8 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(c), 1))
			for range 50 {
				w := r.IntN(workers)
				req := &kvrouterv1.RouteRequest{Model: "m", TokenIds: prompts[w], QueryOnly: true}
				if r.IntN(2) == 0 { // as its block hashes, which are pooled (hashPool) alike
					req = &kvrouterv1.RouteRequest{Model: "m", QueryOnly: true, BlockSize: 4, PromptTokens: uint32(len(prompts[w])),
						BlockHashes: blockhash.Locals(nil, prompts[w], 4, blockhash.Salt("", ""))}
				}
				resp, err := e.router.Route(e.ctx, req)
				if err != nil {
					t.Errorf("Route(prompt of worker %d) = %v", w+1, err)
					return
				}
				got := resp.GetDecode().GetWorkerId()
				overlap := resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice()
				if got != uint64(w+1) || overlap != blocks {
					t.Errorf("Route(prompt of worker %d) went to worker %d with %d cached blocks, want %d", w+1, got, overlap, blocks)
					return
				}
			}
		})
	}
	wg.Wait()
}

// TestRouteTooLargeIsNotDecoded: a Route message larger than the largest one max_prompt_tokens
// allows (five bytes a token id, plus routeOverhead) is refused with RESOURCE_EXHAUSTED naming the
// limit, without being decoded. Before, it was decoded whatever it held: 4 MiB of two-byte
// annotations became a million strings, to be refused (or not: annotations had no limit) only
// after. A message just within the bound is decoded and routed.
func TestRouteTooLargeIsNotDecoded(t *testing.T) {
	e := newTestEnv(t) // max_prompt_tokens 1000: at most 5000 + routeOverhead bytes
	most := maxRouteBytes(1000)
	withAnnotations := func(bytes int) *kvrouterv1.RouteRequest {
		r := &kvrouterv1.RouteRequest{Model: "m", TokenIds: promptTokens(2), QueryOnly: true}
		for size := proto.Size(r); size < bytes; size += 4 { // tag, length, two bytes
			r.Annotations = append(r.Annotations, "ab")
		}
		return r
	}
	tests := []struct {
		name   string
		req    *kvrouterv1.RouteRequest
		reason string // "" when routed (NOT_FOUND: no worker of the model)
	}{
		{"at the bound", withAnnotations(most - 8), ""},
		{"past the bound", withAnnotations(most + 1), "ROUTE_MESSAGE_TOO_LARGE"},
		{"a million annotations", withAnnotations(3 << 20), "ROUTE_MESSAGE_TOO_LARGE"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := e.router.Route(e.ctx, tt.req)
			st := status.Convert(err)
			var info *errdetails.ErrorInfo
			for _, d := range st.Details() {
				if i, ok := d.(*errdetails.ErrorInfo); ok {
					info = i
				}
			}
			if tt.reason == "" {
				if st.Code() != codes.NotFound {
					t.Fatalf("Route of %d bytes = %v, want it decoded and routed (NOT_FOUND: no worker)", proto.Size(tt.req), err)
				}
				return
			}
			if st.Code() != codes.ResourceExhausted || info.GetReason() != tt.reason {
				t.Fatalf("Route of %d bytes = %v, want RESOURCE_EXHAUSTED %s", proto.Size(tt.req), err, tt.reason)
			}
			want := map[string]string{"field": "message", "limit": "max_prompt_tokens", "max": fmt.Sprint(most), "got": fmt.Sprint(proto.Size(tt.req))}
			if diff := cmp.Diff(want, info.GetMetadata()); diff != "" {
				t.Errorf("ErrorInfo metadata (-want +got):\n%s", diff)
			}
		})
	}
}
