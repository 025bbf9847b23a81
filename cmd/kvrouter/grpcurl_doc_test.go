package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// docStep is one sh block of a replayed document and what its output must hold: each substring of
// want; with wantCode, the block fails and grpcurl reports that status code.
type docStep struct {
	script   string
	want     []string
	wantCode string
}

// replaySteps returns the sh blocks between path's replay markers, each with the expect comment
// that follows it (<!-- expect: a | b --> or <!-- expect-code: Code | message part -->).
func replaySteps(t *testing.T, path string) []docStep {
	t.Helper()
	doc, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(doc), "<!-- replay:start -->")
	section, _, ok2 := strings.Cut(rest, "<!-- replay:end -->")
	if !ok || !ok2 {
		t.Fatalf("%s has no replay markers", path)
	}
	re := regexp.MustCompile("(?s)```sh\n(.*?)```\\s*<!-- (expect|expect-code): (.*?) -->")
	var steps []docStep
	for _, m := range re.FindAllStringSubmatch(section, -1) {
		parts := strings.Split(m[3], " | ")
		s := docStep{script: m[1], want: parts}
		if m[2] == "expect-code" {
			s.wantCode, s.want = parts[0], parts[1:]
		}
		steps = append(steps, s)
	}
	if n := strings.Count(section, "```sh"); n != len(steps) {
		t.Fatalf("%s: %d sh blocks, %d with an expect comment right after: every block needs one", path, n, len(steps))
	}
	return steps
}

// TestGrpcurlDoc replays docs/grpcurl.md, unchanged but for the address, with the real grpcurl
// against a real `kvrouter serve`, in one scratch directory.
func TestGrpcurlDoc(t *testing.T) {
	grpcurl := grpcurlPath(t)
	addr, logs := startServer(t, buildBinary(t))
	dir := t.TempDir()
	for i, step := range replaySteps(t, "../../docs/grpcurl.md") {
		cmd := exec.Command("bash", "-uo", "pipefail", "-c", strings.ReplaceAll(step.script, "localhost:50051", addr))
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(grpcurl)+":"+os.Getenv("PATH"))
		out, err := cmd.CombinedOutput()
		switch {
		case step.wantCode == "" && err != nil:
			t.Fatalf("block %d failed: %v\n%s\n--- output:\n%s\n--- server log:\n%s", i, err, step.script, out, logs)
		case step.wantCode != "" && (err == nil || !strings.Contains(string(out), "Code: "+step.wantCode)):
			t.Fatalf("block %d: want it to fail with %s, got %v:\n%s", i, step.wantCode, err, out)
		}
		for _, w := range step.want {
			if !strings.Contains(string(out), w) {
				t.Errorf("block %d: output lacks %q:\n%s\n--- output:\n%s", i, w, step.script, out)
			}
		}
	}
}
