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
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
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
	logs    *lockedBuffer
	cmd     *exec.Cmd
	exited  chan error
	stopped bool
}

// startBridge runs `kvrouter bridge` and waits until /readyz says it is subscribed; at cleanup,
// unless stopped before, it gets SIGTERM and must exit 0.
func startBridge(t *testing.T, bin string, args ...string) *bridgeProcess {
	t.Helper()
	p := &bridgeProcess{metrics: freePort(t), logs: &lockedBuffer{}, exited: make(chan error, 1)}
	p.cmd = exec.Command(bin, append([]string{"bridge", "--metrics-listen", p.metrics, "--log-level", "debug"}, args...)...)
	p.cmd.Stderr = p.logs
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.exited <- p.cmd.Wait() }()
	t.Cleanup(func() {
		if !p.stopped {
			p.stop(t)
		}
	})
	if !kvtest.Poll(defaultTestTimeout, 50*time.Millisecond, func() bool {
		select {
		case err := <-p.exited:
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

// stop sends SIGTERM, after which the bridge must exit 0.
func (p *bridgeProcess) stop(t *testing.T) {
	t.Helper()
	p.stopped = true
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.exited:
		if err != nil {
			t.Errorf("kvrouter bridge exited with %v after SIGTERM, want 0\n%s", err, p.logs)
		}
	case <-time.After(defaultTestTimeout):
		_ = p.cmd.Process.Kill()
		t.Errorf("kvrouter bridge did not stop within %v of SIGTERM", defaultTestTimeout)
	}
}

// kill ends the bridge abruptly, as a crash or an OOM kill would.
func (p *bridgeProcess) kill() {
	p.stopped = true
	_ = p.cmd.Process.Kill()
	<-p.exited
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

// blocks returns what the engine holds: its GPU and CPU blocks.
func (e *pythonEngine) blocks() (device, host uint64) {
	e.t.Helper()
	line, _ := json.Marshal(map[string]any{"op": "blocks"})
	if _, err := fmt.Fprintf(e.stdin, "%s\n", line); err != nil || !e.stdout.Scan() {
		e.t.Fatalf("engine blocks: %v\n%s", err, e.stderr)
	}
	if _, err := fmt.Sscanf(e.stdout.Text(), "blocks %d %d", &device, &host); err != nil {
		e.t.Fatalf("engine blocks answered %q", e.stdout.Text())
	}
	return device, host
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

// startServerAndDial builds kvrouter, runs `kvrouter serve` and dials it; the connection closes at
// cleanup.
func startServerAndDial(t *testing.T) (bin, addr string, conn *grpc.ClientConn) {
	t.Helper()
	bin = buildBinary(t)
	addr, _ = startServer(t, bin)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return bin, addr, conn
}

// TestBridgeFromVLLMFeed drives `kvrouter bridge` with a vLLM-format feed (libzmq and msgpack,
// not this repository's code) into a real `kvrouter serve`, and checks what Route sees: stores and
// removes; a batch dropped on the way recovered from the replay endpoint; without a replay
// endpoint, a gap clears the worker; malformed payloads counted and skipped.
func TestBridgeFromVLLMFeed(t *testing.T) {
	bin, addr, conn := startServerAndDial(t)
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

		// An unknown event: counted and skipped, and the feed goes on.
		engine.do(map[string]any{"op": "raw", "hex": "93cb41daa8dbe02000009191aa426c6f636b4d6f76656400"}) // [ts, [["BlockMoved"]], 0]
		engine.do(map[string]any{"op": "store", "first": 10, "n": 1, "parent": true})
		waitOverlap("m", 1, 11, 11, b)
		if got := b.metric(t, `kvrouter_bridge_events_dropped_total{dp_rank="0",reason="unknown_tag"}`); got != 1 {
			t.Errorf("events dropped as unknown_tag = %v, want 1", got)
		}
		// Not msgpack, live and in the replay buffer: nothing can say what that batch changed, so
		// the worker is cleared (counted as a gap) and the batches after it are applied.
		engine.do(map[string]any{"op": "raw", "hex": "c1c1"})
		engine.do(map[string]any{"op": "store", "first": 0, "n": 2})
		waitOverlap("m", 1, 11, 2, b)
		if got := b.metric(t, `kvrouter_bridge_batches_total{dp_rank="0",result="malformed"}`); got != 2 {
			t.Errorf("malformed batches = %v, want 2 (live, then the replay's copy)", got)
		}
		if got := b.metric(t, `kvrouter_bridge_resets_total{dp_rank="0",reason="gap"}`); got != 1 {
			t.Errorf("resets = %v, want 1 for the unreadable batch", got)
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

// fleetView reads what a `kvrouter serve` holds of one worker, beside the engine stand-in that
// says what the engine holds.
type fleetView struct {
	t      *testing.T
	ctx    context.Context
	admin  kvrouterv1.AdminServiceClient
	router kvrouterv1.RouterServiceClient
	model  string
	id     uint64
}

// blocks returns the device and host blocks the router holds for the worker, and whether it
// lists the worker at all.
func (v *fleetView) blocks() (device, host uint64, listed bool) {
	v.t.Helper()
	resp, err := v.admin.ListWorkers(v.ctx, &kvrouterv1.ListWorkersRequest{Model: v.model})
	if err != nil {
		v.t.Fatalf("ListWorkers() = %v", err)
	}
	for _, w := range resp.GetWorkers() {
		if w.GetWorker().GetWorkerId() == v.id {
			return w.GetCachedBlocks().GetDevice(), w.GetCachedBlocks().GetHost(), true
		}
	}
	return 0, 0, false
}

// waitEqual waits until the router holds, per tier, as many blocks of the worker as the engine
// holds, and the prompt of blocks 0..n-1 finds all n of them on the device.
func (v *fleetView) waitEqual(e *pythonEngine, b *bridgeProcess, n int) {
	v.t.Helper()
	wantDevice, wantHost := e.blocks()
	var device, host, overlap uint64
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
		device, host, _ = v.blocks()
		overlap = v.overlap(n)
		return device == wantDevice && host == wantHost && overlap == uint64(n)
	}) {
		v.t.Fatalf("router holds %d device + %d host blocks, overlap %d of %d; the engine holds %d + %d\n%s",
			device, host, overlap, n, wantDevice, wantHost, b.logs)
	}
}

// overlap is how many device blocks of the prompt of blocks 0..n-1 Route finds on the worker.
func (v *fleetView) overlap(n int) uint64 {
	v.t.Helper()
	tokens := make([]uint32, 4*n)
	for i := range tokens {
		tokens[i] = uint32(i + 1)
	}
	resp, err := v.router.Route(v.ctx, &kvrouterv1.RouteRequest{Model: v.model, TokenIds: tokens, QueryOnly: true})
	if err != nil {
		return 0 // no worker yet
	}
	if resp.GetDecode().GetWorkerId() != v.id {
		return 0
	}
	return resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice()
}

// TestBridgeCPUOffload copies blocks to the CPU as vLLM's OffloadingConnector reports them by
// default (a stored event per block naming its hash only, no tokens), through real `kvrouter bridge`
// and `kvrouter serve` processes: the router holds the copies on the host tier, keyed as on the GPU,
// so that a prompt whose GPU blocks were evicted still finds them there.
func TestBridgeCPUOffload(t *testing.T) {
	bin, addr, conn := startServerAndDial(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout)
	defer cancel()
	v := &fleetView{t: t, ctx: ctx, admin: kvrouterv1.NewAdminServiceClient(conn), router: kvrouterv1.NewRouterServiceClient(conn), model: "offload", id: 31}
	endpoint := "tcp://" + freePort(t)
	engine := startPythonEngine(t, "--endpoint", endpoint, "--style", "maps")
	b := startBridge(t, bin, "--router-addrs", addr, "--engine-endpoint", endpoint, "--worker-id", "31", "--model", "offload",
		"--block-size", "4", "--total-kv-blocks", "100000", "--worker-endpoint", "10.0.0.1:8000")
	waitForFeed(t, engine, b)

	engine.do(map[string]any{"op": "store", "first": 0, "n": 8})
	engine.do(map[string]any{"op": "offload", "first": 0, "n": 8})
	engine.do(map[string]any{"op": "remove", "blocks": []int{4, 5, 6, 7}})
	v.waitEqual(engine, b, 4)
	hostOverlap := func() uint64 {
		tokens := make([]uint32, 4*8)
		for i := range tokens {
			tokens[i] = uint32(i + 1)
		}
		resp, err := v.router.Route(ctx, &kvrouterv1.RouteRequest{Model: "offload", TokenIds: tokens, QueryOnly: true})
		if err != nil {
			t.Fatalf("Route() = %v", err)
		}
		return resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetHost()
	}
	if got := hostOverlap(); got != 4 {
		t.Errorf("host overlap of the 8-block prompt = %d, want 4 (blocks 4-7, evicted from the GPU)", got)
	}
	engine.do(map[string]any{"op": "remove", "blocks": []int{6, 7}, "medium": "CPU"})
	v.waitEqual(engine, b, 4)
	if got := hostOverlap(); got != 2 {
		t.Errorf("host overlap after the CPU evicted blocks 6 and 7 = %d, want 2", got)
	}
	if got := b.metric(t, `kvrouter_bridge_blocks_dropped_total{dp_rank="0",reason="unknown_block"}`); got != 0 {
		t.Errorf("blocks dropped as unknown_block = %v, want 0", got)
	}
}

// TestBridgeRecovery drives real `kvrouter bridge` and `kvrouter serve` processes with the vLLM
// stand-in through what breaks a bridge in production, and checks after each that the router
// holds what the engine holds: a payload damaged on the way, a bridge restarted beside an idle
// engine, a bridge killed and restarted with its checkpoint while a long-running engine goes on
// (its replay buffer no longer starts at 0), and the same after the buffer moved past the

// TestBridgeKeyedRequests stores, through `kvrouter bridge` from a vLLM-format feed, the blocks of
// a prompt with an image, of a LoRA request and of a salted request, each keyed by the engine's extra
// keys as vLLM writes them, and checks that Route finds them only when it names the same image, LoRA
// adapter or cache salt: the bridge's keys and Route's agree.
func TestBridgeKeyedRequests(t *testing.T) {
	bin, addr, conn := startServerAndDial(t)
	router := kvrouterv1.NewRouterServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 2*defaultTestTimeout)
	defer cancel()
	endpoint := "tcp://" + freePort(t)
	engine := startPythonEngine(t, "--endpoint", endpoint, "--style", "maps")
	b := startBridge(t, bin, "--router-addrs", addr, "--engine-endpoint", endpoint, "--worker-id", "1", "--model", "m",
		"--block-size", "4", "--total-kv-blocks", "100000", "--worker-endpoint", "10.0.0.1:8000")
	waitForFeed(t, engine, b)
	// overlap is how many of the test prompt's first n blocks Route finds, for a request like r.
	overlap := func(n int, r *kvrouterv1.RouteRequest) uint64 {
		t.Helper()
		r.Model, r.QueryOnly, r.TokenIds = "m", true, make([]uint32, 4*n)
		for i := range r.TokenIds {
			r.TokenIds[i] = uint32(i + 1)
		}
		resp, err := router.Route(ctx, r)
		if err != nil {
			t.Fatalf("Route() = %v", err)
		}
		return resp.GetDiagnostics().GetDecode().GetOverlapBlocks().GetDevice()
	}
	waitOverlap := func(n int, r *kvrouterv1.RouteRequest, want uint64) {
		t.Helper()
		var got uint64
		if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool { got = overlap(n, r); return got == want }) {
			t.Fatalf("Route overlap of %d blocks = %d, want %d\n%s", n, got, want, b.logs)
		}
	}
	image := func(id string, start, end uint32) []*kvrouterv1.MultimodalObject {
		return []*kvrouterv1.MultimodalObject{{MmHash: blockhash.MultimodalHash(id), Start: start, End: end}}
	}
	const cat = "9b4c0e1f2a3d5b6c7d8e9fa0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0" // vLLM's digest of an image

	t.Run("image", func(t *testing.T) {
		// The image fills prompt tokens [5, 14): blocks 1, 2 and 3 hold it; block 0 is plain text.
		engine.do(map[string]any{"op": "store", "first": 0, "n": 6, "images": []map[string]any{{"id": cat, "start": 5, "end": 14}}})
		waitOverlap(6, &kvrouterv1.RouteRequest{MultimodalObjects: image(cat, 5, 14)}, 6)
		if got := overlap(6, &kvrouterv1.RouteRequest{MultimodalObjects: image("another-image.png", 5, 14)}); got != 1 {
			t.Errorf("another image found %d blocks, want 1 (the text before the image)", got)
		}
		if got := overlap(6, &kvrouterv1.RouteRequest{}); got != 1 {
			t.Errorf("the prompt without its image found %d blocks, want 1", got)
		}
	})
	t.Run("LoRA", func(t *testing.T) {
		engine.do(map[string]any{"op": "store", "first": 0, "n": 6, "lora": "sql-lora"})
		waitOverlap(6, &kvrouterv1.RouteRequest{LoraName: "sql-lora"}, 6)
		if got := overlap(6, &kvrouterv1.RouteRequest{LoraName: "other-lora"}); got != 0 {
			t.Errorf("another adapter found %d blocks, want 0", got)
		}
	})
	t.Run("cache salt", func(t *testing.T) {
		// vLLM names the salt on the prompt's first block only; the blocks stored after it, in this
		// event and the next, are the salted request's too.
		engine.do(map[string]any{"op": "store", "first": 0, "n": 4, "cache_salt": "tenant-1"})
		engine.do(map[string]any{"op": "store", "first": 4, "n": 2, "parent": true, "cache_salt": "tenant-1"})
		waitOverlap(6, &kvrouterv1.RouteRequest{CacheNamespace: "tenant-1"}, 6)
		if got := overlap(6, &kvrouterv1.RouteRequest{CacheNamespace: "tenant-2"}); got != 0 {
			t.Errorf("another tenant found %d blocks, want 0", got)
		}
		if got := overlap(6, &kvrouterv1.RouteRequest{}); got != 1 {
			t.Errorf("an unsalted request found %d blocks, want 1 (the image prompt's text block)", got)
		}
	})
	if got := b.metric(t, `kvrouter_bridge_blocks_dropped_total{dp_rank="0",reason="extra_keys"}`); got != 0 {
		t.Errorf("blocks dropped for their extra keys = %v, want 0\n%s", got, b.logs)
	}
}

// checkpoint, when the worker is cleared and rebuilt from what the buffer holds.
func TestBridgeRecovery(t *testing.T) {
	bin, addr, conn := startServerAndDial(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*defaultTestTimeout)
	defer cancel()
	view := func(model string, id uint64) *fleetView {
		return &fleetView{t: t, ctx: ctx, admin: kvrouterv1.NewAdminServiceClient(conn), router: kvrouterv1.NewRouterServiceClient(conn), model: model, id: id}
	}
	bridgeArgs := func(model string, id int, endpoint, replay string, extra ...string) []string {
		return append([]string{"--router-addrs", addr, "--engine-endpoint", endpoint, "--engine-replay-endpoint", replay,
			"--worker-id", strconv.Itoa(id), "--model", model, "--block-size", "4", "--total-kv-blocks", "100000",
			"--worker-endpoint", "10.0.0.1:8000", "--replay-timeout", "5s"}, extra...)
	}
	// storeChain stores blocks from..to-1 of the test prompt, per blocks in a batch.
	storeChain := func(e *pythonEngine, from, to, per int) {
		for first := from; first < to; first += per {
			e.do(map[string]any{"op": "store", "first": first, "n": min(per, to-first), "parent": first > 0})
		}
	}

	t.Run("a damaged payload is fetched again from the replay buffer", func(t *testing.T) {
		endpoint, replay := "tcp://"+freePort(t), "tcp://"+freePort(t)
		engine := startPythonEngine(t, "--endpoint", endpoint, "--replay-endpoint", replay)
		b := startBridge(t, bin, bridgeArgs("damaged", 21, endpoint, replay)...)
		waitForFeed(t, engine, b)
		v := view("damaged", 21)
		engine.do(map[string]any{"op": "store", "first": 0, "n": 2})
		engine.do(map[string]any{"op": "store", "first": 0, "n": 2, "medium": "CPU", "garbled": true})
		engine.do(map[string]any{"op": "store", "first": 2, "n": 1, "parent": true})
		v.waitEqual(engine, b, 3)
		if _, host, _ := v.blocks(); host != 2 {
			t.Errorf("host blocks = %d, want 2 (the damaged batch's, from the replay)", host)
		}
		if got := b.metric(t, `kvrouter_bridge_resets_total{dp_rank="0",reason="gap"}`); got != 0 {
			t.Errorf("resets = %v, want 0: the replay buffer had the damaged batch whole", got)
		}
		if got := b.metric(t, `kvrouter_bridge_batches_total{dp_rank="0",result="malformed"}`); got != 1 {
			t.Errorf("malformed batches = %v, want 1", got)
		}
	})

	t.Run("a bridge restarted beside an idle engine rebuilds at once", func(t *testing.T) {
		endpoint, replay := "tcp://"+freePort(t), "tcp://"+freePort(t)
		engine := startPythonEngine(t, "--endpoint", endpoint, "--replay-endpoint", replay)
		// The engine stores before any bridge runs: the first bridge, too, gets it from the replay.
		storeChain(engine, 0, 8, 4)
		first := startBridge(t, bin, bridgeArgs("idle", 22, endpoint, replay)...)
		v := view("idle", 22)
		v.waitEqual(engine, first, 8)
		first.stop(t)
		// No state directory: the new bridge registers afresh, so the router drops the worker's
		// blocks, and the engine publishes nothing from here on.
		second := startBridge(t, bin, bridgeArgs("idle", 22, endpoint, replay)...)
		v.waitEqual(engine, second, 8)
		if got := second.metric(t, `kvrouter_bridge_replays_total{dp_rank="0",result="complete"}`); got != 1 {
			t.Errorf("complete replays = %v, want 1", got)
		}
	})

	t.Run("a killed bridge resumes from its checkpoint on a long-running engine", func(t *testing.T) {
		endpoint, replay := "tcp://"+freePort(t), "tcp://"+freePort(t)
		engine := startPythonEngine(t, "--endpoint", endpoint, "--replay-endpoint", replay, "--buffer-steps", "8")
		state := t.TempDir()
		args := bridgeArgs("resumed", 23, endpoint, replay, "--state-dir", state)
		first := startBridge(t, bin, args...)
		v := view("resumed", 23)
		storeChain(engine, 0, 200, 4) // 50 batches: the buffer holds the last 8
		v.waitEqual(engine, first, 200)
		waitCheckpoint(t, state, engine.do(map[string]any{"op": "store", "first": 0, "n": 1}), first)
		first.kill()

		// While no bridge runs, the engine goes on: stores, an eviction, a CPU copy.
		engine.do(map[string]any{"op": "store", "first": 200, "n": 4, "parent": true})
		engine.do(map[string]any{"op": "remove", "blocks": []int{202, 203}})
		engine.do(map[string]any{"op": "store", "first": 0, "n": 3, "medium": "CPU"})
		second := startBridge(t, bin, args...)
		v.waitEqual(engine, second, 202)
		if got := second.metric(t, `kvrouter_bridge_resets_total{dp_rank="0",reason="reconnect"}`) +
			second.metric(t, `kvrouter_bridge_resets_total{dp_rank="0",reason="router_state_lost"}`); got != 0 {
			t.Errorf("resets = %v, want 0: the router held the worker and the buffer held what changed\n%s", got, second.logs)
		}

		// Past the buffer: more batches than it keeps while the bridge is down. The bridge cannot
		// know what the lost ones removed, so it clears the worker and rebuilds it from the
		// buffer: blocks stored before the buffer's first batch stay unknown (the router holds
		// less than the engine, never more) until the engine stores them again, and so do the
		// buffer's blocks whose parent is one of them (the router drops a block of an unknown parent).
		waitCheckpoint(t, state, engine.do(map[string]any{"op": "store", "first": 0, "n": 1}), second)
		second.kill()
		for first := 300; first < 340; first += 4 { // 10 batches, each a chain of its own
			engine.do(map[string]any{"op": "store", "first": first, "n": 4})
		}
		third := startBridge(t, bin, args...)
		if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
			return third.metric(t, `kvrouter_bridge_resets_total{dp_rank="0",reason="reconnect"}`) == 1
		}) {
			t.Fatalf("the bridge did not clear the worker\n%s", third.logs)
		}
		wantDevice, _ := engine.blocks()
		var device uint64
		if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool { device, _, _ = v.blocks(); return device == 32 }) {
			t.Fatalf("router holds %d device blocks, want 32 (the buffer's 8 batches of 4; the engine holds %d)\n%s", device, wantDevice, third.logs)
		}
		storeChain(engine, 0, 202, 101) // the engine stores the prefix again
		if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool { return v.overlap(202) == 202 }) {
			t.Fatalf("Route overlap = %d after the engine stored the prefix again, want 202", v.overlap(202))
		}
	})
}

// waitCheckpoint waits until the bridge's checkpoint names engine batch seq: the router acked it
// and the bridge wrote it down.
func waitCheckpoint(t *testing.T, dir string, seq int, b *bridgeProcess) {
	t.Helper()
	path := filepath.Join(dir, "bridge-worker-"+b.arg("--worker-id")+"-dp-0.json")
	var got struct{ Seq int }
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
		data, err := os.ReadFile(path)
		return err == nil && json.Unmarshal(data, &got) == nil && got.Seq == seq
	}) {
		t.Fatalf("checkpoint %s at seq %d, want %d\n%s", path, got.Seq, seq, b.logs)
	}
}

// arg returns the value given to flag on the bridge's command line.
func (p *bridgeProcess) arg(flag string) string {
	for i, a := range p.cmd.Args[:len(p.cmd.Args)-1] {
		if a == flag {
			return p.cmd.Args[i+1]
		}
	}
	return ""
}

// signal sends sig to the engine process: SIGSTOP hangs it (the TCP connections stay up, nothing
// answers), SIGCONT resumes it.
func (e *pythonEngine) signal(sig syscall.Signal) {
	e.t.Helper()
	if err := e.cmd.Process.Signal(sig); err != nil {
		e.t.Fatalf("signal %v: %v", sig, err)
	}
}

// TestBridgeEngineDown: an engine that hangs or dies must stop getting requests. The bridge checks
// the engine's health endpoint and replay endpoint; when they fail for --engine-down-after, the
// worker leaves the router (removed at once, not after the grace period), and when the engine is
// back, it registers afresh and the router again holds what the engine holds.
func TestBridgeEngineDown(t *testing.T) {
	bin, addr, conn := startServerAndDial(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*defaultTestTimeout)
	defer cancel()
	v := &fleetView{t: t, ctx: ctx, admin: kvrouterv1.NewAdminServiceClient(conn), router: kvrouterv1.NewRouterServiceClient(conn), model: "down", id: 31}
	endpoint, replay := "tcp://"+freePort(t), "tcp://"+freePort(t)
	_, healthPort, _ := strings.Cut(freePort(t), ":")
	engineArgs := []string{"--endpoint", endpoint, "--replay-endpoint", replay, "--health-port", healthPort}
	engine := startPythonEngine(t, engineArgs...)
	const downAfter = 2 * time.Second
	b := startBridge(t, bin, "--router-addrs", addr, "--engine-endpoint", endpoint, "--engine-replay-endpoint", replay,
		"--engine-health-url", "http://127.0.0.1:"+healthPort+"/health", "--engine-check-interval", "250ms", "--engine-down-after", downAfter.String(),
		"--worker-id", "31", "--model", "down", "--block-size", "4", "--total-kv-blocks", "100000", "--worker-endpoint", "10.0.0.1:8000", "--replay-timeout", "5s")
	engine.do(map[string]any{"op": "store", "first": 0, "n": 4})
	v.waitEqual(engine, b, 4)

	// waitGone waits until the router no longer lists the worker and Route finds no worker for
	// its model, and says how long that took.
	waitGone := func(what string, since time.Time) {
		t.Helper()
		if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
			_, _, listed := v.blocks()
			return !listed
		}) {
			t.Fatalf("%s: the router still lists the worker after %v\n%s", what, defaultTestTimeout, b.logs)
		}
		t.Logf("%s: the worker left the router %v after (--engine-down-after %v)", what, time.Since(since).Round(10*time.Millisecond), downAfter)
		_, err := v.router.Route(ctx, &kvrouterv1.RouteRequest{Model: "down", TokenIds: []uint32{1, 2, 3, 4}, QueryOnly: true})
		if status.Code(err) != codes.NotFound {
			t.Errorf("%s: Route() = %v, want NOT_FOUND: no worker may get the request", what, err)
		}
	}

	hung := time.Now()
	engine.signal(syscall.SIGSTOP)
	waitGone("engine hung", hung)
	if got := b.metric(t, `kvrouter_bridge_leaves_total{dp_rank="0"}`); got != 1 {
		t.Errorf("leaves = %v, want 1", got)
	}
	engine.signal(syscall.SIGCONT)
	v.waitEqual(engine, b, 4) // registered afresh, rebuilt from the replay buffer

	killed := time.Now()
	engine.kill()
	waitGone("engine killed", killed)
	engine = startPythonEngine(t, engineArgs...) // a new process: an empty cache
	engine.do(map[string]any{"op": "store", "first": 0, "n": 2})
	v.waitEqual(engine, b, 2)
}
