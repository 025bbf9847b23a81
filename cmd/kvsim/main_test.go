package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
)

// TestCompareAndSweep runs both commands on a small generated workload and checks what they write:
// a report with one row per configuration, the CDF plots, and the sweep's table and curve.
func TestCompareAndSweep(t *testing.T) {
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	args := []string{"compare", "--trace", "shared-prefix", "--limit", "120", "--prefill", "1", "--decode", "1", "--out", out,
		"--configs", "rr-disagg,kv-disagg,cd:isl_bounding,kv-agg"}
	if code := run(context.Background(), args, &stdout, &stderr); code != 0 {
		t.Fatalf("kvsim compare = %d\n%s", code, stderr.String())
	}
	report, err := os.ReadFile(filepath.Join(out, "report.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, row := range []string{"| rr-disagg |", "| kv-disagg |", "| cd:isl_bounding |", "| kv-agg |"} {
		if !strings.Contains(string(report), row) {
			t.Errorf("report.md has no row %q:\n%s", row, report)
		}
	}
	for _, png := range []string{"ttft-cdf.png", "itl-cdf.png"} {
		if fi, err := os.Stat(filepath.Join(out, png)); err != nil || fi.Size() < 1000 {
			t.Errorf("%s: %v", png, err)
		}
	}

	args = []string{"sweep", "--trace", "shared-prefix", "--limit", "80", "--prefill", "1", "--decode", "1", "--out", out, "--values", "128,4096"}
	if code := run(context.Background(), args, &stdout, &stderr); code != 0 {
		t.Fatalf("kvsim sweep = %d\n%s", code, stderr.String())
	}
	table, err := os.ReadFile(filepath.Join(out, "sweep-eff_isl_threshold.md"))
	if err != nil || !strings.Contains(string(table), "| 128 |") || !strings.Contains(string(table), "| 4096 |") {
		t.Errorf("sweep table = %q, %v", table, err)
	}
	if code := run(context.Background(), []string{"compare", "--configs", "cd:nope", "--limit", "1", "--out", out}, &stdout, &stderr); code != 1 ||
		!strings.Contains(stderr.String(), "cd:nope") {
		t.Errorf("an unknown policy: exit %d, stderr %q", code, stderr.String())
	}
}

// TestSensitivity runs kvsim sensitivity on a small generated workload: three tables (TTFT p50,
// ITL p99.9, goodput) with a row per configuration, thresholds in the name included, and a column
// per cost-model variant; and the refusals of a malformed configuration or scale.
func TestSensitivity(t *testing.T) {
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	args := []string{"sensitivity", "--trace", "shared-prefix", "--limit", "60", "--prefill", "1", "--decode", "1", "--out", out,
		"--configs", "kv-disagg,cd:isl_bounding:8192:0.9"}
	if code := run(context.Background(), args, &stdout, &stderr); code != 0 {
		t.Fatalf("kvsim sensitivity = %d\n%s", code, stderr.String())
	}
	table, err := os.ReadFile(filepath.Join(out, "sensitivity.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| TTFT p50 | as given | attention 0.5x | attention 2x | network 0.5x | network 2x |",
		"| ITL p99.9 |", "| goodput |", "| kv-disagg |", "| cd:isl_bounding:8192:0.9 |"} {
		if !strings.Contains(string(table), want) {
			t.Errorf("sensitivity.md has no %q:\n%s", want, table)
		}
	}
	if n := strings.Count(string(table), "| kv-disagg |"); n != 3 {
		t.Errorf("sensitivity.md has %d kv-disagg rows, want one per table (3):\n%s", n, table)
	}
	for _, bad := range []string{"cd:isl_bounding:x:0.9", "cd:isl_bounding:8192", "cd:isl_bounding:-1:0.9"} {
		stderr.Reset()
		if code := run(context.Background(), []string{"compare", "--configs", bad, "--limit", "1", "--out", out}, &stdout, &stderr); code != 1 ||
			!strings.Contains(stderr.String(), bad) {
			t.Errorf("--configs %s: exit %d, stderr %q; want 1 naming it", bad, code, stderr.String())
		}
	}
	stderr.Reset()
	if code := run(context.Background(), []string{"compare", "--attention-scale", "0", "--limit", "1", "--out", out}, &stdout, &stderr); code != 1 ||
		!strings.Contains(stderr.String(), "--attention-scale 0") {
		t.Errorf("--attention-scale 0: exit %d, stderr %q", code, stderr.String())
	}
}

// TestReplicas runs kvsim replicas against a private Redis on a small workload: one row per replica
// count and sharing mode (fleet's TestReplicasShareState checks the figures), and a clear error
// without a Redis.
func TestReplicas(t *testing.T) {
	out := t.TempDir()
	r := redistest.Start(t)
	var stdout, stderr bytes.Buffer
	args := []string{"replicas", "--trace", "shared-prefix", "--limit", "80", "--prefill", "1", "--decode", "2", "--counts", "1,2",
		"--redis-addr", r.Addr, "--out", out}
	if code := run(context.Background(), args, &stdout, &stderr); code != 0 {
		t.Fatalf("kvsim replicas = %d\n%s", code, stderr.String())
	}
	table, err := os.ReadFile(filepath.Join(out, "replicas.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, row := range []string{"| 1 | shared through Redis |", "| 2 | shared through Redis |", "| 2 | own (every worker streams to each) |"} {
		if !strings.Contains(string(table), row) {
			t.Errorf("replicas.md has no row %q:\n%s", row, table)
		}
	}
	if code := run(context.Background(), []string{"replicas", "--limit", "1", "--out", out}, &stdout, &stderr); code != 1 ||
		!strings.Contains(stderr.String(), "--redis-addr") {
		t.Errorf("without --redis-addr: exit %d, stderr %q", code, stderr.String())
	}
}

// TestLoadTraceFile: --trace takes the path of a trace file of either format, by its extension or
// by --trace-format, and refuses what it cannot read with a message naming the flag and the rule.
func TestLoadTraceFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	mooncake := `{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 1500, "input_length": 513, "output_length": 3, "hash_ids": [0, 7]}
`
	azure := "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04.0319600,3180,8\n2023-11-16 18:17:05.0,12,1\n"
	for _, tc := range []struct {
		name, path, format string
		want               int
	}{
		{"mooncake by extension", write("mine.jsonl", mooncake), "", 2},
		{"azure by extension", write("mine.csv", azure), "", 3},
		{"mooncake by flag", write("mine.trace", mooncake), "mooncake", 2},
		{"azure by flag", write("mine.log", azure), "azure", 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reqs, err := loadTrace(tc.path, tc.format, 0)
			if err != nil || len(reqs) != tc.want {
				t.Fatalf("loadTrace(%s) = %d requests, %v; want %d", tc.path, len(reqs), err, tc.want)
			}
		})
	}
	for _, tc := range []struct {
		name, trace, format, want string
	}{
		{"no extension, no format", write("mine", mooncake), "", "say its format with --trace-format"},
		{"unknown format", write("other.trace", mooncake), "sharegpt", `--trace-format "sharegpt": want mooncake or azure`},
		{"missing file", filepath.Join(dir, "gone.jsonl"), "", "gone.jsonl: no such file"},
		{"wrong format", write("wrong.jsonl", azure), "", "--trace " + filepath.Join(dir, "wrong.jsonl") + ": trace: mooncake line 1"},
		{"format for a built-in", "mooncake", "azure", "applies to a trace file given by path"},
		{"unknown name", "sharegpt", "", `want mooncake, azure-code, azure-conv, shared-prefix, multi-turn or the path of a trace file`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := loadTrace(tc.trace, tc.format, 0); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("loadTrace(%s, %q) = %v, want an error containing %q", tc.trace, tc.format, err, tc.want)
			}
		})
	}
}
