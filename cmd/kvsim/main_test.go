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
