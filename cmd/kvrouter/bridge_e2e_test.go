package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// pythonEngine is testdata/vllm_publisher.py: vLLM's KV event feed written by libzmq and msgpack
// from Debian's packages, driven one command at a time.
type pythonEngine struct {
	t      *testing.T
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout *bufio.Scanner
	stderr *bytes.Buffer
}

func startPythonEngine(t *testing.T, args ...string) *pythonEngine {
	t.Helper()
	if err := exec.Command("/usr/bin/python3", "-c", "import zmq, msgpack").Run(); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("python3-zmq and python3-msgpack are missing: scripts/test.sh installs them; CI must run the bridge test")
		}
		t.Skip("python3-zmq or python3-msgpack missing; run scripts/test.sh (it installs them)")
	}
	cmd := exec.Command("/usr/bin/python3", append([]string{"testdata/vllm_publisher.py"}, args...)...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	e := &pythonEngine{t: t, cmd: cmd, stdin: stdin, stdout: bufio.NewScanner(stdout), stderr: &bytes.Buffer{}}
	cmd.Stderr = e.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		e.kill()
	})
	if !e.stdout.Scan() || e.stdout.Text() != "ready" {
		t.Fatalf("the engine stand-in did not start: %s", e.stderr)
	}
	return e
}

// kill ends the engine process abruptly, as a crash would.
func (e *pythonEngine) kill() {
	_ = e.cmd.Process.Kill()
	_ = e.cmd.Wait()
}

// do runs one command (see vllm_publisher.py) and returns the sequence number it used.
func (e *pythonEngine) do(cmd map[string]any) int {
	e.t.Helper()
	line, _ := json.Marshal(cmd)
	if _, err := fmt.Fprintf(e.stdin, "%s\n", line); err != nil {
		e.t.Fatalf("engine %v: %v\n%s", cmd, err, e.stderr)
	}
	if !e.stdout.Scan() {
		e.t.Fatalf("engine %v: no answer\n%s", cmd, e.stderr)
	}
	seq, err := strconv.Atoi(strings.TrimPrefix(e.stdout.Text(), "ok "))
	if err != nil {
		e.t.Fatalf("engine %v answered %q", cmd, e.stdout.Text())
	}
	return seq
}

// bridgeProcess is a running `kvrouter bridge`.
type bridgeProcess struct {
	metrics string
	logs    *bytes.Buffer
}

// startBridge runs `kvrouter bridge` and waits until /readyz says it is subscribed; at cleanup it
// gets SIGTERM and must exit 0.
func startBridge(t *testing.T, bin string, args ...string) *bridgeProcess {
	t.Helper()
	p := &bridgeProcess{metrics: freePort(t), logs: &bytes.Buffer{}}
	cmd := exec.Command(bin, append([]string{"bridge", "--metrics-listen", p.metrics, "--log-level", "debug"}, args...)...)
	cmd.Stderr = p.logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("kvrouter bridge exited with %v after SIGTERM, want 0\n%s", err, p.logs)
			}
		case <-time.After(defaultTestTimeout):
			_ = cmd.Process.Kill()
			t.Errorf("kvrouter bridge did not stop within %v of SIGTERM", defaultTestTimeout)
		}
	})
	if !kvtest.Poll(defaultTestTimeout, 50*time.Millisecond, func() bool {
		select {
		case err := <-exited:
			t.Fatalf("kvrouter bridge exited early: %v\n%s", err, p.logs)
		default:
		}
		resp, err := http.Get("http://" + p.metrics + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}) {
		t.Fatalf("kvrouter bridge not ready after %v\n%s", defaultTestTimeout, p.logs)
	}
	return p
}

// metric returns the value of one series of the bridge's /metrics ("name{labels}"), 0 when absent.
func (p *bridgeProcess) metric(t *testing.T, series string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + p.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return 0
}

// waitForFeed pings the engine until the bridge counts a batch: a SUB socket misses what was
// published before its subscription reached the engine.
func waitForFeed(t *testing.T, e *pythonEngine, b *bridgeProcess) {
	t.Helper()
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
		e.do(map[string]any{"op": "ping"})
		return b.metric(t, `kvrouter_bridge_batches_total{dp_rank="0",result="ok"}`) > 0
	}) {
		t.Fatalf("the bridge received nothing from the engine\n%s\nengine: %s", b.logs, e.stderr)
	}
}

// TestBridgeFromVLLMFeed drives `kvrouter bridge` with a vLLM-format feed (libzmq and msgpack,
// not this repository's code) into a real `kvrouter serve`, and checks what Route sees: stores and
// removes; a batch dropped on the way recovered from the replay endpoint; without a replay
// endpoint, a gap clears the worker; malformed payloads counted and skipped.
func TestBridgeFromVLLMFeed(t *testing.T) {
	bin := buildBinary(t)
	addr, _ := startServer(t, bin)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	router := kvrouterv1.NewRouterServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout)
	defer cancel()
	// overlap is how many blocks of the test prompt (blocks 0..n-1) Route finds on worker id.
	overlap := func(model string, id uint64, n int) uint64 {
		tokens := make([]uint32, 4*n)
		for i := range tokens {
			tokens[i] = uint32(i + 1)
		}
		resp, err := router.Route(ctx, &kvrouterv1.RouteRequest{Model: model, TokenIds: tokens, QueryOnly: true})
		if err != nil {
			t.Fatalf("Route() = %v", err)
		}
		if resp.GetDecode().GetWorkerId() != id {
			return 0
		}
		return resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice()
	}
	waitOverlap := func(model string, id uint64, n int, want uint64, b *bridgeProcess) {
		t.Helper()
		var got uint64
		if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool { got = overlap(model, id, n); return got == want }) {
			t.Fatalf("Route overlap of %d blocks = %d, want %d\n%s", n, got, want, b.logs)
		}
	}
	bridgeArgs := func(model string, id int, endpoint, replay string) []string {
		return []string{"--router-addrs", addr, "--engine-endpoint", endpoint, "--engine-replay-endpoint", replay,
			"--worker-id", strconv.Itoa(id), "--model", model, "--block-size", "4", "--total-kv-blocks", "100000",
			"--worker-endpoint", "10.0.0.1:8000", "--replay-timeout", "5s"}
	}

	t.Run("with replay, positional events", func(t *testing.T) {
		endpoint, replay := "tcp://"+freePort(t), "tcp://"+freePort(t)
		engine := startPythonEngine(t, "--endpoint", endpoint, "--replay-endpoint", replay, "--style", "arrays")
		b := startBridge(t, bin, bridgeArgs("m", 1, endpoint, replay)...)
		waitForFeed(t, engine, b)

		engine.do(map[string]any{"op": "store", "first": 0, "n": 4})
		engine.do(map[string]any{"op": "store", "first": 4, "n": 4, "parent": true})
		waitOverlap("m", 1, 8, 8, b)
		engine.do(map[string]any{"op": "remove", "blocks": []int{6, 7}})
		waitOverlap("m", 1, 8, 6, b)

		// Dropped on the way: the next batch shows the gap, the replay endpoint fills it.
		engine.do(map[string]any{"op": "store", "first": 6, "n": 2, "parent": true, "lost": true})
		engine.do(map[string]any{"op": "store", "first": 8, "n": 2, "parent": true})
		waitOverlap("m", 1, 10, 10, b)
		if got := b.metric(t, `kvrouter_bridge_replays_total{dp_rank="0",result="complete"}`); got < 1 {
			t.Errorf("complete replays = %v, want >= 1", got)
		}
		if got := b.metric(t, `kvrouter_bridge_resets_total{dp_rank="0",reason="gap"}`); got != 0 {
			t.Errorf("resets = %v, want 0: the replay had every batch", got)
		}

		// Not msgpack, then an unknown event: counted, skipped, and the feed goes on.
		engine.do(map[string]any{"op": "raw", "hex": "c1c1"})
		engine.do(map[string]any{"op": "raw", "hex": "93cb41daa8dbe02000009191aa426c6f636b4d6f76656400"}) // [ts, [["BlockMoved"]], 0]
		engine.do(map[string]any{"op": "store", "first": 10, "n": 1, "parent": true})
		waitOverlap("m", 1, 11, 11, b)
		if got := b.metric(t, `kvrouter_bridge_batches_total{dp_rank="0",result="malformed"}`); got != 1 {
			t.Errorf("malformed batches = %v, want 1", got)
		}
		if got := b.metric(t, `kvrouter_bridge_events_dropped_total{dp_rank="0",reason="unknown_tag"}`); got != 1 {
			t.Errorf("events dropped as unknown_tag = %v, want 1", got)
		}
	})

	t.Run("without replay, map events", func(t *testing.T) {
		endpoint := "tcp://" + freePort(t)
		engine := startPythonEngine(t, "--endpoint", endpoint, "--style", "maps")
		b := startBridge(t, bin, bridgeArgs("m2", 2, endpoint, "")...)
		waitForFeed(t, engine, b)

		engine.do(map[string]any{"op": "store", "first": 0, "n": 4})
		waitOverlap("m2", 2, 4, 4, b)
		// A lost removal: the router would keep block 3, which the engine evicted. The bridge
		// cannot know what was lost, so it clears the worker; the next store is applied after.
		engine.do(map[string]any{"op": "remove", "blocks": []int{3}, "lost": true})
		engine.do(map[string]any{"op": "store", "first": 0, "n": 2})
		waitOverlap("m2", 2, 4, 2, b)
		if got := b.metric(t, `kvrouter_bridge_resets_total{dp_rank="0",reason="gap"}`); got != 1 {
			t.Errorf("resets for a gap = %v, want 1", got)
		}
		// The engine process is killed and a new one starts on the same endpoint, its sequence
		// back at 0 (and past the old one's by the time the bridge hears it): the bridge
		// resubscribes and clears the worker.
		engine.kill()
		engine = startPythonEngine(t, "--endpoint", endpoint, "--style", "maps")
		if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
			engine.do(map[string]any{"op": "ping"})
			return b.metric(t, `kvrouter_bridge_resets_total{dp_rank="0",reason="reconnect"}`) == 1
		}) {
			t.Fatalf("the bridge did not clear the worker after the engine restarted\n%s", b.logs)
		}
		engine.do(map[string]any{"op": "store", "first": 0, "n": 1})
		waitOverlap("m2", 2, 4, 1, b)
	})
}
