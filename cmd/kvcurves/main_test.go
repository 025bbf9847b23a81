package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// sample is benchmark output as the curve tests, `go test -bench` and the load-test steps write it,
// with the log lines around it that must be skipped.
const sample = `=== RUN   TestRouteCurves/tokens
    curves_test.go:76: fleet 64 workers, 1024-token prompts: 1000016 blocks, built in 860ms
BenchmarkCurveRoute/curve=tokens/tokens=1024/mode=query 	13142 	6000 p50-ns 	29000 p99-ns 	7000 ns/op 	1000016 index-blocks 	31.0 walk-blocks
BenchmarkCurveRoute/curve=tokens/tokens=1024/mode=query 	13142 	7000 p50-ns 	31000 p99-ns 	7000 ns/op 	1000016 index-blocks 	31.0 walk-blocks
BenchmarkCurveRoute/curve=tokens/tokens=1024/mode=query 	13142 	6500 p50-ns 	30000 p99-ns 	7000 ns/op 	1000016 index-blocks 	31.0 walk-blocks
BenchmarkCurveRoute/curve=tokens/tokens=1024/mode=book 	4000 	12000 p50-ns 	50000 p99-ns 	16000 ns/op 	1000016 index-blocks 	31.0 walk-blocks
BenchmarkCurveRoute/curve=tokens/tokens=65536/mode=query 	1000 	170000 p50-ns 	330000 p99-ns 	180000 ns/op 	1002484 index-blocks 	1906 walk-blocks
BenchmarkCurveRoute/curve=tokens/tokens=65536/mode=book 	500 	800000 p50-ns 	6000000 p99-ns 	900000 ns/op 	1002484 index-blocks 	1906 walk-blocks
BenchmarkRoute/fleet=agg64/tokens=2k/mode=query-2 	90000 	13230 ns/op 	11300 p50-ns 	31800 p99-ns
BenchmarkApply/gomaxprocs=1 	5 	3890000 block-events/s
BenchmarkApply-2 	5 	3090000 block-events/s
PASS
`

func readSample(t *testing.T) *results {
	t.Helper()
	res := newResults()
	if err := res.read(strings.NewReader(sample)); err != nil {
		t.Fatalf("results.read() = %v", err)
	}
	return res
}

func TestResultsMedianAndRange(t *testing.T) {
	res := readSample(t)
	s, ok := res.get("CurveRoute/curve=tokens/tokens=1024/mode=query", "p50-ns")
	if !ok || s.med != 6500 || s.lo != 6000 || s.hi != 7000 || s.n != 3 {
		t.Errorf("get(p50-ns) = %+v, %v; want median 6500 [6000 – 7000] n=3", s, ok)
	}
	if got := s.rangeText(1e-3); got != "6.5 [6 – 7]" {
		t.Errorf("rangeText(1e-3) = %q, want %q", got, "6.5 [6 – 7]")
	}
	// The -GOMAXPROCS suffix is dropped, so BenchmarkApply-2 and Apply/gomaxprocs=1 stay apart.
	if s, ok := res.get("Apply", "block-events/s"); !ok || s.med != 3090000 {
		t.Errorf("get(Apply) = %+v, %v; want 3,090,000", s, ok)
	}
	if s, ok := res.get("Apply/gomaxprocs=1", "block-events/s"); !ok || s.med != 3890000 {
		t.Errorf("get(Apply/gomaxprocs=1) = %+v, %v; want 3,890,000", s, ok)
	}
	if _, ok := res.get("Route/fleet=agg64/tokens=2k/mode=query", "p99-ns"); !ok {
		t.Error("Route-2 not found as Route")
	}
}

func TestCurveTableAndFigure(t *testing.T) {
	res := readSample(t)
	c := &curves[0]
	if c.id != "route-tokens" {
		t.Fatalf("curves[0] is %s, want route-tokens", c.id)
	}
	table := c.table(res)
	lines := strings.Split(strings.TrimSpace(table), "\n")
	if len(lines) != 4 {
		t.Fatalf("table has %d lines, want a header, a rule and 2 rows:\n%s", len(lines), table)
	}
	// 1k tokens: 64 blocks, so the p50 per block is 6,500 / 64 ns.
	if !strings.HasPrefix(lines[2], "| 1k | 31 | 102 [93.75 – 109] | 6.5 [6 – 7] | 30 [29 – 31] | 12 | 50 |") {
		t.Errorf("row 1k = %q", lines[2])
	}
	if !strings.HasPrefix(lines[3], "| 64k | 1,906 |") {
		t.Errorf("row 64k = %q", lines[3])
	}
	path := filepath.Join(t.TempDir(), "route-tokens.png")
	ok, err := c.figure(res, path)
	if err != nil || !ok {
		t.Fatalf("figure() = %v, %v; want a PNG", ok, err)
	}
	if b, err := os.ReadFile(path); err != nil || !bytes.HasPrefix(b, []byte("\x89PNG")) {
		t.Errorf("%s is not a PNG (%v)", path, err)
	}
	if ok, err := curves[4].figure(res, filepath.Join(t.TempDir(), "none.png")); ok || err != nil {
		t.Errorf("figure() of a curve without points = %v, %v; want false, nil", ok, err)
	}
}

func TestMarkdownRegionsKeepTheText(t *testing.T) {
	doc := setRegion("", "a", "## A", "table 1")
	doc += "\nAnalysis written by hand.\n"
	doc = setRegion(doc, "a", "## A", "table 2")
	if strings.Contains(doc, "table 1") || !strings.Contains(doc, "table 2") || !strings.Contains(doc, "Analysis written by hand.") {
		t.Errorf("after replacing region a:\n%s", doc)
	}
	if strings.Count(doc, "## A") != 1 {
		t.Errorf("heading repeated:\n%s", doc)
	}
	doc = setRegion(doc, "b", "## B", "table 3")
	if !strings.HasSuffix(doc, "## B\n\n<!-- kvcurves:b:start -->\ntable 3\n<!-- kvcurves:b:end -->\n") {
		t.Errorf("new region b not appended:\n%s", doc)
	}
}

func TestBaselineCompareAndUpdate(t *testing.T) {
	text := `# comment
Route/fleet=agg64/tokens=2k/mode=query p99-ns 25000 lower summary
Apply block-events/s 3000000 higher ingestion
Apply/gomaxprocs=1 block-events/s 3000000 higher ingestion, one P
CurveRoute/curve=tokens/tokens=65536/mode=query p99-ns - lower curves.md
Hash/tokens=2k ns/token 1 lower not run
`
	b, err := parseBaseline(text)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	n, err := b.compare(&out, readSample(t), 0.2)
	if err != nil {
		t.Fatal(err)
	}
	// p99 31,800 against 25,000 is 27% worse: a regression. Apply at 3.09M against 3M is within
	// 20%; on one P, 3.89M is 30% better.
	if n != 1 {
		t.Errorf("compare() = %d regressions, want 1:\n%s", n, out.String())
	}
	for _, want := range []string{`p99-ns +31,800 n=1 +25,000 +1.27 +REGRESSION`, `gomaxprocs=1 +block-events/s +3,890,000 n=1 +3,000,000 +1.30 +better`,
		`Hash/tokens=2k +ns/token +not measured`, `65536/mode=query +p99-ns +330,000 n=1 +– +–`} {
		if !regexp.MustCompile(want).MatchString(out.String()) {
			t.Errorf("compare() output lacks %q:\n%s", want, out.String())
		}
	}
	updated := b.update(readSample(t), true, "run X")
	if !strings.Contains(updated, "CurveRoute/curve=tokens/tokens=65536/mode=query p99-ns 330000 lower run X") ||
		!strings.Contains(updated, "p99-ns 25000 lower summary") || !strings.HasPrefix(updated, "# comment\n") {
		t.Errorf("update(missing) =\n%s", updated)
	}
	if _, err := parseBaseline("Apply block-events/s fast higher x\n"); err == nil {
		t.Error("parseBaseline accepted a value that is not a number")
	}
}

func TestKvloadLines(t *testing.T) {
	dir := t.TempDir()
	report := filepath.Join(dir, "r.json")
	log := filepath.Join(dir, "r.txt")
	os.WriteFile(report, []byte(`{"calls": 1000, "errors": {}, "achieved_rate": 5000.4, "latency_ms": {"p50": 0.25, "p99": 2.5},
		"client_cpu_us_per_call": 40, "server_cpu_us_per_call": 70.25}`), 0o644)
	os.WriteFile(log, []byte("kvload: seeded 64 workers of model \"bench\" at 127.0.0.1:1: 2073 stored events, 1000305 blocks, acked in 830ms\n"), 0o644)
	var out, errOut bytes.Buffer
	code := run(context.Background(), []string{"kvload", "-name", "G/concurrency=8", "-json", report, "-seed-name", "S", "-log", log}, &out, &errOut)
	if code != 0 {
		t.Fatalf("kvload = %d: %s", code, errOut.String())
	}
	res := newResults()
	res.read(&out)
	if s, _ := res.get("G/concurrency=8", "p99-ns"); s.med != 2.5e6 {
		t.Errorf("p99-ns = %v, want 2.5e6:\n%s", s.med, out.String())
	}
	if s, _ := res.get("G/concurrency=8", "server-cpu-us/op"); s.med != 70.2 && s.med != 70.3 {
		t.Errorf("server-cpu-us/op = %v, want 70.25 rounded:\n%s", s.med, out.String())
	}
	if s, _ := res.get("S", "acked-blocks/s"); s.med != 1205187 {
		t.Errorf("acked-blocks/s = %v, want 1,205,187:\n%s", s.med, out.String())
	}
}
