package main

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestPprofOnlyWhenAsked: `serve --pprof` serves Go's profiler on the metrics listener, beside
// /metrics; without the flag the same path is not found.
func TestPprofOnlyWhenAsked(t *testing.T) {
	bin := buildBinary(t)
	get := func(url string) (int, string) {
		t.Helper()
		resp, err := http.Get(url)
		if err != nil {
			t.Fatalf("GET %s: %v", url, err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	tests := []struct {
		name      string
		pprof     bool
		wantIndex int
	}{
		{"with --pprof", true, http.StatusOK},
		{"without", false, http.StatusNotFound},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			metrics := freePort(t)
			args := []string{"--metrics-listen", metrics}
			if tc.pprof {
				args = append(args, "--pprof")
			}
			startServer(t, bin, args...)
			if code, _ := get("http://" + metrics + "/metrics"); code != http.StatusOK {
				t.Fatalf("GET /metrics = %d, want 200", code)
			}
			code, body := get("http://" + metrics + "/debug/pprof/")
			if code != tc.wantIndex {
				t.Fatalf("GET /debug/pprof/ = %d, want %d", code, tc.wantIndex)
			}
			if !tc.pprof {
				return
			}
			for _, profile := range []string{"heap", "allocs", "mutex", "goroutine"} {
				if !strings.Contains(body, profile) {
					t.Errorf("/debug/pprof/ does not list the %s profile", profile)
				}
			}
			if code, body := get("http://" + metrics + "/debug/pprof/heap?debug=1"); code != http.StatusOK || !strings.Contains(body, "heap profile") {
				t.Errorf("GET /debug/pprof/heap?debug=1 = %d %.60q, want 200 and a heap profile", code, body)
			}
		})
	}
}
