package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// fleet is a seeded fleet: its workers' open Publish streams.
type fleet []*kvclient.Publisher

// seed registers the workers of g's plans on conn, publishes their events and returns once the
// router acked every one (or seeding's --timeout passed). The streams stay open until close.
func seed(ctx context.Context, conn grpc.ClientConnInterface, c *config, g *generator, stderr io.Writer) (fleet, error) {
	seedCtx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	plans := g.plans()
	start := time.Now()
	workers := make(fleet, len(plans))
	errs := make([]error, len(plans))
	var wg sync.WaitGroup
	for i, p := range plans {
		wg.Go(func() {
			workers[i], errs[i] = seedWorker(seedCtx, conn, c, p)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		workers.close(ctx)
		return nil, err
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
	return workers, nil
}

// close ends the workers' streams. The router keeps the workers for its --worker-grace-period.
func (f fleet) close(ctx context.Context) {
	closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	for _, w := range f {
		if w != nil {
			w.Close(closeCtx) //nolint:errcheck // everything was acked; this ends the stream
		}
	}
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

// routeRequests returns --prompts prompts of --route-tokens tokens. Each starts with half of a root
// (as much as the published prompts share with their roots on average), the first a random root and
// the others the roots after it, then blocks nobody has seen and a partial tail. Distinct roots keep
// a run from measuring one hot path of the index only. The requests have no request_id: the --out
// file gets ghz's template, and the driver adds a unique one per call when booking.
func (g *generator) routeRequests() []*kvrouterv1.RouteRequest {
	c := g.c
	n := (c.routeTokens + c.blockSize - 1) / c.blockSize
	shared := int(float64(min(n, c.promptBlocks)) * (c.sharedMin + c.sharedMax) / 2)
	first := g.Rand.IntN(c.roots)
	reqs := make([]*kvrouterv1.RouteRequest, c.prompts)
	for p := range reqs {
		req := &kvrouterv1.RouteRequest{Model: c.model, QueryOnly: c.queryOnly}
		for _, id := range g.IDs(nil, (first+p)%c.roots, shared, n) {
			req.TokenIds = append(req.TokenIds, g.tokens(id)...)
		}
		req.TokenIds = req.TokenIds[:c.routeTokens]
		if c.hashPrompts {
			if err := kvclient.HashPrompt(req, c.blockSize); err != nil {
				panic(err) // the generator's prompts are never empty
			}
		}
		reqs[p] = req
	}
	return reqs
}

// writeRequest writes req as the JSON ghz takes with -D, atomically: the file appears complete or
// not at all, so a script can wait for it. A booking request gets a request id made unique by ghz's
// {{.RequestNumber}} and {{.TimestampUnixNano}} templates.
func writeRequest(path string, req *kvrouterv1.RouteRequest) error {
	if !req.GetQueryOnly() {
		req = proto.CloneOf(req)
		req.RequestId = "kvload-{{.RequestNumber}}-{{.TimestampUnixNano}}"
	}
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
