package main

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/server"
)

// The abuse suite (issue 27): a real `kvrouter serve`, set up as docs/security.md says (TLS, a
// credentials file, a health port), and a well-behaved frontend routing on it, query-only, one call
// after another. Each attack runs in a process of its own (this test binary again, as
// TestAbuseAttacker), so that it competes with the router for the machine as a remote attacker's
// traffic would, not with the frontend for this process's goroutines. For each attack the
// frontend's Route p99 is measured just before it and while it runs, in one round, or up to three
// while none is within the bound or the attacker has not yet been answered as it must; the lowest
// round's ratio must be within abuseP99Ratio (one round can always meet a noisy neighbour on a
// shared two-core machine, where the attacker's own CPU competes with the router too), the router's peak memory must grow less than abuseRSSBound over
// the whole suite, and the attacker must have been answered with the status that names what
// stopped it.

const (
	abuseP99Ratio = 3
	// abuseRSSBound is 64 MiB for all the attacks, plus what the bookings the suite's
	// max_booked_blocks_per_credential admits may take at the process's peak: about 128 B a booked
	// block key (45 B live, in its booking and the load's table, twice that with the garbage
	// collector's headroom, and the 1M-token requests being decoded).
	abuseRSSBound = 64<<20 + abuseMaxBookedPerCredential*128
	// abuseLogBound bounds what the router logs over the whole suite, at the default level (info).
	abuseLogBound  = 1 << 20
	abuseWindow    = time.Second
	abuseAttackEnv = "KVROUTER_ABUSE_ATTACK"
	// abuseReady is the line the attacker prints once it is about to attack.
	abuseReady = "attacking"
)

// abuseReport is what the attacker process prints when it stops: the status codes its calls got
// (or "conn_closed" for a connection the router closed), counted.
type abuseReport struct {
	Codes map[string]int `json:"codes"`
}

// attacks the suite runs, and the answers that show the router stopped each.
var abuseAttacks = []struct {
	name string
	want []string // at least one of these answers
}{
	{"gzip Routes without credentials", []string{codes.Unauthenticated.String()}},
	{"rapid reset without credentials", []string{codes.Unauthenticated.String(), "conn_closed"}},
	{"streams on the health port", []string{"refused_stream"}},
	{"10,000 ranks of one worker", []string{codes.ResourceExhausted.String()}},
	{"1M-token bookings of one frontend credential", []string{codes.ResourceExhausted.String()}},
	{"models from a worker credential without models", []string{codes.ResourceExhausted.String()}},
	{"hellos with a 1 MB endpoint", []string{codes.InvalidArgument.String()}},
	{"64 KiB headers without credentials", []string{"rst_FRAME_SIZE_ERROR", "conn_closed"}},
	{"idle connections past the cap", []string{"conn_closed"}},
}

// abuseCredentials are the attackers' credentials beside testCredentials: a frontend of its own (so
// that its bookings count against it, not the well-behaved frontend) and a worker credential scoped
// to worker ids but not to models.
const abuseCredentials = `  - name: frontend-b
    roles: [frontend]
    token_sha256: {token:frontend-b}
  - name: worker-9
    roles: [worker]
    token_sha256: {token:worker-9}
    worker_ids: [9]
`

// abuseMaxConnections is the suite's max_connections: low enough that the idle connections reach
// it within abuseRSSBound (at the default 4,096, held connections take up to about 256 MiB, which
// the cap bounds as docs/security.md says).
const abuseMaxConnections = 256

// abuseMaxModels is the suite's max_models: low enough that the models attack reaches it within its
// first second even on a busy machine (it made 922 of the default 1,000 in two rounds under CI's
// load, and was never refused).
const abuseMaxModels = 200

// abuseMaxBookedPerCredential is the suite's max_booked_blocks_per_credential: two 1M-token
// bookings of block size 4 (262,144 block keys each), so that what they hold fits within
// abuseRSSBound (the default admits 32).
const abuseMaxBookedPerCredential = 1 << 19

// TestAbuseSuite runs each attack of abuseAttacks against one router, as the file's comment says.
func TestAbuseSuite(t *testing.T) {
	if testing.Short() {
		t.Skip("the abuse suite runs attacks for about a minute")
	}
	healthAddr := freePort(t)
	r := startSecureRouter(t, "--log-level", "info", "--health-listen", healthAddr, "--max-connections", strconv.Itoa(abuseMaxConnections),
		"--max-models", strconv.Itoa(abuseMaxModels),
		"--max-booked-blocks-per-credential", strconv.Itoa(abuseMaxBookedPerCredential))
	for _, name := range []string{"frontend-b", "worker-9"} {
		r.tokens[name] = newToken(t)
	}
	r.writeCredentials(testCredentials + abuseCredentials)
	r.serveLlama()
	pid := r.proc.cmd.Process.Pid
	before := peakRSS(t, pid)
	router := kvrouterv1.NewRouterServiceClient(r.dial(nil))
	tokens := make([]uint32, 2048)
	for i := range tokens {
		tokens[i] = uint32(i%50_000 + 1)
	}
	p99 := func(d time.Duration) (time.Duration, int) {
		var lat []time.Duration
		for end := time.Now().Add(d); time.Now().Before(end); {
			ctx, cancel := r.as("frontend")
			start := time.Now()
			_, err := router.Route(ctx, &kvrouterv1.RouteRequest{Model: "llama", TokenIds: tokens, QueryOnly: true})
			cancel()
			if err != nil {
				t.Errorf("the frontend's Route: %v", err)
				return 0, 0
			}
			lat = append(lat, time.Since(start))
		}
		slices.Sort(lat)
		return lat[len(lat)*99/100], len(lat)
	}
	env := []string{"KVROUTER_ABUSE_ADDR=" + r.proc.addr, "KVROUTER_ABUSE_HEALTH=" + healthAddr, "KVROUTER_ABUSE_CA=" + r.caFile,
		"KVROUTER_ABUSE_WORKER_TOKEN=" + r.tokens["worker-7"], "KVROUTER_ABUSE_FRONTEND_TOKEN=" + r.tokens["frontend-b"],
		"KVROUTER_ABUSE_ANY_MODEL_TOKEN=" + r.tokens["worker-9"]}
	// The credentials file is reloaded every 50 ms: the attackers' credentials are in force once
	// frontend-b is.
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
		ctx, cancel := r.as("frontend-b")
		defer cancel()
		_, err := router.Route(ctx, &kvrouterv1.RouteRequest{Model: "llama", TokenIds: tokens[:4], QueryOnly: true})
		return err == nil
	}) {
		t.Fatal("the attackers' credentials never took effect")
	}
	for _, a := range abuseAttacks {
		t.Run(a.name, func(t *testing.T) {
			best, answers, lastOut := 0.0, map[string]int{}, ""
			var notes []string
			for round := range 3 {
				if round > 0 && best <= abuseP99Ratio && slices.ContainsFunc(a.want, func(c string) bool { return answers[c] > 0 }) {
					break // a round within the bound, and the attacker answered: enough
				}
				base, n0 := p99(abuseWindow)
				attacker, out := startAttacker(t, env, a.name)
				time.Sleep(200 * time.Millisecond) // the attack under way
				under, n1 := p99(abuseWindow)
				stopAttacker(attacker)
				lastOut = out.String()
				var rep abuseReport
				if i := strings.LastIndex(out.String(), `{"codes"`); i >= 0 {
					_ = json.NewDecoder(strings.NewReader(out.String()[i:])).Decode(&rep)
				}
				for c, n := range rep.Codes {
					answers[c] += n
				}
				ratio := float64(under) / float64(base)
				if round == 0 || ratio < best {
					best = ratio
				}
				notes = append(notes, fmt.Sprintf("round %d: p99 %v (%d calls) before, %v (%d calls) under attack", round+1, base, n0, under, n1))
			}
			t.Logf("%s; attacker answered %v; the router's peak memory %.1f MiB over the start", notes, answers, float64(peakRSS(t, pid)-before)/(1<<20))
			if best > abuseP99Ratio {
				t.Errorf("the frontend's Route p99 grew %.1fx under the attack (the best round), more than %dx: %s", best, abuseP99Ratio, notes)
			}
			if !slices.ContainsFunc(a.want, func(c string) bool { return answers[c] > 0 }) {
				t.Errorf("the attacker got %v, want one of %v; its output:\n%s", answers, a.want, lastOut)
			}
		})
	}
	if grew := peakRSS(t, pid) - before; grew > abuseRSSBound {
		t.Errorf("the router's peak memory grew %d MiB over the attacks, more than %d MiB", grew>>20, abuseRSSBound>>20)
	} else {
		t.Logf("the router's peak memory grew %.1f MiB over the attacks (bound %d MiB)", float64(grew)/(1<<20), abuseRSSBound>>20)
	}

	// Refusals are logged at most once a second, with a count: before, every refused call was
	// logged (20 MB in 5 s), so a flood of them flooded the log too.
	if n := len(r.proc.logs.String()); n > abuseLogBound {
		t.Errorf("the router logged %d KiB over the attacks, more than %d KiB", n>>10, abuseLogBound>>10)
	} else {
		t.Logf("the router logged %.1f KiB over the attacks (bound %d KiB)", float64(n)/1024, abuseLogBound>>10)
	}

	// Shutdown under attack: with compressed Routes flooding in, health streams held open and the
	// frontend routing, SIGTERM must stop the router within shutdown_drain and shutdown_timeout
	// (the harness sets the drain to 0; the timeout is the default 15 s), which end whatever streams
	// are still open. Before, shutdown was reported to overrun its timeout under load.
	t.Run("shutdown under attack", func(t *testing.T) {
		for _, name := range []string{"gzip Routes without credentials", "streams on the health port"} {
			attacker, _ := startAttacker(t, env, name)
			defer stopAttacker(attacker)
		}
		stopRouting := make(chan struct{})
		routing := make(chan struct{})
		go func() {
			defer close(routing)
			for {
				select {
				case <-stopRouting:
					return
				default:
				}
				ctx, cancel := r.as("frontend")
				_, _ = router.Route(ctx, &kvrouterv1.RouteRequest{Model: "llama", TokenIds: tokens, QueryOnly: true})
				cancel()
			}
		}()
		defer func() { close(stopRouting); <-routing }()
		time.Sleep(500 * time.Millisecond) // the attacks under way
		const drain, timeout = 0, 15 * time.Second
		start := time.Now()
		if err := r.proc.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if !kvtest.Poll(drain+timeout+defaultTestTimeout, 10*time.Millisecond, func() bool { return processGone(pid) }) {
			t.Fatalf("the router did not exit within %v of SIGTERM", drain+timeout+defaultTestTimeout)
		}
		took := time.Since(start)
		t.Logf("the router exited %v after SIGTERM under attack (shutdown_drain %v, shutdown_timeout %v)", took.Round(time.Millisecond), drain, timeout)
		if took > drain+timeout+time.Second {
			t.Errorf("the router exited %v after SIGTERM, more than shutdown_drain and shutdown_timeout (%v) allow", took, drain+timeout)
		}
	})
}

// startAttacker runs this test binary as TestAbuseAttacker with the attack name and waits until
// it says it attacks; its output is returned.
func startAttacker(t *testing.T, env []string, name string) (*exec.Cmd, *lockedBuffer) {
	t.Helper()
	attacker := exec.Command(os.Args[0], "-test.run=^TestAbuseAttacker$", "-test.v=false")
	attacker.Env = append(append(os.Environ(), env...), abuseAttackEnv+"="+name)
	out := &lockedBuffer{}
	attacker.Stdout, attacker.Stderr = out, out
	if err := attacker.Start(); err != nil {
		t.Fatal(err)
	}
	if !kvtest.Poll(defaultTestTimeout, 10*time.Millisecond, func() bool { return strings.Contains(out.String(), abuseReady) }) {
		_ = attacker.Process.Kill()
		_ = attacker.Wait()
		t.Fatalf("the attacker was not ready within %v:\n%s", defaultTestTimeout, out)
	}
	return attacker, out
}

// stopAttacker interrupts the attacker, which then prints its report, and waits for it to exit.
func stopAttacker(attacker *exec.Cmd) {
	_ = attacker.Process.Signal(os.Interrupt)
	kill := time.AfterFunc(defaultTestTimeout, func() { _ = attacker.Process.Kill() })
	_ = attacker.Wait()
	kill.Stop()
}

// processGone reports whether process pid has exited (it may wait, a zombie, for its parent to
// reap it).
func processGone(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	// The state follows the command's closing parenthesis.
	i := bytes.LastIndexByte(stat, ')')
	return i < 0 || i+2 >= len(stat) || stat[i+2] == 'Z' || stat[i+2] == 'X'
}

// TestAbuseAttacker is not a test of its own: TestAbuseSuite runs this binary again with
// KVROUTER_ABUSE_ATTACK naming an attack, and this runs it until interrupted, then prints what
// the router answered. Without the variable it skips.
func TestAbuseAttacker(t *testing.T) {
	kind := os.Getenv(abuseAttackEnv)
	if kind == "" {
		t.Skip("run by TestAbuseSuite as the attacker")
	}
	stop := make(chan struct{})
	go func() {
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, os.Interrupt)
		<-sig
		close(stop)
	}()
	rep := &abuseCounts{m: map[string]int{}}
	a := &attacker{addr: os.Getenv("KVROUTER_ABUSE_ADDR"), health: os.Getenv("KVROUTER_ABUSE_HEALTH"), stop: stop, counts: rep}
	pem, err := os.ReadFile(os.Getenv("KVROUTER_ABUSE_CA"))
	if err != nil {
		t.Fatal(err)
	}
	a.roots = x509.NewCertPool()
	a.roots.AppendCertsFromPEM(pem)
	switch kind {
	case "gzip Routes without credentials":
		body := gzipRouteBody()
		fmt.Println(abuseReady)
		a.parallel(4, func() { a.gzipRoutes(body) })
	case "rapid reset without credentials":
		fmt.Println(abuseReady)
		a.parallel(2, a.rapidReset)
	case "streams on the health port":
		fmt.Println(abuseReady)
		a.parallel(1, a.healthStreams)
	case "10,000 ranks of one worker":
		fmt.Println(abuseReady)
		a.parallel(1, func() { a.ranks(os.Getenv("KVROUTER_ABUSE_WORKER_TOKEN")) })
	case "1M-token bookings of one frontend credential":
		// Ready once the credential's cap is reached (the bookings are never freed, so a later
		// round starts there): the attack measured is the flood of bookings past it, and the
		// refusals come however slowly a busy machine lets the attacker fill the cap.
		req, full := bigBooking(), make(chan struct{})
		var once sync.Once
		attacking := make(chan struct{})
		go func() {
			defer close(attacking)
			a.parallel(2, func() {
				a.bookings(os.Getenv("KVROUTER_ABUSE_FRONTEND_TOKEN"), req, func() { once.Do(func() { close(full) }) })
			})
		}()
		select {
		case <-full:
			fmt.Println(abuseReady)
		case <-stop:
		}
		<-attacking
	case "models from a worker credential without models":
		fmt.Println(abuseReady)
		a.parallel(4, func() { a.models(os.Getenv("KVROUTER_ABUSE_ANY_MODEL_TOKEN")) })
	case "hellos with a 1 MB endpoint":
		fmt.Println(abuseReady)
		a.parallel(2, func() { a.endpoints(os.Getenv("KVROUTER_ABUSE_WORKER_TOKEN")) })
	case "64 KiB headers without credentials":
		fmt.Println(abuseReady)
		a.parallel(2, a.hugeHeaders)
	case "idle connections past the cap":
		a.idleConnections(abuseMaxConnections+100, func() { fmt.Println(abuseReady) })
	default:
		t.Fatalf("no attack %q", kind)
	}
	out, _ := json.Marshal(abuseReport{Codes: rep.snapshot()})
	fmt.Println(string(out))
}

// abuseCounts counts the answers an attack got.
type abuseCounts struct {
	mu sync.Mutex
	m  map[string]int
}

func (c *abuseCounts) add(code string) {
	c.mu.Lock()
	c.m[code]++
	c.mu.Unlock()
}

func (c *abuseCounts) snapshot() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.m)
}

// attacker holds what every attack needs: the router's ports and CA, and when to stop.
type attacker struct {
	addr, health string
	roots        *x509.CertPool
	stop         <-chan struct{}
	counts       *abuseCounts
	seq          atomic.Uint64
}

// next numbers what an attack creates (request ids, models), apart from every other attacker
// process's numbers: each round's attacker is a new process.
func (a *attacker) next() uint64 {
	return uint64(os.Getpid())<<32 | a.seq.Add(1)
}

func (a *attacker) stopped() bool {
	select {
	case <-a.stop:
		return true
	default:
		return false
	}
}

// parallel runs n copies of attack until they return (each returns once stopped).
func (a *attacker) parallel(n int, attack func()) {
	var wg sync.WaitGroup
	for range n {
		wg.Go(attack)
	}
	wg.Wait()
}

// h2 opens an HTTP/2 connection to addr (TLS with the router's CA unless plain) and returns its
// framer, with a goroutine reading what the router sends: each stream's grpc-status (or its
// refusal) is counted, and closed is closed when the connection ends.
func (a *attacker) h2(addr string, plain bool) (fr *http2.Framer, closed chan struct{}, conn net.Conn, err error) {
	if plain {
		conn, err = net.DialTimeout("tcp", addr, 2*time.Second)
	} else {
		conn, err = tls.DialWithDialer(&net.Dialer{Timeout: 2 * time.Second}, "tcp", addr,
			&tls.Config{RootCAs: a.roots, ServerName: "localhost", NextProtos: []string{"h2"}})
	}
	if err != nil {
		return nil, nil, nil, err
	}
	if _, err := conn.Write([]byte(http2.ClientPreface)); err != nil {
		conn.Close()
		return nil, nil, nil, err
	}
	fr = http2.NewFramer(conn, conn)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if err := fr.WriteSettings(); err != nil {
		conn.Close()
		return nil, nil, nil, err
	}
	closed = make(chan struct{})
	go func() {
		defer close(closed)
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				if !a.stopped() {
					a.counts.add("conn_closed")
				}
				return
			}
			switch f := f.(type) {
			case *http2.MetaHeadersFrame:
				if v := f.PseudoValue("status"); v != "" && v != "200" {
					a.counts.add("http_" + v)
				}
				for _, hf := range f.Fields {
					if hf.Name == "grpc-status" {
						n, _ := strconv.Atoi(hf.Value)
						a.counts.add(codes.Code(n).String())
					}
				}
			case *http2.RSTStreamFrame:
				if f.ErrCode == http2.ErrCodeRefusedStream {
					a.counts.add("refused_stream")
				} else {
					a.counts.add("rst_" + f.ErrCode.String())
				}
			}
			// Nothing is written from here (a settings ack, a ping's answer): a Framer takes one
			// writer at a time, and the attack writes. An attacker need not be polite.
		}
	}()
	return fr, closed, conn, nil
}

// grpcHeaders encodes the request headers of a gRPC call to path, with extra fields.
func grpcHeaders(authority, path string, extra ...string) []byte {
	var b bytes.Buffer
	enc := hpack.NewEncoder(&b)
	fields := append([]string{":method", "POST", ":scheme", "https", ":path", path, ":authority", authority,
		"content-type", "application/grpc", "te", "trailers"}, extra...)
	for i := 0; i+1 < len(fields); i += 2 {
		_ = enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
	}
	return b.Bytes()
}

// grpcFrame is a gRPC length-prefixed message, compressed (flag 1) when compressed.
func grpcFrame(msg []byte, compressed bool) []byte {
	out := make([]byte, 5+len(msg))
	if compressed {
		out[0] = 1
	}
	binary.BigEndian.PutUint32(out[1:], uint32(len(msg)))
	copy(out[5:], msg)
	return out
}

// gzipRouteBody is a gRPC frame holding a gzip-compressed Route of 15 million token ids of value
// 1: 15 MB once decompressed, about 19 KB on the wire. It is written as protobuf wire bytes, a
// chunk at a time, and compressed for speed: the attacker must be ready within moments, even
// built with the race detector on a busy machine.
func gzipRouteBody() []byte {
	var z bytes.Buffer
	w, _ := gzip.NewWriterLevel(&z, gzip.BestSpeed)
	const tokens = 15_000_000
	head := []byte{0x12, 5, 'l', 'l', 'a', 'm', 'a', 0x1a} // model "llama", then token_ids, packed
	head = binary.AppendUvarint(head, tokens)
	_, _ = w.Write(head)
	chunk := bytes.Repeat([]byte{1}, 1<<20)
	for left := tokens; left > 0; left -= len(chunk) {
		_, _ = w.Write(chunk[:min(left, len(chunk))])
	}
	_, _ = w.Write([]byte{0x30, 1}) // query_only
	_ = w.Close()
	return grpcFrame(z.Bytes(), true)
}

// gzipRoutes sends gzip-compressed 15 MB Routes (about 19 KB each on the wire) without
// credentials, on one connection after another, as fast as the router answers them.
func (a *attacker) gzipRoutes(body []byte) {
	headers := grpcHeaders(a.addr, server.RouteMethod, "grpc-encoding", "gzip")
	for !a.stopped() {
		fr, closed, conn, err := a.h2(a.addr, false)
		if err != nil {
			time.Sleep(10 * time.Millisecond)
			continue
		}
		for id := uint32(1); !a.stopped(); id += 2 {
			if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: headers, EndHeaders: true}) != nil {
				break
			}
			if writeData(fr, id, body) != nil {
				break
			}
			select {
			case <-closed:
			case <-time.After(2 * time.Millisecond):
				continue
			}
			break
		}
		conn.Close()
	}
}

// writeData sends body on stream id in frames of at most 16 KB, ending the stream.
func writeData(fr *http2.Framer, id uint32, body []byte) error {
	for len(body) > 0 {
		n := min(len(body), 16<<10)
		if err := fr.WriteData(id, n == len(body), body[:n]); err != nil {
			return err
		}
		body = body[n:]
	}
	return nil
}

// rapidReset opens Route calls without credentials and resets each at once, reconnecting when the
// router closes the connection.
func (a *attacker) rapidReset() {
	headers := grpcHeaders(a.addr, server.RouteMethod)
	a.streamsUntilCut(func(fr *http2.Framer, id uint32) error {
		if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: headers, EndHeaders: true}); err != nil {
			return err
		}
		return fr.WriteRSTStream(id, http2.ErrCodeCancel)
	})
}

// streamsUntilCut opens streams on a connection to the gRPC port with open, one after another,
// until the router closes it, then reconnects, until stopped.
func (a *attacker) streamsUntilCut(open func(fr *http2.Framer, id uint32) error) {
	for !a.stopped() {
		fr, closed, conn, err := a.h2(a.addr, false)
		if err != nil {
			time.Sleep(10 * time.Millisecond)
			continue
		}
	streams:
		for id := uint32(1); !a.stopped(); id += 2 {
			if open(fr, id) != nil {
				break
			}
			select {
			case <-closed:
				break streams
			default:
			}
		}
		conn.Close()
	}
}

// healthStreams opens Watch streams on one plaintext health connection, about 10,000 a second,
// closing none: before, the router served them all (50,000 took 560 MiB).
func (a *attacker) healthStreams() {
	headers := grpcHeaders(a.health, "/grpc.health.v1.Health/Watch")
	body := grpcFrame(nil, false) // an empty HealthCheckRequest
	for !a.stopped() {
		fr, closed, conn, err := a.h2(a.health, true)
		if err != nil {
			time.Sleep(10 * time.Millisecond)
			continue
		}
	streams:
		for id := uint32(1); id < 100_001 && !a.stopped(); id += 2 {
			if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: headers, EndHeaders: true}) != nil ||
				fr.WriteData(id, false, body) != nil {
				break
			}
			select {
			case <-closed:
				break streams
			default:
			}
			if id%20 == 1 {
				time.Sleep(time.Millisecond) // about 10,000 streams a second
			}
		}
		<-a.stop
		conn.Close()
	}
}

// ranks registers rank after rank of worker 7 with its own credential, each on a stream of its
// own (closed once registered: the rank stays for the grace period).
func (a *attacker) ranks(token string) {
	conn := a.grpcConn()
	defer conn.Close()
	workers := kvrouterv1.NewWorkerServiceClient(conn)
	for rank := uint32(1); rank <= 10_000 && !a.stopped(); rank++ { // rank 0 is the frontend's worker, left alone
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token), 5*time.Second)
		s, err := workers.Publish(ctx)
		if err == nil {
			h := helloFor(7, "llama")
			h.GetHello().DpRank = rank
			if err = s.Send(h); err == nil {
				_, err = s.Recv()
			}
		}
		a.counts.add(status.Code(err).String())
		cancel()
	}
}

// grpcConn dials the router's gRPC port over TLS.
func (a *attacker) grpcConn() *grpc.ClientConn {
	conn, err := grpc.NewClient("passthrough:///"+a.addr, grpc.WithTransportCredentials(credentials.NewTLS(
		&tls.Config{RootCAs: a.roots, ServerName: "localhost", MinVersion: tls.VersionTLS12})))
	if err != nil {
		panic(err)
	}
	return conn
}

// bigBooking is a booked Route of 1,048,576 token ids (max_prompt_tokens), about 3 MB on the wire,
// whose request id the attack sets per call.
func bigBooking() *kvrouterv1.RouteRequest {
	tokens := make([]uint32, 1<<20)
	for i := range tokens {
		tokens[i] = uint32(i%50_000 + 1)
	}
	return &kvrouterv1.RouteRequest{Model: "llama", TokenIds: tokens}
}

// bookings books req again and again under new request ids with a frontend credential of its own,
// freeing nothing: before, each pinned about 2 MB of block keys for booking_expiry, with no bound
// but the call rate.
func (a *attacker) bookings(token string, req *kvrouterv1.RouteRequest, refused func()) {
	conn := a.grpcConn()
	defer conn.Close()
	router := kvrouterv1.NewRouterServiceClient(conn)
	r := proto.Clone(req).(*kvrouterv1.RouteRequest)
	for !a.stopped() {
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token), defaultTestTimeout)
		r.RequestId = fmt.Sprintf("big-%d", a.next())
		_, err := router.Route(ctx, r)
		a.counts.add(status.Code(err).String())
		cancel() // RetryInfo not honoured: a hostile caller does not
		if status.Code(err) == codes.ResourceExhausted {
			refused()
		}
	}
}

// models registers worker 9 in model after model, one rank each (a rank belongs to one model), with
// a credential scoped to worker ids but not to models: before, 30,000 models made /metrics 93 MB,
// and sharded by model each is a shard on every replica for good.
func (a *attacker) models(token string) {
	conn := a.grpcConn()
	defer conn.Close()
	workers := kvrouterv1.NewWorkerServiceClient(conn)
	for !a.stopped() {
		i := a.next()
		h := helloFor(9, fmt.Sprintf("abuse-%d", i))
		h.GetHello().DpRank = uint32(i * 0x9e3779b97f4a7c15 >> 32) // a rank belongs to one model: one of its own for each
		a.counts.add(status.Code(a.hello(workers, token, h)).String())
	}
}

// endpoints sends hellos of worker 7 whose endpoint is 1 MB: before, it was kept, and sent in every
// Route response and ListWorkers.
func (a *attacker) endpoints(token string) {
	conn := a.grpcConn()
	defer conn.Close()
	workers := kvrouterv1.NewWorkerServiceClient(conn)
	h := helloFor(7, "llama")
	h.GetHello().DpRank = 1
	h.GetHello().Endpoint = strings.Repeat("w", 1<<20)
	for !a.stopped() {
		a.counts.add(status.Code(a.hello(workers, token, h)).String())
	}
}

// hello sends h on a Publish stream of its own and returns how the router answered it.
func (a *attacker) hello(workers kvrouterv1.WorkerServiceClient, token string, h *kvrouterv1.PublishRequest) error {
	ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token), 5*time.Second)
	defer cancel()
	s, err := workers.Publish(ctx)
	if err == nil {
		if err = s.Send(h); err == nil {
			_, err = s.Recv()
		}
	}
	return err
}

// hugeHeaders opens Route calls whose headers carry a 64 KiB authorization value, four times
// max_header_list_bytes: before, 5 MB headers were read and held before authentication.
func (a *attacker) hugeHeaders() {
	block := grpcHeaders(a.addr, server.RouteMethod, "authorization", "Bearer "+strings.Repeat("x", 64<<10))
	a.streamsUntilCut(func(fr *http2.Framer, id uint32) error { return writeHeaderBlock(fr, id, block) })
}

// writeHeaderBlock sends a header block in a HEADERS frame and as many CONTINUATION frames as its
// size needs (16 KB each).
func writeHeaderBlock(fr *http2.Framer, id uint32, block []byte) error {
	n := min(len(block), 16<<10)
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block[:n], EndHeaders: n == len(block)}); err != nil {
		return err
	}
	for block = block[n:]; len(block) > 0; block = block[n:] {
		n = min(len(block), 16<<10)
		if err := fr.WriteContinuation(id, n == len(block), block[:n]); err != nil {
			return err
		}
	}
	return nil
}

// idleConnections opens n TLS connections (each with the HTTP/2 preface and settings), 16 at a
// time, says ready, and holds them idle until stopped: before, idle connections reached 18,924 of
// 20,000 file descriptors. Those past max_connections are closed by the router at once.
func (a *attacker) idleConnections(n int, ready func()) {
	var (
		mu    sync.Mutex
		conns []net.Conn
		left  atomic.Int64
	)
	left.Store(int64(n))
	a.parallel(16, func() {
		for left.Add(-1) >= 0 && !a.stopped() {
			_, _, conn, err := a.h2(a.addr, false)
			if err != nil {
				a.counts.add("conn_closed") // accepted and closed during the handshake
				continue
			}
			mu.Lock()
			conns = append(conns, conn)
			mu.Unlock()
		}
	})
	ready()
	<-a.stop
	for _, c := range conns {
		c.Close()
	}
}
