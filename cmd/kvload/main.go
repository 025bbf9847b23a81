// Binary kvload seeds a running kvrouter with a synthetic worker fleet, then drives
// RouterService/Route against it and reports throughput, latency and the CPU both sides spent per
// call. It exists because ghz, on a 2-core machine it shares with the router, spends more CPU than
// the router it measures: kvload builds and marshals every request once and sends the same bytes on
// every call.
//
// Seeding (seed.go): it registers --workers workers of one model, each on its own
// WorkerService/Publish stream as a real worker would, and publishes --blocks KV blocks in all:
// prompts of --prompt-blocks blocks that share prefixes of --roots "system prompts", sent as stored
// events with token ids (a worker that already holds a prompt's prefix sends only the new blocks,
// chained onto it by parent_hash). It waits until the router has acked every event.
//
// Driving (drive.go): with --requests N or --duration D it then sends Route calls of --prompts
// distinct prompts of --route-tokens tokens, in turn, over --conns connections: --warmup calls
// first, left out of the figures, then the measured ones. With --rate R it is an open loop (calls
// start at R per second whatever the latency, at most --max-inflight at once, and each call's
// latency counts from when it was due, so queueing is not hidden); without, a closed loop of
// --concurrency callers. The calls are query_only unless --query-only=false; then every call books
// under its own request id and, with --free, frees it once Route returns.
//
// Ingest (ingest.go): with --ingest-rate R, --ingest-streams more workers of the model (ids after
// the seeded ones) each churn their cache over one Publish stream while the Route calls run, so that
// Route is measured under ingestion (issue 12: a million block events a second into one replica, and
// Route p99 within twice its idle value): a stored event of a new prompt's --ingest-event-blocks
// blocks, chained onto a root prefix the worker holds, then the removal of its oldest prompt's
// blocks, keeping --ingest-cap blocks. Each stream paces itself to R block events a second (stored
// blocks plus removed hashes), or with "max" publishes as fast as the router acks; --ingest-batch
// events go in each message. The prompts are built, hashed and marshaled before the window, so
// kvload's CPU goes to sending them only. The streams start --ingest-warmup before the measured
// calls, and the report counts the block events the router acked between their start and end. With
// --concurrency 0 and --duration D, no Route call is made: the window is D of ingest alone.
//
// Credentials: plaintext unless --cacert or --cert is given; then TLS, verified against --cacert's
// CA (or the system's roots), presenting --cert and --key (mutual TLS). --token-file's bearer token is
// sent with every call (Publish and Route), so that Route is measured through the router's TLS and
// token checks; without TLS it goes to a loopback --addr only.
//
// Report (report.go): calls, errors by status code, achieved rate, latency percentiles, kvload's
// CPU per call and, given --server-pid or --server-metrics, the router's; with ingest, the block
// events acked per second; as text on stderr and, with --json, as a JSON object.
//
// --out writes the first prompt as the JSON RouteRequest ghz takes with -D (for comparison; a
// booking request gets a request id templated for ghz). It appears only when seeding is complete,
// so a script can wait for it. With --hold the worker streams then stay open that long (or until
// SIGINT or SIGTERM) after any driving; otherwise kvload closes them and returns, and the router
// keeps the workers for its --worker-grace-period.
//
// Usage:
//
//	kvload --addr 127.0.0.1:50051 --blocks 1000000 --requests 20000 --warmup 1000 --concurrency 8 --conns 2
//	kvload --addr 127.0.0.1:50051 --duration 30s --rate 5000 --query-only=false --server-pid 1234 --json r.json
//	kvload --addr 127.0.0.1:50051 --blocks 1000000 --duration 10s --concurrency 8 --ingest-rate 1000000 --server-pid 1234
//
// scripts/loadtest.sh runs it against a fresh kvrouter on loopback.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"syscall"
	"time"

	"google.golang.org/grpc"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stderr))
}

// config is the command line.
type config struct {
	addr, model, out     string
	workers, prefill     int
	blockSize, blocks    int
	promptBlocks, roots  int
	sharedMin, sharedMax float64
	batch, routeTokens   int
	queryOnly            bool
	hashPrompts          bool
	hold, timeout        time.Duration
	seed                 uint64

	// Driving.
	requests, warmup       int
	duration               time.Duration
	concurrency, conns     int
	rate                   float64
	maxInflight, prompts   int
	free                   bool
	jsonOut, serverMetrics string
	serverPID              int
	cpuProfile             string

	// Credentials of every connection: --cacert, --cert, --key, --token-file, and the dial options
	// they make (plaintext when none is given).
	caCert, cert, key, tokenFile string
	creds                        []grpc.DialOption

	// Ingest during the measured calls.
	ingestRate               rateFlag
	ingestStreams, ingestCap int
	ingestEventBlocks        int
	ingestBatch              int
	ingestWarmup             time.Duration
}

// drives says whether the command line asks for Route calls.
func (c *config) drives() bool { return c.requests > 0 || c.duration > 0 }

// ingests says whether the command line asks for ingest streams during the measured calls.
func (c *config) ingests() bool { return c.ingestRate != 0 }

func parseFlags(args []string, stderr io.Writer) (*config, error) {
	c := &config{}
	fs := flag.NewFlagSet("kvload", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.addr, "addr", "127.0.0.1:50051", "kvrouter gRPC address")
	fs.StringVar(&c.caCert, "cacert", "", "PEM file of the CA of the router's certificate: dial with TLS (default: plaintext, unless --cert)")
	fs.StringVar(&c.cert, "cert", "", "client certificate (PEM) for mutual TLS, with --key: dial with TLS")
	fs.StringVar(&c.key, "key", "", "the key (PEM) of --cert")
	fs.StringVar(&c.tokenFile, "token-file", "", "file holding a bearer token sent with every call; without TLS only to a loopback --addr")
	fs.StringVar(&c.model, "model", "bench", "model the workers serve")
	fs.StringVar(&c.out, "out", "", "file to write the first Route request to, as ghz JSON (required unless --requests or --duration)")
	fs.IntVar(&c.workers, "workers", 64, "workers to register")
	fs.IntVar(&c.prefill, "prefill-workers", 0, "how many of the workers are prefill workers, the rest decode (0: all aggregated)")
	fs.IntVar(&c.blockSize, "block-size", 16, "tokens per KV block")
	fs.IntVar(&c.blocks, "blocks", 65536, "KV blocks to publish, over all workers")
	fs.IntVar(&c.promptBlocks, "prompt-blocks", 128, "blocks per published prompt")
	fs.IntVar(&c.roots, "roots", 16, "shared system prompts the prompts start with")
	fs.Float64Var(&c.sharedMin, "shared-min", 0.25, "least fraction of a prompt taken from its root")
	fs.Float64Var(&c.sharedMax, "shared-max", 0.75, "largest fraction of a prompt taken from its root (< 1)")
	fs.IntVar(&c.batch, "batch", 16, "stored events per Publish message")
	fs.IntVar(&c.routeTokens, "route-tokens", 2048, "tokens of each routed prompt")
	fs.BoolVar(&c.queryOnly, "query-only", true, "send query_only requests; false books load with a unique request id per call")
	fs.BoolVar(&c.hashPrompts, "hash-prompts", false, "send each prompt keyed as a client that hashes its own prompts does (block_hashes, kvclient.HashPrompt) instead of its token ids")
	fs.DurationVar(&c.hold, "hold", 0, "keep the worker streams open this long after seeding and driving (0: close them at once)")
	fs.DurationVar(&c.timeout, "timeout", 5*time.Minute, "deadline for seeding")
	fs.Uint64Var(&c.seed, "seed", 1, "seed of the generated prompts")

	fs.IntVar(&c.requests, "requests", 0, "measured Route calls to send after seeding (0: see --duration)")
	fs.DurationVar(&c.duration, "duration", 0, "send measured Route calls for this long instead of --requests")
	fs.IntVar(&c.warmup, "warmup", 0, "Route calls sent before the measured ones, left out of the report")
	fs.IntVar(&c.concurrency, "concurrency", 8, "closed loop: callers, each sending its next call when the previous returns")
	fs.Float64Var(&c.rate, "rate", 0, "open loop: calls started per second, whatever the latency (0: closed loop)")
	fs.IntVar(&c.maxInflight, "max-inflight", 256, "open loop: most calls in flight; a call due while all are busy starts late")
	fs.IntVar(&c.conns, "conns", 2, "gRPC connections the calls are spread over")
	fs.IntVar(&c.prompts, "prompts", 16, "distinct prompts, on different roots, the calls cycle through")
	fs.BoolVar(&c.free, "free", true, "booking: free each booking once its Route returns, so bookings do not pile up")
	fs.StringVar(&c.jsonOut, "json", "", "also write the report to this file as a JSON object")
	fs.IntVar(&c.serverPID, "server-pid", 0, "kvrouter's process id, to report its CPU per call from /proc/PID/stat")
	fs.StringVar(&c.serverMetrics, "server-metrics", "", "kvrouter's metrics URL (http://host:port/metrics), to report its CPU per call from process_cpu_seconds_total")
	fs.StringVar(&c.cpuProfile, "cpuprofile", "", "write a CPU profile of kvload's measured calls to this file")

	fs.Var(&c.ingestRate, "ingest-rate", "during the measured calls, each ingest stream publishes this many block events (stored blocks and removed hashes) per second, or max: as fast as the router acks (0: no ingest)")
	fs.IntVar(&c.ingestStreams, "ingest-streams", 1, "ingest workers, each publishing over its own Publish stream (with --ingest-rate)")
	fs.IntVar(&c.ingestCap, "ingest-cap", 65536, "new-prompt blocks an ingest worker holds: past it, it removes its oldest prompt after storing a new one")
	fs.IntVar(&c.ingestEventBlocks, "ingest-event-blocks", 128, "new blocks of each ingested prompt: each stored event has this many, each removal as many hashes")
	fs.IntVar(&c.ingestBatch, "ingest-batch", 16, "events per Publish message of the ingest streams")
	fs.DurationVar(&c.ingestWarmup, "ingest-warmup", time.Second, "how long the ingest runs before the measured calls start (during the warmup calls)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	switch {
	case fs.NArg() > 0:
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	case c.out == "" && !c.drives():
		return nil, errors.New("--out is required unless --requests or --duration drives Route calls")
	case c.workers < 1 || c.prefill < 0 || c.prefill >= c.workers:
		return nil, fmt.Errorf("--workers must be >= 1 and --prefill-workers in [0, workers) (got %d and %d)", c.workers, c.prefill)
	case c.blockSize < 1 || c.blocks < 0 || c.promptBlocks < 1 || c.roots < 1 || c.batch < 1:
		return nil, errors.New("--block-size, --prompt-blocks, --roots and --batch must be >= 1, --blocks >= 0")
	case c.sharedMin < 0 || c.sharedMin > c.sharedMax || c.sharedMax >= 1:
		// Below 1, every prompt ends in a block no worker holds yet, so publishing always progresses.
		return nil, fmt.Errorf("need 0 <= --shared-min <= --shared-max < 1 (got %v and %v)", c.sharedMin, c.sharedMax)
	case c.routeTokens < c.blockSize:
		return nil, fmt.Errorf("--route-tokens must be at least --block-size (got %d)", c.routeTokens)
	case c.requests < 0 || c.duration < 0 || c.warmup < 0 || (c.requests > 0 && c.duration > 0):
		return nil, errors.New("give --requests or --duration, not both, and --warmup >= 0")
	case c.concurrency < 0 || c.conns < 1 || c.prompts < 1 || c.maxInflight < 1 || c.rate < 0:
		return nil, errors.New("--concurrency, --conns, --prompts and --max-inflight must be >= 1, --rate >= 0")
	case c.concurrency == 0 && !(c.ingests() && c.duration > 0 && c.rate == 0):
		// No callers: a window of ingest alone, to measure what a stream reaches without Route load.
		return nil, errors.New("--concurrency 0 (no Route calls) needs --ingest-rate and --duration, and no --rate")
	case c.ingests() && !c.drives():
		return nil, errors.New("--ingest-rate needs --requests or --duration: the ingest runs during the measured calls")
	case c.ingests() && (c.ingestStreams < 1 || c.ingestEventBlocks < 1 || c.ingestBatch < 1 || c.ingestCap < c.ingestEventBlocks || c.ingestWarmup < 0):
		return nil, errors.New("--ingest-streams, --ingest-event-blocks and --ingest-batch must be >= 1, --ingest-cap >= --ingest-event-blocks, --ingest-warmup >= 0")
	case c.serverPID != 0 && c.serverMetrics != "":
		return nil, errors.New("give --server-pid or --server-metrics, not both")
	}
	creds, err := c.dialCredentials()
	if err != nil {
		return nil, err
	}
	c.creds = creds
	return c, nil
}

// tls says whether the connections use TLS: a TLS flag is given.
func (c *config) tls() bool { return c.caCert != "" || c.cert != "" || c.key != "" }

// dialCredentials reads the credential flags' files into the connections' dial options.
func (c *config) dialCredentials() ([]grpc.DialOption, error) {
	switch {
	case (c.cert == "") != (c.key == ""):
		return nil, errors.New("--cert and --key go together: give both (the client certificate and its key) or neither")
	case !c.tls() && c.tokenFile != "" && !kvclient.LoopbackTarget(c.addr):
		return nil, fmt.Errorf("--token-file without --cacert or --cert would send the token unencrypted to --addr %s, which is not a loopback address: give --cacert", c.addr)
	}
	return kvclient.DialCredentials(kvclient.CredentialOptions{CAFile: c.caCert, CertFile: c.cert, KeyFile: c.key, TokenFile: c.tokenFile,
		Plaintext: !c.tls(), AllowTokenWithoutTLS: !c.tls()})
}

// dialOptions are the credentials' dial options, then extra.
func (c *config) dialOptions(extra ...grpc.DialOption) []grpc.DialOption {
	return append(slices.Clip(c.creds), extra...)
}

// run executes the command line and returns the exit code: 0 done, 1 failed, 2 bad command line.
// A run whose calls failed still exits 0: the report says how many failed and why.
func run(ctx context.Context, args []string, stderr io.Writer) int {
	c, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvload: %v\n", err)
		return 2
	}
	if err := load(ctx, c, stderr); err != nil {
		fmt.Fprintf(stderr, "kvload: %v\n", err)
		return 1
	}
	return 0
}

// load seeds the router, writes --out, drives the calls and holds the streams, in that order.
func load(ctx context.Context, c *config, stderr io.Writer) error {
	conn, err := grpc.NewClient(c.addr, c.dialOptions(kvclient.WithKeepalive(), grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20)))...)
	if err != nil {
		return err
	}
	defer conn.Close()

	g := newGenerator(c)
	workers, err := seed(ctx, conn, c, g, stderr)
	if err != nil {
		return err
	}
	defer workers.close(ctx)
	reqs := g.routeRequests()

	if c.out != "" {
		if err := writeRequest(c.out, reqs[0]); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "kvload: wrote the Route request (%d tokens, query_only %v) to %s\n", c.routeTokens, c.queryOnly, c.out)
	}
	var in *ingest
	if c.ingests() {
		// After the Route prompts are drawn, so that they are the same with ingest and without.
		if in, err = newIngest(ctx, c, g, stderr); err != nil {
			return err
		}
		defer in.close(ctx)
	}
	if c.drives() {
		r, err := drive(ctx, c, reqs, in)
		if err != nil {
			return err
		}
		r.write(stderr)
		if c.jsonOut != "" {
			if err := r.writeJSON(c.jsonOut); err != nil {
				return err
			}
		}
	}
	if c.hold > 0 {
		fmt.Fprintf(stderr, "kvload: holding %d worker streams open for %v\n", len(workers), c.hold)
		select {
		case <-time.After(c.hold):
		case <-ctx.Done():
		}
	}
	return nil
}
