package replica

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/server/config"
	"github.com/kvrouter/kvrouter/server/config/layered"
	"github.com/kvrouter/kvrouter/server/filewatch"
)

// redisStartupCheck bounds the PING openRedis sends before the replica goes on.
const redisStartupCheck = 3 * time.Second

// openRedis returns the client of the shared state's Redis, after one PING that turns a mistake no
// retry can mend (credentials Redis refuses, a certificate that does not verify, a handshake Redis
// refuses) into an error naming the settings involved. Any other failure, such as a Redis that does
// not answer yet, is logged and the replica starts anyway: it joins the shared log once Redis
// answers, as after an outage.
func openRedis(cfg *config.Options, addrs []string, cluster bool, logger *slog.Logger) (redis.UniversalClient, error) {
	opts, err := redisOptions(cfg, addrs, cluster, logger)
	if err != nil {
		return nil, err
	}
	rdb := redis.NewUniversalClient(opts)
	ctx, cancel := context.WithTimeout(context.Background(), redisStartupCheck)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		if what := redisMisconfigured(cfg, err); what != "" {
			rdb.Close()
			return nil, fmt.Errorf("redis %s: %s: %w", strings.Join(addrs, ","), what, err)
		}
		logger.Warn("redis did not answer the first PING; joining the shared log once it does", "addrs", addrs, "err", err)
	}
	return rdb, nil
}

// redisMisconfigured says what is wrong, and which settings to look at, when err (from the first
// PING) comes from the configuration rather than an outage; "" otherwise. It never quotes a secret.
func redisMisconfigured(cfg *config.Options, err error) string {
	user := cfg.RedisUsername
	if user == "" {
		user = "default"
	}
	var verify *tls.CertificateVerificationError
	var record tls.RecordHeaderError
	switch {
	case redis.IsAuthError(err):
		switch {
		case cfg.RedisPasswordFile != "":
			return fmt.Sprintf("user %q was refused with the password in %s %s (check %s and the password)",
				user, settingName(cfg, "redis_password_file"), cfg.RedisPasswordFile, layered.FlagOf("redis_username"))
		case cfg.RedisPassword != "":
			return fmt.Sprintf("user %q was refused with the password from %s (check %s and the password)",
				user, settingName(cfg, "redis_password"), layered.FlagOf("redis_username"))
		}
		return fmt.Sprintf("user %q was refused without a password (set KVROUTER_REDIS_PASSWORD or %s)", user, layered.FlagOf("redis_password_file"))
	case redis.IsPermissionError(err):
		return fmt.Sprintf("user %q lacks a permission (check its ACL rules)", user)
	case errors.As(err, &verify):
		return fmt.Sprintf("Redis's certificate does not verify (check %s and %s)", layered.FlagOf("redis_tls_ca_file"), layered.FlagOf("redis_tls_server_name"))
	case errors.As(err, &record):
		return fmt.Sprintf("the server does not speak TLS (unset %s, or give its TLS port)", layered.FlagOf("redis_tls"))
	case strings.Contains(err.Error(), "remote error: tls:"):
		if cfg.RedisTLSCertFile == "" {
			return fmt.Sprintf("Redis refused the TLS handshake (does it require a client certificate? set %s and %s)",
				layered.FlagOf("redis_tls_cert_file"), layered.FlagOf("redis_tls_key_file"))
		}
		return fmt.Sprintf("Redis refused the TLS handshake (does it trust the client certificate in %s %s?)",
			settingName(cfg, "redis_tls_cert_file"), cfg.RedisTLSCertFile)
	}
	return ""
}

// redisOptions builds the go-redis options of the shared state's Redis: addresses, timeouts,
// credentials and TLS. Errors name the setting at fault and never quote a secret.
func redisOptions(cfg *config.Options, addrs []string, cluster bool, logger *slog.Logger) (*redis.UniversalOptions, error) {
	opts := &redis.UniversalOptions{
		Addrs: addrs, IsClusterMode: cluster,
		DialTimeout: 2 * time.Second, ReadTimeout: 3 * time.Second, WriteTimeout: 3 * time.Second,
		ContextTimeoutEnabled: true,
		// One retry: a change that cannot be appended is buffered locally (degraded mode) rather
		// than held for several retries while its worker waits.
		MaxRetries: 1,
		Username:   cfg.RedisUsername,
		Password:   cfg.RedisPassword,
	}
	if cfg.RedisPasswordFile != "" {
		password, err := readPasswordFile(cfg)
		if err != nil {
			return nil, err
		}
		opts.Password = password
	}
	if cfg.RedisTLS {
		tc, err := redisTLSConfig(cfg, logger)
		if err != nil {
			return nil, err
		}
		opts.TLSConfig = tc
		opts.Dialer = tlsDialer(tc, opts.DialTimeout)
	}
	return opts, nil
}

// tlsDialer dials Redis over TLS within the caller's context. go-redis's own TLS dialer bounds the
// handshake by DialTimeout alone, for each of its dial attempts, so a Redis that accepts connections
// but never answers (paused, or not speaking TLS) would hold a call for several dial timeouts
// instead of the call's deadline, as it does without TLS.
func tlsDialer(tc *tls.Config, timeout time.Duration) func(ctx context.Context, network, addr string) (net.Conn, error) {
	d := &tls.Dialer{
		NetDialer: &net.Dialer{Timeout: timeout, KeepAliveConfig: net.KeepAliveConfig{
			// go-redis's default: probe after 30 s idle, give up after 3 probes 5 s apart.
			Enable: true, Idle: 30 * time.Second, Interval: 5 * time.Second, Count: 3,
		}},
		Config: tc,
	}
	return d.DialContext
}

// readPasswordFile reads the Redis password from its file, without one trailing "\n" or "\r\n" (as
// echo and editors leave). An error names the setting and the path, never the content.
func readPasswordFile(cfg *config.Options) (string, error) {
	path := cfg.RedisPasswordFile
	data, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("%s %s: %w", settingName(cfg, "redis_password_file"), path, pathCause(err))
	}
	password, crlf := strings.CutSuffix(string(data), "\r\n")
	if !crlf {
		password = strings.TrimSuffix(password, "\n")
	}
	if password == "" {
		return "", fmt.Errorf("%s %s: the file is empty", settingName(cfg, "redis_password_file"), path)
	}
	return password, nil
}

// redisTLSConfig is the TLS configuration of connections to Redis: TLS 1.2 or later, Redis's
// certificate verified against redis_tls_ca_file (or the system's roots) for redis_tls_server_name
// (or the address's host), and a client certificate when one is set, read again whenever its files
// change.
func redisTLSConfig(cfg *config.Options, logger *slog.Logger) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: cfg.RedisTLSServerName}
	if cfg.RedisTLSCAFile != "" {
		name := settingName(cfg, "redis_tls_ca_file") + " " + cfg.RedisTLSCAFile
		pem, err := os.ReadFile(cfg.RedisTLSCAFile)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, pathCause(err))
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s: no certificates found", name)
		}
		tc.RootCAs = pool
	}
	if cfg.RedisTLSCertFile != "" {
		r := &clientCertReloader{cfg: cfg, logger: logger}
		if err := r.load(); err != nil {
			return nil, err
		}
		tc.GetClientCertificate = r.getClientCertificate
	}
	return tc, nil
}

// clientCertReloader hands out the client certificate for Redis, read again from its files when
// either file changed since the last read (filewatch.Version: a renewed certificate is used from
// the next connection on). A pair that does not load, as while one file is replaced and the other
// not yet, keeps the previous certificate, and is tried again at the next connection.
type clientCertReloader struct {
	cfg    *config.Options
	logger *slog.Logger

	mu              sync.Mutex
	cert            *tls.Certificate
	certVer, keyVer filewatch.Version
	lastFailure     string // the last reload failure logged, so that it is logged once
}

// load reads the certificate and key if either changed since the last read.
func (r *clientCertReloader) load() error {
	certFile, keyFile := r.cfg.RedisTLSCertFile, r.cfg.RedisTLSKeyFile
	if _, err := os.Stat(certFile); err != nil {
		return fmt.Errorf("%s %s: %w", settingName(r.cfg, "redis_tls_cert_file"), certFile, pathCause(err))
	}
	if _, err := os.Stat(keyFile); err != nil {
		return fmt.Errorf("%s %s: %w", settingName(r.cfg, "redis_tls_key_file"), keyFile, pathCause(err))
	}
	certVer, keyVer := filewatch.Stat(certFile), filewatch.Stat(keyFile)
	if r.cert != nil && certVer == r.certVer && keyVer == r.keyVer {
		return nil
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		// crypto/tls's messages say what is wrong with the PEM, never what it holds.
		return fmt.Errorf("%s %s and %s %s: %w", settingName(r.cfg, "redis_tls_cert_file"), certFile,
			settingName(r.cfg, "redis_tls_key_file"), keyFile, pathCause(err))
	}
	r.cert, r.certVer, r.keyVer = &cert, certVer, keyVer
	return nil
}

func (r *clientCertReloader) getClientCertificate(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.load(); err != nil {
		if msg := err.Error(); msg != r.lastFailure {
			r.lastFailure = msg
			r.logger.Warn("reloading the Redis client certificate failed; using the previous one", "err", err)
		}
	} else {
		r.lastFailure = ""
	}
	return r.cert, nil
}

// pathCause drops the path from a file error, for messages that already name it.
func pathCause(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// settingName names a setting as the user set it (flag, environment variable or config file key),
// as the configuration's own messages do.
func settingName(cfg *config.Options, key string) string {
	switch cfg.Source(key) {
	case config.SourceEnv:
		return "KVROUTER_" + strings.ToUpper(key)
	case config.SourceFile:
		return key + " (config file)"
	}
	return layered.FlagOf(key)
}
