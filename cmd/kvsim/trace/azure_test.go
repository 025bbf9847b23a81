package trace

import (
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestLoadAzure(t *testing.T) {
	const text = `TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:04.0319601,0,0
2023-11-16 18:18:00.5,1,2000
2023-11-17 00:00:00.0000000,12,1
`
	got, err := LoadAzure(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	seg := func(i, n int) []Segment { return []Segment{{Key: combine(tagAzure, uint64(i)), Len: n}} }
	want := []Request{
		{ID: "azure-0", Arrival: 0, Segments: seg(0, 4808), OutputTokens: 10},
		{ID: "azure-1", Arrival: 52 * time.Millisecond, Segments: seg(1, 3180), OutputTokens: 8},
		{ID: "azure-2", Arrival: 52*time.Millisecond + 100*time.Nanosecond},
		{ID: "azure-3", Arrival: 56*time.Second + 520040*time.Microsecond, Segments: seg(3, 1), OutputTokens: 2000},
		{ID: "azure-4", Arrival: 5*time.Hour + 42*time.Minute + 56*time.Second + 20040*time.Microsecond, Segments: seg(4, 12), OutputTokens: 1},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("(-want +got):\n%s", diff)
	}
	// No two prompts share a token prefix.
	a, b := got[0].AppendTokens(nil), got[1].AppendTokens(nil)
	if n := commonPrefix(a, b); n > 2 {
		t.Errorf("two Azure prompts share their first %d tokens", n)
	}
	if s := Stats(got, 1); s.HitBlocks != 0 {
		t.Errorf("Stats found %d shared blocks in an Azure trace, want 0", s.HitBlocks)
	}
}

func TestLoadAzureMalformed(t *testing.T) {
	const head = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
	const good = "2023-11-16 18:17:03.9799600,4808,10\n"
	tests := []struct {
		name string
		text string
		want []string
	}{
		{"empty", "", []string{"trace: azure trace is empty"}},
		{"wrong header", "TIME,ContextTokens,GeneratedTokens\n" + good, []string{"line 1", `column 1 is "TIME", want "TIMESTAMP"`}},
		{"short header", "TIMESTAMP,ContextTokens\n" + good, []string{"line 1", "wrong number of fields"}},
		{"missing field", head + good + "2023-11-16 18:17:04.0,12\n", []string{"line 3", "wrong number of fields"}},
		{"bad timestamp", head + good + "2023-11-16T18:17:04.0,12,3\n", []string{"line 3", `TIMESTAMP "2023-11-16T18:17:04.0" is not of the form`}},
		{"bad context", head + "2023-11-16 18:17:04.0,1.5,3\n", []string{"line 2", `ContextTokens "1.5" is not an integer`}},
		{"negative generated", head + good + good + "2023-11-16 18:17:04.0,12,-3\n", []string{"line 4", "GeneratedTokens -3 is negative"}},
		{"time goes back", head + good + "2023-11-16 18:17:03.9799599,12,3\n", []string{"line 3", "TIMESTAMP 2023-11-16 18:17:03.9799599 is before the previous row's 2023-11-16 18:17:03.97996"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reqs, err := LoadAzure(strings.NewReader(tt.text))
			if reqs != nil {
				t.Errorf("got %d requests with the error, want none", len(reqs))
			}
			wantErr(t, err, tt.want...)
		})
	}
}

// TestAzureFiles checks the figures of traces/README.md on the real traces.
func TestAzureFiles(t *testing.T) {
	tests := []struct {
		file          string
		rows          int
		spanMin, rate float64
		input, output Dist
	}{
		{"azure_llm_2023_code.csv", 8819, 57.27, 2.567,
			Dist{Mean: 2047.8, Median: 1469, P90: 5187.6, P99: 7436, Min: 3, Max: 7437},
			Dist{Mean: 27.9, Median: 13, P90: 55, P99: 251.5, Min: 6, Max: 1899}},
		{"azure_llm_2023_conv.csv", 19366, 58.36, 5.53,
			Dist{Mean: 1154.7, Median: 1020, P90: 2734.5, P99: 4142, Min: 2, Max: 14050},
			Dist{Mean: 211.1, Median: 129, P90: 424, P99: 601, Min: 7, Max: 1000}},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			f, err := os.Open(traceFile(t, tt.file))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			reqs, err := LoadAzure(f)
			if err != nil {
				t.Fatal(err)
			}
			s := Stats(reqs, 16)
			if s.Requests != tt.rows {
				t.Errorf("Requests = %d, want %d", s.Requests, tt.rows)
			}
			if math.Abs(s.Span.Minutes()-tt.spanMin) > 0.005 || math.Abs(s.Rate-tt.rate) > 0.0005 {
				t.Errorf("span %.3f min, rate %.4f req/s, want %v, %v", s.Span.Minutes(), s.Rate, tt.spanMin, tt.rate)
			}
			want := struct{ Input, Output Dist }{tt.input, tt.output}
			got := struct{ Input, Output Dist }{s.Input, s.Output}
			if diff := cmp.Diff(want, got, cmp.Comparer(func(a, b float64) bool { return math.Abs(a-b) < 0.051 })); diff != "" {
				t.Errorf("length distributions (-README +got):\n%s", diff)
			}
			if s.HitBlocks != 0 {
				t.Errorf("HitBlocks = %d, want 0", s.HitBlocks)
			}
		})
	}
}
