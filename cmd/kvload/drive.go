package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime/pprof"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// The field numbers kvload writes and reads without the generated code, taken from the generated
// descriptors so that they cannot drift from proto/kvrouter/v1/router.proto.
var (
	routeIDField = fieldNumber(&kvrouterv1.RouteRequest{}, "request_id")
	freeIDField  = fieldNumber(&kvrouterv1.FreeRequest{}, "request_id")
	modeField    = fieldNumber(&kvrouterv1.RouteResponse{}, "mode")
	bookedField  = fieldNumber(&kvrouterv1.RouteResponse{}, "booked")
)

func fieldNumber(m proto.Message, name string) protowire.Number {
	return m.ProtoReflect().Descriptor().Fields().ByName(protoreflect.Name(name)).Number()
}

// lateAfter is how far past its due time an open-loop call may start and still count as on time.
// Beyond it the client (its CPU or the in-flight cap), not the router, held the call back.
const lateAfter = time.Millisecond

// rawCodec is the gRPC codec of the calls kvload drives. It sends pre-marshaled request bytes as
// they are and reads only what kvload checks of a response, so a call costs the client no protobuf
// encoding: what ghz spends most of its CPU on. Its name is "proto", so the content-type stays
// application/grpc+proto and the router decodes the bytes with its usual codec. It is set on the
// driving connections only (grpc.ForceCodecV2), never registered, so nothing else in the process
// goes through it.
type rawCodec struct{}

// Name returns "proto": the bytes on the wire are protobuf.
func (rawCodec) Name() string { return "proto" }

// Marshal returns an outgoing message's bytes: the pre-marshaled body as is, or, for a message with
// a request id, the id field followed by the body in a pooled buffer that gRPC frees once sent.
func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(*outgoing)
	if !ok {
		return nil, fmt.Errorf("kvload codec: cannot marshal %T", v)
	}
	if m.idField == 0 {
		return mem.BufferSlice{mem.SliceBuffer(m.body)}, nil
	}
	var digits [20]byte
	num := strconv.AppendUint(digits[:0], m.n, 10)
	idLen := len(m.prefix) + len(num)
	pool := mem.DefaultBufferPool()
	buf := pool.Get(protowire.SizeTag(m.idField) + protowire.SizeBytes(idLen) + len(m.body))
	b := protowire.AppendTag((*buf)[:0], m.idField, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(idLen))
	b = append(append(append(b, m.prefix...), num...), m.body...)
	*buf = b
	return mem.BufferSlice{mem.NewBuffer(buf, pool)}, nil
}

// Unmarshal reads a response into a *reply.
func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	r, ok := v.(*reply)
	if !ok {
		return fmt.Errorf("kvload codec: cannot unmarshal into %T", v)
	}
	if len(data) == 1 {
		return r.parse(data[0].ReadOnlyData())
	}
	return r.parse(data.Materialize())
}

// outgoing is one call's request: body, pre-marshaled, preceded when idField is set by that string
// field holding prefix and n in decimal, the call's request id. Protobuf parsers accept fields in
// any order, so prepending the id to a request marshaled without one is a valid request.
type outgoing struct {
	idField protowire.Number
	prefix  string
	n       uint64
	body    []byte
}

// reply is what kvload reads of a response: RouteResponse's mode and booked, found by walking the
// top-level fields and skipping the others undecoded. A FreeResponse is empty and reads as zero.
type reply struct {
	mode   kvrouterv1.RouteMode
	booked bool
}

func (r *reply) parse(b []byte) error {
	*r = reply{}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if typ == protowire.VarintType && (num == modeField || num == bookedField) {
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			if num == modeField {
				r.mode = kvrouterv1.RouteMode(v)
			} else {
				r.booked = v != 0
			}
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
	}
	return nil
}

// badResponse is the error key of a call that succeeded with a response that is not a decision
// (no mode) or booked when it should not have (or the reverse).
const badResponse = "BAD_RESPONSE"

// driver sends Route calls, each the next of the pre-marshaled prompts on the next connection.
type driver struct {
	conns   []*grpc.ClientConn
	bodies  [][]byte // the prompts' RouteRequests without request_id, marshaled once
	booking bool
	free    bool
	prefix  string // request ids are prefix and the call number: unique across kvload runs
	next    atomic.Uint64
}

// newDriver marshals the requests and opens c.conns connections, each its own HTTP/2 connection:
// one connection's reader and writer goroutines serialize its calls, too few for the router's
// cores. It waits until they are connected, so the first calls do not pay for the handshakes.
func newDriver(ctx context.Context, c *config, reqs []*kvrouterv1.RouteRequest) (*driver, error) {
	d := &driver{booking: !c.queryOnly, free: c.free, prefix: fmt.Sprintf("kvload-%08x-", rand.Uint32())}
	for _, req := range reqs {
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
		if err != nil {
			return nil, err
		}
		d.bodies = append(d.bodies, b)
	}
	for range c.conns {
		conn, err := grpc.NewClient(c.addr, c.dialOptions(grpc.WithDefaultCallOptions(grpc.ForceCodecV2(rawCodec{})))...)
		if err != nil {
			d.close()
			return nil, err
		}
		d.conns = append(d.conns, conn)
	}
	readyCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for _, conn := range d.conns {
		conn.Connect()
		for s := conn.GetState(); s != connectivity.Ready; s = conn.GetState() {
			if !conn.WaitForStateChange(readyCtx, s) {
				d.close()
				return nil, fmt.Errorf("connecting to %s: %w (last state %v)", c.addr, readyCtx.Err(), s)
			}
		}
	}
	return d, nil
}

func (d *driver) close() {
	for _, conn := range d.conns {
		conn.Close()
	}
}

// tally is what one caller saw: the latencies of its successful calls and its failures by code.
// Each caller keeps its own, merged at the end, so callers never contend.
type tally struct {
	lat      []time.Duration
	errs     map[string]int
	freeErrs map[string]int
	late     int // open loop: calls that started more than lateAfter past their due time
	capped   int // open loop: calls due while --max-inflight calls were in flight
}

func newTally() *tally { return &tally{errs: map[string]int{}, freeErrs: map[string]int{}} }

// call sends the next Route call and, when booking with --free, frees its booking. The latency
// recorded is the Route call's, from due (its start in a closed loop, its due time in an open
// one) to its response; the Free after it is not timed.
func (d *driver) call(ctx context.Context, due time.Time, r *reply, t *tally) {
	n := d.next.Add(1) - 1
	conn := d.conns[n%uint64(len(d.conns))]
	req := &outgoing{body: d.bodies[n%uint64(len(d.bodies))]}
	if d.booking {
		req.idField, req.prefix, req.n = routeIDField, d.prefix, n
	}
	err := conn.Invoke(ctx, kvrouterv1.RouterService_Route_FullMethodName, req, r)
	lat := time.Since(due)
	switch {
	case err != nil:
		t.errs[status.Code(err).String()]++
		return
	case r.mode == kvrouterv1.RouteMode_ROUTE_MODE_UNSPECIFIED || r.booked != d.booking:
		t.errs[badResponse]++
		return
	}
	t.lat = append(t.lat, lat)
	if d.booking && d.free {
		free := &outgoing{idField: freeIDField, prefix: d.prefix, n: n}
		if err := conn.Invoke(ctx, kvrouterv1.RouterService_Free_FullMethodName, free, r); err != nil {
			t.freeErrs[status.Code(err).String()]++
		}
	}
}

// closed runs a closed loop: callers goroutines, each sending its next call when the previous
// returns, until calls calls were sent (calls > 0) or until passes (otherwise). With no callers it
// sends nothing and waits until until: a window of ingest alone.
func (d *driver) closed(ctx context.Context, callers, calls int, until time.Time) []*tally {
	if callers == 0 {
		select {
		case <-time.After(time.Until(until)):
		case <-ctx.Done():
		}
		return nil
	}
	var sent atomic.Int64
	tallies := make([]*tally, callers)
	var wg sync.WaitGroup
	for i := range tallies {
		t := newTally()
		tallies[i] = t
		wg.Go(func() {
			var r reply
			for ctx.Err() == nil {
				if (calls > 0 && sent.Add(1) > int64(calls)) || (calls == 0 && !time.Now().Before(until)) {
					return
				}
				d.call(ctx, time.Now(), &r, t)
			}
		})
	}
	wg.Wait()
	return tallies
}

// open runs an open loop: calls calls, call i due at start + i/rate whatever the latency, sent by
// maxInflight goroutines. Latency counts from the due time, so a call held back (the router slow to
// answer the calls before it, every goroutine busy, kvload short of CPU) shows as latency instead of
// silently lowering the rate: no coordinated omission. The schedule catches up after a late wake-up.
func (d *driver) open(ctx context.Context, calls int, rate float64, maxInflight int) []*tally {
	due := make(chan time.Time)
	var inflight atomic.Int64 // calls handed to a goroutine and not answered yet
	tallies := make([]*tally, maxInflight+1)
	sched := newTally()
	tallies[maxInflight] = sched
	var wg sync.WaitGroup
	for i := range maxInflight {
		t := newTally()
		tallies[i] = t
		wg.Go(func() {
			var r reply
			for at := range due {
				if time.Since(at) > lateAfter {
					t.late++
				}
				d.call(ctx, at, &r, t)
				inflight.Add(-1)
			}
		})
	}
	start := time.Now()
	for i := 0; i < calls && ctx.Err() == nil; i++ {
		at := start.Add(time.Duration(float64(i) / rate * float64(time.Second)))
		if wait := time.Until(at); wait > 0 {
			time.Sleep(wait)
		}
		if inflight.Add(1) > int64(maxInflight) {
			sched.capped++
		}
		select {
		case due <- at:
		case <-ctx.Done():
		}
	}
	close(due)
	wg.Wait()
	return tallies
}

// phase is one run of calls: the warmup or the measured one.
type phase struct {
	start, end time.Time
	tally
}

// phase sends calls calls (or calls for dur when calls is 0) in the configured loop, and merges
// what the callers saw.
func (d *driver) phase(ctx context.Context, c *config, calls int, dur time.Duration) *phase {
	p := &phase{start: time.Now(), tally: *newTally()}
	var tallies []*tally
	if c.rate > 0 {
		if calls == 0 {
			calls = max(1, int(c.rate*dur.Seconds()))
		}
		tallies = d.open(ctx, calls, c.rate, c.maxInflight)
	} else {
		tallies = d.closed(ctx, c.concurrency, calls, p.start.Add(dur))
	}
	p.end = time.Now()
	for _, t := range tallies {
		p.lat = append(p.lat, t.lat...)
		for code, n := range t.errs {
			p.errs[code] += n
		}
		for code, n := range t.freeErrs {
			p.freeErrs[code] += n
		}
		p.late += t.late
		p.capped += t.capped
	}
	return p
}

// drive runs the warmup calls, then the measured ones, reading both processes' CPU time around the
// measured ones only. With in, the ingest streams churn from before the warmup calls (at least
// --ingest-warmup before the measured ones, so the router is in its steady state) until the measured
// calls end, and their acked block events are read around the measured calls, as the CPU is.
func drive(ctx context.Context, c *config, reqs []*kvrouterv1.RouteRequest, in *ingest) (*report, error) {
	d, err := newDriver(ctx, c, reqs)
	if err != nil {
		return nil, err
	}
	defer d.close()
	server := serverCPU(c)
	if in != nil {
		in.start(ctx)
		defer in.stop() //nolint:errcheck // stopped and checked below, unless the run failed earlier
	}
	if c.warmup > 0 {
		d.phase(ctx, c, c.warmup, 0)
	}
	var ingest0, ingest1 ingestCounts
	if in != nil {
		select {
		case <-time.After(time.Until(in.started.Add(c.ingestWarmup))):
		case <-ctx.Done():
		}
		ingest0 = in.counts()
	}
	var server0, server1 float64
	if server != nil {
		if server0, err = server(ctx); err != nil {
			return nil, fmt.Errorf("reading the server's CPU time: %w", err)
		}
	}
	stopProfile, err := startProfile(c.cpuProfile)
	if err != nil {
		return nil, err
	}
	client0 := processCPU()
	p := d.phase(ctx, c, c.requests, c.duration)
	client1 := processCPU()
	stopProfile()
	if in != nil {
		ingest1 = in.counts()
		if err := in.stop(); err != nil {
			return nil, err
		}
	}
	if server != nil {
		if server1, err = server(ctx); err != nil {
			return nil, fmt.Errorf("reading the server's CPU time: %w", err)
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("interrupted: %w", err)
	}
	r := newReport(c, p, client1-client0)
	if server != nil {
		r.setServerCPU(server1 - server0)
	}
	if in != nil {
		r.Ingest = newIngestReport(c, ingest0, ingest1)
	}
	return r, nil
}

// startProfile starts a CPU profile into path (none when path is empty) and returns its stop.
func startProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}
