package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

const defaultTestTimeout = 30 * time.Second

// grpcurlPath finds the real grpcurl: $KVROUTER_GRPCURL (set by scripts/test.sh), the pinned copy in
// .tmp/bin, or PATH. Without it the test is skipped locally, but fails in CI, where it must run.
func grpcurlPath(t *testing.T) string {
	t.Helper()
	candidates := []string{os.Getenv("KVROUTER_GRPCURL"), "../../.tmp/bin/grpcurl"}
	if p, err := exec.LookPath("grpcurl"); err == nil {
		candidates = append(candidates, p)
	}
	for _, c := range candidates {
		if c == "" {
			continue
		}
		if abs, err := filepath.Abs(c); err == nil {
			if _, err := os.Stat(abs); err == nil {
				return abs
			}
		}
	}
	if os.Getenv("CI") != "" {
		t.Fatal("grpcurl not found: scripts/test.sh installs it; CI must run the walkthrough")
	}
	t.Skip("grpcurl not found; run scripts/test.sh (it installs the pinned grpcurl)")
	return ""
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("net.Listen() = %v", err)
	}
	defer l.Close()
	return l.Addr().String()
}

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
	buildOut  []byte
)

// buildBinary builds cmd/kvrouter once per test run.
func buildBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kvrouter-test")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "kvrouter")
		buildOut, buildErr = exec.Command("go", "build", "-o", binPath, ".").CombinedOutput()
	})
	if buildErr != nil {
		t.Fatalf("go build = %v\n%s", buildErr, buildOut)
	}
	return binPath
}

// startServer runs `kvrouter serve` with extra args and waits until its health is SERVING. The
// process gets SIGTERM at cleanup, and must exit 0.
func startServer(t *testing.T, bin string, extra ...string) (addr string, logs *lockedBuffer) {
	p := startProcess(t, bin, extra...)
	return p.addr, p.logs
}

// lockedBuffer is a process's output, safe to read while the process writes it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// waitFor polls the output until found says it holds what the test waits for (what), and returns
// the output then; after defaultTestTimeout it fails the test with the output. A process's log
// reaches b through a pipe that os/exec copies in the background, so a line the process wrote
// before it answered a call may land in b after the answer does: a test waits for a line it
// expects, never reads b once and assumes the line is there.
func (b *lockedBuffer) waitFor(t *testing.T, what string, found func(out string) bool) string {
	t.Helper()
	var out string
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool { out = b.String(); return found(out) }) {
		t.Fatalf("no %s in the log within %v:\n%s", what, defaultTestTimeout, out)
	}
	return out
}

// waitLine waits until the output contains s (see waitFor).
func (b *lockedBuffer) waitLine(t *testing.T, s string) string {
	t.Helper()
	return b.waitFor(t, s, func(out string) bool { return strings.Contains(out, s) })
}

// serverProcess is a running `kvrouter serve`.
type serverProcess struct {
	addr    string
	metrics string // its /metrics listener, host:port
	logs    *lockedBuffer
	cmd     *exec.Cmd
	killed  bool
}

// kill ends the process abruptly (SIGKILL), as a crash would.
func (p *serverProcess) kill() {
	p.killed = true
	_ = p.cmd.Process.Signal(syscall.SIGCONT) // a paused process must run to die
	_ = p.cmd.Process.Kill()
}

// metricValue returns the value of the metric without labels name that the process exports (-1
// when it exports none, or its /metrics cannot be read).
func metricValue(t *testing.T, p *serverProcess, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + p.metrics + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return f
			}
		}
	}
	return -1
}

// pause freezes the process (SIGSTOP), as a long stall, a frozen VM or a debugger would; resume
// continues it.
func (p *serverProcess) pause()  { _ = p.cmd.Process.Signal(syscall.SIGSTOP) }
func (p *serverProcess) resume() { _ = p.cmd.Process.Signal(syscall.SIGCONT) }

// processExit is a process's end: done closes once it has exited, with err its exit. Every reader
// sees it (a channel receiving the exit once would leave the second reader waiting for ever).
type processExit struct {
	done chan struct{}
	err  error
}

// exited returns the exit error and true once the process has exited.
func (e *processExit) exited() (error, bool) {
	select {
	case <-e.done:
		return e.err, true
	default:
		return nil, false
	}
}

// runUntilCleanup starts cmd, a `kvrouter serve` whose output goes to logs, and stops it at the
// test's cleanup with SIGTERM, after which it must exit 0 within defaultTestTimeout (unless killed
// says the test killed it already; one that exited on its own with an error fails the test).
func runUntilCleanup(t *testing.T, cmd *exec.Cmd, logs fmt.Stringer, killed *bool) *processExit {
	t.Helper()
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting kvrouter = %v", err)
	}
	e := &processExit{done: make(chan struct{})}
	go func() {
		e.err = cmd.Wait()
		close(e.done)
	}()
	t.Cleanup(func() {
		defer keepLogsOfFailure(t, cmd, logs)
		if killed != nil && *killed {
			<-e.done
			return
		}
		if err, ok := e.exited(); ok {
			if err != nil {
				t.Errorf("kvrouter exited on its own with %v, before the test ended\n%s", err, logs)
			}
			return
		}
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-e.done:
			if e.err != nil {
				t.Errorf("kvrouter exited with %v after SIGTERM, want 0\n%s", e.err, logs)
			}
		case <-time.After(defaultTestTimeout):
			_ = cmd.Process.Kill()
			t.Errorf("kvrouter did not stop within %v of SIGTERM", defaultTestTimeout)
		}
	})
	return e
}

// keepLogsOfFailure writes a failed test's kvrouter logs to the folder $KVROUTER_TEST_LOGS names,
// if it names one, a file per process: a fault found once in many runs can then be traced.
func keepLogsOfFailure(t *testing.T, cmd *exec.Cmd, logs fmt.Stringer) {
	dir := os.Getenv("KVROUTER_TEST_LOGS")
	if dir == "" || !t.Failed() {
		return
	}
	name := strings.NewReplacer("/", "_", " ", "_").Replace(t.Name())
	path := filepath.Join(dir, fmt.Sprintf("%s-%d.log", name, cmd.Process.Pid))
	if err := os.WriteFile(path, []byte(logs.String()), 0o644); err != nil {
		t.Logf("keeping the logs: %v", err)
	}
}

func startProcess(t *testing.T, bin string, extra ...string) *serverProcess {
	t.Helper()
	return startProcessWith(t, bin, []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, extra...)
}

// startProcessWith is startProcess for a server whose health checks need dial (TLS, a token).
//
// The ports it picks (freePort) are free when picked, and may be taken by another process before
// kvrouter binds them: the packages' tests run in parallel, on a machine shared with others. A
// process that exits early saying a port is in use is started again on other ports (three tries),
// rather than failing the test for a race outside it.
func startProcessWith(t *testing.T, bin string, dial []grpc.DialOption, extra ...string) *serverProcess {
	t.Helper()
	for attempt := 1; ; attempt++ {
		addr, metrics := freePort(t), freePort(t)
		args := append([]string{"serve", "--listen", addr, "--metrics-listen", metrics, "--shutdown-drain", "0s"}, extra...)
		for i, a := range extra {
			if a == "--metrics-listen" && i+1 < len(extra) {
				metrics = extra[i+1] // the last one given wins
			}
		}
		cmd := exec.Command(bin, args...)
		logs := &lockedBuffer{}
		cmd.Stderr = logs
		p := &serverProcess{addr: addr, metrics: metrics, logs: logs, cmd: cmd}
		exit := runUntilCleanup(t, cmd, logs, &p.killed)
		conn, err := grpc.NewClient("passthrough:///"+addr, dial...)
		if err != nil {
			t.Fatalf("grpc.NewClient() = %v", err)
		}
		err = waitServingErr(healthpb.NewHealthClient(conn), exit, logs, "")
		conn.Close()
		if err == nil {
			return p
		}
		if _, gone := exit.exited(); gone && attempt < 3 && strings.Contains(logs.String(), "address already in use") {
			t.Logf("kvrouter found a port taken (attempt %d); starting it on others", attempt)
			p.killed = true // its end is expected: the cleanup only waits for it
			continue
		}
		t.Fatal(err)
	}
}

// waitServing polls health until every one of services ("" is the whole server) is SERVING; the
// test fails if the process exits first (exited) or defaultTestTimeout passes, with its logs.
func waitServing(t *testing.T, health healthpb.HealthClient, exit *processExit, logs fmt.Stringer, services ...string) {
	t.Helper()
	if err := waitServingErr(health, exit, logs, services...); err != nil {
		t.Fatal(err)
	}
}

// waitServingErr is waitServing, returning what failed.
func waitServingErr(health healthpb.HealthClient, exit *processExit, logs fmt.Stringer, services ...string) error {
	var last string
	var early error
	if !kvtest.Poll(defaultTestTimeout, 50*time.Millisecond, func() bool {
		if err, ok := exit.exited(); ok {
			early = fmt.Errorf("kvrouter exited early: %v\n%s", err, logs)
			return true
		}
		for _, svc := range services {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			resp, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
			cancel()
			if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
				last = fmt.Sprintf("health %q = %v, %v", svc, resp.GetStatus(), err)
				return false
			}
		}
		return true
	}) {
		return fmt.Errorf("kvrouter not SERVING after %v: %s\n%s", defaultTestTimeout, last, logs)
	}
	return early
}

// walkthroughBlocks returns the sh code blocks between the README's walkthrough markers.
func walkthroughBlocks(t *testing.T) []string {
	t.Helper()
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatalf("reading README = %v", err)
	}
	_, rest, ok := strings.Cut(string(readme), "<!-- walkthrough:start -->")
	section, _, ok2 := strings.Cut(rest, "<!-- walkthrough:end -->")
	if !ok || !ok2 {
		t.Fatal("README has no walkthrough markers")
	}
	var blocks []string
	for _, m := range regexp.MustCompile("(?s)```sh\n(.*?)```").FindAllStringSubmatch(section, -1) {
		blocks = append(blocks, m[1])
	}
	if len(blocks) < 4 {
		t.Fatalf("README walkthrough has %d sh blocks, want at least 4", len(blocks))
	}
	return blocks
}

// TestReadmeWalkthrough replays the README's grpcurl walkthrough, unchanged but for the address,
// with the real grpcurl against a real `kvrouter serve`.
func TestReadmeWalkthrough(t *testing.T) {
	grpcurl := grpcurlPath(t)
	addr, logs := startServer(t, buildBinary(t))
	var outputs []string
	for i, block := range walkthroughBlocks(t) {
		script := strings.ReplaceAll(block, "localhost:50051", addr)
		cmd := exec.Command("bash", "-euo", "pipefail", "-c", script)
		cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(grpcurl)+":"+os.Getenv("PATH"))
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("walkthrough block %d failed: %v\n%s\n--- output:\n%s\n--- server log:\n%s", i, err, block, out, logs)
		}
		outputs = append(outputs, string(out))
	}

	for _, svc := range []string{"kvrouter.v1.RouterService", "kvrouter.v1.WorkerService", "kvrouter.v1.AdminService"} {
		if !strings.Contains(outputs[0], svc+"\n") {
			t.Errorf("grpcurl list does not show %s:\n%s", svc, outputs[0])
		}
	}
	if !strings.Contains(outputs[0], `"status": "SERVING"`) {
		t.Errorf("health check is not SERVING:\n%s", outputs[0])
	}
	for i, worker := range []string{"A", "B"} {
		if !strings.Contains(outputs[1+i], `"registered": {`) || !strings.Contains(outputs[1+i], `"eventId": "0"`) {
			t.Errorf("worker %s's Publish was not registered and acked:\n%s", worker, outputs[1+i])
		}
	}

	var route struct {
		Mode   string `json:"mode"`
		Decode struct {
			WorkerID string `json:"workerId"`
			Endpoint string `json:"endpoint"`
		} `json:"decode"`
		Booked      bool `json:"booked"`
		Diagnostics struct {
			PromptTokens string `json:"promptTokens"`
			Decode       struct {
				OverlapBlocks struct {
					Device string `json:"device"`
				} `json:"overlapBlocks"`
			} `json:"decode"`
			Candidates []struct {
				Worker struct {
					WorkerID string `json:"workerId"`
				} `json:"worker"`
				OverlapBlocks struct {
					Device string `json:"device"`
				} `json:"overlapBlocks"`
				Chosen bool `json:"chosen"`
			} `json:"candidates"`
		} `json:"diagnostics"`
	}
	if err := json.Unmarshal([]byte(outputs[3]), &route); err != nil {
		t.Fatalf("Route output is not JSON: %v\n%s", err, outputs[3])
	}
	got := map[string]string{
		"mode": route.Mode, "decode": route.Decode.WorkerID, "endpoint": route.Decode.Endpoint,
		"booked": fmt.Sprint(route.Booked), "prompt_tokens": route.Diagnostics.PromptTokens,
		"decode_overlap": route.Diagnostics.Decode.OverlapBlocks.Device,
	}
	for _, c := range route.Diagnostics.Candidates {
		got["candidate_"+c.Worker.WorkerID] = fmt.Sprintf("%s chosen=%v", c.OverlapBlocks.Device, c.Chosen)
	}
	want := map[string]string{
		"mode": "ROUTE_MODE_AGGREGATED", "decode": "1", "endpoint": "10.0.0.1:8000", "booked": "true",
		"prompt_tokens": "34", "decode_overlap": "8",
		"candidate_1": "8 chosen=true", "candidate_2": "2 chosen=false",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("Route answer mismatch (-want +got):\n%s\n%s", diff, outputs[3])
	}
	if !strings.Contains(outputs[4], `"activeRequests": "1"`) {
		t.Errorf("ListWorkers does not show the booked request:\n%s", outputs[4])
	}
}
