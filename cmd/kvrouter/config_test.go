package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/server"
)

func envFunc(env map[string]string) func(string) string {
	return func(k string) string { return env[k] }
}

func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "kvrouter.yaml")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestConfigPrecedence: flags > KVROUTER_* environment > YAML file > defaults, and GetConfig's
// sources say which won.
func TestConfigPrecedence(t *testing.T) {
	file := writeFile(t, "overlap_score_credit: 0.25\nrouter_temperature: 0.5\nprefill_load_scale: 3\nrouter_queue_threshold: null\n")
	env := map[string]string{"KVROUTER_CONFIG": file, "KVROUTER_ROUTER_TEMPERATURE": "0.75", "KVROUTER_PREFILL_LOAD_SCALE": "2"}
	cfg, err := loadConfig([]string{"--prefill-load-scale", "1.5", "--enforce-disagg"}, envFunc(env), &bytes.Buffer{})
	if err != nil {
		t.Fatalf("loadConfig() = %v", err)
	}
	got := map[string]server.ConfigEntry{}
	for _, e := range cfg.entries() {
		got[e.Key] = e
	}
	want := map[string]server.ConfigEntry{
		"overlap_score_credit":   {Key: "overlap_score_credit", Value: "0.25", Source: server.SourceFile},
		"router_temperature":     {Key: "router_temperature", Value: "0.75", Source: server.SourceEnv},
		"prefill_load_scale":     {Key: "prefill_load_scale", Value: "1.5", Source: server.SourceFlag},
		"enforce_disagg":         {Key: "enforce_disagg", Value: "true", Source: server.SourceFlag},
		"router_queue_threshold": {Key: "router_queue_threshold", Value: "", Source: server.SourceFile},
		"listen":                 {Key: "listen", Value: ":50051", Source: server.SourceDefault},
		"booking_expiry":         {Key: "booking_expiry", Value: "5m0s", Source: server.SourceDefault},
	}
	for k, w := range want {
		if diff := cmp.Diff(w, got[k]); diff != "" {
			t.Errorf("entry %s mismatch (-want +got):\n%s", k, diff)
		}
	}
	if want := len(settings) + len(cfg.cdEntries()); len(got) != want {
		t.Errorf("entries() has %d settings, want %d", len(got), want)
	}
	if cfg.Router.PrefillLoadScale != 1.5 || !cfg.Router.EnforceDisagg || cfg.Router.OverlapScoreCredit != 0.25 {
		t.Errorf("router config = %+v, want scale 1.5, enforce_disagg, credit 0.25", cfg.Router)
	}
}

// TestBadConfigExits2: every bad value stops the command with status 2 and a message naming the
// setting as the user gave it.
func TestBadConfigExits2(t *testing.T) {
	tests := []struct {
		name string
		args []string
		env  map[string]string
		file string
		want string
	}{
		{name: "negative credit flag", args: []string{"--overlap-score-credit", "-1"},
			want: "kvrouter: invalid configuration: --overlap-score-credit: must be a finite, non-negative number (got -1)"},
		{name: "NaN credit", args: []string{"--overlap-score-credit", "NaN"},
			want: `kvrouter: invalid configuration: --overlap-score-credit: must be a finite number (got "NaN")`},
		{name: "host weight from env", env: map[string]string{"KVROUTER_HOST_CACHE_HIT_WEIGHT": "2"},
			want: "kvrouter: invalid configuration: KVROUTER_HOST_CACHE_HIT_WEIGHT: must be in [0, 1] (got 2)"},
		{name: "unparseable env", env: map[string]string{"KVROUTER_MAX_PROMPT_TOKENS": "lots"},
			want: `kvrouter: invalid configuration: KVROUTER_MAX_PROMPT_TOKENS: must be an integer (got "lots")`},
		{name: "queue policy in file", file: "router_queue_policy: lifo\n",
			want: `kvrouter: invalid configuration: router_queue_policy (config file): must be one of "fcfs", "wspt" (got "lifo")`},
		{name: "unknown key in file", file: "overlap_score_credit: 1\nbogus: 2\nalso_bogus: 3\n",
			want: "has unknown key(s): also_bogus, bogus"},
		{name: "bad log level", args: []string{"--log-level", "loud"},
			want: `kvrouter: invalid configuration: --log-level: must be debug, info, warn or error (got "loud")`},
		{name: "negative duration", args: []string{"--worker-grace-period", "-1s"},
			want: `kvrouter: invalid configuration: --worker-grace-period: must be a non-negative duration such as 30s or 5m (got "-1s")`},
		{name: "publish limit above the receive limit", args: []string{"--max-recv-msg-bytes", "2097152"}, env: map[string]string{"KVROUTER_MAX_PUBLISH_MSG_BYTES": "4194304"},
			want: "kvrouter: invalid configuration: KVROUTER_MAX_PUBLISH_MSG_BYTES: must be at most --max-recv-msg-bytes 2097152 (got 4194304)"},
		{name: "zero batch blocks", args: []string{"--max-batch-blocks", "0"},
			want: "kvrouter: invalid configuration: --max-batch-blocks: must be >= 1 (got 0)"},
		{name: "unknown flag", args: []string{"--no-such-flag"}, want: "flag provided but not defined: -no-such-flag"},
		{name: "missing config file", args: []string{"--config", "/nonexistent/kvrouter.yaml"}, want: "no such file or directory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := map[string]string{}
			for k, v := range tt.env {
				env[k] = v
			}
			if tt.file != "" {
				env["KVROUTER_CONFIG"] = writeFile(t, tt.file)
			}
			var stderr bytes.Buffer
			code := run(context.Background(), append([]string{"serve"}, tt.args...), envFunc(env), &stderr)
			if code != 2 {
				t.Errorf("run() = %d, want 2; stderr:\n%s", code, stderr.String())
			}
			if !strings.Contains(stderr.String(), tt.want) {
				t.Errorf("stderr = %q, want it to contain %q", stderr.String(), tt.want)
			}
		})
	}
}

func TestUsage(t *testing.T) {
	var stderr bytes.Buffer
	if code := run(context.Background(), nil, envFunc(nil), &stderr); code != 2 || !strings.Contains(stderr.String(), "kvrouter serve") {
		t.Errorf("run() with no command = %d, %q; want 2 and the usage", code, stderr.String())
	}
}
