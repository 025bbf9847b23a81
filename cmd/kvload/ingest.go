package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// The field numbers the ingest codec writes, taken from the generated descriptors so that they
// cannot drift from proto/kvrouter/v1/worker.proto.
var (
	requestEventsField = fieldNumber(&kvrouterv1.PublishRequest{}, "events")
	batchEventsField   = fieldNumber(&kvrouterv1.EventBatch{}, "events")
	eventIDField       = fieldNumber(&kvrouterv1.KvEvent{}, "event_id")
	eventRankField     = fieldNumber(&kvrouterv1.KvEvent{}, "dp_rank")
)

// ingestInflightMessages is how many full messages of events an ingest stream may have sent and not
// had acked (the Publisher's MaxUnacked, in messages). The router applies one stream's messages one
// after the other, so a few in flight keep it busy while acks travel back; many more would only
// queue events that are then still unapplied, and unacked, when the measured window closes.
const ingestInflightMessages = 8

// rateFlag is --ingest-rate: block events per second, 0 for none, or "max" (stored as -1, as is any
// negative number or +Inf) for as fast as the router acks. A named mode reads better on a command
// line than a magic number, and a negative one is still accepted for scripts that compute the rate.
type rateFlag float64

// String returns the flag's value as Set takes it.
func (r *rateFlag) String() string {
	if *r < 0 {
		return "max"
	}
	return strconv.FormatFloat(float64(*r), 'g', -1, 64)
}

// Set parses "max" or a number of block events per second.
func (r *rateFlag) Set(s string) error {
	if s == "max" {
		*r = -1
		return nil
	}
	v, err := strconv.ParseFloat(s, 64)
	switch {
	case err != nil || math.IsNaN(v):
		return fmt.Errorf("want a number of block events per second or max, got %q", s)
	case v < 0 || math.IsInf(v, 1):
		v = -1
	}
	*r = rateFlag(v)
	return nil
}

// ingestCodec is the gRPC codec of an ingest stream's connection. It writes an EventBatch of churn
// events from bytes marshaled once per pooled prompt, adding only each event's id (and dp_rank), so
// that publishing a million block events a second costs kvload little of the CPU it shares with
// the router: protobuf-encoding 16 token ids per block would cost it about as much as the router
// spends decoding them. The bytes equal proto.Marshal's (fields in number order), so the router
// decodes and applies exactly what a worker would send. Any other message (the hello, a dump, the
// root prefixes published before the window) and every response goes through gRPC's usual proto
// codec. Its name is "proto", and it is set on the ingest connections only (grpc.ForceCodecV2).
type ingestCodec struct {
	stored  map[*kvrouterv1.BlocksStored][]byte
	removed map[*kvrouterv1.BlocksRemoved][]byte
	std     encoding.CodecV2
}

func newIngestCodec() *ingestCodec {
	return &ingestCodec{
		stored: map[*kvrouterv1.BlocksStored][]byte{}, removed: map[*kvrouterv1.BlocksRemoved][]byte{},
		std: encoding.GetCodecV2(grpcproto.Name),
	}
}

// Name returns "proto": the bytes on the wire are protobuf.
func (*ingestCodec) Name() string { return grpcproto.Name }

// add marshals ev (its storage tier and payload; ev has no id yet) once, for every later event
// with the same payload. It must be called before the codec's connection sends anything: the maps
// are read without a lock.
func (ic *ingestCodec) add(ev *kvrouterv1.KvEvent) error {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(ev)
	if err != nil {
		return err
	}
	if s := ev.GetStored(); s != nil {
		ic.stored[s] = b
	} else {
		ic.removed[ev.GetRemoved()] = b
	}
	return nil
}

// body returns the pre-marshaled storage tier and payload of ev, or nil if it has none.
func (ic *ingestCodec) body(ev *kvrouterv1.KvEvent) []byte {
	switch d := ev.GetData().(type) {
	case *kvrouterv1.KvEvent_Stored:
		return ic.stored[d.Stored]
	case *kvrouterv1.KvEvent_Removed:
		return ic.removed[d.Removed]
	}
	return nil
}

// eventHead returns the size of ev's event_id and dp_rank fields, which proto3 leaves out at zero.
func eventHead(ev *kvrouterv1.KvEvent) int {
	n := 0
	if id := ev.GetEventId(); id != 0 {
		n += protowire.SizeTag(eventIDField) + protowire.SizeVarint(id)
	}
	if r := ev.GetDpRank(); r != 0 {
		n += protowire.SizeTag(eventRankField) + protowire.SizeVarint(uint64(r))
	}
	return n
}

// Marshal writes a batch of pooled events from their pre-marshaled bytes into a pooled buffer that
// gRPC frees once sent, and any other message as gRPC's proto codec does.
func (ic *ingestCodec) Marshal(v any) (mem.BufferSlice, error) {
	req, ok := v.(*kvrouterv1.PublishRequest)
	events := req.GetEvents().GetEvents()
	if !ok || len(events) == 0 {
		return ic.std.Marshal(v)
	}
	batch := 0
	for _, ev := range events {
		body := ic.body(ev)
		if body == nil {
			return ic.std.Marshal(v)
		}
		batch += protowire.SizeTag(batchEventsField) + protowire.SizeBytes(eventHead(ev)+len(body))
	}
	pool := mem.DefaultBufferPool()
	buf := pool.Get(protowire.SizeTag(requestEventsField) + protowire.SizeBytes(batch))
	b := protowire.AppendTag((*buf)[:0], requestEventsField, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(batch))
	for _, ev := range events {
		body := ic.body(ev)
		b = protowire.AppendTag(b, batchEventsField, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(eventHead(ev)+len(body)))
		if id := ev.GetEventId(); id != 0 {
			b = protowire.AppendTag(b, eventIDField, protowire.VarintType)
			b = protowire.AppendVarint(b, id)
		}
		if r := ev.GetDpRank(); r != 0 {
			b = protowire.AppendTag(b, eventRankField, protowire.VarintType)
			b = protowire.AppendVarint(b, uint64(r))
		}
		b = append(b, body...)
	}
	*buf = b
	return mem.BufferSlice{mem.NewBuffer(buf, pool)}, nil
}

// Unmarshal decodes a response as gRPC's proto codec does.
func (ic *ingestCodec) Unmarshal(data mem.BufferSlice, v any) error { return ic.std.Unmarshal(data, v) }

// ingester is one extra worker that churns its cache over one Publish stream while Route is
// measured: it stores a new prompt's blocks, then removes the oldest prompt's blocks, over and over,
// so the index keeps its size and the router does the steady work of a busy fleet. Its prompts come
// from a pool built, hashed and marshaled before the window, so the generator costs next to nothing
// during it: a prompt comes back once it has been out of the cache as long as it was in it, and the
// router, which drops a block no worker holds, inserts it again as new.
type ingester struct {
	id       uint64
	conn     *grpc.ClientConn
	pub      *kvclient.Publisher
	stores   []*kvrouterv1.BlocksStored // the pool's prompts: their new blocks, chained onto a root prefix
	removes  []*kvrouterv1.BlocksRemoved
	held     int    // prompts held in steady state: --ingest-cap / --ingest-event-blocks
	first    uint64 // event id of the first churn event: what was published before is the prefill
	next     int    // churn events published so far
	perEvent int    // block events of every churn event
	// published is next, for the reader of the window's figures.
	published atomic.Int64
}

// event returns churn event k: even events store prompt held+k/2 of the pool (counted round it),
// odd ones remove the oldest held prompt, k/2. Each is a new KvEvent, since the Publisher numbers
// the event it is given and keeps it until acked, while the payload is the pool's, read-only.
func (s *ingester) event(k int) *kvrouterv1.KvEvent {
	ev := &kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE}
	if k%2 == 0 {
		ev.Data = &kvrouterv1.KvEvent_Stored{Stored: s.stores[(s.held+k/2)%len(s.stores)]}
	} else {
		ev.Data = &kvrouterv1.KvEvent_Removed{Removed: s.removes[(k/2)%len(s.removes)]}
	}
	return ev
}

// run publishes churn events in messages of chunk events until ctx ends: at rate block events per
// second (event k due at k·perEvent/rate after start, catching up after a late wake-up), or with
// rate < 0 as fast as the Publisher takes them, which is as fast as the router acks. A router that
// falls behind blocks Publish once ingestInflightMessages are unacked, so the schedule slips
// rather than queueing without bound.
func (s *ingester) run(ctx context.Context, rate float64, chunk int) error {
	start := time.Now()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	evs := make([]*kvrouterv1.KvEvent, chunk)
	for ctx.Err() == nil {
		if rate > 0 {
			at := start.Add(time.Duration(float64(s.next*s.perEvent) / rate * float64(time.Second)))
			if wait := time.Until(at); wait > 0 {
				timer.Reset(wait)
				select {
				case <-timer.C:
				case <-ctx.Done():
					return nil
				}
			}
		}
		for i := range evs {
			evs[i] = s.event(s.next + i)
		}
		if err := s.pub.Publish(ctx, evs...); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("ingest worker %d: %w", s.id, err)
		}
		s.next += chunk
		s.published.Store(int64(s.next))
	}
	return nil
}

// acked returns the churn events the router acked so far.
func (s *ingester) acked() int64 {
	last, ok := s.pub.LastAcked()
	if !ok || last < s.first {
		return 0
	}
	return int64(last - s.first + 1)
}

// ingest is the --ingest-streams churning workers.
type ingest struct {
	c       *config
	streams []*ingester
	cancel  context.CancelFunc
	errs    []error
	wg      sync.WaitGroup
	started time.Time
}

// ingestCounts are the block events published and acked over all streams at one moment.
type ingestCounts struct {
	at               time.Time
	published, acked int64
}

// newIngest registers the ingest workers (ids after the seeded ones, same model and role as the
// seeded decode or aggregated workers), each on its own connection as a real worker has, and
// prefills each: the root prefixes its prompts chain onto, kept for the whole run as a fleet keeps
// its system prompts, then --ingest-cap blocks of new prompts. It returns once the router acked all
// of it, so the window starts in steady state. g must have drawn the Route prompts already, so
// that an idle run and a loaded run of one --seed route the same prompts over the same fleet.
func newIngest(ctx context.Context, c *config, g *generator, stderr io.Writer) (*ingest, error) {
	setupCtx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	start := time.Now()
	in := &ingest{c: c}
	roots := g.rootPrefixes()
	for i := range c.ingestStreams {
		s, err := newIngester(setupCtx, c, g, uint64(c.workers+i+1), roots)
		if s != nil {
			in.streams = append(in.streams, s)
		}
		if err != nil {
			in.close(ctx)
			return nil, err
		}
	}
	fmt.Fprintf(stderr, "kvload: registered %d ingest workers, each holding %d root prefix blocks and %d churned blocks in %d-block prompts (pool of %d), in %v\n",
		len(in.streams), c.roots*len(roots[0].GetBlocks()), in.streams[0].held*c.ingestEventBlocks, c.ingestEventBlocks, len(in.streams[0].stores), time.Since(start).Round(time.Millisecond))
	return in, nil
}

// rootPrefixes returns, for each root, a stored event of its first blocks: as many as a prompt
// ever shares with it.
func (g *generator) rootPrefixes() []*kvrouterv1.BlocksStored {
	c := g.c
	n := max(1, int(c.sharedMax*float64(c.promptBlocks)))
	prefixes := make([]*kvrouterv1.BlocksStored, c.roots)
	for r := range prefixes {
		st := &kvrouterv1.BlocksStored{}
		var seq uint64
		for i := range n {
			tokens := g.tokens(kvtest.RootBlock(r, i))
			if local := blockhash.Local(tokens, g.salt); i == 0 {
				seq = local
			} else {
				seq = blockhash.Chain(seq, local)
			}
			st.Blocks = append(st.Blocks, &kvrouterv1.StoredBlock{BlockHash: seq, TokenIds: tokens})
		}
		prefixes[r] = st
	}
	return prefixes
}

// churnPool returns n prompts: each a draw of root and shared length as the seeded prompts make,
// whose blocks after the shared ones (blocks of them, all new) chain onto the root prefix.
func (g *generator) churnPool(roots []*kvrouterv1.BlocksStored, n, blocks int) []*kvrouterv1.BlocksStored {
	pool := make([]*kvrouterv1.BlocksStored, n)
	for p := range pool {
		root, shared := g.Draw(g.c.promptBlocks)
		shared = min(shared, len(roots[root].GetBlocks()))
		st := &kvrouterv1.BlocksStored{Blocks: make([]*kvrouterv1.StoredBlock, blocks)}
		var seq uint64
		if shared > 0 {
			seq = roots[root].GetBlocks()[shared-1].GetBlockHash()
			st.ParentHash = proto.Uint64(seq)
		}
		first := g.NewIDs(blocks)
		for i := range blocks {
			tokens := g.tokens(first + uint64(i))
			if local := blockhash.Local(tokens, g.salt); i == 0 && shared == 0 {
				seq = local
			} else {
				seq = blockhash.Chain(seq, local)
			}
			st.Blocks[i] = &kvrouterv1.StoredBlock{BlockHash: seq, TokenIds: tokens}
		}
		pool[p] = st
	}
	return pool
}

// newIngester builds worker id's pool and codec, opens its connection and Publish stream and
// prefills it.
func newIngester(ctx context.Context, c *config, g *generator, id uint64, roots []*kvrouterv1.BlocksStored) (*ingester, error) {
	held := c.ingestCap / c.ingestEventBlocks
	s := &ingester{id: id, held: held, perEvent: c.ingestEventBlocks}
	s.stores = g.churnPool(roots, 2*held, c.ingestEventBlocks)
	codec := newIngestCodec()
	for _, st := range s.stores {
		rm := &kvrouterv1.BlocksRemoved{BlockHashes: make([]uint64, len(st.GetBlocks()))}
		for i, b := range st.GetBlocks() {
			rm.BlockHashes[i] = b.GetBlockHash()
		}
		s.removes = append(s.removes, rm)
		for _, ev := range []*kvrouterv1.KvEvent{
			{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}},
			{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Removed{Removed: rm}},
		} {
			if err := codec.add(ev); err != nil {
				return nil, err
			}
		}
	}
	conn, err := grpc.NewClient(c.addr, c.dialOptions(kvclient.WithKeepalive(),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(codec), grpc.MaxCallSendMsgSize(64<<20)))...)
	if err != nil {
		return nil, err
	}
	s.conn = conn
	role := kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED
	if c.prefill > 0 {
		role = kvrouterv1.WorkerRole_WORKER_ROLE_DECODE
	}
	s.pub, err = kvclient.NewPublisher(kvclient.PublisherOptions{
		Hello: &kvrouterv1.WorkerHello{
			WorkerId: id, Model: c.model, Role: role, BlockSize: uint32(c.blockSize),
			TotalKvBlocks: 1 << 20, MaxNumBatchedTokens: 8192, Endpoint: fmt.Sprintf("kvload-ingest-%d:8000", id),
			KvEventsEnabled: true, FreshStart: true,
		},
		Conns: []grpc.ClientConnInterface{conn}, MaxBatchEvents: c.ingestBatch, MaxUnacked: ingestInflightMessages * c.ingestBatch,
		// No Dump: a router that asks this worker for a resync lost events it should not have, and
		// the run had better stop with that error than measure something else.
	})
	if err != nil {
		conn.Close()
		return nil, err
	}
	var prefill []*kvrouterv1.KvEvent
	for _, st := range roots {
		prefill = append(prefill, &kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}})
	}
	for _, st := range s.stores[:held] {
		prefill = append(prefill, &kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}})
	}
	// Publish takes at most MaxUnacked events at once.
	for i := 0; i < len(prefill) && err == nil; i += c.ingestBatch {
		err = s.pub.Publish(ctx, prefill[i:min(i+c.ingestBatch, len(prefill))]...)
	}
	if err == nil {
		err = s.pub.Flush(ctx)
	}
	if err != nil {
		return s, fmt.Errorf("ingest worker %d: prefill: %w", id, err)
	}
	s.first = uint64(len(prefill))
	return s, nil
}

// start starts churning on every stream.
func (in *ingest) start(ctx context.Context) {
	ctx, in.cancel = context.WithCancel(ctx)
	in.started = time.Now()
	in.errs = make([]error, len(in.streams))
	rate := float64(in.c.ingestRate)
	for i, s := range in.streams {
		in.wg.Go(func() { in.errs[i] = s.run(ctx, rate, in.c.ingestBatch) })
	}
}

// counts returns the block events published and acked so far.
func (in *ingest) counts() ingestCounts {
	n := ingestCounts{at: time.Now()}
	for _, s := range in.streams {
		n.published += s.published.Load() * int64(s.perEvent)
		n.acked += s.acked() * int64(s.perEvent)
	}
	return n
}

// stop stops churning and returns why a stream stopped early, if one did.
func (in *ingest) stop() error {
	if in.cancel == nil {
		return nil
	}
	in.cancel()
	in.wg.Wait()
	in.cancel = nil
	return errors.Join(in.errs...)
}

// close stops churning and closes the streams once what was published is acked. The router keeps
// the workers for its --worker-grace-period, as it keeps the seeded ones.
func (in *ingest) close(ctx context.Context) {
	in.stop() //nolint:errcheck // the caller reported it
	closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	for _, s := range in.streams {
		if s.pub != nil {
			s.pub.Close(closeCtx) //nolint:errcheck // a failure was reported by stop
		}
		s.conn.Close()
	}
}

// ingestReport is what the ingest streams did over the measured window: the block events (a stored
// block or a removed hash each, as BenchmarkRouteUnderIngestion counts them) published and acked
// by the router, per second. Acked is what counts: an ack comes once the events are applied.
type ingestReport struct {
	Streams        int     `json:"streams"`
	Rate           float64 `json:"rate_per_stream"` // asked for, block events/s; -1: as fast as acked
	EventBlocks    int     `json:"event_blocks"`
	BatchEvents    int     `json:"batch_events"`
	CapBlocks      int     `json:"cap_blocks"`
	Seconds        float64 `json:"seconds"`
	Published      int64   `json:"published_block_events"`
	Acked          int64   `json:"acked_block_events"`
	AckedRate      float64 `json:"acked_rate"`            // block events/s, all streams
	AckedPerStream float64 `json:"acked_rate_per_stream"` // block events/s, one stream on average
}

func newIngestReport(c *config, from, to ingestCounts) *ingestReport {
	r := &ingestReport{
		Streams: c.ingestStreams, Rate: float64(c.ingestRate), EventBlocks: c.ingestEventBlocks, BatchEvents: c.ingestBatch,
		CapBlocks: c.ingestCap, Seconds: to.at.Sub(from.at).Seconds(),
		Published: to.published - from.published, Acked: to.acked - from.acked,
	}
	if r.Seconds > 0 {
		r.AckedRate = float64(r.Acked) / r.Seconds
		r.AckedPerStream = r.AckedRate / float64(r.Streams)
	}
	return r
}

func (r *ingestReport) write(w io.Writer) {
	rate := "as fast as acked"
	if r.Rate >= 0 {
		rate = fmt.Sprintf("at %.0f block events/s each", r.Rate)
	}
	streams := "streams"
	if r.Streams == 1 {
		streams = "stream"
	}
	fmt.Fprintf(w, "  ingest:   %d Publish %s %s (store a %d-block prompt, remove the oldest past %d blocks; %d events per message)\n",
		r.Streams, streams, rate, r.EventBlocks, r.CapBlocks, r.BatchEvents)
	fmt.Fprintf(w, "            %d block events acked in %.2f s: %.0f/s, %.0f/s per stream (%d published)\n",
		r.Acked, r.Seconds, r.AckedRate, r.AckedPerStream, r.Published)
}
