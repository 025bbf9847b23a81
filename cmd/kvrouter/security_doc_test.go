package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestSecurityDoc replays docs/security.md, unchanged but for its two ports, with the real openssl,
// grpcurl and kvrouter, in one scratch directory: certificates, tokens, a credentials file, a router
// with TLS and credentials, each role's calls and refusals, a token rotation, and the stop.
func TestSecurityDoc(t *testing.T) {
	grpcurl := grpcurlPath(t)
	if _, err := exec.LookPath("openssl"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("openssl not found: .ci/run installs it; CI must replay docs/security.md")
		}
		t.Skip("openssl not found")
	}
	bin := buildBinary(t)
	dir := t.TempDir()
	grpcPort, metricsPort := freePort(t), freePort(t)
	ports := strings.NewReplacer("localhost:50051", "localhost"+grpcPort[strings.LastIndex(grpcPort, ":"):],
		"localhost:9090", "localhost"+metricsPort[strings.LastIndex(metricsPort, ":"):])
	t.Cleanup(func() { // a router the document started and a failed step left running
		if pid, err := os.ReadFile(filepath.Join(dir, "kvrouter.pid")); err == nil {
			var p int
			if _, err := fmt.Sscan(strings.TrimSpace(string(pid)), &p); err == nil && syscall.Kill(p, 0) == nil {
				_ = syscall.Kill(p, syscall.SIGKILL)
				time.Sleep(100 * time.Millisecond)
			}
		}
	})
	path := filepath.Dir(bin) + ":" + filepath.Dir(grpcurl) + ":" + os.Getenv("PATH")
	for i, step := range replaySteps(t, "../../docs/security.md") {
		cmd := exec.Command("bash", "-uo", "pipefail", "-c", ports.Replace(step.script))
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "PATH="+path)
		out, err := cmd.CombinedOutput()
		log, _ := os.ReadFile(filepath.Join(dir, "kvrouter.log"))
		switch {
		case step.wantCode == "" && err != nil:
			t.Fatalf("block %d failed: %v\n%s\n--- output:\n%s\n--- server log:\n%s", i, err, step.script, out, log)
		case step.wantCode != "" && (err == nil || !strings.Contains(string(out), "Code: "+step.wantCode)):
			t.Fatalf("block %d: want it to fail with %s, got %v:\n%s\n--- server log:\n%s", i, step.wantCode, err, out, log)
		}
		for _, w := range step.want {
			if !strings.Contains(string(out), w) {
				t.Errorf("block %d: output lacks %q:\n%s\n--- output:\n%s", i, w, step.script, out)
			}
		}
	}
}
