package policy

import (
	"context"
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

const testBlockSize = 16

// fleet is a real state with a log, for routing tests.
type fleet struct {
	t     *testing.T
	state *kvstate.State
	log   *kvstate.MemLog
}

func newFleet(t *testing.T) *fleet {
	t.Helper()
	state := kvstate.NewState()
	return &fleet{t: t, state: state, log: kvstate.NewMemLog(state)}
}

func (f *fleet) append(c kvstate.Change) kvstate.Result {
	f.t.Helper()
	res, err := f.log.Append(context.Background(), c)
	if err != nil {
		f.t.Fatalf("Append(%T) = %v", c, err)
	}
	return res
}

// add registers a worker rank of model "m".
func (f *fleet) add(id uint64, rank uint32, role kvstate.Role, maxBatched uint64) {
	f.t.Helper()
	f.append(kvstate.WorkerUp{Info: kvstate.WorkerInfo{
		Key: kvstate.WorkerKey{ID: id, Rank: rank}, Model: "m", Role: role, BlockSize: testBlockSize,
		TotalKVBlocks: 1000, MaxNumBatchedTokens: maxBatched, Endpoint: "w", KVEventsEnabled: true,
	}})
}

// cache stores the first n blocks of tokens on the worker, in the device tier.
func (f *fleet) cache(id uint64, tokens []uint32, n int) {
	f.t.Helper()
	local := blockhash.Locals(nil, tokens, testBlockSize, blockhash.Salt("", ""))[:n]
	blocks := make([]kvstate.Block, n)
	for i, h := range local {
		blocks[i] = kvstate.Block{Hash: id<<32 | uint64(i), Local: h}
	}
	w := f.state.Worker(kvstate.WorkerKey{ID: id})
	next := uint64(0)
	if st := w.Status(); st.HasLastEvent {
		next = st.LastEventID + 1
	}
	f.append(kvstate.KVEvents{Worker: kvstate.WorkerKey{ID: id}, Events: []kvstate.Event{
		{ID: next, Tier: kvstate.TierDevice, Kind: kvstate.EventStored, Blocks: blocks},
	}})
}

// router returns a kernel over the fleet whose Route books what it decides, the way server/app
// does, so that tests see each decision's load in the state.
func (f *fleet) router(cfg Config, opts ...Option) *bookingKernel {
	k := NewKernel(StateView(f.state), cfg, append([]Option{WithRand(fixedRand{keepFirst: true})}, opts...)...)
	return &bookingKernel{Kernel: k, f: f}
}

type bookingKernel struct {
	*Kernel
	f *fleet
}

func (b *bookingKernel) Route(ctx context.Context, req *Request) (*Decision, error) {
	dec, err := b.Decide(req, nil)
	if err != nil || req.QueryOnly {
		return dec, err
	}
	if _, err := b.f.log.Append(ctx, kvstate.Booked{Booking: kvstate.Booking{RequestID: req.ID, At: 1000e9, Hops: dec.Load}}); err != nil {
		return nil, err
	}
	dec.Booked = true
	return dec, nil
}

func prompt(n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(i*31 + 7)
	}
	return t
}

func TestRouteAggregatedPicksWarmestWorker(t *testing.T) {
	f := newFleet(t)
	f.add(1, 0, kvstate.RoleAggregated, 0)
	f.add(2, 0, kvstate.RoleAggregated, 0)
	tokens := prompt(8*testBlockSize + 3)
	f.cache(1, tokens, 8)
	f.cache(2, tokens, 2)
	dec, err := f.router(DefaultConfig()).Route(context.Background(), &Request{ID: "r1", Model: "m", Tokens: tokens, Explain: true})
	if err != nil {
		t.Fatalf("Route() = %v", err)
	}
	got := struct {
		Mode            Mode
		Decode          uint64
		Overlap         uint64
		Cached          float64
		Booked          bool
		Blocks          uint64
		CandidateBlocks map[uint64]uint64
	}{dec.Mode, dec.Decode.Worker.Info.Key.ID, dec.Decode.Overlap[kvstate.TierDevice], dec.Decode.CachedTokens, dec.Booked, dec.PromptBlocks, map[uint64]uint64{}}
	for _, c := range dec.Candidates {
		got.CandidateBlocks[c.Worker.Info.Key.ID] = c.Overlap[kvstate.TierDevice]
	}
	want := got
	want.Mode, want.Decode, want.Overlap, want.Cached, want.Booked, want.Blocks = ModeAggregated, 1, 8, 8*testBlockSize, true, 8
	want.CandidateBlocks = map[uint64]uint64{1: 8, 2: 2}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("Route() mismatch (-want +got):\n%s", diff)
	}
	// The booking charges the decode worker its 9 blocks (8 + a partial tail) and the uncached
	// prompt tokens: it prefills itself.
	if diff := cmp.Diff(kvstate.SlotLoad{ActiveBlocks: 9, ActivePrefillTokens: 3, ActiveRequests: 1},
		f.state.Load().Slot(dec.Decode.Worker.Slot)); diff != "" {
		t.Errorf("booked load mismatch (-want +got):\n%s", diff)
	}
}

func TestRouteDisaggregated(t *testing.T) {
	f := newFleet(t)
	f.add(10, 0, kvstate.RolePrefill, 0)
	f.add(11, 0, kvstate.RolePrefill, 0)
	f.add(20, 0, kvstate.RoleDecode, 0)
	f.add(21, 0, kvstate.RoleDecode, 0)
	tokens := prompt(4 * testBlockSize)
	f.cache(11, tokens, 4)
	f.cache(20, tokens, 4) // decode overlap is ignored in plain disaggregation (credit 0 on that hop)
	// Worker 20 is busier: the load-only decode hop must avoid it.
	f.append(kvstate.Booked{Booking: kvstate.Booking{RequestID: "busy", Hops: []kvstate.HopBooking{{Worker: kvstate.WorkerKey{ID: 20}, Blocks: []uint64{1, 2, 3}}}}})

	dec, err := f.router(DefaultConfig()).Route(context.Background(), &Request{ID: "r1", Model: "m", Tokens: tokens})
	if err != nil {
		t.Fatalf("Route() = %v", err)
	}
	if dec.Mode != ModeDisaggregated || dec.Prefill == nil {
		t.Fatalf("Route() mode %v prefill %v, want disaggregated with a prefill worker", dec.Mode, dec.Prefill)
	}
	if got := []uint64{dec.Prefill.Worker.Info.Key.ID, dec.Decode.Worker.Info.Key.ID}; !cmp.Equal(got, []uint64{11, 21}) {
		t.Errorf("Route() chose prefill/decode %v, want [11 21]", got)
	}
	// Prefill carries the uncached tokens (all cached: 0); decode carries 4 blocks and no prefill.
	load := f.state.Load()
	if diff := cmp.Diff(kvstate.SlotLoad{ActiveRequests: 1}, load.Slot(dec.Prefill.Worker.Slot)); diff != "" {
		t.Errorf("prefill load mismatch (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(kvstate.SlotLoad{ActiveBlocks: 4, ActiveRequests: 1}, load.Slot(dec.Decode.Worker.Slot)); diff != "" {
		t.Errorf("decode load mismatch (-want +got):\n%s", diff)
	}
}

func TestRouteQueryOnlyBooksNothing(t *testing.T) {
	f := newFleet(t)
	f.add(1, 0, kvstate.RoleAggregated, 0)
	dec, err := f.router(DefaultConfig()).Route(context.Background(), &Request{Model: "m", Tokens: prompt(40), QueryOnly: true})
	if err != nil {
		t.Fatalf("Route() = %v", err)
	}
	if dec.Booked || f.state.Load().Bookings() != 0 || f.log.Position() != 1 {
		t.Errorf("query-only Route booked %v, bookings %d, log position %d; want nothing booked", dec.Booked, f.state.Load().Bookings(), f.log.Position())
	}
}

func TestRouteErrors(t *testing.T) {
	tokens := prompt(64)
	tests := []struct {
		name  string
		setup func(f *fleet)
		cfg   func(*Config)
		req   Request
		want  error
	}{
		{name: "unknown model", req: Request{ID: "a", Model: "nope", Tokens: tokens}, want: ErrUnknownModel},
		{name: "no decode workers", setup: func(f *fleet) { f.add(1, 0, kvstate.RolePrefill, 0) },
			req: Request{ID: "a", Model: "m", Tokens: tokens}, want: ErrNoWorkers},
		{name: "allow-list excludes everyone", setup: func(f *fleet) { f.add(1, 0, kvstate.RoleDecode, 0) },
			req: Request{ID: "a", Model: "m", Tokens: tokens, AllowedWorkers: []uint64{9}}, want: ErrNoEligibleWorkers},
		{name: "decode pin to an unknown worker", setup: func(f *fleet) { f.add(1, 0, kvstate.RoleDecode, 0) },
			req: Request{ID: "a", Model: "m", Tokens: tokens, DecodePin: &Pin{Worker: 2}}, want: ErrPinnedWorkerNotFound},
		{name: "decode pin to an unknown rank", setup: func(f *fleet) { f.add(1, 0, kvstate.RoleDecode, 0) },
			req: Request{ID: "a", Model: "m", Tokens: tokens, DecodePin: &Pin{Worker: 1, Rank: ptr(uint32(3))}}, want: ErrPinnedWorkerNotFound},
		{name: "enforce_disagg without prefill workers", setup: func(f *fleet) { f.add(1, 0, kvstate.RoleDecode, 0) },
			cfg: func(c *Config) { c.EnforceDisagg = true }, req: Request{ID: "a", Model: "m", Tokens: tokens}, want: ErrDisaggRequired},
		{name: "pinned worker overloaded", setup: func(f *fleet) {
			f.add(1, 0, kvstate.RoleAggregated, 100)
			f.append(kvstate.Booked{Booking: kvstate.Booking{RequestID: "x", Hops: []kvstate.HopBooking{{Worker: kvstate.WorkerKey{ID: 1}, PrefillTokens: 101}}}})
		}, cfg: func(c *Config) { c.QueueThreshold = ptr(1.0) }, req: Request{ID: "a", Model: "m", Tokens: tokens, DecodePin: &Pin{Worker: 1}}, want: ErrPinnedWorkerOverloaded},
		{name: "request id already booked", setup: func(f *fleet) {
			f.add(1, 0, kvstate.RoleAggregated, 0)
			f.append(kvstate.Booked{Booking: kvstate.Booking{RequestID: "a", Hops: []kvstate.HopBooking{{Worker: kvstate.WorkerKey{ID: 1}}}}})
		}, req: Request{ID: "a", Model: "m", Tokens: tokens}, want: kvstate.ErrAlreadyBooked},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFleet(t)
			if tt.setup != nil {
				tt.setup(f)
			}
			cfg := DefaultConfig()
			if tt.cfg != nil {
				tt.cfg(&cfg)
			}
			before := f.state.Load().BookingIDs()
			_, err := f.router(cfg).Route(context.Background(), &tt.req)
			if !errors.Is(err, tt.want) {
				t.Fatalf("Route() = %v, want %v", err, tt.want)
			}
			if diff := cmp.Diff(before, f.state.Load().BookingIDs()); diff != "" {
				t.Errorf("a failed Route changed bookings (-before +after):\n%s", diff)
			}
		})
	}
}

// TestRouteSkipsOverloadedWarmWorker: an overloaded high-overlap worker is excluded and the other
// one chosen (§10.9); without a queue threshold the warm worker wins.
func TestRouteSkipsOverloadedWarmWorker(t *testing.T) {
	f := newFleet(t)
	f.add(1, 0, kvstate.RoleAggregated, 100)
	f.add(2, 0, kvstate.RoleAggregated, 100)
	tokens := prompt(20 * testBlockSize)
	f.cache(1, tokens, 20)
	f.append(kvstate.Booked{Booking: kvstate.Booking{RequestID: "x", Hops: []kvstate.HopBooking{{Worker: kvstate.WorkerKey{ID: 1}, PrefillTokens: 101}}}})
	for _, tt := range []struct {
		threshold *float64
		want      uint64
	}{{nil, 1}, {ptr(1.0), 2}} {
		cfg := DefaultConfig()
		cfg.QueueThreshold = tt.threshold
		dec, err := f.router(cfg).Route(context.Background(), &Request{Model: "m", Tokens: tokens, QueryOnly: true})
		if err != nil {
			t.Fatalf("Route() = %v", err)
		}
		if got := dec.Decode.Worker.Info.Key.ID; got != tt.want {
			t.Errorf("with queue threshold %v Route() chose worker %d, want %d", tt.threshold, got, tt.want)
		}
	}
}

func TestRoutePinsAndAllowList(t *testing.T) {
	f := newFleet(t)
	f.add(1, 0, kvstate.RoleAggregated, 0)
	f.add(2, 0, kvstate.RoleAggregated, 0)
	f.add(2, 1, kvstate.RoleAggregated, 0)
	tokens := prompt(64)
	f.cache(1, tokens, 4)
	tests := []struct {
		name string
		req  Request
		want kvstate.WorkerKey
	}{
		{"no hints: warmest", Request{}, kvstate.WorkerKey{ID: 1}},
		{"pin worker and rank", Request{DecodePin: &Pin{Worker: 2, Rank: ptr(uint32(1))}}, kvstate.WorkerKey{ID: 2, Rank: 1}},
		{"allow-list", Request{AllowedWorkers: []uint64{2}}, kvstate.WorkerKey{ID: 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := tt.req
			req.Model, req.Tokens, req.QueryOnly = "m", tokens, true
			dec, err := f.router(DefaultConfig()).Route(context.Background(), &req)
			if err != nil {
				t.Fatalf("Route() = %v", err)
			}
			if got := dec.Decode.Worker.Info.Key; got != tt.want {
				t.Errorf("Route() chose %v, want %v", got, tt.want)
			}
		})
	}
}

// TestRouteSharedPrefixCountsOnce: a second request sharing a booked prefix adds only its new blocks
// to the worker's projected decode load.
func TestRouteSharedPrefixCountsOnce(t *testing.T) {
	f := newFleet(t)
	f.add(1, 0, kvstate.RoleAggregated, 0)
	r := f.router(DefaultConfig())
	tokens := prompt(4 * testBlockSize)
	if _, err := r.Route(context.Background(), &Request{ID: "a", Model: "m", Tokens: tokens}); err != nil {
		t.Fatalf("Route(a) = %v", err)
	}
	longer := append(append([]uint32(nil), tokens...), prompt(2*testBlockSize)...)
	dec, err := r.Route(context.Background(), &Request{ID: "b", Model: "m", Tokens: longer})
	if err != nil {
		t.Fatalf("Route(b) = %v", err)
	}
	if got := dec.Decode.PotentialDecodeBlocks; got != 6 {
		t.Errorf("potential decode blocks = %d, want 6 (4 active + 2 new)", got)
	}
	if got := f.state.Load().Slot(dec.Decode.Worker.Slot).ActiveBlocks; got != 6 {
		t.Errorf("active blocks after both bookings = %d, want 6", got)
	}
}

// TestStripBypassMarkers: both router-only markers go, exact or as "<marker>:<value>" (§1.5); a
// longer annotation that merely starts with a marker's name stays.
func TestStripBypassMarkers(t *testing.T) {
	tests := []struct {
		name string
		in   []string
		want []string
	}{
		{name: "none", in: []string{"a", "b"}, want: []string{"a", "b"}},
		{name: "bypass", in: []string{"a", "x-bypass-remote-prefill", "x-bypass-remote-prefill:true", "b"}, want: []string{"a", "b"}},
		{name: "prefill continue", in: []string{"a", "x-prefill-continue", "x-prefill-continue:7", "x-prefill-continue:", "b"}, want: []string{"a", "b"}},
		{name: "both", in: []string{"x-prefill-continue", "keep", "x-bypass-remote-prefill"}, want: []string{"keep"}},
		{name: "look-alikes stay", in: []string{"x-bypass-remote-prefillx", "x-prefill-continued", "X-Prefill-Continue"},
			want: []string{"x-bypass-remote-prefillx", "x-prefill-continued", "X-Prefill-Continue"}},
		{name: "empty", in: nil, want: []string{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, StripBypassMarkers(tt.in)); diff != "" {
				t.Errorf("StripBypassMarkers(%q) mismatch (-want +got):\n%s", tt.in, diff)
			}
		})
	}
}
