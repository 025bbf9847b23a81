// Package redistest runs private redis-server processes for tests: one server, or a local Redis
// Cluster, on free loopback ports, in a temporary directory, stopped when the test ends. Tests never
// touch a Redis they did not start.
package redistest

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
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

// startAttempts bounds how many ports Start tries: a port found free may be taken by another
// process before redis-server binds it.
const startAttempts = 5

// busPortOffset is how far above its client port a Redis Cluster node listens for the cluster bus.
const busPortOffset = 10000

// quietLogger drops go-redis's own log lines (dial failures while a test has stopped Redis on
// purpose); tests assert on errors instead.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

func init() { redis.SetLogger(quietLogger{}) }

// Server is a running private redis-server.
type Server struct {
	Addr   string
	dir    string
	args   []string // extra arguments, kept for restarts
	cmd    *exec.Cmd
	exited chan struct{} // closed once cmd has exited and been waited for
	t      testing.TB
	opts   Options // how clients connect: TLS and credentials (StartWith)
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

// freeClusterPort returns a free loopback port whose cluster bus port (port+10000) is free too: a
// cluster node binds both, and a port found free by itself says nothing of the other, which
// another test may hold.
func freeClusterPort(t testing.TB) int {
	t.Helper()
	return clusterPort(t, freePort)
}

// clusterPort returns the first port candidate gives whose bus port is free and within range
// (redis-server refuses a cluster port above 65535-10000).
func clusterPort(t testing.TB, candidate func(testing.TB) int) int {
	t.Helper()
	for range 100 {
		port := candidate(t)
		if port+busPortOffset > 65535 {
			continue
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+busPortOffset))
		if err != nil {
			continue
		}
		l.Close()
		return port
	}
	t.Fatal("no free loopback port with a free cluster bus port found in 100 tries")
	return 0
}

// portPicker returns how a server started with args picks its port: with its bus port free too
// when args enable cluster mode.
func portPicker(args []string) func(testing.TB) int {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "--cluster-enabled" && args[i+1] == "yes" {
			return freeClusterPort
		}
	}
	return freePort
}

// Start runs a redis-server with persistence off on a free port and stops it at cleanup.
func Start(t testing.TB, extraArgs ...string) *Server {
	t.Helper()
	return start(t, Options{Args: extraArgs}, portPicker(extraArgs))
}

// StartWith runs a redis-server as Start does, with TLS and credentials as o says, and stops it at
// cleanup. Its Client, FastClient and readiness PING connect as o says.
func StartWith(t testing.TB, o Options) *Server {
	t.Helper()
	return start(t, o, portPicker(o.Args))
}

// start runs a redis-server on a port pick gives, in a fresh directory, and stops it at cleanup.
// A port can be taken between the pick and redis-server's bind (the pick only found it free), so
// a server that cannot bind its port, or its cluster bus port, is started again on another one.
func start(t testing.TB, o Options, pick func(testing.TB) int) *Server {
	t.Helper()
	bin := serverBinary(t)
	var taken []string
	for range startAttempts {
		s := &Server{dir: t.TempDir(), args: o.Args, t: t, opts: o}
		t.Cleanup(s.Stop)
		err := s.launch(bin, pick(t))
		if err == nil {
			return s
		}
		taken = append(taken, fmt.Sprintf("%s: %v", s.Addr, err))
	}
	t.Fatalf("redis-server could not bind a port in %d attempts:\n%s", startAttempts, strings.Join(taken, "\n"))
	return nil
}

// clientOptions are the connection settings of the server's clients, on top of a client's own.
func (s *Server) clientOptions(o *redis.UniversalOptions) *redis.UniversalOptions {
	if s.opts.TLS != nil {
		o.TLSConfig = s.opts.TLS.Clone()
	}
	o.Username, o.Password = s.opts.Username, s.opts.Password
	return o
}

// errPortTaken is launch's answer when redis-server could not bind its port or its cluster bus
// port: another process holds it.
var errPortTaken = errors.New("address already in use")

// launch runs redis-server on port and waits until it answers PING. It returns errPortTaken when
// the server exits because a port it binds is in use, and fails the test on any other failure.
// The server that answers must be this process (INFO's process_id): when another test's Redis
// holds the port, it answers PING while this one exits.
func (s *Server) launch(bin string, port int) error {
	s.t.Helper()
	s.Addr = "127.0.0.1:" + strconv.Itoa(port)
	logFile := filepath.Join(s.dir, "redis.log")
	args := []string{
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", s.dir, "--logfile", logFile,
	}
	if s.opts.TLS != nil {
		args = append(args, "--port", "0", "--tls-port", strconv.Itoa(port))
	}
	args = append(args, s.args...)
	logStart := int64(0) // a restart appends to the log: only this run's lines count
	if fi, err := os.Stat(logFile); err == nil {
		logStart = fi.Size()
	}
	cmd := exec.Command(bin, args...)
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("starting redis-server = %v", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	s.cmd, s.exited = cmd, exited
	thisRun := func() []byte {
		log, _ := os.ReadFile(logFile)
		return log[min(logStart, int64(len(log))):]
	}
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	// No retries inside a call: the loop retries, and looks at the process between tries.
	c := redis.NewUniversalClient(s.clientOptions(&redis.UniversalOptions{Addrs: []string{s.Addr}, MaxRetries: -1}))
	defer c.Close()
	pid := "process_id:" + strconv.Itoa(cmd.Process.Pid) + "\r\n"
	for {
		select {
		case <-exited:
			s.cmd = nil
			log := thisRun()
			if bytes.Contains(log, []byte("Address already in use")) {
				return errPortTaken
			}
			s.t.Fatalf("redis-server on %s exited at start (%v):\n%s", s.Addr, cmd.ProcessState, log)
		default:
		}
		err := c.Ping(ctx).Err()
		if err == nil {
			info, infoErr := c.Info(ctx, "server").Result()
			switch {
			case infoErr != nil && strings.HasPrefix(infoErr.Error(), "NOPERM"):
				// A user that may not run INFO cannot tell whose server answers; trust the PING.
			case infoErr != nil:
				err = infoErr
			case !strings.Contains(info, pid):
				err = errors.New("another redis-server answers on the port")
			}
		}
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			s.t.Fatalf("redis-server on %s did not answer PING within %v (last: %v):\n%s", s.Addr, startTimeout, err, thisRun())
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
	<-s.exited
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
	if err := s.launch(serverBinary(s.t), port); err != nil {
		s.t.Fatalf("restarting redis-server on %s: %v", s.Addr, err)
	}
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
