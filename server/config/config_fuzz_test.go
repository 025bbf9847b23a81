package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-cmp/cmp"
	"gopkg.in/yaml.v3"

	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/config/layered"
)

// fuzzSecret is the Redis password FuzzLoad sets in the environment when asked to: it must never
// show in an error or in the reported configuration.
const fuzzSecret = "fuzz-secret-5d41402abc4b2a76"

// loadSeed is one FuzzLoad input: a command line (one argument a line), KVROUTER_* variables (NAME=value
// lines, the prefix optional), KVROUTER_CONDITIONAL_DISAGG_CONFIG, a YAML file (given with
// KVROUTER_CONFIG when not empty), and whether KVROUTER_REDIS_PASSWORD holds fuzzSecret.
type loadSeed struct {
	args, env, cd, file string
	secret              bool
}

// loadSeeds are the configurations of config_test.go, good and bad (TestBadConfig's cases each),
// with their arguments one a line.
var loadSeeds = []loadSeed{
	{},
	{args: "--prefill-load-scale\n1.5\n--enforce-disagg", env: "ROUTER_TEMPERATURE=0.75\nPREFILL_LOAD_SCALE=2",
		file: "overlap_score_credit: 0.25\nrouter_temperature: 0.5\nprefill_load_scale: 3\nrouter_queue_threshold: null\n"},
	// TestBadConfig.
	{args: "--overlap-score-credit\n-1"},
	{args: "--overlap-score-credit\nNaN"},
	{env: "KVROUTER_HOST_CACHE_HIT_WEIGHT=2"},
	{env: "KVROUTER_MAX_PROMPT_TOKENS=lots"},
	{file: "router_queue_policy: lifo\n"},
	{file: "overlap_score_credit: 1\nbogus: 2\nalso_bogus: 3\n"},
	{args: "--log-level\nloud"},
	{args: "--worker-grace-period\n-1s"},
	{args: "--max-recv-msg-bytes\n2097152", env: "KVROUTER_MAX_PUBLISH_MSG_BYTES=4194304"},
	{args: "--max-batch-blocks\n0"},
	{args: "--pprof\n--metrics-listen="},
	{args: "--no-such-flag"},
	{args: "--listen\n:50051"},
	{args: "--tls-cert-file\nc.pem"},
	{env: "KVROUTER_TLS_CLIENT_CA_FILE=ca.pem"},
	{args: "--plaintext\n--tls-cert-file\nc.pem\n--tls-key-file\nk.pem"},
	{args: "--tls-min-version\n1.1"},
	{args: "--route-rate-limit\n-5"},
	{args: "--redis-password\nhunter2"},
	{args: "--redis-password-file\np", secret: true},
	{args: "--redis-tls-ca-file\nca.pem"},
	{args: "--config\n/nonexistent/kvrouter.yaml"}, // --config always names the fuzzed file
	// Secrets, TLS, Redis.
	{secret: true},
	{file: "redis_password: hunter2\nredis_username: app\n"},
	{args: "-h"},
	{args: "--listen=0.0.0.0:50051\n--tls-cert-file=c.pem\n--tls-key-file=k.pem\n--tls-client-ca-file=ca.pem\n--tls-min-version=1.3"},
	{args: "--listen\n10.0.0.1:50051\n--plaintext\n--credentials-file\ncreds.yaml\n--auth-open-reflection\n--route-rate-limit\n100"},
	{args: "--redis-addr\nlocalhost:6379\n--redis-tls\n--redis-tls-ca-file\nca.pem\n--redis-tls-server-name\nredis", secret: true},
	{env: "REDIS_CLUSTER_ADDRS=a:7000,b:7001\nREDIS_PREFIX=kvr:{x}\nREPLICA_ID=r1", file: "redis_addr: localhost:6379\n"},
	{args: "--redis-prefix\nkvr:{}"},
	{args: "--max-recv-msg-bytes\n2048\n--snapshot-interval\n1h30m\n--session-affinity-ttl\n10m"},
	// Conditional disaggregation (TestConditionalDisaggConfig).
	{args: "--conditional-disagg", cd: `{"policy":"isl_or_load","eff_isl_threshold":4096,"eff_isl_ratio_threshold":0.8,"prefill_busy_threshold":16,"decode_busy_threshold":0.9}`},
	{args: "--conditional-disagg-config\n{\"policy\":\"isl_bounding\"}"},
	{args: "--conditional-disagg\n--router-queue-threshold\n4", cd: `{"policy":"prefill_load"}`},
	{args: "--conditional-disagg", cd: `{"policy":"prefill_load"}`},
	{args: "--conditional-disagg\n--use-kv-events=false"},
	{env: "CONDITIONAL_DISAGG=true", cd: `{"eff_isl_threshold":1.5,"zz":1}`},
	{env: "CONDITIONAL_DISAGG=true", cd: `{"eff_isl_ratio_threshold":1.0000001,"decode_busy_threshold":null}`},
	{file: "conditional_disagg: true\nconditional_disagg_config:\n  policy: isl_or_load\n  eff_isl_threshold: 512\n  prefill_busy_threshold: 2.5\n"},
	{file: "conditional_disagg: true\nconditional_disagg_config:\n  eff_isl_threshold: 2048.0\n  decode_busy_threshold: null\n"},
	{file: "conditional_disagg: true\nconditional_disagg_config: '{\"policy\":\"isl_bounding\"}'\nrouter_queue_threshold: 2\n"},
	{file: "scorer: dynamo\noverlap_score_weight: 0\n", env: "SCORER=nope"},
	// Files that are not one mapping of settings.
	{file: "0"},
	{file: "- listen: 127.0.0.1:1\n"},
	{file: "listen: 127.0.0.1:1\nlisten: 127.0.0.1:2\n"},
	{file: "listen: 127.0.0.1:1\n---\nbogus: 1\n"},
	{file: "listen: 127.0.0.1:1\n---\n"},
	{file: "conditional_disagg: true\nconditional_disagg_config:\n  eff_isl_ratio_threshold: .5\n"},
}

// FuzzLoad loads kvrouter serve's configuration from a fuzzed command line, environment and YAML
// file (loadSeed says how each input is read; besides, one setting, picked by number, may be set to
// value as a flag, a variable or in the file), and checks what Load promises:
//
//   - it never panics;
//   - a malformed command line is ErrUsage after the flag set printed why; any other error prints
//     nothing, is one line, names a setting (or the config file), never shows the Redis password,
//     and is not much longer than the input it may quote;
//   - a loaded configuration validates again to the same entries (Validate is idempotent);
//   - Entries lists every setting and every derived conditional_disagg.* value exactly once, sorted,
//     each from a known source: a flag's if the command line set it, else the environment's if its
//     variable is set, else the file's if it has the key, else the default, with the default's value
//     (max_publish_msg_bytes excepted: its default follows a lower max_recv_msg_bytes);
//   - the Redis password shows as layered.Redacted when set, never as itself;
//   - the configuration round-trips: its entries given back as flags (the password through its
//     variable; the derived conditional_disagg.* values left out) load to the same values.
func FuzzLoad(f *testing.F) {
	for _, s := range loadSeeds {
		f.Add(s.args, s.env, s.cd, []byte(s.file), s.secret, uint16(0), "")
	}
	// Every setting at its default, as flags, as variables and in the file: values of every
	// setting for the fuzzer to change.
	var flags, vars []string
	file := map[string]string{}
	for i, s := range settings {
		v := s.Get(New())
		// Each setting at its default and at values below most settings' ranges, as a flag, a
		// variable or in the file.
		for _, value := range []string{v, "0", "-1", "0s", "x"} {
			f.Add("", "", "", []byte(nil), false, uint16(4*i+1+i%3), value)
		}
		if !s.Secret {
			flags = append(flags, layered.FlagOf(s.Key)+"="+v)
		}
		vars = append(vars, strings.ToUpper(s.Key)+"="+v)
		file[s.Key] = v
	}
	yamlFile, err := yaml.Marshal(file)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(strings.Join(flags, "\n"), "", "", []byte(nil), false, uint16(0), "")
	f.Add("", strings.Join(vars, "\n"), "", []byte(nil), false, uint16(0), "")
	f.Add("", "", "", yamlFile, false, uint16(0), "")
	dir := f.TempDir()
	var files atomic.Uint64
	defaults := map[string]string{}
	for _, e := range New().Entries() {
		defaults[e.Key] = e.Value
	}
	f.Fuzz(func(t *testing.T, argLines, envLines, cdJSON string, file []byte, secret bool, one uint16, value string) {
		if len(argLines)+len(envLines)+len(cdJSON)+len(file)+len(value) > 8<<10 {
			return // every setting fits; longer inputs only cost the fuzzer time (minimizing them)
		}
		// one picks a setting and where value sets it: none, as a flag, as a variable, in the file.
		// (Changing one setting is a small step for the fuzzer; finding its name in text is not.)
		picked, where := settings[int(one/4)%len(settings)], one%4
		if where == 3 {
			quoted, _ := json.Marshal(value) // a JSON string is a YAML one
			file = slices.Concat(file, []byte("\n"+picked.Key+": "), quoted, []byte("\n"))
		}
		path := filepath.Join(dir, fmt.Sprintf("%d.yaml", files.Add(1)))
		if err := os.WriteFile(path, file, 0o600); err != nil {
			t.Fatal(err)
		}
		defer os.Remove(path)
		args, env := fuzzCommandLine(argLines, envLines, cdJSON, path, len(file) > 0, secret)
		switch where {
		case 1:
			args = append(args, layered.FlagOf(picked.Key)+"="+value) // a secret has no flag: a usage error
		case 2:
			env[picked.EnvName()] = value
		}
		// The secret is only looked for where no input holds it (a mutation may well copy it).
		secretOnlyInEnv := secret && !strings.Contains(argLines+envLines+cdJSON+string(file)+value, fuzzSecret)

		var stderr bytes.Buffer
		o, err := Load("kvrouter serve", args, envFunc(env), &stderr)
		if err != nil {
			checkLoadError(t, err, stderr.String(), secretOnlyInEnv, len(argLines)+len(envLines)+len(cdJSON)+len(file)+len(value))
			return
		}
		if stderr.Len() > 0 {
			t.Fatalf("Load() = nil, but printed %q", stderr.String())
		}
		entries := o.Entries()
		checkEntries(t, o, entries, secretOnlyInEnv)
		if err := o.Validate(); err != nil {
			t.Fatalf("Validate() after Load() = %v, want nil", err)
		}
		if diff := cmp.Diff(entries, o.Entries()); diff != "" {
			t.Fatalf("Validate() again changed the entries (-before +after):\n%s", diff)
		}
		checkSources(t, entries, defaults, args, env, file)
		checkRoundTrip(t, o, entries)
	})
}

// fuzzCommandLine builds Load's arguments and environment from FuzzLoad's inputs. Every --config on
// the command line names the fuzzed file (never a path of the fuzzer's choosing, which could be a
// device that never ends); so does KVROUTER_CONFIG when useFile.
func fuzzCommandLine(argLines, envLines, cdJSON, path string, useFile, secret bool) ([]string, map[string]string) {
	var args []string
	if argLines != "" {
		args = strings.Split(argLines, "\n")
	}
	for i, a := range args {
		if name, _, _ := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-"), "="); name == "config" && strings.HasPrefix(a, "-") {
			args[i] = "--config=" + path
		}
	}
	env := map[string]string{}
	for line := range strings.SplitSeq(envLines, "\n") {
		name, value, ok := strings.Cut(line, "=")
		if !ok {
			continue
		}
		name = strings.ToUpper(name)
		if !strings.HasPrefix(name, "KVROUTER_") {
			name = "KVROUTER_" + name
		}
		env[name] = value
	}
	delete(env, "KVROUTER_CONFIG")
	if useFile {
		env["KVROUTER_CONFIG"] = path
	}
	if cdJSON != "" {
		env["KVROUTER_CONDITIONAL_DISAGG_CONFIG"] = cdJSON
	}
	if secret {
		env["KVROUTER_REDIS_PASSWORD"] = fuzzSecret
	}
	return args, env
}

// checkLoadError checks an error of Load: ErrUsage after the flag set printed why; anything else
// printed nothing and is one line naming a setting, without the password, and of a length bounded
// by the input it may quote (strconv.Quote writes a byte as at most 10 characters: \U0010ffff).
func checkLoadError(t *testing.T, err error, stderr string, secretOnlyInEnv bool, inputLen int) {
	t.Helper()
	msg := err.Error()
	if msg == "" {
		t.Fatalf("Load() = %#v, an error without a message", err)
	}
	if secretOnlyInEnv && strings.Contains(msg+stderr, fuzzSecret) {
		t.Fatalf("Load() = %q (printed %q): shows the Redis password", msg, stderr)
	}
	if errors.Is(err, ErrUsage) {
		if stderr == "" {
			t.Fatalf("Load() = %v without printing why", err)
		}
		return
	}
	if stderr != "" {
		t.Fatalf("Load() = %q, and printed %q: only a usage error prints", msg, stderr)
	}
	if strings.ContainsAny(msg, "\n\r") {
		t.Fatalf("Load() = %q: not one line", msg)
	}
	if limit := 512 + 10*inputLen; len(msg) > limit {
		t.Fatalf("Load() = an error of %d bytes (limit %d for %d bytes of input): %.200q...", len(msg), limit, inputLen, msg)
	}
	if !namesSetting(msg) {
		t.Fatalf("Load() = %q: names no setting", msg)
	}
	for _, internal := range goInternals {
		if strings.Contains(msg, internal) {
			t.Fatalf("Load() = %q: shows Go internals (%s) instead of the rule", msg, internal)
		}
	}
}

// goInternals are words of Go's decoders that an error shown to a user must not quote: they say
// how the configuration is read, not what is wrong with it.
var goInternals = []string{"json.RawMessage", "MarshalJSON", "map[string]", "yaml.Node", "reflect."}

// namesSetting reports whether an error message names a setting as a key, a flag or a variable,
// or the config file.
func namesSetting(msg string) bool {
	if strings.Contains(msg, "config file") || strings.Contains(msg, "--config") {
		return true
	}
	return slices.ContainsFunc(settings, func(s setting) bool {
		return strings.Contains(msg, s.Key) || strings.Contains(msg, layered.FlagOf(s.Key)) || strings.Contains(msg, s.EnvName())
	})
}

// cdEntryKeys are the derived entries of conditional disaggregation.
var cdEntryKeys = func() []string {
	var keys []string
	for _, k := range policy.CDConfigKeys {
		keys = append(keys, "conditional_disagg."+k)
	}
	return keys
}()

// checkEntries checks that entries list every setting and every derived value once, sorted, from a
// known source, with the password redacted.
func checkEntries(t *testing.T, o *Options, entries []Entry, secretOnlyInEnv bool) {
	t.Helper()
	var want []string
	for _, s := range settings {
		want = append(want, s.Key)
	}
	want = append(want, cdEntryKeys...)
	slices.Sort(want)
	var got []string
	for _, e := range entries {
		got = append(got, e.Key)
		if e.Source < SourceDefault || e.Source > SourceFlag {
			t.Errorf("entry %s: unknown source %d", e.Key, e.Source)
		}
		if secretOnlyInEnv && strings.Contains(e.Value, fuzzSecret) {
			t.Errorf("entry %s = %q: shows the Redis password", e.Key, e.Value)
		}
		if e.Key == "redis_password" {
			want := ""
			if o.RedisPassword != "" {
				want = layered.Redacted
			}
			if e.Value != want {
				t.Errorf("entry redis_password = %q, want %q", e.Value, want)
			}
		}
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("Entries() keys mismatch (-want +got):\n%s", diff)
	}
}

// checkSources checks each setting's source against the inputs: flags over the environment over
// the file over the defaults.
func checkSources(t *testing.T, entries []Entry, defaults map[string]string, args []string, env map[string]string, file []byte) {
	t.Helper()
	fs := flag.NewFlagSet("kvrouter serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	New().AddFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatalf("the command line Load accepted does not parse: %v", err)
	}
	flags := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { flags[f.Name] = true })
	var doc map[string]yaml.Node
	if flags["config"] || env["KVROUTER_CONFIG"] != "" {
		dec := yaml.NewDecoder(bytes.NewReader(file))
		if err := dec.Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
			t.Fatalf("the file Load accepted does not decode: %v", err)
		}
		// A key the file sets is never ignored, not even in a document after the first.
		for n := 2; ; n++ {
			var more map[string]yaml.Node
			if err := dec.Decode(&more); err != nil {
				break
			}
			if len(more) > 0 {
				t.Fatalf("Load() accepted a file whose YAML document %d sets %d key(s) it ignores", n, len(more))
			}
		}
	}
	for _, e := range entries {
		if slices.Contains(cdEntryKeys, e.Key) {
			continue // derived: TestConditionalDisaggEntries checks their sources
		}
		_, inFile := doc[e.Key]
		want := SourceDefault
		switch {
		case flags[strings.ReplaceAll(e.Key, "_", "-")]:
			want = SourceFlag
		case env["KVROUTER_"+strings.ToUpper(e.Key)] != "":
			want = SourceEnv
		case inFile:
			want = SourceFile
		}
		if e.Source != want {
			t.Errorf("entry %s = %q from %v, want from %v", e.Key, e.Value, e.Source, want)
		}
		if e.Source == SourceDefault && e.Key != "max_publish_msg_bytes" && e.Value != defaults[e.Key] {
			t.Errorf("entry %s = %q from the default, but the default is %q", e.Key, e.Value, defaults[e.Key])
		}
	}
}

// checkRoundTrip loads the configuration again from its entries, as flags, and wants the same
// values.
func checkRoundTrip(t *testing.T, o *Options, entries []Entry) {
	t.Helper()
	var args []string
	env := map[string]string{}
	for _, e := range entries {
		switch {
		case slices.Contains(cdEntryKeys, e.Key):
		case e.Key == "redis_password":
			if o.RedisPassword != "" {
				env["KVROUTER_REDIS_PASSWORD"] = o.RedisPassword
			}
		default:
			args = append(args, layered.FlagOf(e.Key)+"="+e.Value)
		}
	}
	var stderr bytes.Buffer
	again, err := Load("kvrouter serve", args, envFunc(env), &stderr)
	if err != nil {
		t.Fatalf("Load(the entries as flags %q) = %v (printed %q), want the same configuration", args, err, stderr.String())
	}
	values := func(es []Entry) map[string]string {
		m := map[string]string{}
		for _, e := range es {
			m[e.Key] = e.Value
		}
		return m
	}
	if diff := cmp.Diff(values(entries), values(again.Entries())); diff != "" {
		t.Fatalf("the entries given back as flags load differently (-first +again):\n%s", diff)
	}
}
