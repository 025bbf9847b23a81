package app

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/policy"
)

const (
	testBlockSize = 16
	testTimeout   = 10 * time.Second
)

// fleet is a real state and log for dispatch tests; model "m" has 16-token blocks.
type fleet struct {
	t     *testing.T
	state *kvstate.State
	log   *kvstate.MemLog
	now   time.Time
}

func newFleet(t *testing.T) *fleet {
	state := kvstate.NewState()
	return &fleet{t: t, state: state, log: kvstate.NewMemLog(state), now: time.Unix(1000, 0)}
}

func (f *fleet) append(c kvstate.Change) {
	f.t.Helper()
	if _, err := f.log.Append(context.Background(), c); err != nil {
		f.t.Fatalf("Append(%T) = %v", c, err)
	}
}

// add registers worker id (rank 0) of model "m"; it supports bypass.
func (f *fleet) add(id uint64, role kvstate.Role, maxBatched uint64) {
	f.t.Helper()
	f.append(kvstate.WorkerUp{Info: kvstate.WorkerInfo{
		Key: kvstate.WorkerKey{ID: id}, Model: "m", Role: role, BlockSize: testBlockSize, TotalKVBlocks: 1000,
		MaxNumBatchedTokens: maxBatched, Endpoint: "w", KVEventsEnabled: true, SupportsBypass: true,
	}})
}

// cache stores the first n blocks of tokens on worker id, in the device tier.
func (f *fleet) cache(id uint64, tokens []uint32, n int) {
	f.t.Helper()
	local := blockhash.Locals(nil, tokens, testBlockSize, blockhash.Salt("", ""))[:n]
	blocks := make([]kvstate.Block, n)
	for i, h := range local {
		blocks[i] = kvstate.Block{Hash: id<<32 | uint64(i), Local: h}
	}
	f.append(kvstate.KVEvents{Worker: kvstate.WorkerKey{ID: id}, Events: []kvstate.Event{
		{ID: 0, Tier: kvstate.TierDevice, Kind: kvstate.EventStored, Blocks: blocks},
	}})
}

// dispatcher routes over the fleet on the fleet's clock, keeping the first of tied workers.
func (f *fleet) dispatcher(cfg policy.Config) *Dispatcher { return f.cappedDispatcher(cfg, nil) }

// cappedDispatcher is dispatcher with a cap on what bookings hold.
func (f *fleet) cappedDispatcher(cfg policy.Config, cap *BookingCap) *Dispatcher {
	k := policy.NewKernel(policy.StateView(f.state), cfg, policy.WithRand(keepFirst{}))
	return New(f.state, f.log, k, Options{Clock: kvstate.ClockFunc(func() time.Time { return f.now }), Cap: cap})
}

type keepFirst struct{}

func (keepFirst) Float64() float64 { return 0 }
func (keepFirst) IntN(n int) int   { return n - 1 }

func prompt(n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(i*31 + 7)
	}
	return t
}

func request(id string, tokens []uint32) *Request {
	return &Request{Request: policy.Request{ID: id, Model: "m", Tokens: tokens}}
}

// sessionFleet: prefill worker 10, decode workers 21 (cold) and 22, which caches 15 of the 16 blocks
// of a 256-token prompt; conditional disaggregation on, sessions kept for a minute.
func sessionFleet(t *testing.T) (*fleet, *Dispatcher, []uint32) {
	f := newFleet(t)
	f.add(10, kvstate.RolePrefill, 8192)
	f.add(21, kvstate.RoleDecode, 8192)
	f.add(22, kvstate.RoleDecode, 8192)
	tokens := prompt(16 * testBlockSize)
	f.cache(22, tokens, 15)
	cfg := policy.DefaultConfig()
	cfg.ConditionalDisagg.Enabled = true
	cfg.SessionAffinityTTL = time.Minute
	return f, f.dispatcher(cfg), tokens
}

func TestRouteBooksTheDecision(t *testing.T) {
	f, d, tokens := sessionFleet(t)
	dec, err := d.Route(context.Background(), request("r", tokens))
	if err != nil {
		t.Fatalf("Route() = %v", err)
	}
	if !dec.Booked || dec.Mode != policy.ModeBypass {
		t.Fatalf("Route() = %v, booked %v; want a booked bypass", dec.Mode, dec.Booked)
	}
	// The bypassing decode worker carries the request's 16 blocks (15 shared, by sequence hash) and
	// the one uncached block's tokens, from the dispatcher's clock.
	if diff := cmp.Diff(kvstate.SlotLoad{ActiveBlocks: 16, ActivePrefillTokens: 16, ActiveRequests: 1},
		f.state.Load().Slot(dec.Decode.Worker.Slot)); diff != "" {
		t.Errorf("booked load mismatch (-want +got):\n%s", diff)
	}
	query := request("", tokens)
	query.QueryOnly = true
	if dec, err := d.Route(context.Background(), query); err != nil || dec.Booked {
		t.Fatalf("query-only Route() = %v, booked %v; want unbooked", err, dec != nil && dec.Booked)
	}
	if got := f.state.Load().BookingIDs(); !cmp.Equal(got, []string{"r"}) {
		t.Errorf("bookings %v, want only r", got)
	}
}

// TestSessionFollowsItsDecodeWorker: a session's first turn binds it to the decode worker that
// served it; the next turn goes there even when another worker is idler, until the binding expires.
func TestSessionFollowsItsDecodeWorker(t *testing.T) {
	f, d, tokens := sessionFleet(t)
	first := request("turn-1", tokens)
	first.SessionID = "chat"
	dec, err := d.Route(context.Background(), first)
	if err != nil || dec.Decode.Worker.Info.Key.ID != 22 {
		t.Fatalf("first turn = %v, %v; want decode worker 22", dec, err)
	}
	if key, ok := f.state.Session("m", "chat", f.now.UnixNano()); !ok || key.ID != 22 {
		t.Fatalf("session bound to %v (%v), want 22", key, ok)
	}
	// Load 22 so that, without affinity, 21 would win the load-only decode hop of a cold prompt.
	f.append(kvstate.Booked{Booking: kvstate.Booking{RequestID: "busy", Hops: []kvstate.HopBooking{{Worker: kvstate.WorkerKey{ID: 22}, Blocks: []uint64{1, 2, 3}}}}})
	cold := prompt(4096)
	for i := range cold {
		cold[i] += 1 << 30
	}
	turn := func(id string) uint64 {
		r := request(id, cold)
		r.SessionID, r.QueryOnly = "chat", true
		dec, err := d.Route(context.Background(), r)
		if err != nil {
			t.Fatalf("Route(%s) = %v", id, err)
		}
		return dec.Decode.Worker.Info.Key.ID
	}
	if got := turn("turn-2"); got != 22 {
		t.Errorf("second turn went to %d, want 22 (the session's worker)", got)
	}
	f.now = f.now.Add(time.Minute + time.Second) // past session_affinity_ttl
	if got := turn("turn-3"); got != 21 {
		t.Errorf("turn after the binding expired went to %d, want 21 (the idler worker)", got)
	}
}

// TestSessionsAreKeyedByModel: a session id used in two models binds two sessions, one per model's
// decode pool. Before, the second model's booking overwrote the first's binding, and the first
// model's next turn found its session bound to another model's worker: it lost its affinity and
// skipped conditional disaggregation (DECODE_AFFINITY_UNRESOLVED).
func TestSessionsAreKeyedByModel(t *testing.T) {
	f, d, tokens := sessionFleet(t)
	f.append(kvstate.WorkerUp{Info: kvstate.WorkerInfo{Key: kvstate.WorkerKey{ID: 41}, Model: "other", Role: kvstate.RoleAggregated,
		BlockSize: testBlockSize, TotalKVBlocks: 1000, MaxNumBatchedTokens: 8192, Endpoint: "w", KVEventsEnabled: true}})
	turn := func(id, model string) *policy.Decision {
		t.Helper()
		r := request(id, tokens)
		r.Model, r.SessionID = model, "chat"
		dec, err := d.Route(context.Background(), r)
		if err != nil {
			t.Fatalf("Route(%s in %s) = %v", id, model, err)
		}
		return dec
	}
	if dec := turn("m-1", "m"); dec.Decode.Worker.Info.Key.ID != 22 || dec.Mode != policy.ModeBypass {
		t.Fatalf("first turn in m = %v to %d, want a bypass to 22", dec.Mode, dec.Decode.Worker.Info.Key.ID)
	}
	if dec := turn("other-1", "other"); dec.Decode.Worker.Info.Key.ID != 41 {
		t.Fatalf("first turn in other went to %d, want 41", dec.Decode.Worker.Info.Key.ID)
	}
	dec := turn("m-2", "m")
	if dec.Decode.Worker.Info.Key.ID != 22 || dec.Mode != policy.ModeBypass || dec.Reason == policy.ReasonDecodeAffinityUnresolved {
		t.Errorf("second turn in m = %v to %d (%v), want a bypass to 22, the session's worker in m", dec.Mode, dec.Decode.Worker.Info.Key.ID, dec.Reason)
	}
	for model, want := range map[string]uint64{"m": 22, "other": 41} {
		if key, ok := f.state.Session(model, "chat", f.now.UnixNano()); !ok || key.ID != want {
			t.Errorf("session chat of %s bound to %v (%v), want %d", model, key, ok, want)
		}
	}
}

func TestSessionAffinityOff(t *testing.T) {
	f, _, tokens := sessionFleet(t)
	bind := request("bind", prompt(64))
	bind.SessionID, bind.DecodePin = "chat", &policy.Pin{Worker: 21}
	withTTL := f.dispatcher(func() policy.Config {
		c := policy.DefaultConfig()
		c.ConditionalDisagg.Enabled, c.SessionAffinityTTL = true, time.Minute
		return c
	}())
	if _, err := withTTL.Route(context.Background(), bind); err != nil {
		t.Fatalf("Route(bind) = %v", err)
	}
	off := policy.DefaultConfig()
	off.ConditionalDisagg.Enabled = true
	r := request("r", tokens)
	r.SessionID = "chat"
	dec, err := f.dispatcher(off).Route(context.Background(), r)
	if err != nil || dec.Decode.Worker.Info.Key.ID != 22 || dec.Mode != policy.ModeBypass {
		t.Fatalf("Route() with affinity off = %v, %v; want a bypass to 22 (the binding to 21 ignored)", dec, err)
	}
}

func TestEndBooking(t *testing.T) {
	f, d, tokens := sessionFleet(t)
	dec, err := d.Route(context.Background(), request("r", tokens))
	if err != nil {
		t.Fatalf("Route() = %v", err)
	}
	slot := dec.Decode.Worker.Slot
	if err := d.PrefillComplete(context.Background(), "r"); err != nil {
		t.Fatalf("PrefillComplete(r) = %v", err)
	}
	if got := f.state.Load().Slot(slot).ActivePrefillTokens; got != 0 {
		t.Errorf("after PrefillComplete: %d prefill tokens, want 0", got)
	}
	if err := d.Free(context.Background(), "r"); err != nil {
		t.Fatalf("Free(r) = %v", err)
	}
	for _, end := range []func(context.Context, string) error{d.Free, d.PrefillComplete} {
		if err := end(context.Background(), "r"); !errors.Is(err, kvstate.ErrUnknownRequest) {
			t.Errorf("ending a freed booking = %v, want ErrUnknownRequest", err)
		}
	}
	if got := f.state.Load().Bookings(); got != 0 {
		t.Errorf("%d bookings left, want 0", got)
	}
}

// cancelOnBook is a log whose Append of a booking ends the caller's context once the booking is
// applied: the caller leaves at the worst moment.
type cancelOnBook struct {
	kvstate.Log
	cancel context.CancelFunc
}

func (l cancelOnBook) Append(ctx context.Context, c kvstate.Change) (kvstate.Result, error) {
	res, err := l.Log.Append(ctx, c)
	if _, ok := c.(kvstate.Booked); ok {
		l.cancel()
	}
	return res, err
}

// TestCallerGoneUndoesBooking: a Route whose caller left while it was booked frees what it booked.
func TestCallerGoneUndoesBooking(t *testing.T) {
	f := newFleet(t)
	f.add(1, kvstate.RoleAggregated, 8192)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	routeCtx, leave := context.WithCancel(ctx)
	k := policy.NewKernel(policy.StateView(f.state), policy.DefaultConfig())
	d := New(f.state, cancelOnBook{Log: f.log, cancel: leave}, k, Options{})
	_, err := d.Route(routeCtx, &Request{Request: policy.Request{ID: "r", Model: "m", Tokens: prompt(64)}})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("Route() = %v, want context.Canceled", err)
	}
	if n := f.state.Load().Bookings(); n != 0 {
		t.Errorf("%d bookings after the caller left, want 0", n)
	}
}
