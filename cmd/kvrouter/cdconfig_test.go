package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server"
)

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
			env := map[string]string{}
			for k, v := range tt.env {
				env[k] = v
			}
			if tt.file != "" {
				env["KVROUTER_CONFIG"] = writeFile(t, tt.file)
			}
			var stderr bytes.Buffer
			cfg, err := loadConfig(tt.args, envFunc(env), &stderr)
			if tt.err != "" {
				if err == nil || err.Error() != tt.err {
					t.Fatalf("loadConfig() = %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("loadConfig() = %v", err)
			}
			if diff := cmp.Diff(tt.want, cfg.Router.ConditionalDisagg); diff != "" {
				t.Errorf("conditional disagg config mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// TestConditionalDisaggEntryPoint: the command exits 2 and prints the integer message (issue
// acceptance: kvrouter serve --conditional-disagg-config '{"eff_isl_threshold":1.5}').
func TestConditionalDisaggEntryPoint(t *testing.T) {
	var stderr bytes.Buffer
	code := run(context.Background(), []string{"serve", "--conditional-disagg-config", `{"eff_isl_threshold":1.5}`}, envFunc(nil), &stderr)
	want := "kvrouter: invalid configuration: --conditional-disagg-config eff_isl_threshold must be an integer\n"
	if code != 2 || stderr.String() != want {
		t.Errorf("run() = %d, %q; want 2, %q", code, stderr.String(), want)
	}
}

func TestConditionalDisaggEntries(t *testing.T) {
	cfg, err := loadConfig([]string{"--conditional-disagg", "--router-queue-threshold", "3", "--conditional-disagg-config", `{"policy":"isl_or_load"}`},
		envFunc(nil), &bytes.Buffer{})
	if err != nil {
		t.Fatalf("loadConfig() = %v", err)
	}
	got := map[string]server.ConfigEntry{}
	for _, e := range cfg.entries() {
		if strings.HasPrefix(e.Key, "conditional_disagg") {
			got[e.Key] = e
		}
	}
	want := map[string]server.ConfigEntry{
		"conditional_disagg":                         {Key: "conditional_disagg", Value: "true", Source: server.SourceFlag},
		"conditional_disagg_config":                  {Key: "conditional_disagg_config", Value: `{"policy":"isl_or_load"}`, Source: server.SourceFlag},
		"conditional_disagg.policy":                  {Key: "conditional_disagg.policy", Value: "isl_or_load", Source: server.SourceFlag},
		"conditional_disagg.eff_isl_threshold":       {Key: "conditional_disagg.eff_isl_threshold", Value: "2048", Source: server.SourceDefault},
		"conditional_disagg.eff_isl_ratio_threshold": {Key: "conditional_disagg.eff_isl_ratio_threshold", Value: "0.7", Source: server.SourceDefault},
		"conditional_disagg.prefill_busy_threshold":  {Key: "conditional_disagg.prefill_busy_threshold", Value: "3", Source: server.SourceFlag},
		"conditional_disagg.decode_busy_threshold":   {Key: "conditional_disagg.decode_busy_threshold", Value: "", Source: server.SourceDefault},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("entries mismatch (-want +got):\n%s", diff)
	}
}
