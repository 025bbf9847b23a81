package main

import (
	"context"
	"crypto/tls"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
	"github.com/kvrouter/kvrouter/server"
	"github.com/kvrouter/kvrouter/server/servertest/testpki"
)

// The tests below run kvrouter against a real redis-server speaking TLS (Debian's 7.0.15 is built
// with it) and checking ACL credentials: no miniredis, no TLS-terminating stand-in.

// redisUser and redisPassword are the ACL user of the secured test Redis; the password is distinctive
// so that finding it in a log or an answer cannot be a coincidence.
const (
	redisUser     = "kvr"
	redisPassword = "pw-9f4c2e7a-do-not-log"
	wrongPassword = "pw-0b1d3f5-wrong"
)

// startSecureRedis runs a private redis-server that speaks TLS only, requires a client certificate
// when mutual is set, and knows one ACL user (the default user is off) when acl is set, with the
// rights docs/operations.md gives kvrouter's user: the keys of the default prefix and every command.
func startSecureRedis(t *testing.T, p *testpki.RedisPKI, mutual, acl bool) *redistest.Server {
	t.Helper()
	authClients := "no"
	clientTLS := &tls.Config{RootCAs: p.ServerCA.Pool(), MinVersion: tls.VersionTLS12}
	if mutual {
		authClients = "yes"
		clientTLS.Certificates = []tls.Certificate{p.ClientLeaf.TLS(t)}
	}
	o := redistest.Options{
		Args: []string{"--tls-cert-file", p.ServerCert, "--tls-key-file", p.ServerKey,
			"--tls-ca-cert-file", p.ClientCAFile, "--tls-auth-clients", authClients},
		TLS: clientTLS,
	}
	if acl {
		o.Args = append(o.Args, "--user", "default", "off", "--user", redisUser, "on", ">"+redisPassword, "~kvr:*", "+@all")
		o.Username, o.Password = redisUser, redisPassword
	}
	return redistest.StartWith(t, o)
}

// kvrouterCommand is `kvrouter serve` on a free loopback port, its environment without any
// KVROUTER_* variable of the test's own but with env. The reseed window is the shortest there is:
// a replica that creates the shared log reports SharedState NOT_SERVING for that long.
func kvrouterCommand(t *testing.T, bin string, env []string, args ...string) (*exec.Cmd, string, *lockedBuffer) {
	t.Helper()
	addr := freePort(t)
	cmd := exec.Command(bin, append([]string{"serve", "--listen", addr, "--metrics-listen", "", "--shutdown-drain", "0s",
		"--redis-reseed-window", "1s"}, args...)...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KVROUTER_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	out := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	return cmd, addr, out
}

// startSecureKvrouter runs `kvrouter serve` with env and args, and waits until both its overall
// health and its kvrouter.v1.SharedState entry are SERVING: it has joined the shared log. The
// process gets SIGTERM at cleanup and must exit 0.
func startSecureKvrouter(t *testing.T, bin string, env []string, args ...string) (addr string, logs *lockedBuffer) {
	t.Helper()
	cmd, addr, logs := kvrouterCommand(t, bin, env, args...)
	exited := runUntilCleanup(t, cmd, logs, nil)
	waitServing(t, healthpb.NewHealthClient(dial(t, addr)), exited, logs, "", server.SharedStateService)
	return addr, logs
}

// kvrouterExit runs `kvrouter serve`, which must stop on its own within 10 s, and returns its exit
// status and output.
func kvrouterExit(t *testing.T, bin string, env []string, args ...string) (int, string) {
	t.Helper()
	cmd, _, out := kvrouterCommand(t, bin, env, args...)
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting kvrouter = %v", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode(), out.String()
		}
		if err != nil {
			t.Fatalf("kvrouter: %v", err)
		}
		return 0, out.String()
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-exited
		t.Fatalf("kvrouter still running after 10 s; output:\n%s", out)
		return 0, ""
	}
}

// tlsFlags are kvrouter's flags for the secured Redis p protects: TLS, its CA, and the client
// certificate when mutual.
func tlsFlags(p *testpki.RedisPKI, mutual bool) []string {
	f := []string{"--redis-tls", "--redis-tls-ca-file", p.ServerCAFile}
	if mutual {
		f = append(f, "--redis-tls-cert-file", p.ClientCert, "--redis-tls-key-file", p.ClientKey)
	}
	return f
}

// publishAndRoute is the round trip through the shared state: worker id publishes one block on
// replica pub, which acks it once it is in Redis, and replica route routes the block's tokens to that
// worker.
func publishAndRoute(t *testing.T, pub, route string, id uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	w := &worker{t: t, id: id, acked: -1}
	w.connect(ctx, pub)
	if !w.publish() || w.acked != 0 {
		t.Fatalf("worker %d's first event: published and acked through %d, want acked through 0", id, w.acked)
	}
	router := kvrouterv1.NewRouterServiceClient(dial(t, route))
	var resp *kvrouterv1.RouteResponse
	var err error
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
		resp, err = router.Route(ctx, &kvrouterv1.RouteRequest{Model: "m", TokenIds: []uint32{uint32(id), 0, 1, 2}, QueryOnly: true})
		return err == nil && resp.GetDecode().GetWorkerId() == id && resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice() == 1
	}) {
		t.Fatalf("Route on %s never chose worker %d with its 1 block: last %v, %v", route, id, resp, err)
	}
}

// configOf returns the replica's GetConfig answer as key → entry.
func configOf(t *testing.T, addr string) map[string]*kvrouterv1.ConfigEntry {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	resp, err := kvrouterv1.NewAdminServiceClient(dial(t, addr)).GetConfig(ctx, &kvrouterv1.GetConfigRequest{})
	if err != nil {
		t.Fatalf("GetConfig() = %v", err)
	}
	out := map[string]*kvrouterv1.ConfigEntry{}
	for _, e := range resp.GetEntries() {
		out[e.GetKey()] = e
		if strings.Contains(e.GetValue(), redisPassword) {
			t.Errorf("GetConfig shows the Redis password in %s", e.GetKey())
		}
	}
	return out
}

// TestRedisTLSAndACL runs two replicas on a Redis that accepts only TLS with a client certificate,
// and only its ACL user with its password: replica A gets the password from
// KVROUTER_REDIS_PASSWORD, replica B from --redis-password-file (with a trailing CRLF, as an editor
// may leave). Both reach SERVING, including their SharedState entry; a worker's event acked by A is
// routed on by B; GetConfig shows the password redacted, and neither output holds it.
func TestRedisTLSAndACL(t *testing.T) {
	p := testpki.NewRedisPKI(t)
	srv := startSecureRedis(t, p, true, true)
	bin := buildBinary(t)
	common := append([]string{"--redis-addr", srv.Addr, "--redis-username", redisUser}, tlsFlags(p, true)...)

	a, aLogs := startSecureKvrouter(t, bin, []string{"KVROUTER_REDIS_PASSWORD=" + redisPassword}, append(common, "--replica-id", "a")...)
	passwordFile := filepath.Join(p.Dir, "redis-password")
	if err := os.WriteFile(passwordFile, []byte(redisPassword+"\r\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	b, bLogs := startSecureKvrouter(t, bin, nil, append(common, "--replica-id", "b", "--redis-password-file", passwordFile)...)

	publishAndRoute(t, a, b, 7)

	cfgA, cfgB := configOf(t, a), configOf(t, b)
	if e := cfgA["redis_password"]; e.GetValue() != "(redacted)" || e.GetSource() != kvrouterv1.ConfigSource_CONFIG_SOURCE_ENV {
		t.Errorf("A's GetConfig redis_password = %q from %v, want \"(redacted)\" from the environment", e.GetValue(), e.GetSource())
	}
	if e := cfgB["redis_password_file"]; e.GetValue() != passwordFile {
		t.Errorf("B's GetConfig redis_password_file = %q, want %q", e.GetValue(), passwordFile)
	}
	if e := cfgB["redis_password"]; e.GetValue() != "" {
		t.Errorf("B's GetConfig redis_password = %q, want empty (it came from the file)", e.GetValue())
	}
	for name, logs := range map[string]*lockedBuffer{"A": aLogs, "B": bLogs} {
		out := logs.waitFor(t, "line saying replica "+name+" shares state through Redis over TLS as kvr", func(out string) bool {
			return strings.Contains(out, `"msg":"sharing state through Redis"`) && strings.Contains(out, `"tls":true,"user":"kvr"`)
		})
		if strings.Contains(out, redisPassword) {
			t.Errorf("replica %s's log holds the Redis password:\n%s", name, out)
		}
	}
}

// TestRedisTLSServerOnly runs a replica on a Redis that speaks TLS but asks for no client
// certificate and has no password: --redis-tls and --redis-tls-ca-file are enough.
func TestRedisTLSServerOnly(t *testing.T) {
	p := testpki.NewRedisPKI(t)
	srv := startSecureRedis(t, p, false, false)
	bin := buildBinary(t)
	a, logs := startSecureKvrouter(t, bin, nil, append([]string{"--redis-addr", srv.Addr}, tlsFlags(p, false)...)...)
	publishAndRoute(t, a, a, 3)
	logs.waitLine(t, `"tls":true,"user":""`)
}

// TestRedisMisconfiguredExits starts kvrouter with one thing wrong for a Redis that requires TLS, a
// client certificate and an ACL user's password. Each time the process exits 1 within seconds (a
// first PING at startup tells such mistakes from an outage) with a message naming what to fix, and
// its output holds neither the right password nor the wrong one. Without that PING it would retry
// for ever, never SERVING, logging WRONGPASS ten times a second.
func TestRedisMisconfiguredExits(t *testing.T) {
	p := testpki.NewRedisPKI(t)
	srv := startSecureRedis(t, p, true, true)
	bin := buildBinary(t)
	wrongFile := filepath.Join(p.Dir, "wrong-password")
	if err := os.WriteFile(wrongFile, []byte(wrongPassword+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	base := []string{"--redis-addr", srv.Addr, "--redis-username", redisUser}
	goodEnv := []string{"KVROUTER_REDIS_PASSWORD=" + redisPassword}
	for _, tc := range []struct {
		name  string
		env   []string
		flags []string
		want  []string
	}{
		{"wrong password from the environment", []string{"KVROUTER_REDIS_PASSWORD=" + wrongPassword}, tlsFlags(p, true),
			[]string{"WRONGPASS", `user "kvr" was refused with the password from KVROUTER_REDIS_PASSWORD`, "--redis-username"}},
		{"wrong password file", nil, append(tlsFlags(p, true), "--redis-password-file", wrongFile),
			[]string{"WRONGPASS", "--redis-password-file " + wrongFile}},
		{"no password", nil, tlsFlags(p, true),
			[]string{"NOAUTH", `user "kvr" was refused without a password`, "KVROUTER_REDIS_PASSWORD"}},
		{"untrusted server certificate", goodEnv, []string{"--redis-tls", "--redis-tls-ca-file", p.OtherCAFile,
			"--redis-tls-cert-file", p.ClientCert, "--redis-tls-key-file", p.ClientKey},
			[]string{"certificate does not verify", "--redis-tls-ca-file", "unknown authority"}},
		{"server name not in the certificate", goodEnv, append(tlsFlags(p, true), "--redis-tls-server-name", "redis.example"),
			[]string{"certificate does not verify", "--redis-tls-server-name", "redis.example"}},
		{"no client certificate", goodEnv, tlsFlags(p, false),
			[]string{"refused the TLS handshake", "--redis-tls-cert-file"}},
		{"CA file without certificates", goodEnv, append(tlsFlags(p, true)[:1], "--redis-tls-ca-file", wrongFile),
			[]string{"--redis-tls-ca-file " + wrongFile + ": no certificates found"}},
		{"missing password file", nil, append(tlsFlags(p, true), "--redis-password-file", wrongFile+".missing"),
			[]string{"--redis-password-file " + wrongFile + ".missing: no such file or directory"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			code, out := kvrouterExit(t, bin, tc.env, append(append([]string{}, base...), tc.flags...)...)
			t.Logf("exit %d after %v: %s", code, time.Since(start).Round(time.Millisecond), lastLine(out))
			if code != 1 {
				t.Errorf("exit status = %d, want 1\n%s", code, out)
			}
			for _, w := range tc.want {
				if !strings.Contains(out, w) {
					t.Errorf("output does not say %q:\n%s", w, out)
				}
			}
			for _, secret := range []string{redisPassword, wrongPassword} {
				if strings.Contains(out, secret) {
					t.Errorf("output holds a password:\n%s", out)
				}
			}
		})
	}
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// TestRedisClientCertReloaded renews kvrouter's client certificate while it runs: the new one is
// issued by another CA, Redis is told to trust only that CA (CONFIG SET tls-ca-cert-file) and drops
// every connection. The replica reconnects with the new certificate, read again from the same files,
// and goes on: a new worker's event is acked and SharedState is SERVING again.
func TestRedisClientCertReloaded(t *testing.T) {
	p := testpki.NewRedisPKI(t)
	srv := startSecureRedis(t, p, true, true)
	bin := buildBinary(t)
	a, logs := startSecureKvrouter(t, bin, []string{"KVROUTER_REDIS_PASSWORD=" + redisPassword},
		append([]string{"--redis-addr", srv.Addr, "--redis-username", redisUser}, tlsFlags(p, true)...)...)
	publishAndRoute(t, a, a, 1)

	// An admin connection, opened before the switch: new ones need the new CA's certificate too.
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	admin := srv.Client().(*redis.Client).Conn()
	defer admin.Close()
	if err := admin.Ping(ctx).Err(); err != nil {
		t.Fatalf("admin PING = %v", err)
	}
	renewedCA := testpki.NewCA(t, "renewed redis client CA")
	renewedCA.Client(t, "spiffe://kvrouter/replica").Write(t, p.Dir, "kvrouter") // replaces the files kvrouter reads
	renewedCAFile := renewedCA.WriteCert(t, p.Dir, "renewed-client-ca.crt")
	if err := admin.ConfigSet(ctx, "tls-ca-cert-file", renewedCAFile).Err(); err != nil {
		t.Fatalf("CONFIG SET tls-ca-cert-file = %v", err)
	}
	if err := admin.ClientKillByFilter(ctx, "TYPE", "normal", "SKIPME", "yes").Err(); err != nil {
		t.Fatalf("CLIENT KILL = %v", err)
	}
	// The old certificate no longer gets in.
	old := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: redisUser, Password: redisPassword, MaxRetries: -1,
		TLSConfig: &tls.Config{RootCAs: p.ServerCA.Pool(), Certificates: []tls.Certificate{p.ClientLeaf.TLS(t)}, MinVersion: tls.VersionTLS12}})
	defer old.Close()
	if err := old.Ping(ctx).Err(); err == nil {
		t.Fatal("PING with the old client certificate succeeded after the switch, want a refused handshake")
	}

	publishAndRoute(t, a, a, 2)
	health := healthpb.NewHealthClient(dial(t, a))
	if !kvtest.Poll(defaultTestTimeout, 50*time.Millisecond, func() bool {
		resp, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: server.SharedStateService})
		return err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
	}) {
		t.Fatalf("SharedState not SERVING again after the renewal:\n%s", logs)
	}
	if out := logs.String(); strings.Contains(out, "reloading the Redis client certificate failed") {
		t.Errorf("a reload failed:\n%s", out)
	}
}
