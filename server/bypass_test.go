package server

import (
	"bytes"
	"log/slog"
	"math"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/policy"
)

// syncBuffer is a log sink safe for concurrent writes.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func withCD(logs *syncBuffer) func(*Options) {
	return func(o *Options) {
		withRouting(func(c *policy.Config) { c.ConditionalDisagg.Enabled = true })(o)
		if logs != nil {
			o.Logger = slog.New(slog.NewTextHandler(logs, nil))
		}
	}
}

func registerRole(e *testEnv, id uint64, role kvrouterv1.WorkerRole, kvEvents bool) *publisher {
	p := e.publish()
	h := hello(id, role, 4)
	h.GetHello().KvEventsEnabled = kvEvents
	p.send(h)
	wantMsg(e.t, p.recv(), registered(nil))
	return p
}

// TestDecodeWorkerWithoutKVEvents: §8 item 8. A decode worker without KV events can never be a bypass
// target; with conditional disaggregation on, its registration logs a warning and the per-model gauge
// counts it.
func TestDecodeWorkerWithoutKVEvents(t *testing.T) {
	logs := &syncBuffer{}
	e := newTestEnv(t, withCD(logs))
	silent := registerRole(e, 1, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, false)
	defer silent.stream.CloseSend()
	loud := registerRole(e, 2, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, true)
	defer loud.stream.CloseSend()
	if got := e.gauge("kvrouter_decode_workers_without_kv_events", "model", "m"); got != 1 {
		t.Errorf("kvrouter_decode_workers_without_kv_events{model=m} = %v, want 1", got)
	}
	if n := strings.Count(logs.String(), "decode worker publishes no KV events"); n != 1 {
		t.Errorf("warning logged %d times, want once (for worker 1 only):\n%s", n, logs.String())
	}
}

func TestCDOverrideValidation(t *testing.T) {
	e := newTestEnv(t, withCD(nil))
	p := registerRole(e, 1, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, true)
	defer p.stream.CloseSend()
	str := func(s string) *string { return &s }
	f := func(v float64) *float64 { return &v }
	tests := []struct {
		name string
		o    *kvrouterv1.ConditionalDisaggOverride
		msg  string
	}{
		{"unknown policy", &kvrouterv1.ConditionalDisaggOverride{Policy: str("always")},
			"config_override.conditional_disagg.policy: must be one of 'isl_bounding', 'prefill_load', 'isl_or_load'"},
		{"ratio above 1", &kvrouterv1.ConditionalDisaggOverride{EffIslRatioThreshold: f(1.5)},
			"config_override.conditional_disagg.eff_isl_ratio_threshold: must be in [0.0, 1.0]"},
		{"negative prefill busy", &kvrouterv1.ConditionalDisaggOverride{PrefillBusyThreshold: f(-0.1)},
			"config_override.conditional_disagg.prefill_busy_threshold: must be >= 0"},
		{"negative decode busy", &kvrouterv1.ConditionalDisaggOverride{DecodeBusyThreshold: f(-1)},
			"config_override.conditional_disagg.decode_busy_threshold: must be >= 0"},
		{"infinite decode busy", &kvrouterv1.ConditionalDisaggOverride{DecodeBusyThreshold: f(math.Inf(1))},
			"config_override.conditional_disagg.decode_busy_threshold: must be a finite number >= 0 (got +Inf)"},
		{"NaN decode busy", &kvrouterv1.ConditionalDisaggOverride{DecodeBusyThreshold: f(math.NaN())},
			"config_override.conditional_disagg.decode_busy_threshold: must be a finite number >= 0 (got NaN)"},
		{"infinite prefill busy", &kvrouterv1.ConditionalDisaggOverride{PrefillBusyThreshold: f(math.Inf(1))},
			"config_override.conditional_disagg.prefill_busy_threshold: must be a finite number >= 0 (got +Inf)"},
		{"NaN ratio", &kvrouterv1.ConditionalDisaggOverride{EffIslRatioThreshold: f(math.NaN())},
			"config_override.conditional_disagg.eff_isl_ratio_threshold: must be in [0.0, 1.0]"},
		{"load-aware policy without a threshold", &kvrouterv1.ConditionalDisaggOverride{Policy: str("isl_or_load")},
			"config_override.conditional_disagg.policy: conditional_disagg policy='isl_or_load' needs prefill_busy_threshold, but neither prefill_busy_threshold nor router_queue_threshold is set"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := e.router.Route(e.ctx, &kvrouterv1.RouteRequest{RequestId: "r", Model: "m", TokenIds: promptTokens(2),
				ConfigOverride: &kvrouterv1.RouterConfigOverride{ConditionalDisagg: tt.o}})
			wantStatus(t, err, codes.InvalidArgument, tt.msg)
		})
	}
}

// TestBypassOnTheWire: a decode worker holding 15 of 16 blocks takes the request; the response
// carries the mode, the annotation (the client's own marker stripped) and the numbers behind it.
func TestBypassOnTheWire(t *testing.T) {
	e := newTestEnv(t, withCD(nil))
	pre := registerRole(e, 1, kvrouterv1.WorkerRole_WORKER_ROLE_PREFILL, true)
	dec := registerRole(e, 2, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, true)
	defer pre.stream.CloseSend()
	defer dec.stream.CloseSend()
	dec.send(events(stored(0, nil, 0, 15)))
	wantMsg(t, dec.recv(), ack(0))
	resp, err := e.router.Route(e.ctx, &kvrouterv1.RouteRequest{RequestId: "r", Model: "m", TokenIds: promptTokens(16),
		Annotations: []string{policy.BypassAnnotation + ":forged"}})
	if err != nil {
		t.Fatalf("Route() = %v", err)
	}
	wantMsg(t, resp, &kvrouterv1.RouteResponse{
		Mode:        kvrouterv1.RouteMode_ROUTE_MODE_BYPASS,
		Decode:      &kvrouterv1.WorkerTarget{WorkerId: 2, Endpoint: "10.0.0.1:8000"},
		Annotations: []string{policy.BypassAnnotation},
		Booked:      true,
		Diagnostics: &kvrouterv1.RouteDiagnostics{
			PromptTokens: 64, PromptBlocks: 16, BlockSize: 4,
			Decode: &kvrouterv1.HopDiagnostics{OverlapBlocks: &kvrouterv1.TierBlocks{Device: 15}, CachedTokens: 60, Cost: 17},
			Reason: kvrouterv1.DecisionReason_DECISION_REASON_BYPASS,
			ConditionalDisagg: &kvrouterv1.ConditionalDisaggDiagnostics{
				Policy: "isl_bounding", Decode: &kvrouterv1.WorkerTarget{WorkerId: 2, Endpoint: "10.0.0.1:8000"},
				CachedTokens: 60, EffectiveIsl: 4, Ratio: 0.0625, PolicySaysBypass: true,
				GateDecision: "bypass_allowed_decode_gate_disabled", PotentialDecodeBlocks: 16,
				EffIslThreshold: 2048, EffIslRatioThreshold: 0.7,
			},
		},
	})
	if got := e.counter("kvrouter_conditional_disagg_gate_total", "decision", "bypass_allowed_decode_gate_disabled"); got != 1 {
		t.Errorf("kvrouter_conditional_disagg_gate_total{decision=bypass_allowed_decode_gate_disabled} = %v, want 1", got)
	}
	if got := e.counter("kvrouter_route_decisions_total", "reason", "bypass"); got != 1 {
		t.Errorf("kvrouter_route_decisions_total{reason=bypass} = %v, want 1", got)
	}
}

// TestCDOverrideNeedsKVEvents: turning conditional disaggregation on per request while the router
// runs without KV events is refused, naming the field.
func TestCDOverrideNeedsKVEvents(t *testing.T) {
	e := newTestEnv(t, withRouting(func(c *policy.Config) { c.UseKVEvents = false }))
	p := registerRole(e, 1, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, true)
	defer p.stream.CloseSend()
	on := true
	_, err := e.router.Route(e.ctx, &kvrouterv1.RouteRequest{RequestId: "r", Model: "m", TokenIds: promptTokens(2),
		ConfigOverride: &kvrouterv1.RouterConfigOverride{ConditionalDisagg: &kvrouterv1.ConditionalDisaggOverride{Enabled: &on}}})
	wantStatus(t, err, codes.InvalidArgument,
		"config_override.conditional_disagg.enabled: conditional_disagg requires use_kv_events")
}
