package policy

import (
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/kvstate"
)

// fixedRand returns fixed draws: f for Float64; for IntN, 0 (so reservoir sampling takes each new
// tie and the last one wins) unless keepFirst is set (no tie replaces the first).
type fixedRand struct {
	f         float64
	keepFirst bool
}

func (r fixedRand) Float64() float64 { return r.f }
func (r fixedRand) IntN(n int) int {
	if r.keepFirst {
		return n - 1
	}
	return 0
}

func worker(id uint64, role kvstate.Role) *kvstate.Worker {
	return &kvstate.Worker{Info: kvstate.WorkerInfo{Key: kvstate.WorkerKey{ID: id}, Role: role, BlockSize: 16}}
}

func device(n uint64) kvstate.TierCounts { return kvstate.TierCounts{kvstate.TierDevice: n} }

func ptr[T any](v T) *T { return &v }

// TestCostVectors restates Dynamo's selector vectors (§10.9) and the documented example (§3.3).
func TestCostVectors(t *testing.T) {
	base := DefaultConfig().Weights(Override{})
	decodeHop := DecodeHopWeights(base, true) // decode affinity: prefill tracking off, credit kept
	withRequestWeight := decodeHop
	withRequestWeight.DecodeActiveRequestWeight = 32
	creditZero := DecodeHopWeights(base, false)
	tests := []struct {
		name string
		w    Weights
		c    Candidate
		p    Prompt
		want float64
	}{
		{
			name: "docs example W1: raw 10, overlap 2, decode 10",
			w:    base, p: Prompt{Tokens: 160, BlockSize: 16},
			c:    Candidate{Worker: worker(1, kvstate.RoleAggregated), Overlap: device(2), PotentialDecodeBlocks: 10},
			want: 18,
		},
		{
			name: "docs example W2: raw 10, overlap 5, decode 5",
			w:    base, p: Prompt{Tokens: 160, BlockSize: 16},
			c:    Candidate{Worker: worker(2, kvstate.RoleAggregated), Overlap: device(5), PotentialDecodeBlocks: 5},
			want: 10,
		},
		{
			name: "docs example W3: raw 10, overlap 8, decode 9",
			w:    base, p: Prompt{Tokens: 160, BlockSize: 16},
			c:    Candidate{Worker: worker(3, kvstate.RoleAggregated), Overlap: device(8), PotentialDecodeBlocks: 9},
			want: 11,
		},
		{
			name: "decode affinity: potential 10, overlap 4",
			w:    decodeHop, p: Prompt{Tokens: 160, BlockSize: 16},
			c:    Candidate{Worker: worker(1, kvstate.RoleDecode), Overlap: device(4), PotentialDecodeBlocks: 10},
			want: 6,
		},
		{
			name: "decode affinity: overlap 12 clamps at 0",
			w:    decodeHop, p: Prompt{Tokens: 160, BlockSize: 16},
			c:    Candidate{Worker: worker(1, kvstate.RoleDecode), Overlap: device(12), PotentialDecodeBlocks: 10},
			want: 0,
		},
		{
			name: "decode affinity: request weight 32 x 4 active requests adds 128",
			w:    withRequestWeight, p: Prompt{Tokens: 160, BlockSize: 16},
			c: Candidate{Worker: worker(1, kvstate.RoleDecode), Overlap: device(4), PotentialDecodeBlocks: 10,
				Load: kvstate.SlotLoad{ActiveRequests: 4}},
			want: 134,
		},
		{
			name: "decode worker with credit 0 takes the ordinary formula: cost = potential decode blocks",
			w:    creditZero, p: Prompt{Tokens: 160, BlockSize: 16},
			c:    Candidate{Worker: worker(1, kvstate.RoleDecode), Overlap: device(4), PotentialDecodeBlocks: 10},
			want: 10,
		},
		{
			name: "prefill worker never takes the decode-affinity branch",
			w:    decodeHop, p: Prompt{Tokens: 160, BlockSize: 16},
			c:    Candidate{Worker: worker(1, kvstate.RolePrefill), Overlap: device(4), PotentialDecodeBlocks: 10},
			want: 10,
		},
		{
			name: "host blocks credited at 0.75",
			w:    base, p: Prompt{Tokens: 160, BlockSize: 16},
			c: Candidate{Worker: worker(1, kvstate.RoleAggregated), PotentialDecodeBlocks: 10,
				Overlap: kvstate.TierCounts{kvstate.TierDevice: 2, kvstate.TierHost: 4}},
			want: 10 - 2 - 3 + 10,
		},
		{
			name: "prefill term clamps at 0",
			w:    base, p: Prompt{Tokens: 32, BlockSize: 16},
			c:    Candidate{Worker: worker(1, kvstate.RoleAggregated), Overlap: device(5), PotentialDecodeBlocks: 3},
			want: 3,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.w.Cost(&tt.c, tt.p, 0); got != tt.want {
				t.Errorf("Cost() = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestDocsExamplePicksWorker2(t *testing.T) {
	if got := Pick([]float64{18, 10, 11}, 0, fixedRand{}); got != 1 {
		t.Errorf("Pick(18, 10, 11) = worker %d, want worker index 1 (cost 10)", got+1)
	}
}

func TestDecayFactor(t *testing.T) {
	w := DefaultConfig().Weights(Override{})
	p := Prompt{Tokens: 64, BlockSize: 16} // 4 request blocks
	tests := []struct {
		name              string
		decay             float64
		track             bool
		active, minActive uint64
		want              float64
	}{
		{"decay 1, 4 blocks more prefill than the least loaded", 1, true, 64, 0, 0.5},
		{"decay 1, least loaded worker", 1, true, 64, 64, 1},
		{"decay 0", 0, true, 64, 0, 1},
		{"prefill tracking off", 1, false, 64, 0, 1},
		{"decay 2, 2 blocks excess", 2, true, 32, 0, 0.5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := w
			w.Decay, w.TrackPrefillTokens = tt.decay, tt.track
			if got := w.DecayFactor(p, tt.active, tt.minActive); got != tt.want {
				t.Errorf("DecayFactor() = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestPick(t *testing.T) {
	tests := []struct {
		name  string
		costs []float64
		temp  float64
		r     fixedRand
		want  int
	}{
		{"argmin", []float64{3, 1, 2}, 0, fixedRand{}, 1},
		{"softmax over ±MaxFloat64, T=1, u=0.6 picks the -MAX worker", []float64{-math.MaxFloat64, math.MaxFloat64}, 1, fixedRand{f: 0.6}, 0},
		{"softmax, T=1, u=0.9 picks the dearer worker", []float64{7, 8}, 1, fixedRand{f: 0.9}, 1},
		{"softmax, T=1, u=0.5 picks the cheaper worker", []float64{7, 8}, 1, fixedRand{f: 0.5}, 0},
		{"softmax with equal costs is uniform", []float64{5, 5, 5}, 1, fixedRand{}, 0},
		{"tie: a draw that keeps the first", []float64{1, 1, 1}, 0, fixedRand{keepFirst: true}, 0},
		{"tie: a draw that takes each new tie", []float64{1, 1, 1}, 0, fixedRand{}, 2},
		{"tie among the cheapest only", []float64{2, 1, 3, 1}, 0, fixedRand{}, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Pick(tt.costs, tt.temp, tt.r); got != tt.want {
				t.Errorf("Pick(%v, T=%v) = %d, want %d", tt.costs, tt.temp, got, tt.want)
			}
		})
	}
}

// TestPickBreaksTiesAtRandom: with temperature 0 and equal costs, 120 draws choose more than one
// worker (§10.9).
func TestPickBreaksTiesAtRandom(t *testing.T) {
	seen := map[int]bool{}
	for range 120 {
		seen[Pick([]float64{4, 4, 4}, 0, GlobalRand{})] = true
	}
	if len(seen) < 2 {
		t.Errorf("120 tie-breaks chose %v, want more than one worker", seen)
	}
}

// TestOverridesFlipWarmVsCold: each per-request override of §10.9 (credit 0, prefill_load_scale 0,
// shared_cache_multiplier 1, temperature 1) flips the choice between a warm, busier worker and a cold,
// idle one.
func TestOverridesFlipWarmVsCold(t *testing.T) {
	p := Prompt{Tokens: 64, BlockSize: 16}
	warm := Candidate{Worker: worker(1, kvstate.RoleAggregated), Overlap: device(4),
		Load: kvstate.SlotLoad{ActivePrefillTokens: 32, ActiveBlocks: 1}, PotentialDecodeBlocks: 5}
	cold := Candidate{Worker: worker(2, kvstate.RoleAggregated), Overlap: kvstate.TierCounts{kvstate.TierExternal: 4},
		PotentialDecodeBlocks: 4}
	choose := func(o Override, u float64) string {
		w := DefaultConfig().Weights(o)
		costs := []float64{w.Cost(&warm, p, 0), w.Cost(&cold, p, 0)}
		return []string{"warm", "cold"}[Pick(costs, w.Temperature, fixedRand{f: u})]
	}
	if got := choose(Override{}, 0.9); got != "warm" {
		t.Fatalf("with no override chose %s, want warm", got)
	}
	tests := []struct {
		name string
		o    Override
	}{
		{"overlap_score_credit 0", Override{OverlapScoreCredit: ptr(0.0)}},
		{"prefill_load_scale 0", Override{PrefillLoadScale: ptr(0.0)}},
		{"overlap_score_weight 0 (deprecated: credit 0 and scale 0)", Override{OverlapScoreWeight: ptr(0.0)}},
		{"shared_cache_multiplier 1", Override{SharedCacheMultiplier: ptr(1.0)}},
		{"router_temperature 1", Override{RouterTemperature: ptr(1.0)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := choose(tt.o, 0.9); got != "cold" {
				t.Errorf("with %v chose %s, want cold", tt.o, got)
			}
		})
	}
}

func TestWeightsDeprecatedMapping(t *testing.T) {
	tests := []struct {
		name              string
		cfg               Config
		o                 Override
		wantCredit, scale float64
	}{
		{"config weight 3 sets scale, keeps credit", func() Config {
			c := DefaultConfig()
			c.OverlapScoreCredit, c.PrefillLoadScale, c.OverlapScoreWeight = 0.25, 2, ptr(3.0)
			return c
		}(), Override{}, 0.25, 3},
		{"config weight 0 zeroes credit and scale", func() Config {
			c := DefaultConfig()
			c.OverlapScoreCredit, c.OverlapScoreWeight = 0.75, ptr(0.0)
			return c
		}(), Override{}, 0, 0},
		{"request weight wins over request scale", DefaultConfig(), Override{PrefillLoadScale: ptr(5.0), OverlapScoreWeight: ptr(2.0)}, 1, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := tt.cfg.Weights(tt.o)
			if diff := cmp.Diff([]float64{tt.wantCredit, tt.scale}, []float64{w.Credit, w.PrefillLoadScale}); diff != "" {
				t.Errorf("credit, scale mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*Config)
		wantErr string
	}{
		{"defaults", func(*Config) {}, ""},
		{"negative credit", func(c *Config) { c.OverlapScoreCredit = -1 }, "overlap_score_credit must be a finite, non-negative number (got -1)"},
		{"NaN credit", func(c *Config) { c.OverlapScoreCredit = math.NaN() }, "overlap_score_credit must be a finite, non-negative number (got NaN)"},
		{"infinite decode weight", func(c *Config) { c.DecodeActiveRequestWeight = math.Inf(1) }, "decode_active_request_weight must be a finite, non-negative number (got +Inf)"},
		{"negative decay", func(c *Config) { c.OverlapScoreCreditDecay = -0.1 }, "overlap_score_credit_decay must be a finite, non-negative number (got -0.1)"},
		{"host weight above 1", func(c *Config) { c.HostCacheHitWeight = 1.5 }, "host_cache_hit_weight must be in [0, 1] (got 1.5)"},
		{"disk weight negative", func(c *Config) { c.DiskCacheHitWeight = -0.5 }, "disk_cache_hit_weight must be in [0, 1] (got -0.5)"},
		{"shared multiplier NaN", func(c *Config) { c.SharedCacheMultiplier = math.NaN() }, "shared_cache_multiplier must be in [0, 1] (got NaN)"},
		{"negative temperature", func(c *Config) { c.RouterTemperature = -1 }, "router_temperature must be a finite, non-negative number (got -1)"},
		{"negative queue threshold", func(c *Config) { c.QueueThreshold = ptr(-1.0) }, "router_queue_threshold must be a finite, non-negative number (got -1)"},
		{"queue threshold 0 is valid", func(c *Config) { c.QueueThreshold = ptr(0.0) }, ""},
		{"unknown queue policy", func(c *Config) { c.QueuePolicy = "lifo" }, `router_queue_policy must be one of "fcfs", "wspt" (got "lifo")`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := DefaultConfig()
			tt.mutate(&c)
			err := c.Validate()
			got := ""
			if err != nil {
				got = err.Error()
			}
			if got != tt.wantErr {
				t.Errorf("Validate() = %q, want %q", got, tt.wantErr)
			}
		})
	}
}

func TestOverrideValidate(t *testing.T) {
	tests := []struct {
		name    string
		o       Override
		wantErr string
	}{
		{"empty", Override{}, ""},
		{"NaN credit", Override{OverlapScoreCredit: ptr(math.NaN())}, "overlap_score_credit must be a finite, non-negative number (got NaN)"},
		{"negative scale", Override{PrefillLoadScale: ptr(-2.0)}, "prefill_load_scale must be a finite, non-negative number (got -2)"},
		{"negative temperature", Override{RouterTemperature: ptr(-0.5)}, "router_temperature must be a finite, non-negative number (got -0.5)"},
		{"shared multiplier above 1", Override{SharedCacheMultiplier: ptr(1.1)}, "shared_cache_multiplier must be in [0, 1] (got 1.1)"},
		{"negative legacy weight", Override{OverlapScoreWeight: ptr(-1.0)}, "overlap_score_weight must be a finite, non-negative number (got -1)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := ""
			if err := tt.o.Validate(); err != nil {
				got = err.Error()
			}
			if got != tt.wantErr {
				t.Errorf("Validate() = %q, want %q", got, tt.wantErr)
			}
		})
	}
}
