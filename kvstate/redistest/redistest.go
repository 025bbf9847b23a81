// Package redistest runs private redis-server processes for tests: one server, or a local Redis
// Cluster, on free loopback ports, in a temporary directory, stopped when the test ends. Tests never
// touch a Redis they did not start.
package redistest

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const startTimeout = 10 * time.Second

// quietLogger drops go-redis's own log lines (dial failures while a test has stopped Redis on
// purpose); tests assert on errors instead.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

func init() { redis.SetLogger(quietLogger{}) }

// Server is a running private redis-server.
type Server struct {
	Addr string
	dir  string
	args []string // extra arguments, kept for restarts
	cmd  *exec.Cmd
	t    testing.TB
	opts Options // how clients connect: TLS and credentials (StartWith)
}

// Options describe a server for StartWith: extra arguments, and how clients, the readiness PING
// among them, reach it.
type Options struct {
	// Args are extra redis-server arguments, as Start's: an ACL user, for example "--user",
	// "default", "off", "--user", "app", "on", ">secret", "~*", "&*", "+@all".
	Args []string
	// TLS, when set, makes the server's one port speak TLS only ("--port 0 --tls-port N"); Args
	// then give --tls-cert-file, --tls-key-file and --tls-ca-cert-file (and --tls-auth-clients).
	// Clients of the server dial with this configuration.
	TLS *tls.Config
	// Username and Password are the clients' credentials, for a server whose default user is off
	// or has a password.
	Username, Password string
}

// serverBinary finds redis-server. Without it the test is skipped locally but fails in CI, where
// .ci/run installs it.
func serverBinary(t testing.TB) string {
	t.Helper()
	if p, err := exec.LookPath("redis-server"); err == nil {
		return p
	}
	if os.Getenv("CI") != "" {
		t.Fatal("redis-server not found: .ci/run installs it (apt-get install redis-server)")
	}
	t.Skip("redis-server not found; install it (apt-get install redis-server) to run the Redis tests")
	return ""
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("net.Listen() = %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Start runs a redis-server with persistence off on a free port and stops it at cleanup.
func Start(t testing.TB, extraArgs ...string) *Server {
	t.Helper()
	bin := serverBinary(t)
	dir := t.TempDir()
	s := &Server{dir: dir, args: extraArgs, t: t}
	s.start(bin, freePort(t), extraArgs...)
	t.Cleanup(s.Stop)
	return s
}

// StartWith runs a redis-server as Start does, with TLS and credentials as o says, and stops it at
// cleanup. Its Client, FastClient and readiness PING connect as o says.
func StartWith(t testing.TB, o Options) *Server {
	t.Helper()
	bin := serverBinary(t)
	dir := t.TempDir()
	s := &Server{dir: dir, args: o.Args, t: t, opts: o}
	s.start(bin, freePort(t), o.Args...)
	t.Cleanup(s.Stop)
	return s
}

// clientOptions are the connection settings of the server's clients, on top of a client's own.
func (s *Server) clientOptions(o *redis.UniversalOptions) *redis.UniversalOptions {
	if s.opts.TLS != nil {
		o.TLSConfig = s.opts.TLS.Clone()
	}
	o.Username, o.Password = s.opts.Username, s.opts.Password
	return o
}

func (s *Server) start(bin string, port int, extraArgs ...string) {
	s.t.Helper()
	s.Addr = "127.0.0.1:" + strconv.Itoa(port)
	args := []string{
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", s.dir, "--logfile", filepath.Join(s.dir, "redis.log"),
	}
	if s.opts.TLS != nil {
		args = append(args, "--port", "0", "--tls-port", strconv.Itoa(port))
	}
	args = append(args, extraArgs...)
	s.cmd = exec.Command(bin, args...)
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("starting redis-server = %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	c := redis.NewUniversalClient(s.clientOptions(&redis.UniversalOptions{Addrs: []string{s.Addr}}))
	defer c.Close()
	for {
		err := c.Ping(ctx).Err()
		if err == nil {
			return
		}
		select {
		case <-ctx.Done():
			log, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
			s.t.Fatalf("redis-server on %s did not answer PING within %v (last: %v):\n%s", s.Addr, startTimeout, err, log)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Stop kills the server (data is not kept). Stopping twice is harmless.
func (s *Server) Stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGCONT) // a paused process must run to die
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
}

// Pause freezes the server (SIGSTOP): connections stay open but nothing answers, as in a network
// partition. Resume ends it. The data is kept.
func (s *Server) Pause() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Signal(syscall.SIGSTOP)
	}
}

// Resume continues a paused server (SIGCONT).
func (s *Server) Resume() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Signal(syscall.SIGCONT)
	}
}

// FastClient returns a client with short timeouts, so that tests of an outage do not wait long for
// each failed call. Closed at cleanup.
func (s *Server) FastClient() redis.UniversalClient {
	c := redis.NewUniversalClient(s.clientOptions(&redis.UniversalOptions{Addrs: []string{s.Addr},
		DialTimeout: 200 * time.Millisecond, ReadTimeout: 200 * time.Millisecond, WriteTimeout: 200 * time.Millisecond,
		MaxRetries: -1, ContextTimeoutEnabled: true}))
	s.t.Cleanup(func() { c.Close() })
	return c
}

// Restart kills the server (SIGKILL, as a crash) and starts it again on the same address, with the
// same settings and directory: empty by default (persistence is off), or from its append-only file
// when it was started with "--appendonly", "yes".
func (s *Server) Restart() {
	s.t.Helper()
	s.Stop()
	port, _ := strconv.Atoi(s.Addr[strings.LastIndexByte(s.Addr, ':')+1:])
	s.start(serverBinary(s.t), port, s.args...)
}

// Client returns a client of the server, closed at cleanup.
func (s *Server) Client() redis.UniversalClient {
	c := redis.NewUniversalClient(s.clientOptions(&redis.UniversalOptions{Addrs: []string{s.Addr}}))
	s.t.Cleanup(func() { c.Close() })
	return c
}

// Cluster is a running local Redis Cluster of masters without replicas.
type Cluster struct {
	Addrs   []string
	servers []*Server
	t       testing.TB
}

// StartCluster runs n cluster-enabled redis-servers and joins them with redis-cli --cluster create.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		serverBinary(t) // skips or fails the same way
		t.Fatal("redis-cli not found")
	}
	c := &Cluster{t: t}
	for i := 0; i < n; i++ {
		s := Start(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
		c.servers = append(c.servers, s)
		c.Addrs = append(c.Addrs, s.Addr)
	}
	args := append([]string{"--cluster", "create"}, c.Addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create = %v\n%s", err, out)
	}
	// Every node must see the whole cluster: one node saying ok is not enough, another may still
	// answer CLUSTERDOWN.
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	for _, addr := range c.Addrs {
		node := redis.NewClient(&redis.Options{Addr: addr})
		for {
			info, err := node.ClusterInfo(ctx).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") && strings.Contains(info, fmt.Sprintf("cluster_known_nodes:%d", n)) {
				break
			}
			select {
			case <-ctx.Done():
				node.Close()
				t.Fatalf("cluster node %s not ok within %v: %v %s", addr, startTimeout, err, info)
			case <-time.After(50 * time.Millisecond):
			}
		}
		node.Close()
	}
	return c
}

// Client returns a cluster client, closed at cleanup.
func (c *Cluster) Client() redis.UniversalClient {
	cl := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: c.Addrs, IsClusterMode: true})
	c.t.Cleanup(func() { cl.Close() })
	return cl
}

// Pause freezes every node (see Server.Pause).
func (c *Cluster) Pause() {
	for _, s := range c.servers {
		s.Pause()
	}
}

// Resume continues every node.
func (c *Cluster) Resume() {
	for _, s := range c.servers {
		s.Resume()
	}
}

// String describes the cluster.
func (c *Cluster) String() string { return fmt.Sprintf("cluster%v", c.Addrs) }
