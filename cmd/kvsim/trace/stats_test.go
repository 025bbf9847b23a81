package trace

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"fmt"
	"hash/maphash"
	"os"
	"slices"
	"testing"
	"time"

	gocmp "github.com/google/go-cmp/cmp"
)

func TestStatsDistributions(t *testing.T) {
	req := func(at time.Duration, in, out int) Request {
		return Request{Arrival: at, Segments: appendSegment(nil, uint64(in), in), OutputTokens: out}
	}
	tests := []struct {
		name string
		reqs []Request
		want Summary
	}{
		{"none", nil, Summary{}},
		{"one", []Request{req(time.Second, 10, 3)}, Summary{
			Requests:    1,
			Input:       Dist{Mean: 10, Median: 10, P90: 10, P99: 10, Min: 10, Max: 10},
			Output:      Dist{Mean: 3, Median: 3, P90: 3, P99: 3, Min: 3, Max: 3},
			InputTokens: 10, OutputTokens: 3,
			BlockSize: 4, Blocks: 3, FullBlocks: 2,
		}},
		{"four, unordered", []Request{req(3*time.Second, 40, 1), req(time.Second, 10, 2), req(2*time.Second, 20, 0), req(5*time.Second, 30, 5)}, Summary{
			Requests: 4, Span: 4 * time.Second, Rate: 1,
			// numpy.percentile([10, 20, 30, 40], [50, 90, 99]) = 25, 37, 39.7
			Input:       Dist{Mean: 25, Median: 25, P90: 37, P99: 39.7, Min: 10, Max: 40},
			Output:      Dist{Mean: 2, Median: 1.5, P90: 4.1, P99: 4.91, Min: 0, Max: 5},
			InputTokens: 100, OutputTokens: 8,
			BlockSize: 4, Blocks: 26, FullBlocks: 24,
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Stats(tt.reqs, 4)
			if diff := gocmp.Diff(tt.want, got, gocmp.Comparer(func(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 })); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
	if s := Stats([]Request{req(0, 10, 3)}, 0); s.BlockSize != 0 || s.Blocks != 0 {
		t.Errorf("Stats with block size 0 gave BlockSize %d, Blocks %d, want 0", s.BlockSize, s.Blocks)
	}
}

// TestStatsReuseMatchesTokens checks Stats's reuse, computed from segments, against hashing the
// materialised prompts block by block as a prefix cache does.
func TestStatsReuseMatchesTokens(t *testing.T) {
	mooncake := []Request{
		{Segments: []Segment{{0, 512}, {1, 512}, {2, 100}}},
		{Segments: []Segment{{0, 512}, {1, 300}}},
		{Segments: []Segment{{0, 512}, {1, 512}, {2, 512}, {3, 7}}},
		{Segments: []Segment{{0, 512}, {4, 512}}},
		{Segments: []Segment{{0, 512}, {1, 512}, {2, 50}}},
		{Segments: []Segment{{0, 200}}},
	}
	for i := range mooncake {
		mooncake[i].Arrival = time.Duration(i)
	}
	sources := map[string][]Request{
		"mooncake-like": mooncake,
		"shared prefix": SharedPrefix(5, 6, 300, 41, 1, 1, 9),
		"multi-turn":    MultiTurn(4, 5, 100, 33, 57, 1, 9),
		"reversed":      reversed(MultiTurn(3, 4, 64, 20, 30, 1, 4)),
	}
	data, err := os.ReadFile(traceFile(t, "mooncake_conversation_trace.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	head := bytes.SplitAfterN(data, []byte("\n"), 401)[:400]
	file, err := LoadMooncake(bytes.NewReader(bytes.Join(head, nil)), 16)
	if err != nil {
		t.Fatal(err)
	}
	sources["mooncake file, 400 rows"] = file
	for name, reqs := range sources {
		for _, bs := range []int{1, 7, 16, 64, 100, 512} {
			if bs == 1 && len(reqs) > 100 {
				continue // too slow to hash token by token
			}
			t.Run(fmt.Sprintf("%s/%d", name, bs), func(t *testing.T) {
				s := Stats(reqs, bs)
				blocks, full, hits := reuseByTokens(reqs, bs)
				want := [3]int{blocks, full, hits}
				if got := [3]int{s.Blocks, s.FullBlocks, s.HitBlocks}; got != want {
					t.Errorf("blocks, full, hits = %v, want %v by hashing tokens", got, want)
				}
				t.Logf("blocks, full, hits = %v", want)
			})
		}
	}
}

// reuseByTokens is reuse computed the slow way: it hashes every complete block of every prompt with
// all the tokens before it, in arrival order, into one set.
func reuseByTokens(reqs []Request, b int) (blocks, full, hits int) {
	order := make([]int, len(reqs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(i, j int) int { return cmp.Compare(reqs[i].Arrival, reqs[j].Arrival) })
	seed := maphash.MakeSeed()
	cache := make(map[uint64]bool)
	var toks []uint32
	var ids []uint64
	for _, i := range order {
		toks = reqs[i].AppendTokens(toks[:0])
		var h maphash.Hash
		h.SetSeed(seed)
		ids = ids[:0]
		var buf [4]byte
		for k, tok := range toks {
			binary.LittleEndian.PutUint32(buf[:], tok)
			h.Write(buf[:])
			if (k+1)%b == 0 {
				ids = append(ids, h.Sum64())
			}
		}
		for _, id := range ids {
			if cache[id] {
				hits++
			}
		}
		for _, id := range ids {
			cache[id] = true
		}
		full += len(toks) / b
		blocks += (len(toks) + b - 1) / b
	}
	return blocks, full, hits
}

// reversed returns a reversed copy of reqs.
func reversed(reqs []Request) []Request {
	reqs = slices.Clone(reqs)
	slices.Reverse(reqs)
	return reqs
}
