package policy

import (
	"context"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/kvstate"
)

// register adds (or re-registers afresh) a worker rank of model "m" with the given details.
func (f *fleet) register(id uint64, rank uint32, role kvstate.Role, totalKV uint64, bypass bool) {
	f.t.Helper()
	f.append(kvstate.WorkerUp{Reset: true, Info: kvstate.WorkerInfo{
		Key: kvstate.WorkerKey{ID: id, Rank: rank}, Model: "m", Role: role, BlockSize: testBlockSize,
		TotalKVBlocks: totalKV, MaxNumBatchedTokens: 8192, Endpoint: "w", SupportsBypass: bypass, KVEventsEnabled: true,
	}})
}

// cdFleet is the §10.7 shape: prefill workers 10 and 11, decode workers 21 (cold) and 22, which
// caches 15 of the 16 blocks of a 256-token prompt.
func cdFleet(t *testing.T) (*fleet, []uint32) {
	f := newFleet(t)
	f.register(10, 0, kvstate.RolePrefill, 100, false)
	f.register(11, 0, kvstate.RolePrefill, 100, false)
	f.register(21, 0, kvstate.RoleDecode, 100, true)
	f.register(22, 0, kvstate.RoleDecode, 100, true)
	tokens := prompt(16 * testBlockSize)
	f.cache(22, tokens, 15)
	return f, tokens
}

// coldPrompt shares no block with prompt().
func coldPrompt(n int) []uint32 {
	t := prompt(n)
	for i := range t {
		t[i] += 1 << 30
	}
	return t
}

func cdOn() Config {
	c := DefaultConfig()
	c.ConditionalDisagg.Enabled = true
	return c
}

// outcome is the part of a decision the flow tests compare.
type outcome struct {
	Mode        Mode
	Reason      Reason
	Prefill     uint64 // 0 when no prefill worker
	Decode      uint64
	Annotations []string
	Booked      []string // booking ids after the call
	PreviewHops []string // hops of the explained candidates, in order, deduplicated
}

func route(t *testing.T, f *fleet, cfg Config, req Request) (outcome, *Decision) {
	t.Helper()
	req.Model, req.Explain = "m", true
	dec, err := f.router(cfg).Route(context.Background(), &req)
	if err != nil {
		t.Fatalf("Route() = %v", err)
	}
	o := outcome{Mode: dec.Mode, Reason: dec.Reason, Decode: dec.Decode.Worker.Info.Key.ID, Annotations: dec.Annotations, Booked: f.state.Load().BookingIDs()}
	if dec.Prefill != nil {
		o.Prefill = dec.Prefill.Worker.Info.Key.ID
	}
	for _, c := range dec.Candidates {
		if n := len(o.PreviewHops); n == 0 || o.PreviewHops[n-1] != c.Hop {
			o.PreviewHops = append(o.PreviewHops, c.Hop)
		}
	}
	return o, dec
}

func TestConditionalDisaggFlow(t *testing.T) {
	marker := []string{"keep", BypassAnnotation, BypassAnnotation + ":true"}
	pinned := func(id uint64, rank *uint32) *Pin { return &Pin{Worker: id, Rank: rank} }
	tests := []struct {
		name  string
		cfg   func(*Config)
		setup func(f *fleet, tokens []uint32)
		req   Request
		want  outcome
	}{
		{
			// §10.7: the decode worker holding the prompt takes it; the prefill pool is never
			// contacted (no prefill preview, no prefill booking).
			name: "bypass to the decode worker holding the prompt",
			req:  Request{ID: "r", Annotations: []string{"keep"}},
			want: outcome{Mode: ModeBypass, Reason: ReasonBypass, Decode: 22, Annotations: []string{"keep", BypassAnnotation},
				Booked: []string{"r"}, PreviewHops: []string{HopDecodePreview}},
		},
		{
			// §8 item 11: a client-sent marker is stripped before the policy runs.
			name: "client marker stripped, C/D off: remote prefill",
			cfg:  func(c *Config) { c.ConditionalDisagg.Enabled = false },
			req:  Request{ID: "r", Annotations: marker},
			want: outcome{Mode: ModeDisaggregated, Reason: ReasonConditionalDisaggOff, Prefill: 10, Decode: 21, Annotations: []string{"keep"},
				Booked: []string{"r"}, PreviewHops: []string{HopPrefill, HopDecode}},
		},
		{
			name: "client marker stripped, policy declines a cold prompt",
			req:  Request{ID: "r", Annotations: marker, Tokens: coldPrompt(4096)},
			want: outcome{Mode: ModeDisaggregated, Reason: ReasonPolicyDeclined, Prefill: 10, Decode: 21, Annotations: []string{"keep"},
				Booked: []string{"r"}, PreviewHops: []string{HopDecodePreview, HopPrefill, HopDecode}},
		},
		{
			name: "explicit prefill worker skips C/D",
			req:  Request{ID: "r", PrefillPin: pinned(11, nil)},
			want: outcome{Mode: ModeDisaggregated, Reason: ReasonPrefillWorkerPinned, Prefill: 11, Decode: 22, Annotations: []string{},
				Booked: []string{"r"}, PreviewHops: []string{HopPrefill, HopDecode}},
		},
		{
			// §8 item 6: a query-only request is previewed, never booked.
			name: "query-only is never booked",
			req:  Request{QueryOnly: true},
			want: outcome{Mode: ModeBypass, Reason: ReasonBypass, Decode: 22, Annotations: []string{BypassAnnotation},
				Booked: []string{}, PreviewHops: []string{HopDecodePreview}},
		},
		{
			// §10.6: a pin with no rank resolves to the worker's only rank.
			name: "decode pin without rank resolves to the unique rank",
			req:  Request{ID: "r", DecodePin: pinned(22, nil)},
			want: outcome{Mode: ModeBypass, Reason: ReasonBypass, Decode: 22, Annotations: []string{BypassAnnotation},
				Booked: []string{"r"}, PreviewHops: []string{HopDecodePreview}},
		},
		{
			// §10.6: two ranks and no rank in the pin: unresolved, C/D skipped.
			name:  "decode pin with no unique rank skips C/D",
			setup: func(f *fleet, _ []uint32) { f.register(22, 1, kvstate.RoleDecode, 100, true) },
			req:   Request{ID: "r", DecodePin: pinned(22, nil)},
			want: outcome{Mode: ModeDisaggregated, Reason: ReasonDecodePinUnresolved, Prefill: 10, Decode: 22, Annotations: []string{},
				Booked: []string{"r"}, PreviewHops: []string{HopPrefill, HopDecode}},
		},
		{
			// The advisory selection honours the explicit pin: pinned to the cold worker, the
			// prompt is uncached there and goes to remote prefill.
			name: "explicit pin to a cold worker decides on that worker",
			req:  Request{ID: "r", DecodePin: pinned(21, ptr(uint32(0)))},
			want: outcome{Mode: ModeDisaggregated, Reason: ReasonPolicyDeclined, Prefill: 10, Decode: 21, Annotations: []string{},
				Booked: []string{"r"}, PreviewHops: []string{HopDecodePreview, HopPrefill, HopDecode}},
		},
		{
			// §8 item 10: with the gate configured, unknown decode capacity vetoes the bypass.
			name: "decode gate fails closed on unknown capacity",
			cfg:  func(c *Config) { c.ConditionalDisagg.DecodeBusyThreshold = ptr(0.9) },
			setup: func(f *fleet, tokens []uint32) {
				f.register(22, 0, kvstate.RoleDecode, 0, true)
				f.cache(22, tokens, 15)
			},
			req: Request{ID: "r"},
			want: outcome{Mode: ModeDisaggregated, Reason: ReasonDecodeBusyUnknown, Prefill: 10, Decode: 22, Annotations: []string{},
				Booked: []string{"r"}, PreviewHops: []string{HopDecodePreview, HopPrefill, HopDecode}},
		},
		{
			name: "decode gate allows a worker under its threshold",
			cfg:  func(c *Config) { c.ConditionalDisagg.DecodeBusyThreshold = ptr(0.9) },
			req:  Request{ID: "r"},
			want: outcome{Mode: ModeBypass, Reason: ReasonBypass, Decode: 22, Annotations: []string{BypassAnnotation},
				Booked: []string{"r"}, PreviewHops: []string{HopDecodePreview}},
		},
		{
			name: "decode gate vetoes a busy worker",
			cfg:  func(c *Config) { c.ConditionalDisagg.DecodeBusyThreshold = ptr(0.1) }, // 16 blocks > 0.1 x 100
			req:  Request{ID: "r"},
			want: outcome{Mode: ModeDisaggregated, Reason: ReasonDecodeBusy, Prefill: 10, Decode: 22, Annotations: []string{},
				Booked: []string{"r"}, PreviewHops: []string{HopDecodePreview, HopPrefill, HopDecode}},
		},
		{
			name: "a decode worker without bypass support is never a bypass target",
			setup: func(f *fleet, tokens []uint32) {
				f.register(22, 0, kvstate.RoleDecode, 100, false)
				f.cache(22, tokens, 15)
			},
			req: Request{ID: "r"},
			want: outcome{Mode: ModeDisaggregated, Reason: ReasonDecodeCannotBypass, Prefill: 10, Decode: 22, Annotations: []string{},
				Booked: []string{"r"}, PreviewHops: []string{HopDecodePreview, HopPrefill, HopDecode}},
		},
		{
			// prefill_load: every prefill worker over the threshold counts as busy: bypass even
			// though the prompt is cold.
			name: "prefill_load bypasses when the prefill pool is busy",
			cfg: func(c *Config) {
				c.ConditionalDisagg.Policy, c.ConditionalDisagg.PrefillBusyThreshold = PrefillLoad, ptr(1.0)
			},
			setup: func(f *fleet, _ []uint32) {
				for i, id := range []uint64{10, 11} {
					f.append(kvstate.Booked{Booking: kvstate.Booking{RequestID: string(rune('p' + i)), Hops: []kvstate.HopBooking{{Worker: kvstate.WorkerKey{ID: id}, PrefillTokens: 9000}}}})
				}
			},
			req: Request{ID: "r", Tokens: coldPrompt(4096)},
			want: outcome{Mode: ModeBypass, Reason: ReasonBypass, Decode: 21, Annotations: []string{BypassAnnotation},
				Booked: []string{"p", "q", "r"}, PreviewHops: []string{HopDecodePreview, HopPrefillPreview}},
		},
		{
			name: "prefill_load keeps remote prefill while the prefill pool is calm",
			cfg: func(c *Config) {
				c.ConditionalDisagg.Policy, c.ConditionalDisagg.PrefillBusyThreshold = PrefillLoad, ptr(1.0)
			},
			req: Request{ID: "r"},
			want: outcome{Mode: ModeDisaggregated, Reason: ReasonPolicyDeclined, Prefill: 10, Decode: 22, Annotations: []string{},
				Booked: []string{"r"}, PreviewHops: []string{HopDecodePreview, HopPrefillPreview, HopPrefill, HopDecode}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, tokens := cdFleet(t)
			if tt.setup != nil {
				tt.setup(f, tokens)
			}
			cfg := cdOn()
			if tt.cfg != nil {
				tt.cfg(&cfg)
			}
			req := tt.req
			if req.Tokens == nil {
				req.Tokens = tokens
			}
			got, _ := route(t, f, cfg, req)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Route() mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// TestBypassBooking: a bypass books the decode worker alone, with its prefill tokens (it prefills
// locally); a plain disaggregated decision books the decode worker without them.
func TestBypassBooking(t *testing.T) {
	f, tokens := cdFleet(t)
	_, dec := route(t, f, cdOn(), Request{ID: "r", Tokens: tokens})
	if dec.Mode != ModeBypass {
		t.Fatalf("Route() mode = %v, want bypass", dec.Mode)
	}
	load := f.state.Load()
	if diff := cmp.Diff(kvstate.SlotLoad{ActiveBlocks: 16, ActivePrefillTokens: testBlockSize, ActiveRequests: 1}, load.Slot(dec.Decode.Worker.Slot)); diff != "" {
		t.Errorf("decode worker load mismatch (-want +got):\n%s", diff)
	}
	for _, id := range []uint64{10, 11, 21} {
		if l := load.Slot(f.state.Worker(kvstate.WorkerKey{ID: id}).Slot); l != (kvstate.SlotLoad{}) {
			t.Errorf("worker %d was loaded by a bypass: %+v", id, l)
		}
	}
	if dec.CD == nil || dec.CD.EffectiveISL != testBlockSize || dec.CD.CachedTokens != 15*testBlockSize || dec.CD.Gate != GateAllowedGateDisabled {
		t.Errorf("diagnostics = %+v, want eff ISL %d, cached %d, gate %s", dec.CD, testBlockSize, 15*testBlockSize, GateAllowedGateDisabled)
	}
}

// TestDecodeAffinityKeepsCredit: with C/D on, the decode hop after a remote prefill keeps the overlap
// credit (§2), so the decode worker holding the conversation wins over an idler cold one; with C/D
// off it is load-only.
func TestDecodeAffinityKeepsCredit(t *testing.T) {
	for _, tt := range []struct {
		cd   bool
		want uint64
	}{{true, 22}, {false, 21}} {
		f, _ := cdFleet(t)
		tokens := prompt(64 * testBlockSize) // 15 of 64 blocks cached on 22: too few to bypass
		// Worker 22 is a little busier than 21.
		f.append(kvstate.Booked{Booking: kvstate.Booking{RequestID: "busy", Hops: []kvstate.HopBooking{{Worker: kvstate.WorkerKey{ID: 22}, Blocks: []uint64{1, 2}}}}})
		cfg := cdOn()
		cfg.ConditionalDisagg.Enabled = tt.cd
		got, _ := route(t, f, cfg, Request{ID: "r", Tokens: tokens})
		if got.Mode != ModeDisaggregated || got.Decode != tt.want {
			t.Errorf("C/D %v: Route() = %v to decode %d, want disaggregated to %d", tt.cd, got.Mode, got.Decode, tt.want)
		}
	}
}

func TestResolvePin(t *testing.T) {
	pool := []*kvstate.Worker{worker(7, kvstate.RoleDecode), worker(8, kvstate.RoleDecode), worker(8, kvstate.RoleDecode)}
	pool[0].Info.Key.Rank = 3
	pool[2].Info.Key.Rank = 1
	tests := []struct {
		name string
		pin  Pin
		want kvstate.WorkerKey
		ok   bool
	}{
		{"worker and rank", Pin{Worker: 7, Rank: ptr(uint32(2))}, kvstate.WorkerKey{ID: 7, Rank: 2}, true},
		{"unique rank", Pin{Worker: 7}, kvstate.WorkerKey{ID: 7, Rank: 3}, true},
		{"rank not unique", Pin{Worker: 8}, kvstate.WorkerKey{}, false},
		{"unknown worker", Pin{Worker: 9}, kvstate.WorkerKey{}, false},
	}
	for _, tt := range tests {
		got, ok := resolvePin(&tt.pin, pool)
		if ok != tt.ok || (ok && got != tt.want) {
			t.Errorf("%s: resolvePin() = %v, %v; want %v, %v", tt.name, got, ok, tt.want, tt.ok)
		}
	}
}

func TestEffectiveCD(t *testing.T) {
	tests := []struct {
		name   string
		cfg    func(*Config)
		o      CDOverride
		want   string
		thresh *float64
	}{
		{name: "prefill_load inherits the queue threshold", cfg: func(c *Config) { c.QueueThreshold = ptr(4.0) },
			o: CDOverride{Policy: ptr(PrefillLoad)}, thresh: ptr(4.0)},
		{name: "prefill_load without any threshold", o: CDOverride{Policy: ptr(PrefillLoad)},
			want: "conditional_disagg policy='prefill_load' needs prefill_busy_threshold, but neither prefill_busy_threshold nor router_queue_threshold is set"},
		{name: "override ratio out of range", o: CDOverride{EffISLRatioThreshold: ptr(1.5)},
			want: "eff_isl_ratio_threshold must be in [0.0, 1.0]"},
		{name: "KV events off", cfg: func(c *Config) { c.UseKVEvents = false },
			want: "conditional_disagg requires use_kv_events"},
		{name: "override turns it off, KV events off is fine", cfg: func(c *Config) { c.UseKVEvents = false }, o: CDOverride{Enabled: ptr(false)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := cdOn()
			if tt.cfg != nil {
				tt.cfg(&cfg)
			}
			cd, err := cfg.EffectiveCD(tt.o)
			got := ""
			if err != nil {
				got = err.Error()
			}
			if got != tt.want {
				t.Fatalf("EffectiveCD() = %q, want %q", got, tt.want)
			}
			if tt.thresh != nil && (cd.PrefillBusyThreshold == nil || *cd.PrefillBusyThreshold != *tt.thresh) {
				t.Errorf("prefill busy threshold = %v, want %v", cd.PrefillBusyThreshold, *tt.thresh)
			}
		})
	}
}

// TestSessionAffinity: the kernel's side of session affinity, given the decode worker the session
// is bound to (server/app looks it up and binds sessions).
func TestSessionAffinity(t *testing.T) {
	tests := []struct {
		name string
		req  Request
		want outcome
	}{
		{
			// §8 item 4: the explicit pin is resolved first; a session bound to a worker that is gone
			// must not abort it.
			name: "explicit pin wins over a stale session",
			req:  Request{ID: "r", SessionWorker: &kvstate.WorkerKey{ID: 23}, DecodePin: &Pin{Worker: 22}},
			want: outcome{Mode: ModeBypass, Reason: ReasonBypass, Decode: 22, Annotations: []string{BypassAnnotation},
				Booked: []string{"r"}, PreviewHops: []string{HopDecodePreview}},
		},
		{
			name: "a stale session without a pin skips C/D",
			req:  Request{ID: "r", SessionWorker: &kvstate.WorkerKey{ID: 23}},
			want: outcome{Mode: ModeDisaggregated, Reason: ReasonDecodeAffinityUnresolved, Prefill: 10, Decode: 22, Annotations: []string{},
				Booked: []string{"r"}, PreviewHops: []string{HopPrefill, HopDecode}},
		},
		{
			// Hard affinity: the session's (cold) decode worker is where C/D looks, and where the
			// decode hop goes.
			name: "a bound session pins the decode worker",
			req:  Request{ID: "r", SessionWorker: &kvstate.WorkerKey{ID: 21}},
			want: outcome{Mode: ModeDisaggregated, Reason: ReasonPolicyDeclined, Prefill: 10, Decode: 21, Annotations: []string{},
				Booked: []string{"r"}, PreviewHops: []string{HopDecodePreview, HopPrefill, HopDecode}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, tokens := cdFleet(t)
			req := tt.req
			req.Tokens = tokens
			got, _ := route(t, f, cdOn(), req)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Route() mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// TestCannotBypassSkipsTheGate: a decode worker without bypass support ends the decision before the
// gate, so no gate label is recorded (and counted) for a bypass that cannot happen.
func TestCannotBypassSkipsTheGate(t *testing.T) {
	f, tokens := cdFleet(t)
	f.register(22, 0, kvstate.RoleDecode, 100, false)
	f.cache(22, tokens, 15)
	got, dec := route(t, f, cdOn(), Request{ID: "r", Tokens: tokens})
	if got.Reason != ReasonDecodeCannotBypass || dec.CD == nil || dec.CD.Gate != "" || !dec.CD.PolicySaysBypass {
		t.Errorf("Route() reason %v, diagnostics %+v; want decode_cannot_bypass, policy yes, no gate label", got.Reason, dec.CD)
	}
}
