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
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/server"
)

// The abuse suite (issue 27): a real `kvrouter serve`, set up as docs/security.md says (TLS, a
// credentials file, a health port), and a well-behaved frontend routing on it, query-only, one call
// after another. Each attack runs in a process of its own (this test binary again, as
// TestAbuseAttacker), so that it competes with the router for the machine as a remote attacker's
// traffic would, not with the frontend for this process's goroutines. For each attack the
// frontend's Route p99 is measured just before it and while it runs, in two rounds (a third when
// neither is within the bound); the lowest round's ratio must be within abuseP99Ratio (one round
// can always meet a noisy neighbour on a shared two-core machine, where the attacker's own CPU
// competes with the router too), the router's peak memory must grow less than abuseRSSBound over
// the whole suite, and the attacker must have been answered with the status that names what
// stopped it.

const (
	abuseP99Ratio  = 3
	abuseRSSBound  = 64 << 20
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
}

// TestAbuseSuite runs each attack of abuseAttacks against one router, as the file's comment says.
func TestAbuseSuite(t *testing.T) {
	if testing.Short() {
		t.Skip("the abuse suite runs attacks for about a minute")
	}
	healthAddr := freePort(t)
	r := startSecureRouter(t, "--health-listen", healthAddr)
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
		"KVROUTER_ABUSE_WORKER_TOKEN=" + r.tokens["worker-7"]}
	for _, a := range abuseAttacks {
		t.Run(a.name, func(t *testing.T) {
			best, answers, lastOut := 0.0, map[string]int{}, ""
			var notes []string
			for round := range 3 {
				if round == 2 && best <= abuseP99Ratio {
					break // two rounds, one within the bound: enough
				}
				base, n0 := p99(abuseWindow)
				attacker := exec.Command(os.Args[0], "-test.run=^TestAbuseAttacker$", "-test.v=false")
				attacker.Env = append(append(os.Environ(), env...), abuseAttackEnv+"="+a.name)
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
				time.Sleep(200 * time.Millisecond) // the attack under way
				under, n1 := p99(abuseWindow)
				_ = attacker.Process.Signal(os.Interrupt)
				kill := time.AfterFunc(defaultTestTimeout, func() { _ = attacker.Process.Kill() })
				_ = attacker.Wait()
				kill.Stop()
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
			t.Logf("%s; attacker answered %v", notes, answers)
			if best > abuseP99Ratio {
				t.Errorf("the frontend's Route p99 grew %.1fx under the attack (the best of three rounds), more than %dx: %s", best, abuseP99Ratio, notes)
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
	for !a.stopped() {
		fr, closed, conn, err := a.h2(a.addr, false)
		if err != nil {
			time.Sleep(10 * time.Millisecond)
			continue
		}
	streams:
		for id := uint32(1); !a.stopped(); id += 2 {
			if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: headers, EndHeaders: true}) != nil ||
				fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
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
	for rank := uint32(0); rank < 10_000 && !a.stopped(); rank++ {
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
