package trace

import (
	"bytes"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// traceFile returns the path of one of the repository's traces (traces/), as Find finds it.
func traceFile(tb testing.TB, name string) string {
	tb.Helper()
	p, err := Find(name)
	if err != nil {
		tb.Fatal(err)
	}
	return p
}

func TestLoadMooncake(t *testing.T) {
	const text = `{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 0, "input_length": 1024, "output_length": 6, "hash_ids": [0, 1]}

{"timestamp": 1500, "input_length": 513, "output_length": 0, "hash_ids": [0, 7], "extra": true}
{"timestamp": 3001, "input_length": 0, "output_length": 1, "hash_ids": []}
`
	want := []Request{
		{ID: "mooncake-0", Segments: []Segment{{0, 512}, {1, 488}}, OutputTokens: 5},
		{ID: "mooncake-1", Segments: []Segment{{0, 512}, {1, 512}}, OutputTokens: 6},
		{ID: "mooncake-2", Arrival: 1500 * time.Millisecond, Segments: []Segment{{0, 512}, {7, 1}}},
		{ID: "mooncake-3", Arrival: 3001 * time.Millisecond, OutputTokens: 1},
	}
	for _, bs := range []int{1, 16, 512} {
		got, err := LoadMooncake(strings.NewReader(text), bs)
		if err != nil {
			t.Fatalf("block size %d: %v", bs, err)
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("block size %d (-want +got):\n%s", bs, diff)
		}
	}
	// Arrivals count from the first row even if the trace does not start at 0.
	got, err := LoadMooncake(strings.NewReader(`{"timestamp": 100, "input_length": 1, "output_length": 1, "hash_ids": [3]}
{"timestamp": 250, "input_length": 1, "output_length": 1, "hash_ids": [3]}`), 512)
	if err != nil {
		t.Fatal(err)
	}
	if got[0].Arrival != 0 || got[1].Arrival != 150*time.Millisecond {
		t.Errorf("arrivals %v, %v, want 0s, 150ms", got[0].Arrival, got[1].Arrival)
	}
}

// TestMooncakePrefix checks that two rows whose first k hash ids agree have exactly k*512 tokens in
// common, for every block size, and that the last block is cut to the input length.
func TestMooncakePrefix(t *testing.T) {
	tests := []struct {
		name   string
		a, b   string
		common int
	}{
		{"first id differs", `"input_length": 1536, "hash_ids": [0, 1, 2]`, `"input_length": 1536, "hash_ids": [5, 3, 4]`, 0},
		{"one shared id", `"input_length": 1536, "hash_ids": [0, 1, 2]`, `"input_length": 1536, "hash_ids": [0, 3, 4]`, 512},
		{"two shared ids", `"input_length": 1536, "hash_ids": [0, 1, 2]`, `"input_length": 1536, "hash_ids": [0, 1, 4]`, 1024},
		{"partial shared last", `"input_length": 1300, "hash_ids": [0, 1, 2]`, `"input_length": 1536, "hash_ids": [0, 1, 2]`, 1300},
		{"one a prefix of the other", `"input_length": 1024, "hash_ids": [0, 1]`, `"input_length": 2000, "hash_ids": [0, 1, 2, 3]`, 1024},
		{"same ids at other positions", `"input_length": 1024, "hash_ids": [0, 1]`, `"input_length": 1024, "hash_ids": [1, 0]`, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			text := `{"timestamp": 0, "output_length": 1, ` + tt.a + "}\n" + `{"timestamp": 0, "output_length": 1, ` + tt.b + "}\n"
			for _, bs := range []int{1, 16, 64, 512} {
				reqs, err := LoadMooncake(strings.NewReader(text), bs)
				if err != nil {
					t.Fatal(err)
				}
				a, b := reqs[0].AppendTokens(nil), reqs[1].AppendTokens(nil)
				if len(a) != reqs[0].InputTokens() || len(b) != reqs[1].InputTokens() {
					t.Fatalf("prompt lengths %d, %d, want %d, %d", len(a), len(b), reqs[0].InputTokens(), reqs[1].InputTokens())
				}
				if got := commonPrefix(a, b); got != tt.common {
					t.Errorf("block size %d: common prefix %d tokens, want %d", bs, got, tt.common)
				}
				// After the shared prefix no whole engine block agrees.
				if n := tt.common; n < min(len(a), len(b)) {
					if same := countEqual(a[n:], b[n:]); same > 3 {
						t.Errorf("block size %d: %d equal tokens after the shared prefix", bs, same)
					}
				}
			}
		})
	}
}

func TestMooncakeLastBlock(t *testing.T) {
	for _, n := range []int{1, 2, 511, 512, 513, 1000, 1023, 1024, 1025} {
		ids := make([]string, (n+511)/512)
		for i := range ids {
			ids[i] = "9"
		}
		text := `{"timestamp": 0, "output_length": 1, "input_length": ` + itoa(n) + `, "hash_ids": [` + strings.Join(ids, ",") + "]}"
		reqs, err := LoadMooncake(strings.NewReader(text), 16)
		if err != nil {
			t.Fatalf("input_length %d: %v", n, err)
		}
		segs := reqs[0].Segments
		if got := len(reqs[0].AppendTokens(nil)); got != n {
			t.Errorf("input_length %d: prompt has %d tokens", n, got)
		}
		if got, want := segs[len(segs)-1].Len, n-512*(len(segs)-1); got != want {
			t.Errorf("input_length %d: last block has %d tokens, want %d", n, got, want)
		}
	}
}

// TestMooncakeSubBlocks checks that sub-block j of hash id h has the same tokens in every prompt
// and for every block size: positions [j*b, (j+1)*b) of the segment {h, 512}.
func TestMooncakeSubBlocks(t *testing.T) {
	text := `{"timestamp": 0, "output_length": 1, "input_length": 1400, "hash_ids": [0, 11, 12]}
{"timestamp": 0, "output_length": 1, "input_length": 600, "hash_ids": [12, 0]}`
	for _, bs := range []int{8, 64, 256} {
		reqs, err := LoadMooncake(strings.NewReader(text), bs)
		if err != nil {
			t.Fatal(err)
		}
		a, b := reqs[0].AppendTokens(nil), reqs[1].AppendTokens(nil)
		for j := range 512 / bs {
			want := Segment{Key: 12, Len: 512}.AppendTokens(nil, j*bs, (j+1)*bs)
			if end := 1024 + (j+1)*bs; end <= len(a) {
				if diff := cmp.Diff(want, a[end-bs:end]); diff != "" {
					t.Errorf("block size %d: sub-block %d of id 12 in the first prompt (-want +got):\n%s", bs, j, diff)
				}
			}
			if diff := cmp.Diff(want, b[j*bs:(j+1)*bs]); diff != "" {
				t.Errorf("block size %d: sub-block %d of id 12 in the second prompt (-want +got):\n%s", bs, j, diff)
			}
		}
	}
}

func TestLoadMooncakeBlockSize(t *testing.T) {
	const row = `{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}`
	for _, bs := range []int{1, 2, 4, 8, 16, 32, 64, 128, 256, 512} {
		if _, err := LoadMooncake(strings.NewReader(row), bs); err != nil {
			t.Errorf("block size %d: %v", bs, err)
		}
	}
	for _, bs := range []int{0, -16, 3, 48, 100, 384, 513, 1024} {
		_, err := LoadMooncake(strings.NewReader(row), bs)
		wantErr(t, err, "block size "+itoa(bs)+" does not divide the Mooncake block size 512")
	}
}

func TestLoadMooncakeMalformed(t *testing.T) {
	const good = `{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}` + "\n"
	tests := []struct {
		name string
		text string
		want []string
	}{
		{"not json", good + "{timestamp: 5}\n", []string{"line 2", "invalid character"}},
		{"truncated", good + good + `{"timestamp": 5, "input_length"` + "\n", []string{"line 3", "unexpected end of JSON"}},
		{"float length", `{"timestamp": 5, "input_length": 600.5, "output_length": 1, "hash_ids": [0, 1]}`, []string{"line 1", "number 600.5"}},
		{"missing timestamp", good + `{"input_length": 600, "output_length": 1, "hash_ids": [0, 1]}`, []string{"line 2", `field "timestamp" is missing`}},
		{"missing input", `{"timestamp": 5, "output_length": 1, "hash_ids": [0, 1]}`, []string{"line 1", `field "input_length" is missing`}},
		{"missing output", `{"timestamp": 5, "input_length": 600, "hash_ids": [0, 1]}`, []string{"line 1", `field "output_length" is missing`}},
		{"missing ids", `{"timestamp": 5, "input_length": 600, "output_length": 1}`, []string{"line 1", `field "hash_ids" is missing`}},
		{"null ids", `{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": null}`, []string{"line 1", `field "hash_ids" is missing`}},
		{"negative input", `{"timestamp": 5, "input_length": -1, "output_length": 1, "hash_ids": []}`, []string{"line 1", "input_length -1 is negative"}},
		{"negative output", `{"timestamp": 5, "input_length": 1, "output_length": -3, "hash_ids": [0]}`, []string{"line 1", "output_length -3 is negative"}},
		{"too few ids", good + "\n" + `{"timestamp": 5, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}`, []string{"line 3", "2 hash_ids for input_length 1025, want ceil(1025/512) = 3"}},
		{"too many ids", `{"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [0, 1]}`, []string{"line 1", "2 hash_ids for input_length 512, want ceil(512/512) = 1"}},
		{"ids for empty prompt", `{"timestamp": 5, "input_length": 0, "output_length": 1, "hash_ids": [0]}`, []string{"line 1", "want ceil(0/512) = 0"}},
		{"negative id", `{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [0, -2]}`, []string{"line 1", "hash_ids[1] = -2 is negative"}},
		{"time goes back", good + good + `{"timestamp": 4, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}`, []string{"line 3", "timestamp 4 is before the previous row's 5"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reqs, err := LoadMooncake(strings.NewReader(tt.text), 16)
			if reqs != nil {
				t.Errorf("got %d requests with the error, want none", len(reqs))
			}
			wantErr(t, err, append([]string{"trace: mooncake "}, tt.want...)...)
		})
	}
}

// loadMooncakeFile loads the real trace, skipping the test if the file is absent.
func loadMooncakeFile(tb testing.TB, blockSize int) []Request {
	tb.Helper()
	f, err := os.Open(traceFile(tb, "mooncake_conversation_trace.jsonl"))
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	reqs, err := LoadMooncake(f, blockSize)
	if err != nil {
		tb.Fatal(err)
	}
	return reqs
}

// TestMooncakeFile checks the figures of traces/README.md on the real trace.
func TestMooncakeFile(t *testing.T) {
	reqs := loadMooncakeFile(t, 512)
	s := Stats(reqs, 512)
	approx := func(name string, got, want, tol float64) {
		t.Helper()
		if math.Abs(got-want) > tol {
			t.Errorf("%s = %v, want %v ± %v", name, got, want, tol)
		}
	}
	if s.Requests != 12031 {
		t.Errorf("Requests = %d, want 12,031", s.Requests)
	}
	approx("span (min)", s.Span.Minutes(), 58.95, 0.005)
	approx("rate (req/s)", s.Rate, 3.401, 0.0005)
	want := struct{ Input, Output Dist }{
		Input:  Dist{Mean: 12035.1, Median: 6909, P90: 27367, P99: 85400.4, Min: 891, Max: 126195},
		Output: Dist{Mean: 342.6, Median: 350, P90: 597, P99: 1118.5, Min: 1, Max: 2000},
	}
	got := struct{ Input, Output Dist }{s.Input, s.Output}
	if diff := cmp.Diff(want, got, cmp.Comparer(func(a, b float64) bool { return math.Abs(a-b) < 0.051 })); diff != "" {
		t.Errorf("length distributions (-README +got):\n%s", diff)
	}
	if s.InputTokens != 144_793_823 {
		t.Errorf("InputTokens = %d, want 144,793,823", s.InputTokens)
	}
	distinct := make(map[uint64]bool)
	for _, r := range reqs {
		if r.Segments[0].Key != 0 {
			t.Fatalf("%s starts with hash id %d, want 0", r.ID, r.Segments[0].Key)
		}
		for _, seg := range r.Segments {
			distinct[seg.Key] = true
		}
	}
	if len(distinct) != 182_790 {
		t.Errorf("%d distinct hash ids, want 182,790", len(distinct))
	}
	if s.Blocks != 288_500 {
		t.Errorf("Blocks = %d, want 288,500 (the number of hash ids)", s.Blocks)
	}
	approx("IdealReuse", s.IdealReuse, 0.366, 0.001)
	approx("IdealTokenReuse", s.IdealTokenReuse, 0.374, 0.001)
	t.Logf("block size 512: %d blocks, %d complete, %d hits: reuse %.4f, token reuse %.4f",
		s.Blocks, s.FullBlocks, s.HitBlocks, s.IdealReuse, s.IdealTokenReuse)
	s512 := s
	for _, bs := range []int{16, 64} {
		s := Stats(reqs, bs)
		if s.IdealTokenReuse <= s512.IdealTokenReuse || s.IdealTokenReuse > 0.38 {
			t.Errorf("block size %d: IdealTokenReuse = %.4f, want a little more than at 512 (%.4f)", bs, s.IdealTokenReuse, s512.IdealTokenReuse)
		}
		t.Logf("block size %d: %d blocks, %d hits: reuse %.4f, token reuse %.4f", bs, s.Blocks, s.HitBlocks, s.IdealReuse, s.IdealTokenReuse)
	}
}

func BenchmarkLoadMooncake(b *testing.B) {
	data, err := os.ReadFile(traceFile(b, "mooncake_conversation_trace.jsonl"))
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := LoadMooncake(bytes.NewReader(data), 16); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkMooncakeTokens materialises every prompt of the trace once per iteration, into one reused
// buffer, as a replay does.
func BenchmarkMooncakeTokens(b *testing.B) {
	reqs := loadMooncakeFile(b, 16)
	var buf []uint32
	tokens := 0
	b.ReportAllocs()
	for b.Loop() {
		tokens = 0
		for i := range reqs {
			buf = reqs[i].AppendTokens(buf[:0])
			tokens += len(buf)
		}
	}
	b.ReportMetric(float64(tokens)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
}

func BenchmarkStatsMooncake(b *testing.B) {
	reqs := loadMooncakeFile(b, 16)
	b.ReportAllocs()
	for b.Loop() {
		Stats(reqs, 16)
	}
}
