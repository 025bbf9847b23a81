package main

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/server/config"
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
			code := run(context.Background(), append([]string{"serve"}, tt.args...), func(k string) string { return tt.env[k] }, io.Discard, &stderr)
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
	if code := run(context.Background(), nil, func(string) string { return "" }, io.Discard, &stderr); code != 2 || !strings.Contains(stderr.String(), "kvrouter serve") {
		t.Errorf("run() with no command = %d, %q; want 2 and the usage", code, stderr.String())
	}
}

// TestBadBridgeConfigExits2: kvrouter bridge refuses a configuration it cannot run with, before it
// connects to anything, naming the setting as the user gave it.
func TestBadBridgeConfigExits2(t *testing.T) {
	required := []string{"--router-addrs", "127.0.0.1:1", "--worker-id", "7", "--model", "m", "--block-size", "16", "--total-kv-blocks", "1000", "--worker-endpoint", "10.0.0.7:8000"}
	tests := []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{name: "no router", args: []string{"--worker-id", "7"}, want: "--router-addrs: must name at least one router"},
		{name: "no worker id", args: required[:2], want: "--worker-id: must be set, and not 0"},
		{name: "no block size", args: []string{"--router-addrs", "a:1", "--worker-id", "7", "--model", "m"}, want: "--block-size: must be set to the engine's block size (> 0)"},
		{name: "no worker endpoint", args: required[:len(required)-2], want: "--worker-endpoint: must be set to where frontends send the engine's requests"},
		{name: "bad role from env", args: required, env: map[string]string{"KVROUTER_ROLE": "encoder"}, want: `KVROUTER_ROLE: must be prefill, decode or aggregated (got "encoder")`},
		{name: "bad extra keys", args: append(required, "--extra-keys", "drop"), want: `--extra-keys: must be hash, skip or ignore (got "drop")`},
		{name: "ranks need tcp", args: append(required, "--dp-ranks", "2", "--engine-endpoint", "ipc:///tmp/kv"), want: `ranks after 0 need a tcp:// endpoint`},
		{name: "not an endpoint", args: append(required, "--engine-endpoint", "127.0.0.1:5557"), want: `--engine-endpoint: must be a ZMQ endpoint such as tcp://127.0.0.1:5557 (got "127.0.0.1:5557")`},
		{name: "negative worker id", args: []string{"--worker-id", "-3"}, want: `--worker-id: must be an unsigned integer (got "-3")`},
		{name: "remote routers without TLS", args: append([]string{"--router-addrs", "10.0.0.5:50051"}, required[2:]...),
			want: "--router-addrs: routers that are not on loopback (10.0.0.5:50051) are dialled with TLS or with an explicit choice of plaintext"},
		{name: "a token in the clear", args: append([]string{"--router-addrs", "10.0.0.5:50051", "--router-plaintext", "--router-token-file", "t"}, required[2:]...),
			want: "--router-token-file: a bearer token sent without TLS can be read off the wire"},
		{name: "certificate without key", args: append(required, "--router-cert-file", "c.pem"),
			want: "--router-cert-file and --router-key-file: set both"},
		{name: "plaintext and TLS", args: append(required, "--router-plaintext", "--router-ca-file", "ca.pem"),
			want: "--router-plaintext turns TLS off"},
		{name: "unreadable CA", args: append(required, "--router-ca-file", "/nonexistent/ca.pem"),
			want: "/nonexistent/ca.pem"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stderr bytes.Buffer
			code := run(context.Background(), append([]string{"bridge"}, tt.args...), func(k string) string { return tt.env[k] }, io.Discard, &stderr)
			if code != 2 {
				t.Errorf("run() = %d, want 2; stderr:\n%s", code, stderr.String())
			}
			if got := stderr.String(); !strings.Contains(got, tt.want) {
				t.Errorf("stderr = %q, want it to contain %q", got, tt.want)
			}
		})
	}
}

// TestCleartextSecretsWarned: the router warns at start when bearer tokens reach a plaintext port
// other hosts can reach, or the Redis password goes to a Redis on another host without TLS; not
// when the hop stays on the machine or is encrypted.
func TestCleartextSecretsWarned(t *testing.T) {
	for _, tt := range []struct {
		name  string
		set   func(o *config.Options)
		redis []string
		want  int
	}{
		{"tokens over plaintext to other hosts", func(o *config.Options) {
			o.CredentialsFile, o.Listen, o.Plaintext = "creds.yaml", "0.0.0.0:50051", true
		}, nil, 1},
		{"tokens on loopback", func(o *config.Options) { o.CredentialsFile = "creds.yaml" }, nil, 0},
		{"tokens over TLS", func(o *config.Options) {
			o.CredentialsFile, o.Listen, o.TLSCertFile = "creds.yaml", "0.0.0.0:50051", "s.crt"
		}, nil, 0},
		{"Redis password to another host", func(o *config.Options) { o.RedisPasswordFile = "pw" }, []string{"10.0.0.5:6379"}, 1},
		{"Redis password over TLS", func(o *config.Options) { o.RedisPasswordFile, o.RedisTLS = "pw", true }, []string{"10.0.0.5:6379"}, 0},
		{"Redis password on loopback", func(o *config.Options) { o.RedisPassword = "x" }, []string{"127.0.0.1:6379"}, 0},
	} {
		o := config.New()
		tt.set(o)
		if got := cleartextSecrets(o, tt.redis); len(got) != tt.want {
			t.Errorf("%s: %q, want %d warnings", tt.name, got, tt.want)
		}
	}
}
