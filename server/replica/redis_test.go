package replica

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/server/config"
	"github.com/kvrouter/kvrouter/server/servertest/testpki"
)

// TestRedisOptions checks the client options kvrouter builds from its settings, without a Redis:
// the timeouts, the password file's one trailing line end, the TLS settings, and errors that name
// the setting and never the secret.
func TestRedisOptions(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	load := func(t *testing.T, env map[string]string, args ...string) *config.Options {
		t.Helper()
		cfg, err := config.Load("kvrouter serve", append([]string{"--redis-addr", "127.0.0.1:6379"}, args...), func(k string) string { return env[k] }, io.Discard)
		if err != nil {
			t.Fatalf("config.Load(%q) = %v", args, err)
		}
		return cfg
	}
	options := func(t *testing.T, cfg *config.Options) (*redis.UniversalOptions, error) {
		return redisOptions(cfg, []string{cfg.RedisAddr}, false, slog.New(slog.DiscardHandler))
	}

	t.Run("defaults", func(t *testing.T) {
		o, err := options(t, load(t, nil))
		if err != nil {
			t.Fatalf("redisOptions() = %v", err)
		}
		if o.DialTimeout != 2*time.Second || o.ReadTimeout != 3*time.Second || o.WriteTimeout != 3*time.Second || !o.ContextTimeoutEnabled || o.MaxRetries != 1 {
			t.Errorf("timeouts = dial %v read %v write %v context %v retries %d, want 2s 3s 3s true 1", o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled, o.MaxRetries)
		}
		if o.TLSConfig != nil || o.Username != "" || o.Password != "" {
			t.Errorf("TLS %v, user %q, password set %v; want none", o.TLSConfig, o.Username, o.Password != "")
		}
	})
	t.Run("password file", func(t *testing.T) {
		for content, want := range map[string]string{
			"s3cret": "s3cret", "s3cret\n": "s3cret", "s3cret\r\n": "s3cret", "s3cret\n\n": "s3cret\n", " s3cret \n": " s3cret ",
		} {
			o, err := options(t, load(t, nil, "--redis-username", "u", "--redis-password-file", write("pw", content)))
			if err != nil {
				t.Fatalf("redisOptions() = %v", err)
			}
			if o.Password != want || o.Username != "u" {
				t.Errorf("file %q: user %q, password %q; want u, %q", content, o.Username, o.Password, want)
			}
		}
	})
	t.Run("password from the environment", func(t *testing.T) {
		o, err := options(t, load(t, map[string]string{"KVROUTER_REDIS_PASSWORD": "env-pw\n"}))
		if err != nil || o.Password != "env-pw\n" {
			t.Errorf("redisOptions() = password %q, %v; want %q as given", o.Password, err, "env-pw\n")
		}
	})
	t.Run("tls", func(t *testing.T) {
		p := testpki.NewRedisPKI(t)
		o, err := options(t, load(t, nil, "--redis-tls", "--redis-tls-ca-file", p.ServerCAFile, "--redis-tls-server-name", "redis.internal",
			"--redis-tls-cert-file", p.ClientCert, "--redis-tls-key-file", p.ClientKey))
		if err != nil {
			t.Fatalf("redisOptions() = %v", err)
		}
		tc := o.TLSConfig
		if tc == nil || tc.MinVersion != tls.VersionTLS12 || tc.ServerName != "redis.internal" || tc.RootCAs == nil || tc.GetClientCertificate == nil {
			t.Fatalf("TLSConfig = %+v, want TLS 1.2+, server name redis.internal, the CA file's roots and a client certificate", tc)
		}
		if !tc.RootCAs.Equal(p.ServerCA.Pool()) {
			t.Error("RootCAs is not the CA file's pool")
		}
		cert, err := tc.GetClientCertificate(&tls.CertificateRequestInfo{})
		if err != nil || cert.Leaf == nil || !cert.Leaf.Equal(p.ClientLeaf.Cert) {
			t.Errorf("GetClientCertificate() = %v, want the client certificate", err)
		}
		o, err = options(t, load(t, nil, "--redis-tls"))
		if err != nil || o.TLSConfig.RootCAs != nil || o.TLSConfig.GetClientCertificate != nil || o.TLSConfig.ServerName != "" {
			t.Errorf("--redis-tls alone = %+v, %v; want the system's roots, no client certificate, the address's host", o.TLSConfig, err)
		}
	})
	t.Run("client certificate renewed", func(t *testing.T) {
		p := testpki.NewRedisPKI(t)
		o, err := options(t, load(t, nil, "--redis-tls", "--redis-tls-cert-file", p.ClientCert, "--redis-tls-key-file", p.ClientKey))
		if err != nil {
			t.Fatalf("redisOptions() = %v", err)
		}
		get := o.TLSConfig.GetClientCertificate
		renewed := p.ClientCA.Client(t, "spiffe://kvrouter/renewed")
		renewed.Write(t, p.Dir, "kvrouter")
		future := time.Now().Add(time.Minute) // a modification time surely different from the first files'
		for _, f := range []string{p.ClientCert, p.ClientKey} {
			if err := os.Chtimes(f, future, future); err != nil {
				t.Fatal(err)
			}
		}
		if cert, err := get(nil); err != nil || !cert.Leaf.Equal(renewed.Cert) {
			t.Errorf("after renewal GetClientCertificate() = %v, want the renewed certificate", err)
		}
		// A half-written pair (a key of another certificate) keeps the last good one.
		if err := os.WriteFile(p.ClientKey, p.ClientLeaf.KeyPEM, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(p.ClientKey, future.Add(time.Second), future.Add(time.Second)); err != nil {
			t.Fatal(err)
		}
		if cert, err := get(nil); err != nil || !cert.Leaf.Equal(renewed.Cert) {
			t.Errorf("with a mismatched key GetClientCertificate() = %v, want the last good certificate", err)
		}
	})
	t.Run("handshake within the call's deadline", func(t *testing.T) {
		// A server that accepts the connection and never answers, as a paused Redis does.
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer lis.Close()
		go func() {
			for {
				c, err := lis.Accept()
				if err != nil {
					return
				}
				t.Cleanup(func() { c.Close() })
			}
		}()
		o, err := options(t, load(t, nil, "--redis-tls"))
		if err != nil {
			t.Fatalf("redisOptions() = %v", err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		_, err = o.Dialer(ctx, "tcp", lis.Addr().String())
		if took := time.Since(start); err == nil || took > time.Second {
			t.Errorf("Dialer() to a silent server = %v after %v, want an error after the context's 200ms", err, took)
		}
	})
	t.Run("mistakes told from outages", func(t *testing.T) {
		cfg := load(t, nil, "--redis-tls")
		for _, tc := range []struct {
			err  error
			want string // "" for an outage
		}{
			{tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake"}, "does not speak TLS (unset --redis-tls"},
			{fmt.Errorf("dial: %w", &tls.CertificateVerificationError{Err: errors.New("x509: certificate signed by unknown authority")}), "certificate does not verify"},
			{errors.New("remote error: tls: bad certificate"), "does it require a client certificate"},
			{io.EOF, ""},
			{context.DeadlineExceeded, ""},
			{errors.New("dial tcp 127.0.0.1:6379: connect: connection refused"), ""},
		} {
			if got := redisMisconfigured(cfg, tc.err); !strings.Contains(got, tc.want) || (tc.want == "") != (got == "") {
				t.Errorf("redisMisconfigured(%v) = %q, want %q", tc.err, got, tc.want)
			}
		}
	})
	t.Run("errors", func(t *testing.T) {
		p := testpki.NewRedisPKI(t)
		junk := write("junk.pem", "junk: not PEM, maybe a secret\n")
		empty := write("empty", "\n")
		for _, tc := range []struct {
			name string
			env  map[string]string
			args []string
			want string
		}{
			{"missing password file", nil, []string{"--redis-password-file", dir + "/none"}, "--redis-password-file " + dir + "/none: no such file or directory"},
			{"password file from the environment", map[string]string{"KVROUTER_REDIS_PASSWORD_FILE": dir + "/none"}, nil, "KVROUTER_REDIS_PASSWORD_FILE " + dir + "/none: no such file or directory"},
			{"empty password file", nil, []string{"--redis-password-file", empty}, "--redis-password-file " + empty + ": the file is empty"},
			{"CA file not PEM", nil, []string{"--redis-tls", "--redis-tls-ca-file", junk}, "--redis-tls-ca-file " + junk + ": no certificates found"},
			{"missing CA file", nil, []string{"--redis-tls", "--redis-tls-ca-file", dir + "/none"}, "--redis-tls-ca-file " + dir + "/none: no such file or directory"},
			{"missing key file", nil, []string{"--redis-tls", "--redis-tls-cert-file", p.ClientCert, "--redis-tls-key-file", dir + "/none"}, "--redis-tls-key-file " + dir + "/none: no such file or directory"},
			{"key not PEM", nil, []string{"--redis-tls", "--redis-tls-cert-file", p.ClientCert, "--redis-tls-key-file", junk}, "--redis-tls-key-file " + junk + ": tls: "},
		} {
			_, err := options(t, load(t, tc.env, tc.args...))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: redisOptions() = %v, want an error containing %q", tc.name, err, tc.want)
			}
			if err != nil && strings.Contains(err.Error(), "secret") {
				t.Errorf("%s: the error quotes the file: %v", tc.name, err)
			}
		}
	})
}
