package config

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/config/layered"
)

// cdConfigFlag is how messages name conditional_disagg_config, wherever it was given: as Dynamo's
// messages name theirs (§1.9).
const cdConfigFlag = "--conditional-disagg-config"

// Validate checks every rule, in Dynamo's order where Dynamo has one (conditional disaggregation
// first, §1.9), and returns the first broken one, naming the setting as the user gave it. It also
// fills what the rules derive: Router.ConditionalDisagg from conditional_disagg and
// conditional_disagg_config (with a prefill busy threshold inherited from router_queue_threshold),
// and a default max_publish_msg_bytes lowered to a smaller max_recv_msg_bytes.
func (o *Options) Validate() error {
	if err := o.resolveConditionalDisagg(); err != nil {
		return err
	}
	if err := o.Routing.Validate(); err != nil {
		var fe *policy.FieldError
		if errors.As(err, &fe) {
			return fmt.Errorf("%s: %s", o.describe(fe.Field), fe.Rule)
		}
		return err
	}
	switch o.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		return fmt.Errorf("%s: must be debug, info, warn or error (got %q)", o.describe("log_level"), o.LogLevel)
	}
	if o.Source("max_publish_msg_bytes") == SourceDefault {
		o.MaxPublishMsgBytes = min(o.MaxPublishMsgBytes, o.MaxRecvMsgBytes) // the default follows a lower receive limit
	}
	if o.MaxPublishMsgBytes > o.MaxRecvMsgBytes {
		return fmt.Errorf("%s: must be at most %s %d (got %d)", o.describe("max_publish_msg_bytes"), o.describe("max_recv_msg_bytes"), o.MaxRecvMsgBytes, o.MaxPublishMsgBytes)
	}
	if o.Listen == "" {
		return fmt.Errorf("%s: must not be empty", o.describe("listen"))
	}
	for _, h := range []struct {
		key, value string
		optional   bool
	}{
		{"picker_destination_header", o.PickerDestinationHeader, false}, {"picker_prefill_header", o.PickerPrefillHeader, false},
		{"picker_session_header", o.PickerSessionHeader, true}, {"picker_model_header", o.PickerModelHeader, true},
	} {
		if h.value == "" && h.optional {
			continue
		}
		if !isHeaderName(h.value) {
			return fmt.Errorf("%s: must be an HTTP header name in lower case (letters, digits and - . _; got %q)", o.describe(h.key), h.value)
		}
	}
	if _, err := o.PickerModelDirs(); err != nil {
		return err
	}
	if o.Pprof && o.MetricsListen == "" {
		return fmt.Errorf("%s: needs %s, where the profiler is served", o.describe("pprof"), o.describe("metrics_listen"))
	}
	if err := o.validateSecurity(); err != nil {
		return err
	}
	if o.RedisAddr != "" && o.RedisClusterAddrs != "" {
		return fmt.Errorf("%s and %s: set one, not both", o.describe("redis_addr"), o.describe("redis_cluster_addrs"))
	}
	if open, close := strings.Index(o.RedisPrefix, "{"), strings.Index(o.RedisPrefix, "}"); open < 0 || close < open+2 {
		return fmt.Errorf("%s: must contain a non-empty hash tag such as {default} (got %q)", o.describe("redis_prefix"), o.RedisPrefix)
	}
	if err := o.validateSharding(); err != nil {
		return err
	}
	if o.WorkerGracePeriod == 0 {
		return fmt.Errorf("%s: must be > 0", o.describe("worker_grace_period"))
	}
	if o.RedisReseedWindow < time.Second {
		return fmt.Errorf("%s: must be at least 1s (got %v)", o.describe("redis_reseed_window"), o.RedisReseedWindow)
	}
	if o.BookingExpiry == 0 {
		return fmt.Errorf("%s: must be > 0", o.describe("booking_expiry"))
	}
	return nil
}

// validateSharding checks the settings of a log sharded by model: it is a Redis layout, and the
// models served are named once each.
func (o *Options) validateSharding() error {
	if o.RedisShardByModel && o.RedisAddr == "" && o.RedisClusterAddrs == "" {
		return fmt.Errorf("%s: shards the shared log in Redis; needs %s or %s", o.describe("redis_shard_by_model"), o.describe("redis_addr"), o.describe("redis_cluster_addrs"))
	}
	if o.RedisModels == "" {
		return nil
	}
	if !o.RedisShardByModel {
		return fmt.Errorf("%s: needs %s (an unsharded log holds every model)", o.describe("redis_models"), o.describe("redis_shard_by_model"))
	}
	seen := map[string]bool{}
	for i, m := range strings.Split(o.RedisModels, ",") {
		m = strings.TrimSpace(m)
		switch {
		case m == "":
			return fmt.Errorf("%s: model %d is empty (got %q)", o.describe("redis_models"), i+1, o.RedisModels)
		case seen[m]:
			return fmt.Errorf("%s: model %q is listed twice", o.describe("redis_models"), m)
		}
		seen[m] = true
	}
	return nil
}

// Models returns the models of redis_models, trimmed; nil means every model.
func (o *Options) Models() []string {
	if o.RedisModels == "" {
		return nil
	}
	models := strings.Split(o.RedisModels, ",")
	for i, m := range models {
		models[i] = strings.TrimSpace(m)
	}
	return models
}

// PickerModelDirs returns picker_models as model name -> directory. The rules: each entry is
// name=directory, neither empty, no name twice, and picker_listen set (the models serve nothing
// else). The first "=" ends the name: model names (meta-llama/Llama-3.1-8B-Instruct) hold none,
// directories may.
func (o *Options) PickerModelDirs() (map[string]string, error) {
	if o.PickerModels == "" {
		return nil, nil
	}
	if o.PickerListen == "" {
		return nil, fmt.Errorf("%s: needs %s (the models are the endpoint picker's)", o.describe("picker_models"), o.describe("picker_listen"))
	}
	dirs := map[string]string{}
	for i, entry := range strings.Split(o.PickerModels, ",") {
		name, dir, ok := strings.Cut(strings.TrimSpace(entry), "=")
		name, dir = strings.TrimSpace(name), strings.TrimSpace(dir)
		switch {
		case !ok || name == "" || dir == "":
			return nil, fmt.Errorf("%s: entry %d must be name=directory (got %q)", o.describe("picker_models"), i+1, entry)
		case dirs[name] != "":
			return nil, fmt.Errorf("%s: model %q is listed twice", o.describe("picker_models"), name)
		}
		dirs[name] = dir
	}
	return dirs, nil
}

// validateSecurity checks the TLS, credentials and Redis-credential settings: files come in pairs,
// and a listen address other hosts can reach serves TLS unless plaintext is asked for.
func (o *Options) validateSecurity() error {
	switch {
	case (o.TLSCertFile == "") != (o.TLSKeyFile == ""):
		return fmt.Errorf("%s and %s: set both or neither", o.describe("tls_cert_file"), o.describe("tls_key_file"))
	case o.TLSClientCAFile != "" && o.TLSCertFile == "":
		return fmt.Errorf("%s: needs %s and %s (mutual TLS is TLS)", o.describe("tls_client_ca_file"), o.describe("tls_cert_file"), o.describe("tls_key_file"))
	case o.Plaintext && o.TLSCertFile != "":
		return fmt.Errorf("%s and %s: set one, not both", o.describe("plaintext"), o.describe("tls_cert_file"))
	case o.TLSCertFile == "" && !o.Plaintext && !IsLoopback(o.Listen):
		return fmt.Errorf("%s %q: other hosts can reach it, so it serves TLS: set %s and %s, or %s to serve without TLS",
			o.describe("listen"), o.Listen, layered.FlagOf("tls_cert_file"), layered.FlagOf("tls_key_file"), layered.FlagOf("plaintext"))
	case o.PickerListen != "" && o.TLSCertFile == "" && !o.Plaintext && !IsLoopback(o.PickerListen):
		return fmt.Errorf("%s %q: other hosts can reach it, so it serves TLS: set %s and %s, or %s to serve without TLS",
			o.describe("picker_listen"), o.PickerListen, layered.FlagOf("tls_cert_file"), layered.FlagOf("tls_key_file"), layered.FlagOf("plaintext"))
	case o.TLSClientAuth != "require" && o.TLSClientAuth != "optional":
		return fmt.Errorf("%s: must be require or optional (got %q)", o.describe("tls_client_auth"), o.TLSClientAuth)
	case o.FileReloadInterval < 10*time.Millisecond:
		return fmt.Errorf("%s: must be at least 10ms (got %v)", o.describe("file_reload_interval"), o.FileReloadInterval)
	case o.Pprof && !IsLoopback(o.PprofListen):
		return fmt.Errorf("%s %q: the profiler answers without authentication, so it must be a loopback address (reach it with kubectl port-forward or ssh)", o.describe("pprof_listen"), o.PprofListen)
	case o.RouteRateLimit < 0:
		return fmt.Errorf("%s: must be >= 0 (got %v)", o.describe("route_rate_limit"), o.RouteRateLimit)
	case o.RouteTokenRateLimit < 0:
		return fmt.Errorf("%s: must be >= 0 (got %v)", o.describe("route_token_rate_limit"), o.RouteTokenRateLimit)
	case o.EventRateLimit < 0:
		return fmt.Errorf("%s: must be >= 0 (got %v)", o.describe("event_rate_limit"), o.EventRateLimit)
	case o.RedisPassword != "" && o.RedisPasswordFile != "":
		return fmt.Errorf("%s and %s: set one, not both", o.describe("redis_password"), o.describe("redis_password_file"))
	case (o.RedisTLSCertFile == "") != (o.RedisTLSKeyFile == ""):
		return fmt.Errorf("%s and %s: set both or neither", o.describe("redis_tls_cert_file"), o.describe("redis_tls_key_file"))
	case !o.RedisTLS && (o.RedisTLSCAFile != "" || o.RedisTLSCertFile != "" || o.RedisTLSServerName != ""):
		return fmt.Errorf("%s: must be true when a redis_tls_* file or name is set", o.describe("redis_tls"))
	}
	return nil
}

// IsLoopback says whether a listen address (host:port) accepts connections from this machine only:
// its host is localhost or a loopback IP. An empty host listens on every interface.
func IsLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// resolveConditionalDisagg builds Router.ConditionalDisagg from conditional_disagg and
// conditional_disagg_config with Dynamo's steps (§1.9): the JSON is checked as it is read, then it
// requires the feature, then the rules that relate it to the rest of the configuration
// (policy.Config.ResolveCD, the ones per-request overrides meet too) run with settings named as
// flags.
func (o *Options) resolveConditionalDisagg() error {
	cd := policy.DefaultCDConfig()
	cd.Enabled = o.ConditionalDisagg
	o.cdSet = nil
	if o.ConditionalDisaggConfig != "" {
		set, err := policy.ParseCDConfigJSON(o.ConditionalDisaggConfig, &cd)
		if err != nil {
			return cdConfigError(err)
		}
		if !cd.Enabled {
			return fmt.Errorf("%s requires %s", cdConfigFlag, layered.FlagOf("conditional_disagg"))
		}
		o.cdSet = set
	}
	resolved, err := o.Routing.ResolveCD(cd, layered.FlagOf)
	if err != nil {
		return cdConfigError(err)
	}
	o.Routing.ConditionalDisagg = resolved
	o.prefillBusyInherited = cd.PrefillBusyThreshold == nil && resolved.PrefillBusyThreshold != nil
	return nil
}

// cdConfigError names a broken conditional-disaggregation rule the way Dynamo's command line does:
// a key of the JSON after the flag that carries it, a rule relating settings as it is.
func cdConfigError(err error) error {
	var fe *policy.FieldError
	if !errors.As(err, &fe) {
		return err
	}
	if fe.Field == "" {
		return fmt.Errorf("%s %s", cdConfigFlag, fe.Rule)
	}
	return fmt.Errorf("%s %s %s", cdConfigFlag, fe.Field, fe.Rule)
}

// LogDerived logs, at info, the values Validate derived that an operator may not expect: Dynamo's
// two start-up lines of conditional disaggregation (§1.9).
func (o *Options) LogDerived(logger *slog.Logger) {
	cd := o.Routing.ConditionalDisagg
	if !cd.Enabled {
		return
	}
	if cd.Policy.NeedsPrefillBusy() && o.prefillBusyInherited {
		logger.Info(fmt.Sprintf("conditional_disagg prefill_busy_threshold defaults to --router-queue-threshold=%v", *cd.PrefillBusyThreshold))
	}
	if cd.DecodeBusyThreshold != nil {
		logger.Info("conditional_disagg decode busy guard enabled", "decode_busy_threshold", *cd.DecodeBusyThreshold)
	}
}

// describe names a key as the user set it, for error messages: its flag, its environment variable,
// or its key in the file.
func (o *Options) describe(key string) string { return o.layers.Describe(key) }

// isHeaderName reports whether s is a lower-case HTTP header name that is not a pseudo-header:
// HTTP/2, which carries the proxy's headers to the picker, has lower-case names only.
func isHeaderName(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '.' || c == '_') {
			return false
		}
	}
	return true
}
