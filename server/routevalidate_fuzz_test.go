package server

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
)

// fuzzMaxPromptTokens is max_prompt_tokens of FuzzRouteValidation's router: small, so that the
// fuzzer reaches it.
const fuzzMaxPromptTokens = 64

// fuzzBlockSize is the block size of FuzzRouteValidation's workers.
const fuzzBlockSize = 4

// fuzzSetupBooking is the request id of the booking every FuzzRouteValidation router starts with.
const fuzzSetupBooking = "setup"

// fuzzClock is the dispatcher's clock: bookings and sessions do not depend on when the fuzzer runs.
var fuzzClock = time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)

// fuzzRouter is a RouterService over a small fleet, its state built directly through the log:
//
//   - model "m" (block size 4): prefill workers 1/0, 2/0 and 2/1; decode workers 3/0 (takes bypasses,
//     holds the first 8 blocks of promptTokens), 4/0 and 4/1 (no bypass);
//   - model "agg" (block size 4): aggregated workers 5/0 (holds the first 4 blocks) and 6/0;
//   - a booking, fuzzSetupBooking: prefill tokens on 1/0, and session "s1" bound to decode worker 3/0.
//
// The routing configuration is one of fuzzConfigs; ties between workers break the same way every
// time, so that an input routes the same way whenever it runs.
type fuzzRouter struct {
	state *kvstate.State
	log   *kvstate.MemLog
	disp  *app.Dispatcher
	svc   *routerService
}

// fuzzConfigs are the routing configurations FuzzRouteValidation routes with.
var fuzzConfigs = []struct {
	name   string
	change func(*policy.Config)
}{
	{"defaults", func(*policy.Config) {}},
	{"conditional disaggregation and sessions", func(c *policy.Config) {
		busy := 0.9
		c.ConditionalDisagg.Enabled, c.ConditionalDisagg.DecodeBusyThreshold = true, &busy
		c.SessionAffinityTTL = 10 * time.Minute
	}},
	{"queue threshold 0 (1/0 overloaded), enforce_disagg, wspt", func(c *policy.Config) {
		zero := 0.0
		c.QueueThreshold, c.EnforceDisagg, c.QueuePolicy, c.QueueMaxDepth = &zero, true, policy.QueuePolicyWSPT, 1
	}},
	{"no KV events", func(c *policy.Config) { c.UseKVEvents = false }},
}

func newFuzzRouter(t *testing.T, config int) *fuzzRouter {
	t.Helper()
	cfg := policy.DefaultConfig()
	fuzzConfigs[config].change(&cfg)
	if err := cfg.Validate(); err != nil {
		t.Fatalf("configuration %q: %v", fuzzConfigs[config].name, err)
	}
	state := kvstate.NewState()
	log := kvstate.NewMemLog(state)
	ctx := context.Background()
	apply := func(c kvstate.Change) {
		t.Helper()
		if _, err := log.Append(ctx, c); err != nil {
			t.Fatalf("Append(%T) = %v", c, err)
		}
	}
	worker := func(id uint64, rank uint32, model string, role kvstate.Role, bypass bool) kvstate.WorkerKey {
		key := kvstate.WorkerKey{ID: id, Rank: rank}
		apply(kvstate.WorkerUp{Info: kvstate.WorkerInfo{Key: key, Model: model, Role: role, BlockSize: fuzzBlockSize, TotalKVBlocks: 100,
			MaxNumBatchedTokens: 8192, Endpoint: "10.0.0.1:8000", SupportsBypass: bypass, KVEventsEnabled: true}})
		return key
	}
	locals := blockhash.Locals(nil, promptTokens(8), 4, blockhash.Salt("", ""))
	store := func(key kvstate.WorkerKey, blocks int) {
		ev := kvstate.Event{Tier: kvstate.TierDevice, Kind: kvstate.EventStored}
		for i, local := range locals[:blocks] {
			ev.Blocks = append(ev.Blocks, kvstate.Block{Hash: key.ID<<32 | uint64(i+1), Local: local})
		}
		apply(kvstate.KVEvents{Worker: key, Events: []kvstate.Event{ev}})
	}
	p1 := worker(1, 0, "m", kvstate.RolePrefill, false)
	worker(2, 0, "m", kvstate.RolePrefill, false)
	worker(2, 1, "m", kvstate.RolePrefill, false)
	d3 := worker(3, 0, "m", kvstate.RoleDecode, true)
	worker(4, 0, "m", kvstate.RoleDecode, false)
	worker(4, 1, "m", kvstate.RoleDecode, false)
	a5 := worker(5, 0, "agg", kvstate.RoleAggregated, true)
	worker(6, 0, "agg", kvstate.RoleAggregated, true)
	store(p1, 2)
	store(d3, 8)
	store(a5, 4)
	apply(kvstate.Booked{Booking: kvstate.Booking{RequestID: fuzzSetupBooking, At: fuzzClock.UnixNano(),
		Hops:    []kvstate.HopBooking{{Worker: p1, PrefillTokens: 100}, {Worker: d3, Blocks: []uint64{1, 2}}},
		Session: "s1", SessionExpires: fuzzClock.Add(time.Hour).UnixNano()}})

	kernel := policy.NewKernel(policy.StateView(state), cfg, policy.WithRand(rand.New(rand.NewPCG(1, 2)))) // ties break the same way every run of an input
	disp := app.New(state, log, kernel, app.Options{Clock: kvstate.ClockFunc(func() time.Time { return fuzzClock })})
	svc := &routerService{dispatcher: disp, maxPromptTokens: fuzzMaxPromptTokens,
		metrics: newMetrics(prometheus.NewRegistry(), kvstate.OneShard{Shard: &kvstate.Shard{State: state, Log: log}}, kvstate.NewPresence(), disp),
		logger:  slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	return &fuzzRouter{state: state, log: log, disp: disp, svc: svc}
}

// fuzzRouteSeeds are requests of the server's tests (TestRouteValidation, TestBookingLifecycle,
// TestRouteAfterPublish, bypass_test.go) and the walkthrough, good and bad.
func fuzzRouteSeeds() []*kvrouterv1.RouteRequest {
	u64 := func(v uint64) *uint64 { return &v }
	u32 := func(v uint32) *uint32 { return &v }
	f := func(v float64) *float64 { return &v }
	b := func(v bool) *bool { return &v }
	s := func(v string) *string { return &v }
	valid := func() *kvrouterv1.RouteRequest {
		return &kvrouterv1.RouteRequest{RequestId: "r", Model: "m", TokenIds: promptTokens(2)}
	}
	with := func(change func(*kvrouterv1.RouteRequest)) *kvrouterv1.RouteRequest {
		r := valid()
		change(r)
		return r
	}
	return []*kvrouterv1.RouteRequest{
		valid(),
		{RequestId: "req-1", Model: "agg", Explain: true, TokenIds: append(promptTokens(8), 33, 34)},
		{Model: "m", TokenIds: promptTokens(8), QueryOnly: true, Explain: true},
		{RequestId: "q", Model: "agg", TokenIds: promptTokens(3), QueryOnly: true, SessionId: "s1"},
		{RequestId: "r", Model: "m", TokenIds: promptTokens(16), SessionId: "s1",
			Annotations: []string{"keep", policy.BypassAnnotation, policy.BypassAnnotation + ":forged",
				policy.PrefillContinueAnnotation, policy.PrefillContinueAnnotation + ":forged"}},
		{RequestId: fuzzSetupBooking, Model: "m", TokenIds: promptTokens(1)},
		{RequestId: "lora", Model: "m", TokenIds: promptTokens(4), LoraName: "adapter", CacheNamespace: "tenant"},
		{Model: "m", TokenIds: promptTokens(4), QueryOnly: true, MultimodalObjects: []*kvrouterv1.MultimodalObject{{MmHash: 7, Start: 3, End: 9}, {MmHash: 1 << 63, Start: 9, End: 16}}},
		{Model: "agg", TokenIds: promptTokens(4), QueryOnly: true, MultimodalObjects: []*kvrouterv1.MultimodalObject{{MmHash: 7, Start: 8, End: 12}, {MmHash: 8, Start: 2, End: 9}}},
		{Model: "m", TokenIds: promptTokens(2), QueryOnly: true, MultimodalObjects: []*kvrouterv1.MultimodalObject{{MmHash: 7, Start: 2, End: 2}}},
		// Hashed prompts: valid, booking and not; another block size; hashes without their size or
		// count; token ids beside them.
		{Model: "m", BlockHashes: blockhash.Locals(nil, promptTokens(8), fuzzBlockSize, blockhash.Salt("", "")), BlockSize: fuzzBlockSize, PromptTokens: 10, QueryOnly: true},
		{RequestId: "hashed", Model: "agg", BlockHashes: blockhash.Locals(nil, promptTokens(4), fuzzBlockSize, blockhash.Salt("", "")), BlockSize: fuzzBlockSize, PromptTokens: 4},
		{Model: "m", BlockHashes: []uint64{1, 2}, BlockSize: 8, PromptTokens: 16, QueryOnly: true},
		{Model: "m", BlockHashes: []uint64{1, 2}, QueryOnly: true},
		{Model: "m", BlockHashes: []uint64{1, 2}, BlockSize: fuzzBlockSize, PromptTokens: 12, QueryOnly: true},
		{Model: "m", BlockSize: fuzzBlockSize, PromptTokens: 3, TokenIds: promptTokens(1), QueryOnly: true},
		{Model: "m", BlockSize: fuzzBlockSize, PromptTokens: 3, LoraName: "adapter", QueryOnly: true},
		{Model: "m", TokenIds: promptTokens(2), PromptTokens: 48, QueryOnly: true},
		// TestRouteValidation.
		with(func(r *kvrouterv1.RouteRequest) { r.Model = "" }),
		with(func(r *kvrouterv1.RouteRequest) { r.Model = "other" }),
		with(func(r *kvrouterv1.RouteRequest) { r.TokenIds = nil }),
		with(func(r *kvrouterv1.RouteRequest) { r.TokenIds = make([]uint32, fuzzMaxPromptTokens+1) }),
		with(func(r *kvrouterv1.RouteRequest) { r.RequestId = "" }),
		with(func(r *kvrouterv1.RouteRequest) { r.RequestId = strings.Repeat("x", maxRequestIDBytes+1) }),
		with(func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{OverlapScoreCredit: f(math.NaN())}
		}),
		with(func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{RouterTemperature: f(-1)}
		}),
		with(func(r *kvrouterv1.RouteRequest) { r.Hints = &kvrouterv1.RoutingHints{DecodeDpRank: u32(1)} }),
		with(func(r *kvrouterv1.RouteRequest) { r.Hints = &kvrouterv1.RoutingHints{PrefillDpRank: u32(1)} }),
		with(func(r *kvrouterv1.RouteRequest) { r.Hints = &kvrouterv1.RoutingHints{DecodeWorkerId: u64(9)} }),
		// Pins and allow-lists.
		with(func(r *kvrouterv1.RouteRequest) {
			r.Hints = &kvrouterv1.RoutingHints{PrefillWorkerId: u64(2), PrefillDpRank: u32(1), DecodeWorkerId: u64(4), DecodeDpRank: u32(1)}
		}),
		with(func(r *kvrouterv1.RouteRequest) { r.Hints = &kvrouterv1.RoutingHints{PrefillWorkerId: u64(1)} }),
		with(func(r *kvrouterv1.RouteRequest) { r.Hints = &kvrouterv1.RoutingHints{DecodeWorkerId: u64(4)} }),
		with(func(r *kvrouterv1.RouteRequest) { r.Hints = &kvrouterv1.RoutingHints{AllowedWorkerIds: []uint64{1, 3}} }),
		with(func(r *kvrouterv1.RouteRequest) { r.Hints = &kvrouterv1.RoutingHints{AllowedWorkerIds: []uint64{5, 6}} }),
		with(func(r *kvrouterv1.RouteRequest) {
			r.Model, r.Hints = "agg", &kvrouterv1.RoutingHints{DecodeWorkerId: u64(6), AllowedWorkerIds: []uint64{5}}
		}),
		// Overrides (bypass_test.go).
		with(func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{OverlapScoreCredit: f(2), PrefillLoadScale: f(0), OverlapScoreWeight: f(0),
				RouterTemperature: f(0.5), SharedCacheMultiplier: f(1), AssumeKvReuse: b(false), TrackPrefillTokens: b(false)}
		}),
		with(func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{SharedCacheMultiplier: f(1.5)}
		}),
		with(func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{OverlapScoreWeight: f(math.Inf(1))}
		}),
		with(func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{ConditionalDisagg: &kvrouterv1.ConditionalDisaggOverride{Policy: s("always")}}
		}),
		with(func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{ConditionalDisagg: &kvrouterv1.ConditionalDisaggOverride{EffIslRatioThreshold: f(1.5)}}
		}),
		with(func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{ConditionalDisagg: &kvrouterv1.ConditionalDisaggOverride{PrefillBusyThreshold: f(-0.1)}}
		}),
		with(func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{ConditionalDisagg: &kvrouterv1.ConditionalDisaggOverride{DecodeBusyThreshold: f(-1)}}
		}),
		with(func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{ConditionalDisagg: &kvrouterv1.ConditionalDisaggOverride{Policy: s("isl_or_load")}}
		}),
		with(func(r *kvrouterv1.RouteRequest) {
			r.TokenIds = promptTokens(8)
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{ConditionalDisagg: &kvrouterv1.ConditionalDisaggOverride{Enabled: b(true),
				Policy: s("isl_or_load"), EffIslThreshold: u64(4096), EffIslRatioThreshold: f(0.8), PrefillBusyThreshold: f(16), DecodeBusyThreshold: f(0.9)}}
		}),
		with(func(r *kvrouterv1.RouteRequest) {
			r.ConfigOverride = &kvrouterv1.RouterConfigOverride{ConditionalDisagg: &kvrouterv1.ConditionalDisaggOverride{Enabled: b(true)}}
		}),
	}
}

// FuzzRouteValidation routes any RouteRequest (decoded from the wire by the server's own codec path,
// unmarshalRoute, with extraTokens more tokens of the cached prompt) through the real Route handler, over a fresh fuzzRouter with each configuration
// of fuzzConfigs, and checks:
//
//   - it never panics;
//   - it answers, or refuses with INVALID_ARGUMENT naming a field the request set (message "field:
//     rule", and a BadRequest detail with that field), or with NOT_FOUND, FAILED_PRECONDITION,
//     RESOURCE_EXHAUSTED or UNAVAILABLE carrying the ErrorInfo reason of a routing error (and
//     ALREADY_EXISTS for the id of the booking already there; CANCELED for a request left waiting in
//     the queue, which the test gives up); every message is one line;
//   - a refused request changes nothing: the state's digest (workers, indexes, bookings, sessions),
//     the log position, and the queue are as before;
//   - an accepted request is one the rules allow (a known model; 1 to max_prompt_tokens tokens; a
//     request id of at most 512 bytes, present unless query-only; a rank only with its worker;
//     finite, non-negative override weights, shared_cache_multiplier and the conditional-
//     disaggregation ratio in [0, 1]; a registered policy), answered with workers of the model in
//     their roles, within the allow-list and on the pins, the bypass marker only on a bypass and
//     only the router's;
//   - a query-only request never books and changes nothing; any other accepted one books exactly
//     its request id, with one log entry.
func FuzzRouteValidation(f *testing.F) {
	for _, req := range fuzzRouteSeeds() {
		wire, err := proto.Marshal(req)
		if err != nil {
			f.Fatal(err)
		}
		for c := range fuzzConfigs {
			f.Add(wire, uint8(c), uint8(0))
		}
	}
	f.Add([]byte{}, uint8(0), uint8(fuzzMaxPromptTokens))
	f.Add([]byte{0x12, 0x03, 'a', 'g', 'g'}, uint8(1), uint8(fuzzMaxPromptTokens+1))
	f.Fuzz(func(t *testing.T, wire []byte, config, extraTokens uint8) {
		if len(wire) > 1<<10 {
			return // room for every field and a request id over the limit; longer only costs time
		}
		req := &kvrouterv1.RouteRequest{}
		if err := unmarshalRoute(wire, req); err != nil {
			return // the codec refuses it before the handler
		}
		// Prompt lengths are hard to reach by changing wire bytes (a packed field's length comes
		// first): extraTokens appends tokens of the cached prompt.
		// A hashed prompt (block_size set) gets none: its token ids must stay empty.
		if req.GetBlockSize() == 0 {
			req.TokenIds = append(req.TokenIds, promptTokens(int(extraTokens)/4 + 1)[:extraTokens]...)
		}
		sent := proto.Clone(req).(*kvrouterv1.RouteRequest) // Route gives req's token ids back to a pool
		r := newFuzzRouter(t, int(config)%len(fuzzConfigs))
		digest, position, bookings, sessions := r.state.Digest(), r.log.Position(), r.state.Load().Bookings(), r.state.Sessions()

		// A request whose every eligible worker is overloaded waits in the queue for capacity that
		// never comes here: the caller gives up once it is queued.
		ctx, cancel := context.WithCancel(context.Background())
		done, queued := make(chan struct{}), make(chan struct{})
		go func() {
			for r.disp.QueueDepth() == 0 {
				select {
				case <-done:
					return
				case <-time.After(50 * time.Microsecond):
				}
			}
			close(queued)
			cancel()
		}()
		// A call that never returns fails the input (the fuzzer would only stall), with the
		// goroutines that hold it.
		hung := time.AfterFunc(10*time.Second, func() {
			var stacks strings.Builder
			_ = pprof.Lookup("goroutine").WriteTo(&stacks, 1)
			panic(fmt.Sprintf("Route(%v) did not return in 10 s:\n%s", sent, stacks.String()))
		})
		resp, err := r.svc.Route(ctx, req)
		hung.Stop()
		close(done)
		cancel()

		if err != nil {
			checkRouteRefusal(t, sent, err, queued)
			if d, p, b, s, q := r.state.Digest(), r.log.Position(), r.state.Load().Bookings(), r.state.Sessions(), r.disp.QueueDepth(); d != digest || p != position || b != bookings || s != sessions || q != 0 {
				t.Fatalf("a refused Route(%v) changed the state: digest %x -> %x, log position %d -> %d, bookings %d -> %d, sessions %d -> %d, queue depth %d",
					sent, digest, d, position, p, bookings, b, sessions, s, q)
			}
			return
		}
		checkRouteAccepted(t, r, sent, resp)
		switch {
		case sent.GetQueryOnly():
			if resp.GetBooked() || r.state.Digest() != digest || r.log.Position() != position {
				t.Fatalf("query-only Route(%v) booked %v, or changed the state (digest %x -> %x, log position %d -> %d)",
					sent, resp.GetBooked(), digest, r.state.Digest(), position, r.log.Position())
			}
		default:
			if !resp.GetBooked() || r.state.Load().Bookings() != bookings+1 || r.log.Position() != position+1 ||
				!slices.Contains(r.state.Load().BookingIDs(), sent.GetRequestId()) {
				t.Fatalf("Route(%v) booked %v: bookings %d -> %d (ids %v), log position %d -> %d; want its id booked, with one log entry",
					sent, resp.GetBooked(), bookings, r.state.Load().Bookings(), r.state.Load().BookingIDs(), position, r.log.Position())
			}
		}
	})
}

// routeRefusalReasons are the ErrorInfo reasons a Route call may be refused with, and their codes.
var routeRefusalReasons = map[string]codes.Code{
	"UNKNOWN_MODEL":            codes.NotFound,
	"NO_WORKERS":               codes.Unavailable,
	"NO_ELIGIBLE_WORKERS":      codes.FailedPrecondition,
	"PINNED_WORKER_NOT_FOUND":  codes.NotFound,
	"PINNED_WORKER_OVERLOADED": codes.ResourceExhausted,
	"QUEUE_FULL":               codes.ResourceExhausted,
	"ALL_WORKERS_OVERLOADED":   codes.ResourceExhausted,
	"DISAGG_REQUIRED":          codes.FailedPrecondition,
	"BLOCK_SIZE_MISMATCH":      codes.FailedPrecondition,
}

// checkRouteRefusal checks how a Route call was refused.
func checkRouteRefusal(t *testing.T, req *kvrouterv1.RouteRequest, err error, queued <-chan struct{}) {
	t.Helper()
	st, ok := status.FromError(err)
	if !ok || st.Message() == "" || strings.ContainsAny(st.Message(), "\r\n") {
		t.Fatalf("Route(%v) = %v: want a status with a one-line message", req, err)
	}
	var (
		violations []*errdetails.BadRequest_FieldViolation
		info       *errdetails.ErrorInfo
	)
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.BadRequest:
			violations = d.GetFieldViolations()
		case *errdetails.ErrorInfo:
			info = d
		}
	}
	switch st.Code() {
	case codes.InvalidArgument:
		if len(violations) != 1 || st.Message() != violations[0].GetField()+": "+violations[0].GetDescription() {
			t.Fatalf("Route(%v) = %v with field violations %v: want one, as the message says", req, err, violations)
		}
		if field := violations[0].GetField(); !requestSets(req, field) {
			t.Fatalf("Route(%v) = %v: names %q, which the request does not set (or which is no field)", req, err, field)
		}
	case codes.AlreadyExists:
		if req.GetRequestId() != fuzzSetupBooking || info.GetReason() != "ALREADY_BOOKED" {
			t.Fatalf("Route(%v) = %v (reason %q): only the setup booking's id is booked already", req, err, info.GetReason())
		}
	case codes.Canceled:
		select {
		case <-queued:
		default:
			t.Fatalf("Route(%v) = %v, but it was not queued", req, err)
		}
	default:
		if code, ok := routeRefusalReasons[info.GetReason()]; !ok || code != st.Code() || info.GetDomain() != errorDomain {
			t.Fatalf("Route(%v) = %v with ErrorInfo %v: want a routing error's code and reason", req, err, info)
		}
	}
}

// requestSets reports whether field names a field of a RouteRequest that req sets (a rule broken
// by a field left empty names that field).
func requestSets(req *kvrouterv1.RouteRequest, field string) bool {
	h, o, cd := presentFields(req)
	switch field {
	case "request_id", "model", "token_ids":
		return true
	case "block_size": // required with block_hashes
		return req.GetBlockSize() != 0 || len(req.GetBlockHashes()) > 0
	case "prompt_tokens": // required with block_size
		return req.GetPromptTokens() != 0 || req.GetBlockSize() != 0
	case "lora_name":
		return req.GetLoraName() != ""
	case "cache_namespace":
		return req.GetCacheNamespace() != ""
	case "multimodal_objects":
		return len(req.GetMultimodalObjects()) > 0
	case "hints.prefill_dp_rank":
		return h.PrefillDpRank != nil
	case "hints.decode_dp_rank":
		return h.DecodeDpRank != nil
	case "config_override.overlap_score_credit":
		return o.OverlapScoreCredit != nil
	case "config_override.prefill_load_scale":
		return o.PrefillLoadScale != nil
	case "config_override.overlap_score_weight":
		return o.OverlapScoreWeight != nil
	case "config_override.router_temperature":
		return o.RouterTemperature != nil
	case "config_override.shared_cache_multiplier":
		return o.SharedCacheMultiplier != nil
	case "config_override.conditional_disagg.enabled":
		return cd.Enabled != nil
	case "config_override.conditional_disagg.policy":
		return cd.Policy != nil || cd.Enabled != nil // a rule of the policy broken by enabling it
	case "config_override.conditional_disagg.eff_isl_ratio_threshold":
		return cd.EffIslRatioThreshold != nil
	case "config_override.conditional_disagg.prefill_busy_threshold":
		return cd.PrefillBusyThreshold != nil
	case "config_override.conditional_disagg.decode_busy_threshold":
		return cd.DecodeBusyThreshold != nil
	}
	// multimodal_objects[i] and multimodal_objects[i].end: a rule of an input the request sends (an
	// input's end left 0 breaks "greater than start").
	if rest, ok := strings.CutPrefix(field, "multimodal_objects["); ok {
		rest = strings.TrimSuffix(rest, ".end")
		i, err := strconv.Atoi(strings.TrimSuffix(rest, "]"))
		return err == nil && strings.HasSuffix(rest, "]") && i >= 0 && i < len(req.GetMultimodalObjects())
	}
	return false
}

// presentFields returns the request's hints and overrides, empty ones where it has none, so that
// the presence of their optional fields can be read.
func presentFields(req *kvrouterv1.RouteRequest) (*kvrouterv1.RoutingHints, *kvrouterv1.RouterConfigOverride, *kvrouterv1.ConditionalDisaggOverride) {
	h, o, cd := req.GetHints(), req.GetConfigOverride(), req.GetConfigOverride().GetConditionalDisagg()
	if h == nil {
		h = &kvrouterv1.RoutingHints{}
	}
	if o == nil {
		o = &kvrouterv1.RouterConfigOverride{}
	}
	if cd == nil {
		cd = &kvrouterv1.ConditionalDisaggOverride{}
	}
	return h, o, cd
}

// checkRouteAccepted checks that an accepted request is one the rules allow, and its answer.
func checkRouteAccepted(t *testing.T, r *fuzzRouter, req *kvrouterv1.RouteRequest, resp *kvrouterv1.RouteResponse) {
	t.Helper()
	var broken []string
	rule := func(ok bool, what string) {
		if !ok {
			broken = append(broken, what)
		}
	}
	n := len(req.GetTokenIds())
	if size := uint64(req.GetBlockSize()); size != 0 {
		// A hashed prompt: its own token count, whole blocks in its hashes, and nothing that
		// would salt the hashes beside them.
		tokens, blocks := uint64(req.GetPromptTokens()), uint64(len(req.GetBlockHashes()))
		rule(n == 0 && req.GetLoraName() == "" && req.GetCacheNamespace() == "" && len(req.GetMultimodalObjects()) == 0,
			"no token ids, LoRA, namespace or multimodal inputs beside block hashes")
		rule(size == fuzzBlockSize, "the model's block size")
		rule(tokens >= blocks*size && tokens < (blocks+1)*size, "prompt_tokens of the hashes' blocks and a partial block")
		n = int(min(tokens, math.MaxInt32))
	} else {
		rule(len(req.GetBlockHashes()) == 0 && req.GetPromptTokens() == 0, "block hashes and prompt_tokens only with block_size")
	}
	rule(req.GetModel() == "m" || req.GetModel() == "agg", "a known model")
	rule(n >= 1 && n <= fuzzMaxPromptTokens, "1 to max_prompt_tokens tokens")
	rule(len(req.GetRequestId()) <= maxRequestIDBytes, "a request id of at most 512 bytes")
	rule(req.GetQueryOnly() || req.GetRequestId() != "", "a request id unless query-only")
	h, o, cd := presentFields(req)
	rule(h.PrefillDpRank == nil || h.PrefillWorkerId != nil, "a prefill rank only with its worker")
	rule(h.DecodeDpRank == nil || h.DecodeWorkerId != nil, "a decode rank only with its worker")
	nonNegative := func(v *float64) bool { return v == nil || *v >= 0 && !math.IsInf(*v, 1) }
	unit := func(v *float64) bool { return v == nil || *v >= 0 && *v <= 1 }
	rule(nonNegative(o.OverlapScoreCredit) && nonNegative(o.PrefillLoadScale) && nonNegative(o.OverlapScoreWeight) &&
		nonNegative(o.RouterTemperature) && unit(o.SharedCacheMultiplier), "finite, non-negative override weights")
	rule(unit(cd.EffIslRatioThreshold) && nonNegative(cd.PrefillBusyThreshold) && nonNegative(cd.DecodeBusyThreshold),
		"conditional-disaggregation thresholds in range")
	if cd.Policy != nil {
		_, err := policy.LookupCDPolicy(cd.GetPolicy())
		rule(err == nil, "a registered policy")
	}
	mm := slices.Clone(req.GetMultimodalObjects())
	slices.SortFunc(mm, func(a, b *kvrouterv1.MultimodalObject) int { return cmp.Compare(a.GetStart(), b.GetStart()) })
	rule(len(mm) <= maxMultimodalObjects, "at most 256 multimodal inputs")
	for k, o := range mm {
		rule(o.GetStart() < o.GetEnd() && int(o.GetEnd()) <= n, "multimodal inputs within the prompt")
		rule(k == 0 || mm[k-1].GetEnd() <= o.GetStart(), "multimodal inputs that do not overlap")
	}

	mode := resp.GetMode()
	target := func(w *kvrouterv1.WorkerTarget, roles ...kvstate.Role) bool {
		wk := r.state.Worker(kvstate.WorkerKey{ID: w.GetWorkerId(), Rank: w.GetDpRank()})
		return w != nil && wk != nil && wk.Info.Model == req.GetModel() && slices.Contains(roles, wk.Info.Role)
	}
	if req.GetModel() == "agg" {
		rule(mode == kvrouterv1.RouteMode_ROUTE_MODE_AGGREGATED, "aggregated routing for a model without prefill workers")
		rule(target(resp.GetDecode(), kvstate.RoleAggregated) && resp.GetPrefill() == nil, "one aggregated worker")
	} else {
		rule(mode == kvrouterv1.RouteMode_ROUTE_MODE_DISAGGREGATED || mode == kvrouterv1.RouteMode_ROUTE_MODE_BYPASS, "disaggregated routing, or a bypass")
		rule(target(resp.GetDecode(), kvstate.RoleDecode), "a decode worker")
		rule((mode == kvrouterv1.RouteMode_ROUTE_MODE_DISAGGREGATED) == (resp.GetPrefill() != nil), "a prefill worker exactly when disaggregated")
		rule(resp.GetPrefill() == nil || target(resp.GetPrefill(), kvstate.RolePrefill), "a prefill worker of the model")
	}
	if allowed := h.GetAllowedWorkerIds(); len(allowed) > 0 {
		rule(slices.Contains(allowed, resp.GetDecode().GetWorkerId()), "a decode worker of the allow-list")
		rule(resp.GetPrefill() == nil || slices.Contains(allowed, resp.GetPrefill().GetWorkerId()), "a prefill worker of the allow-list")
	}
	if h.DecodeWorkerId != nil {
		rule(resp.GetDecode().GetWorkerId() == h.GetDecodeWorkerId() && (h.DecodeDpRank == nil || resp.GetDecode().GetDpRank() == h.GetDecodeDpRank()),
			"the pinned decode worker")
	}
	if h.PrefillWorkerId != nil && req.GetModel() == "m" {
		rule(mode == kvrouterv1.RouteMode_ROUTE_MODE_DISAGGREGATED && resp.GetPrefill().GetWorkerId() == h.GetPrefillWorkerId() &&
			(h.PrefillDpRank == nil || resp.GetPrefill().GetDpRank() == h.GetPrefillDpRank()), "the pinned prefill worker, never bypassed")
	}
	markers := 0
	for _, a := range resp.GetAnnotations() {
		if a == policy.BypassAnnotation {
			markers++
		}
		rule(!strings.HasPrefix(a, policy.BypassAnnotation+":"), "no client bypass marker")
		rule(a != policy.PrefillContinueAnnotation && !strings.HasPrefix(a, policy.PrefillContinueAnnotation+":"),
			"no client prefill-continue marker")
	}
	rule(markers == 0 && mode != kvrouterv1.RouteMode_ROUTE_MODE_BYPASS || markers == 1 && mode == kvrouterv1.RouteMode_ROUTE_MODE_BYPASS,
		"the bypass marker exactly on a bypass")
	rule(resp.GetDiagnostics().GetPromptTokens() == uint64(n), "diagnostics of the request's prompt")
	if len(broken) > 0 {
		t.Fatalf("Route(%v) = %v, accepted; it breaks: %s", req, resp, strings.Join(broken, "; "))
	}
}
