package config

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/config/layered"
)

func envFunc(env map[string]string) func(string) string {
	return func(k string) string { return env[k] }
}

// load runs Load with args and the environment env, plus KVROUTER_CONFIG naming a YAML file of
// content file when it is not empty; it returns what Load printed too.
func load(t *testing.T, args []string, env map[string]string, file string) (*Options, string, error) {
	t.Helper()
	env = maps.Clone(env)
	if file != "" {
		if env == nil {
			env = map[string]string{}
		}
		env["KVROUTER_CONFIG"] = writeFile(t, file)
	}
	var stderr bytes.Buffer
	o, err := Load("kvrouter serve", args, envFunc(env), &stderr)
	return o, stderr.String(), err
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
	cfg, err := Load("kvrouter serve", []string{"--prefill-load-scale", "1.5", "--enforce-disagg"}, envFunc(env), &bytes.Buffer{})
	if err != nil {
		t.Fatalf("Load() = %v", err)
	}
	got := map[string]Entry{}
	for _, e := range cfg.Entries() {
		got[e.Key] = e
	}
	want := map[string]Entry{
		"overlap_score_credit":   {Key: "overlap_score_credit", Value: "0.25", Source: SourceFile},
		"router_temperature":     {Key: "router_temperature", Value: "0.75", Source: SourceEnv},
		"prefill_load_scale":     {Key: "prefill_load_scale", Value: "1.5", Source: SourceFlag},
		"enforce_disagg":         {Key: "enforce_disagg", Value: "true", Source: SourceFlag},
		"router_queue_threshold": {Key: "router_queue_threshold", Value: "", Source: SourceFile},
		"listen":                 {Key: "listen", Value: "127.0.0.1:50051", Source: SourceDefault},
		"booking_expiry":         {Key: "booking_expiry", Value: "5m0s", Source: SourceDefault},
	}
	for k, w := range want {
		if diff := cmp.Diff(w, got[k]); diff != "" {
			t.Errorf("entry %s mismatch (-want +got):\n%s", k, diff)
		}
	}
	if want := len(settings) + len(policy.CDConfigKeys); len(got) != want {
		t.Errorf("entries() has %d settings, want %d", len(got), want)
	}
	if cfg.Routing.PrefillLoadScale != 1.5 || !cfg.Routing.EnforceDisagg || cfg.Routing.OverlapScoreCredit != 0.25 {
		t.Errorf("router config = %+v, want scale 1.5, enforce_disagg, credit 0.25", cfg.Routing)
	}
}

// TestBadConfig: every bad value is refused with a message naming the setting as the user gave it.
func TestBadConfig(t *testing.T) {
	tests := []struct {
		name string
		args []string
		env  map[string]string
		file string
		want string
	}{
		{name: "negative credit flag", args: []string{"--overlap-score-credit", "-1"},
			want: "--overlap-score-credit: must be a finite, non-negative number (got -1)"},
		{name: "NaN credit", args: []string{"--overlap-score-credit", "NaN"},
			want: `--overlap-score-credit: must be a finite number (got "NaN")`},
		{name: "host weight from env", env: map[string]string{"KVROUTER_HOST_CACHE_HIT_WEIGHT": "2"},
			want: "KVROUTER_HOST_CACHE_HIT_WEIGHT: must be in [0, 1] (got 2)"},
		{name: "unparseable env", env: map[string]string{"KVROUTER_MAX_PROMPT_TOKENS": "lots"},
			want: `KVROUTER_MAX_PROMPT_TOKENS: must be an integer (got "lots")`},
		{name: "queue policy in file", file: "router_queue_policy: lifo\n",
			want: `router_queue_policy (config file): must be one of "fcfs", "wspt" (got "lifo")`},
		{name: "unknown key in file", file: "overlap_score_credit: 1\nbogus: 2\nalso_bogus: 3\n",
			want: "has unknown key(s): also_bogus, bogus"},
		{name: "bad log level", args: []string{"--log-level", "loud"},
			want: `--log-level: must be debug, info, warn or error (got "loud")`},
		{name: "negative duration", args: []string{"--worker-grace-period", "-1s"},
			want: `--worker-grace-period: must be a non-negative duration such as 30s or 5m (got "-1s")`},
		{name: "publish limit above the receive limit", args: []string{"--max-recv-msg-bytes", "2097152"}, env: map[string]string{"KVROUTER_MAX_PUBLISH_MSG_BYTES": "4194304"},
			want: "KVROUTER_MAX_PUBLISH_MSG_BYTES: must be at most --max-recv-msg-bytes 2097152 (got 4194304)"},
		{name: "zero batch blocks", args: []string{"--max-batch-blocks", "0"},
			want: "--max-batch-blocks: must be >= 1 (got 0)"},
		{name: "pprof without a metrics listener", args: []string{"--pprof", "--metrics-listen", ""},
			want: "--pprof: needs --metrics-listen, where the profiler is served"},
		{name: "unknown flag", args: []string{"--no-such-flag"}, want: "flag provided but not defined: -no-such-flag"},
		{name: "all interfaces without TLS", args: []string{"--listen", ":50051"},
			want: `--listen ":50051": other hosts can reach it, so it serves TLS: set --tls-cert-file and --tls-key-file, or --plaintext to serve without TLS`},
		{name: "certificate without key", args: []string{"--tls-cert-file", "c.pem"},
			want: "--tls-cert-file and tls_key_file (default): set both or neither"},
		{name: "client CA without TLS", env: map[string]string{"KVROUTER_TLS_CLIENT_CA_FILE": "ca.pem"},
			want: "KVROUTER_TLS_CLIENT_CA_FILE: needs tls_cert_file (default) and tls_key_file (default) (mutual TLS is TLS)"},
		{name: "plaintext and TLS", args: []string{"--plaintext", "--tls-cert-file", "c.pem", "--tls-key-file", "k.pem"},
			want: "--plaintext and --tls-cert-file: set one, not both"},
		{name: "TLS 1.1", args: []string{"--tls-min-version", "1.1"}, want: `--tls-min-version: must be 1.2 or 1.3 (got "1.1")`},
		{name: "negative route rate", args: []string{"--route-rate-limit", "-5"}, want: "--route-rate-limit: must be >= 0 (got -5)"},
		{name: "redis password as a flag", args: []string{"--redis-password", "hunter2"}, want: "flag provided but not defined: -redis-password"},
		{name: "redis password twice", env: map[string]string{"KVROUTER_REDIS_PASSWORD": "x"}, args: []string{"--redis-password-file", "p"},
			want: "KVROUTER_REDIS_PASSWORD and --redis-password-file: set one, not both"},
		{name: "redis CA without TLS", args: []string{"--redis-tls-ca-file", "ca.pem"},
			want: "redis_tls (default): must be true when a redis_tls_* file or name is set"},
		{name: "sharding without Redis", args: []string{"--redis-shard-by-model"},
			want: "--redis-shard-by-model: shards the shared log in Redis; needs redis_addr (default) or redis_cluster_addrs (default)"},
		{name: "models without sharding", args: []string{"--redis-addr", "127.0.0.1:6379", "--redis-models", "a"},
			want: "--redis-models: needs redis_shard_by_model (default) (an unsharded log holds every model)"},
		{name: "an empty model", file: "redis_addr: 127.0.0.1:6379\nredis_shard_by_model: true\nredis_models: a,,b\n",
			want: `redis_models (config file): model 2 is empty (got "a,,b")`},
		{name: "a model twice", env: map[string]string{"KVROUTER_REDIS_MODELS": "a, b,a"}, args: []string{"--redis-addr", "127.0.0.1:6379", "--redis-shard-by-model"},
			want: `KVROUTER_REDIS_MODELS: model "a" is listed twice`},
		{name: "picker models without the picker", args: []string{"--picker-models", "m=/models/m"},
			want: "--picker-models: needs picker_listen (default) (the models are the endpoint picker's)"},
		{name: "a picker model without a directory", args: []string{"--picker-listen", "127.0.0.1:9002", "--picker-models", "a=/m/a,b"},
			want: `--picker-models: entry 2 must be name=directory (got "b")`},
		{name: "a picker model twice", env: map[string]string{"KVROUTER_PICKER_MODELS": "a=/m/a, a=/m/b"}, args: []string{"--picker-listen", "127.0.0.1:9002"},
			want: `KVROUTER_PICKER_MODELS: model "a" is listed twice`},
		{name: "missing config file", args: []string{"--config", "/nonexistent/kvrouter.yaml"}, want: "no such file or directory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, stderr, err := load(t, tt.args, tt.env, tt.file)
			if err == nil {
				t.Fatalf("Load() = nil, want %q", tt.want)
			}
			if got := err.Error() + stderr; !strings.Contains(got, tt.want) {
				t.Errorf("Load() = %q, want it to contain %q", got, tt.want)
			}
		})
	}
}

// TestSecretsStayOut: the Redis password is read from the environment or the file, never offered
// as a flag, and GetConfig's entries show only that it is set.
func TestSecretsStayOut(t *testing.T) {
	var help bytes.Buffer
	if _, err := Load("kvrouter serve", []string{"-h"}, envFunc(nil), &help); err == nil {
		t.Fatal("Load(-h) = nil, want ErrUsage")
	}
	if strings.Contains(help.String(), "redis-password ") || !strings.Contains(help.String(), "redis-password-file") {
		t.Errorf("--help offers a password flag, or lacks the password file:\n%s", help.String())
	}
	for _, src := range []struct {
		name string
		env  map[string]string
		file string
	}{
		{"env", map[string]string{"KVROUTER_REDIS_PASSWORD": "hunter2"}, ""},
		{"file", nil, "redis_password: hunter2\n"},
	} {
		cfg, _, err := load(t, nil, src.env, src.file)
		if err != nil {
			t.Fatalf("%s: Load() = %v", src.name, err)
		}
		if cfg.RedisPassword != "hunter2" {
			t.Errorf("%s: RedisPassword = %q, want hunter2", src.name, cfg.RedisPassword)
		}
		for _, e := range cfg.Entries() {
			if strings.Contains(e.Value, "hunter2") {
				t.Errorf("%s: entry %s shows the password: %q", src.name, e.Key, e.Value)
			}
			if e.Key == "redis_password" && e.Value != layered.Redacted {
				t.Errorf("%s: redis_password entry = %q, want %q", src.name, e.Value, layered.Redacted)
			}
		}
	}
}

// TestConditionalDisaggConfig restates §10.8 with our flag names.
func TestConditionalDisaggConfig(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	full := `{"policy":"isl_or_load","eff_isl_threshold":4096,"eff_isl_ratio_threshold":0.8,"prefill_busy_threshold":16,"decode_busy_threshold":0.9}`
	tests := []struct {
		name string
		args []string
		env  map[string]string
		file string
		want policy.CDConfig
		err  string
	}{
		{name: "every key", args: []string{"--conditional-disagg", "--conditional-disagg-config", full},
			want: policy.CDConfig{Enabled: true, Policy: policy.ISLOrLoad, EffISLThreshold: 4096, EffISLRatioThreshold: 0.8, PrefillBusyThreshold: f(16), DecodeBusyThreshold: f(0.9)}},
		{name: "defaults when enabled", args: []string{"--conditional-disagg"},
			want: policy.CDConfig{Enabled: true, Policy: policy.ISLBounding, EffISLThreshold: 2048, EffISLRatioThreshold: 0.7}},
		{name: "off by default", want: policy.DefaultCDConfig()},
		{name: "config without the feature", args: []string{"--conditional-disagg-config", `{"policy":"isl_bounding"}`},
			err: "--conditional-disagg-config requires --conditional-disagg"},
		{name: "unknown field", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"foo":1}`},
			err: "--conditional-disagg-config has unknown field(s): foo"},
		{name: "unknown fields sorted", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"zz":1,"foo":2,"policy":"isl_bounding"}`},
			err: "--conditional-disagg-config has unknown field(s): foo, zz"},
		{name: "not an object", args: []string{"--conditional-disagg", "--conditional-disagg-config", `[1]`},
			err: "--conditional-disagg-config must be a JSON object"},
		{name: "not JSON", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{policy:`},
			err: "--conditional-disagg-config must be a JSON object"},
		{name: "float threshold, before the requires rule", args: []string{"--conditional-disagg-config", `{"eff_isl_threshold":1.5}`},
			err: "--conditional-disagg-config eff_isl_threshold must be an integer"},
		{name: "boolean threshold", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"eff_isl_threshold":true}`},
			err: "--conditional-disagg-config eff_isl_threshold must be an integer"},
		{name: "null threshold", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"eff_isl_threshold":null}`},
			err: "--conditional-disagg-config eff_isl_threshold must be an integer"},
		{name: "negative threshold", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"eff_isl_threshold":-1}`},
			err: "--conditional-disagg-config eff_isl_threshold must be >= 0"},
		{name: "null ratio", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"eff_isl_ratio_threshold":null}`},
			err: "--conditional-disagg-config eff_isl_ratio_threshold must be a number"},
		{name: "string ratio", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"eff_isl_ratio_threshold":"0.5"}`},
			err: "--conditional-disagg-config eff_isl_ratio_threshold must be a number"},
		{name: "ratio 1.5", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"eff_isl_ratio_threshold":1.5}`},
			err: "--conditional-disagg-config eff_isl_ratio_threshold must be in [0.0, 1.0]"},
		{name: "ratio 1.0000001", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"eff_isl_ratio_threshold":1.0000001}`},
			err: "--conditional-disagg-config eff_isl_ratio_threshold must be in [0.0, 1.0]"},
		{name: "null prefill busy threshold is unset", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"prefill_busy_threshold":null}`},
			want: policy.CDConfig{Enabled: true, Policy: policy.ISLBounding, EffISLThreshold: 2048, EffISLRatioThreshold: 0.7}},
		{name: "boolean busy threshold", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"decode_busy_threshold":false}`},
			err: "--conditional-disagg-config decode_busy_threshold must be a number"},
		{name: "negative prefill busy", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"prefill_busy_threshold":-0.1}`},
			err: "--conditional-disagg-config prefill_busy_threshold must be >= 0"},
		{name: "negative decode busy", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"decode_busy_threshold":-0.1}`},
			err: "--conditional-disagg-config decode_busy_threshold must be >= 0"},
		{name: "decode busy beyond a float64 is infinite", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"decode_busy_threshold":1e999}`},
			err: "--conditional-disagg-config decode_busy_threshold must be a finite number >= 0 (got +Inf)"},
		{name: "prefill busy beyond a float64 is infinite", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"prefill_busy_threshold":-1e999}`},
			err: "--conditional-disagg-config prefill_busy_threshold must be a finite number >= 0 (got -Inf)"},
		{name: "ratio beyond a float64", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"eff_isl_ratio_threshold":1e999}`},
			err: "--conditional-disagg-config eff_isl_ratio_threshold must be in [0.0, 1.0]"},
		{name: "policy not a string", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"policy":1}`},
			err: "--conditional-disagg-config policy must be a string"},
		{name: "unknown policy", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"policy":"bogus"}`},
			err: "--conditional-disagg-config policy must be one of 'isl_bounding', 'prefill_load', 'isl_or_load'"},
		{name: "prefill_load without any threshold", args: []string{"--conditional-disagg", "--conditional-disagg-config", `{"policy":"prefill_load"}`},
			err: "conditional_disagg policy='prefill_load' needs prefill_busy_threshold, but neither prefill_busy_threshold nor --router-queue-threshold is set"},
		{name: "prefill_load inherits the queue threshold", args: []string{"--conditional-disagg", "--router-queue-threshold", "4", "--conditional-disagg-config", `{"policy":"prefill_load"}`},
			want: policy.CDConfig{Enabled: true, Policy: policy.PrefillLoad, EffISLThreshold: 2048, EffISLRatioThreshold: 0.7, PrefillBusyThreshold: f(4)}},
		{name: "KV events off", args: []string{"--conditional-disagg", "--use-kv-events=false"},
			err: "--conditional-disagg requires --use-kv-events"},
		{name: "from the environment", env: map[string]string{"KVROUTER_CONDITIONAL_DISAGG": "true", "KVROUTER_CONDITIONAL_DISAGG_CONFIG": `{"eff_isl_threshold":1024}`},
			want: policy.CDConfig{Enabled: true, Policy: policy.ISLBounding, EffISLThreshold: 1024, EffISLRatioThreshold: 0.7}},
		{name: "bogus policy in the environment is an error, not ignored", env: map[string]string{"KVROUTER_CONDITIONAL_DISAGG": "true", "KVROUTER_CONDITIONAL_DISAGG_CONFIG": `{"policy":"bogus"}`},
			err: "--conditional-disagg-config policy must be one of 'isl_bounding', 'prefill_load', 'isl_or_load'"},
		{name: "YAML mapping", file: "conditional_disagg: true\nconditional_disagg_config:\n  policy: isl_or_load\n  eff_isl_threshold: 512\n  prefill_busy_threshold: 2.5\n",
			want: policy.CDConfig{Enabled: true, Policy: policy.ISLOrLoad, EffISLThreshold: 512, EffISLRatioThreshold: 0.7, PrefillBusyThreshold: f(2.5)}},
		{name: "YAML mapping checked like the flag", file: "conditional_disagg: true\nconditional_disagg_config:\n  eff_isl_threshold: 1.5\n",
			err: "--conditional-disagg-config eff_isl_threshold must be an integer"},
		{name: "YAML float written as 2048.0 is not an integer", file: "conditional_disagg: true\nconditional_disagg_config:\n  eff_isl_threshold: 2048.0\n",
			err: "--conditional-disagg-config eff_isl_threshold must be an integer"},
		{name: "YAML null busy threshold is unset", file: "conditional_disagg: true\nconditional_disagg_config:\n  decode_busy_threshold: null\n  policy: isl_bounding\n",
			want: policy.CDConfig{Enabled: true, Policy: policy.ISLBounding, EffISLThreshold: 2048, EffISLRatioThreshold: 0.7}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, _, err := load(t, tt.args, tt.env, tt.file)
			if tt.err != "" {
				if err == nil || err.Error() != tt.err {
					t.Fatalf("Load() = %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Load() = %v", err)
			}
			if diff := cmp.Diff(tt.want, cfg.Routing.ConditionalDisagg); diff != "" {
				t.Errorf("conditional disagg config mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

func TestConditionalDisaggEntries(t *testing.T) {
	cfg, err := Load("kvrouter serve", []string{"--conditional-disagg", "--router-queue-threshold", "3", "--conditional-disagg-config", `{"policy":"isl_or_load"}`},
		envFunc(nil), &bytes.Buffer{})
	if err != nil {
		t.Fatalf("Load() = %v", err)
	}
	got := map[string]Entry{}
	for _, e := range cfg.Entries() {
		if strings.HasPrefix(e.Key, "conditional_disagg") {
			got[e.Key] = e
		}
	}
	want := map[string]Entry{
		"conditional_disagg":                         {Key: "conditional_disagg", Value: "true", Source: SourceFlag},
		"conditional_disagg_config":                  {Key: "conditional_disagg_config", Value: `{"policy":"isl_or_load"}`, Source: SourceFlag},
		"conditional_disagg.policy":                  {Key: "conditional_disagg.policy", Value: "isl_or_load", Source: SourceFlag},
		"conditional_disagg.eff_isl_threshold":       {Key: "conditional_disagg.eff_isl_threshold", Value: "2048", Source: SourceDefault},
		"conditional_disagg.eff_isl_ratio_threshold": {Key: "conditional_disagg.eff_isl_ratio_threshold", Value: "0.7", Source: SourceDefault},
		"conditional_disagg.prefill_busy_threshold":  {Key: "conditional_disagg.prefill_busy_threshold", Value: "3", Source: SourceFlag},
		"conditional_disagg.decode_busy_threshold":   {Key: "conditional_disagg.decode_busy_threshold", Value: "", Source: SourceDefault},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("entries mismatch (-want +got):\n%s", diff)
	}
}

// testScorer is a test-only scorer: every candidate costs the same.
type testScorer struct{}

func (testScorer) String() string { return "flat" }
func (testScorer) Score(_ *policy.Hop, cands []policy.Candidate) {
	for i := range cands {
		cands[i].Cost = 1
	}
}

// TestScorerSetting: the scorer is named by the configuration, from any layer, among the
// registered ones.
func TestScorerSetting(t *testing.T) {
	cfg, err := Load("kvrouter serve", nil, envFunc(nil), &bytes.Buffer{})
	if err != nil {
		t.Fatalf("Load() = %v", err)
	}
	if want := (Entry{Key: "scorer", Value: "dynamo", Source: SourceDefault}); !slices.Contains(cfg.Entries(), want) {
		t.Errorf("Entries() lacks %+v", want)
	}
	_, err = Load("kvrouter serve", []string{"--scorer", "flat"}, envFunc(nil), &bytes.Buffer{})
	if want := `--scorer: must be one of 'dynamo' (got "flat")`; err == nil || err.Error() != want {
		t.Errorf("Load(--scorer flat) before registration = %v, want %q", err, want)
	}

	defer policy.RegisterScorer(testScorer{})()
	for _, tt := range []struct {
		name   string
		args   []string
		env    map[string]string
		source Source
	}{
		{"flag", []string{"--scorer", "flat"}, nil, SourceFlag},
		{"env", nil, map[string]string{"KVROUTER_SCORER": "flat"}, SourceEnv},
		{"file", nil, map[string]string{"KVROUTER_CONFIG": writeFile(t, "scorer: flat\n")}, SourceFile},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := Load("kvrouter serve", tt.args, envFunc(tt.env), &bytes.Buffer{})
			if err != nil {
				t.Fatalf("Load() = %v", err)
			}
			if cfg.Routing.Scorer != (testScorer{}) {
				t.Errorf("Router.Scorer = %v, want flat", cfg.Routing.Scorer)
			}
			if want := (Entry{Key: "scorer", Value: "flat", Source: tt.source}); !slices.Contains(cfg.Entries(), want) {
				t.Errorf("Entries() lacks %+v", want)
			}
		})
	}
}

// TestStepByStep uses the package the way a command with flags of its own does: New, AddFlags on
// its flag set, Parse, Complete, Validate. A flag wins over the environment wherever it stands.
func TestStepByStep(t *testing.T) {
	o := New()
	fs := flag.NewFlagSet("kvsim", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	own := fs.Int("workers", 4, "a flag of the command's own")
	o.AddFlags(fs)
	if err := fs.Parse([]string{"--router-temperature", "0.5", "--workers", "8", "--config", writeFile(t, "router_temperature: 0.1\nlisten: 127.0.0.1:7000\n")}); err != nil {
		t.Fatal(err)
	}
	if err := o.Complete(envFunc(map[string]string{"KVROUTER_ROUTER_TEMPERATURE": "0.25"})); err != nil {
		t.Fatalf("Complete() = %v", err)
	}
	if err := o.Validate(); err != nil {
		t.Fatalf("Validate() = %v", err)
	}
	got := struct {
		Temperature float64
		Listen      string
		Workers     int
		Sources     [2]Source
	}{o.Routing.RouterTemperature, o.Listen, *own, [2]Source{o.Source("router_temperature"), o.Source("listen")}}
	want := struct {
		Temperature float64
		Listen      string
		Workers     int
		Sources     [2]Source
	}{0.5, "127.0.0.1:7000", 8, [2]Source{SourceFlag, SourceFile}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("options mismatch (-want +got):\n%s", diff)
	}
}

// TestLogDerived: the start-up lines Dynamo logs for conditional disaggregation (§1.9).
func TestLogDerived(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want []string
	}{
		{"off", []string{"--router-queue-threshold", "4"}, nil},
		{"inherited threshold and the guard", []string{"--conditional-disagg", "--router-queue-threshold", "4", "--conditional-disagg-config", `{"policy":"prefill_load","decode_busy_threshold":0.9}`},
			[]string{"conditional_disagg prefill_busy_threshold defaults to --router-queue-threshold=4", "conditional_disagg decode busy guard enabled"}},
		{"own threshold", []string{"--conditional-disagg", "--router-queue-threshold", "4", "--conditional-disagg-config", `{"policy":"prefill_load","prefill_busy_threshold":2}`}, nil},
		{"null threshold inherits", []string{"--conditional-disagg", "--router-queue-threshold", "4", "--conditional-disagg-config", `{"policy":"isl_or_load","prefill_busy_threshold":null}`},
			[]string{"conditional_disagg prefill_busy_threshold defaults to --router-queue-threshold=4"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := Load("kvrouter serve", tt.args, envFunc(nil), &bytes.Buffer{})
			if err != nil {
				t.Fatalf("Load() = %v", err)
			}
			var out bytes.Buffer
			cfg.LogDerived(slog.New(slog.NewTextHandler(&out, nil)))
			var got []string
			for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
				if _, msg, ok := strings.Cut(line, `msg="`); ok {
					got = append(got, msg[:strings.Index(msg, `"`)])
				}
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("logged lines mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// TestOneRuleEverywhere: a conditional-disaggregation value breaks the same rule, with the same
// words, whether it comes from the flag, the environment, the YAML file or a per-request override
// (policy.Config.EffectiveCD); only the way the setting is named differs.
func TestOneRuleEverywhere(t *testing.T) {
	ratio := 1.5
	_, overrideErr := policy.DefaultConfig().EffectiveCD(policy.CDOverride{EffISLRatioThreshold: &ratio})
	var fe *policy.FieldError
	if !errors.As(overrideErr, &fe) || fe.Field != "eff_isl_ratio_threshold" {
		t.Fatalf("EffectiveCD() = %v, want a field error on eff_isl_ratio_threshold", overrideErr)
	}
	want := "--conditional-disagg-config eff_isl_ratio_threshold " + fe.Rule
	for name, env := range map[string]map[string]string{
		"flag": nil,
		"env":  {"KVROUTER_CONDITIONAL_DISAGG": "true", "KVROUTER_CONDITIONAL_DISAGG_CONFIG": `{"eff_isl_ratio_threshold":1.5}`},
		"file": {"KVROUTER_CONFIG": writeFile(t, "conditional_disagg: true\nconditional_disagg_config:\n  eff_isl_ratio_threshold: 1.5\n")},
	} {
		var args []string
		if name == "flag" {
			args = []string{"--conditional-disagg", "--conditional-disagg-config", `{"eff_isl_ratio_threshold":1.5}`}
		}
		_, err := Load("kvrouter serve", args, envFunc(env), &bytes.Buffer{})
		if err == nil || err.Error() != want {
			t.Errorf("%s: Load() = %v, want %q", name, err, want)
		}
	}
}

// TestPickerModelDirs: picker_models reads as model -> directory, spaces trimmed, a directory
// keeping any "=" after the first.
func TestPickerModelDirs(t *testing.T) {
	o, _, err := load(t, []string{"--picker-listen", "127.0.0.1:9002"}, nil,
		"picker_models: \" meta-llama/Llama-3.1-8B-Instruct = /models/llama ,Qwen/Qwen3-8B=/models/a=b\"\n")
	if err != nil {
		t.Fatal(err)
	}
	got, err := o.PickerModelDirs()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"meta-llama/Llama-3.1-8B-Instruct": "/models/llama", "Qwen/Qwen3-8B": "/models/a=b"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("PickerModelDirs() (-want +got):\n%s", diff)
	}
}
