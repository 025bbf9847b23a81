package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// TestBadConfigExits2: a bad value stops the command with status 2 and a line naming the setting as
// the user gave it (server/config's tests hold every rule).
func TestBadConfigExits2(t *testing.T) {
	tests := []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{name: "negative credit flag", args: []string{"--overlap-score-credit", "-1"},
			want: "kvrouter: invalid configuration: --overlap-score-credit: must be a finite, non-negative number (got -1)\n"},
		{name: "host weight from env", env: map[string]string{"KVROUTER_HOST_CACHE_HIT_WEIGHT": "2"},
			want: "kvrouter: invalid configuration: KVROUTER_HOST_CACHE_HIT_WEIGHT: must be in [0, 1] (got 2)\n"},
		// The acceptance command: kvrouter serve --conditional-disagg-config '{"eff_isl_threshold":1.5}'.
		{name: "conditional disaggregation, Dynamo's message", args: []string{"--conditional-disagg-config", `{"eff_isl_threshold":1.5}`},
			want: "kvrouter: invalid configuration: --conditional-disagg-config eff_isl_threshold must be an integer\n"},
		{name: "unknown flag", args: []string{"--no-such-flag"}, want: "flag provided but not defined: -no-such-flag"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stderr bytes.Buffer
			code := run(context.Background(), append([]string{"serve"}, tt.args...), func(k string) string { return tt.env[k] }, &stderr)
			if code != 2 {
				t.Errorf("run() = %d, want 2; stderr:\n%s", code, stderr.String())
			}
			if got := stderr.String(); !strings.Contains(got, tt.want) {
				t.Errorf("stderr = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestUsage(t *testing.T) {
	var stderr bytes.Buffer
	if code := run(context.Background(), nil, func(string) string { return "" }, &stderr); code != 2 || !strings.Contains(stderr.String(), "kvrouter serve") {
		t.Errorf("run() with no command = %d, %q; want 2 and the usage", code, stderr.String())
	}
}
