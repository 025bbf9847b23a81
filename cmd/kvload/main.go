// Binary kvload seeds a running kvrouter with a synthetic worker fleet for load tests, and writes a
// Route request for ghz.
//
// It registers --workers workers of one model, each on its own WorkerService/Publish stream as a
// real worker would, and publishes --blocks KV blocks in all: prompts of --prompt-blocks blocks that
// share prefixes of --roots "system prompts", sent as stored events with token ids (a worker that
// already holds a prompt's prefix sends only the new blocks, chained onto it by parent_hash). It
// waits until the router has acked every event, then writes to --out a RouteRequest in the JSON that
// ghz takes with -D: a prompt of --route-tokens tokens that shares a cached root prefix. The request
// is query_only unless --query-only=false; then every call books load under its own request id,
// made unique by ghz's {{.RequestNumber}} and {{.TimestampUnixNano}} templates.
//
// With --hold the streams stay open that long (or until SIGINT or SIGTERM), so the workers stay
// connected while ghz runs; without it kvload returns once seeded, and the router keeps the workers
// for its --worker-grace-period. The --out file appears only when seeding is complete, so a script
// can wait for it.
//
// Usage:
//
//	kvload --addr 127.0.0.1:50051 --workers 64 --blocks 1000000 --out route.json --hold 10m
//	ghz --insecure --call kvrouter.v1.RouterService/Route -D route.json -n 20000 -c 8 127.0.0.1:50051
//
// scripts/loadtest.sh runs both against a fresh kvrouter on loopback.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
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
	hold, timeout        time.Duration
	seed                 uint64
}

func parseFlags(args []string, stderr io.Writer) (*config, error) {
	c := &config{}
	fs := flag.NewFlagSet("kvload", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.addr, "addr", "127.0.0.1:50051", "kvrouter gRPC address")
	fs.StringVar(&c.model, "model", "bench", "model the workers serve")
	fs.StringVar(&c.out, "out", "", "file to write the ghz RouteRequest JSON to (required)")
	fs.IntVar(&c.workers, "workers", 64, "workers to register")
	fs.IntVar(&c.prefill, "prefill-workers", 0, "how many of the workers are prefill workers, the rest decode (0: all aggregated)")
	fs.IntVar(&c.blockSize, "block-size", 16, "tokens per KV block")
	fs.IntVar(&c.blocks, "blocks", 65536, "KV blocks to publish, over all workers")
	fs.IntVar(&c.promptBlocks, "prompt-blocks", 128, "blocks per published prompt")
	fs.IntVar(&c.roots, "roots", 16, "shared system prompts the prompts start with")
	fs.Float64Var(&c.sharedMin, "shared-min", 0.25, "least fraction of a prompt taken from its root")
	fs.Float64Var(&c.sharedMax, "shared-max", 0.75, "largest fraction of a prompt taken from its root (< 1)")
	fs.IntVar(&c.batch, "batch", 16, "stored events per Publish message")
	fs.IntVar(&c.routeTokens, "route-tokens", 2048, "tokens of the Route request written to --out")
	fs.BoolVar(&c.queryOnly, "query-only", true, "write a query_only request; false books load with a unique request id per call")
	fs.DurationVar(&c.hold, "hold", 0, "keep the worker streams open this long after seeding (0: close them at once)")
	fs.DurationVar(&c.timeout, "timeout", 5*time.Minute, "deadline for seeding")
	fs.Uint64Var(&c.seed, "seed", 1, "seed of the generated prompts")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	switch {
	case fs.NArg() > 0:
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	case c.out == "":
		return nil, errors.New("--out is required")
	case c.workers < 1 || c.prefill < 0 || c.prefill >= c.workers:
		return nil, fmt.Errorf("--workers must be >= 1 and --prefill-workers in [0, workers) (got %d and %d)", c.workers, c.prefill)
	case c.blockSize < 1 || c.blocks < 0 || c.promptBlocks < 1 || c.roots < 1 || c.batch < 1:
		return nil, errors.New("--block-size, --prompt-blocks, --roots and --batch must be >= 1, --blocks >= 0")
	case c.sharedMin < 0 || c.sharedMin > c.sharedMax || c.sharedMax >= 1:
		// Below 1, every prompt ends in a block no worker holds yet, so publishing always progresses.
		return nil, fmt.Errorf("need 0 <= --shared-min <= --shared-max < 1 (got %v and %v)", c.sharedMin, c.sharedMax)
	case c.routeTokens < c.blockSize:
		return nil, fmt.Errorf("--route-tokens must be at least --block-size (got %d)", c.routeTokens)
	}
	return c, nil
}

// run executes the command line and returns the exit code: 0 done, 1 failed, 2 bad command line.
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

func load(ctx context.Context, c *config, stderr io.Writer) error {
	conn, err := grpc.NewClient(c.addr, grpc.WithTransportCredentials(insecure.NewCredentials()), kvclient.WithKeepalive(),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20)))
	if err != nil {
		return err
	}
	defer conn.Close()
	// Seeding has its own deadline; the streams live on until the hold ends.
	seedCtx, cancelSeed := context.WithTimeout(ctx, c.timeout)
	defer cancelSeed()

	g := newGenerator(c)
	plans := g.plans()
	start := time.Now()
	workers := make([]*kvclient.Publisher, len(plans))
	errs := make([]error, len(plans))
	var wg sync.WaitGroup
	for i, p := range plans {
		wg.Go(func() {
			workers[i], errs[i] = seedWorker(seedCtx, conn, c, p)
		})
	}
	wg.Wait()
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		for _, w := range workers {
			if w != nil {
				w.Close(closeCtx) //nolint:errcheck // everything was acked; this ends the stream
			}
		}
	}()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	events, blocks := 0, 0
	for _, p := range plans {
		events += len(p.events)
		for _, ev := range p.events {
			blocks += len(ev.GetStored().GetBlocks())
		}
	}
	fmt.Fprintf(stderr, "kvload: seeded %d workers of model %q at %s: %d stored events, %d blocks, acked in %v\n",
		len(plans), c.model, c.addr, events, blocks, time.Since(start).Round(time.Millisecond))

	if err := writeRequest(c.out, g.routeRequest()); err != nil {
		return err
	}
	fmt.Fprintf(stderr, "kvload: wrote the Route request (%d tokens, query_only %v) to %s\n", c.routeTokens, c.queryOnly, c.out)

	if c.hold > 0 {
		fmt.Fprintf(stderr, "kvload: holding %d worker streams open for %v\n", len(workers), c.hold)
		select {
		case <-time.After(c.hold):
		case <-ctx.Done():
		}
	}
	return nil
}

// plan is what one worker publishes.
type plan struct {
	hello  *kvrouterv1.WorkerHello
	events []*kvrouterv1.KvEvent
}

// generator makes the fleet's prompts (kvtest.Prompts: a block's tokens follow from its content
// id). A block's engine block_hash is its sequence hash, so equal prefixes are equal blocks on every
// worker, as with real engines.
type generator struct {
	*kvtest.Prompts
	c    *config
	salt uint64
}

func newGenerator(c *config) *generator {
	shape := kvtest.Shape{Roots: c.roots, SharedMin: c.sharedMin, SharedMax: c.sharedMax}
	return &generator{Prompts: kvtest.NewPrompts(shape, rand.New(rand.NewPCG(c.seed, 0x6b766c6f6164))), c: c, salt: blockhash.Salt("", "")}
}

func (g *generator) tokens(id uint64) []uint32 { return kvtest.BlockTokensOf(nil, id, g.c.blockSize) }

// plans generates every worker's hello and stored events: prompts on random workers until the
// fleet holds --blocks blocks.
func (g *generator) plans() []*plan {
	c := g.c
	plans := make([]*plan, c.workers)
	held := make([]map[uint64]bool, c.workers) // sequence hashes each worker holds
	for i := range plans {
		role := kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED
		if c.prefill > 0 {
			role = kvrouterv1.WorkerRole_WORKER_ROLE_DECODE
			if i < c.prefill {
				role = kvrouterv1.WorkerRole_WORKER_ROLE_PREFILL
			}
		}
		plans[i] = &plan{hello: &kvrouterv1.WorkerHello{
			WorkerId: uint64(i) + 1, Model: c.model, Role: role, BlockSize: uint32(c.blockSize),
			TotalKvBlocks: 1 << 20, MaxNumBatchedTokens: 8192, Endpoint: fmt.Sprintf("kvload-worker-%d:8000", i+1),
			KvEventsEnabled: true, FreshStart: true,
		}}
		held[i] = map[uint64]bool{}
	}
	for published := 0; published < c.blocks; {
		w := g.Rand.IntN(c.workers)
		root, shared := g.Draw(c.promptBlocks)
		ids := g.IDs(nil, root, shared, c.promptBlocks)
		stored := &kvrouterv1.BlocksStored{}
		var seq uint64
		for i, id := range ids {
			tokens := g.tokens(id)
			local := blockhash.Local(tokens, g.salt)
			if i == 0 {
				seq = local
			} else {
				seq = blockhash.Chain(seq, local)
			}
			if held[w][seq] {
				// Held already: the worker reports only what follows, chained onto this block.
				parent := seq
				stored.ParentHash = &parent
				continue
			}
			held[w][seq] = true
			stored.Blocks = append(stored.Blocks, &kvrouterv1.StoredBlock{BlockHash: seq, TokenIds: tokens})
		}
		if len(stored.Blocks) == 0 {
			continue
		}
		p := plans[w]
		p.events = append(p.events, &kvrouterv1.KvEvent{
			EventId: uint64(len(p.events)), StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
			Data: &kvrouterv1.KvEvent_Stored{Stored: stored},
		})
		published += len(stored.Blocks)
	}
	return plans
}

// routeRequest is a prompt of --route-tokens tokens that starts with half of a root (as much as the
// published prompts share with their roots on average), then unseen blocks and a partial tail.
func (g *generator) routeRequest() *kvrouterv1.RouteRequest {
	c := g.c
	n := (c.routeTokens + c.blockSize - 1) / c.blockSize
	shared := int(float64(min(n, c.promptBlocks)) * (c.sharedMin + c.sharedMax) / 2)
	req := &kvrouterv1.RouteRequest{Model: c.model, QueryOnly: c.queryOnly}
	for _, id := range g.IDs(nil, g.Rand.IntN(c.roots), shared, n) {
		req.TokenIds = append(req.TokenIds, g.tokens(id)...)
	}
	req.TokenIds = req.TokenIds[:c.routeTokens]
	if !c.queryOnly {
		req.RequestId = "kvload-{{.RequestNumber}}-{{.TimestampUnixNano}}"
	}
	return req
}

// writeRequest writes the request as JSON, atomically: the file appears complete or not at all.
func writeRequest(path string, req *kvrouterv1.RouteRequest) error {
	b, err := protojson.Marshal(req)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".kvload-*.json")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// worker is one seeded worker's open stream.
// seedWorker publishes the plan's events through a kvclient.Publisher and returns it once the
// router acked the last one (or seedCtx ends). The publisher answers a resync with the plan's
// events, which are the worker's whole cache; the caller closes it.
func seedWorker(seedCtx context.Context, conn grpc.ClientConnInterface, c *config, p *plan) (*kvclient.Publisher, error) {
	pub, err := kvclient.NewPublisher(kvclient.PublisherOptions{
		Hello: p.hello, Conns: []grpc.ClientConnInterface{conn}, MaxBatchEvents: c.batch,
		Dump: func(context.Context) ([]*kvrouterv1.KvEvent, error) { return p.events, nil },
	})
	if err != nil {
		return nil, err
	}
	err = pub.Publish(seedCtx, p.events...)
	if err == nil {
		err = pub.Flush(seedCtx)
	}
	if err != nil {
		pub.Close(seedCtx) //nolint:errcheck // the error above says more
		return nil, fmt.Errorf("worker %d: %w", p.hello.GetWorkerId(), err)
	}
	return pub, nil
}
