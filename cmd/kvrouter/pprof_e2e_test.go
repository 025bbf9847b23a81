package main

import (
	"io"
	"net/http"
	"os/exec"
	"strings"
	"testing"
)

// TestPprofOnlyWhenAsked: `serve --pprof` serves Go's profiler on its own loopback listener
// (--pprof-listen), never on the metrics listener; without the flag nothing serves it. A CPU
// profile asking for more than maxProfileSeconds is refused, and --pprof on an address other hosts
// can reach does not start (the profiler answers without authentication).
func TestPprofOnlyWhenAsked(t *testing.T) {
	bin := buildBinary(t)
	get := func(url string) (int, string) {
		t.Helper()
		resp, err := http.Get(url)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	tests := []struct {
		name  string
		pprof bool
	}{
		{"with --pprof", true},
		{"without", false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			metrics, pprofAddr := freePort(t), freePort(t)
			args := []string{"--metrics-listen", metrics, "--pprof-listen", pprofAddr}
			if tc.pprof {
				args = append(args, "--pprof")
			}
			startServer(t, bin, args...)
			if code, _ := get("http://" + metrics + "/metrics"); code != http.StatusOK {
				t.Fatalf("GET /metrics = %d, want 200", code)
			}
			if code, _ := get("http://" + metrics + "/debug/pprof/"); code != http.StatusNotFound {
				t.Errorf("GET /debug/pprof/ on the metrics listener = %d, want 404", code)
			}
			code, body := get("http://" + pprofAddr + "/debug/pprof/")
			if !tc.pprof {
				if code != 0 {
					t.Errorf("GET /debug/pprof/ on the pprof address without --pprof = %d, want nothing listening", code)
				}
				return
			}
			if code != http.StatusOK {
				t.Fatalf("GET /debug/pprof/ = %d, want 200", code)
			}
			for _, profile := range []string{"heap", "allocs", "mutex", "goroutine"} {
				if !strings.Contains(body, profile) {
					t.Errorf("/debug/pprof/ does not list the %s profile", profile)
				}
			}
			if code, body := get("http://" + pprofAddr + "/debug/pprof/heap?debug=1"); code != http.StatusOK || !strings.Contains(body, "heap profile") {
				t.Errorf("GET /debug/pprof/heap?debug=1 = %d %.60q, want 200 and a heap profile", code, body)
			}
			if code, _ := get("http://" + pprofAddr + "/debug/pprof/profile?seconds=3600"); code != http.StatusBadRequest {
				t.Errorf("GET /debug/pprof/profile?seconds=3600 = %d, want 400 (at most %d s)", code, maxProfileSeconds)
			}
		})
	}
	out, err := exec.Command(bin, "serve", "--pprof", "--pprof-listen", "0.0.0.0:6060").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "must be a loopback address") {
		t.Errorf("serve --pprof --pprof-listen 0.0.0.0:6060 = %v\n%s\nwant it refused: the profiler answers without authentication", err, out)
	}
}
