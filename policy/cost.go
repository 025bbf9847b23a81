package policy

import (
	"math"
	"math/rand/v2"
	"sync"

	"github.com/kvrouter/kvrouter/kvstate"
)

// Candidate is one worker scored for one hop: its overlap with the prompt and its load.
type Candidate struct {
	Worker *kvstate.Worker
	// Overlap is the prompt's overlap per tier: the device prefix, then further blocks in host
	// memory or better, on disk or better, and anywhere (external).
	Overlap kvstate.TierCounts
	// Load is the worker's router-tracked load before this request.
	Load kvstate.SlotLoad
	// PotentialDecodeBlocks is the worker's active blocks plus this request's blocks not already
	// active there (§3.5).
	PotentialDecodeBlocks uint64
	// Cost is the worker's cost for this request; lower is better.
	Cost float64
}

// Prompt holds the per-request quantities the cost formula needs.
type Prompt struct {
	Tokens    uint64 // P
	BlockSize uint32 // B
}

// Blocks returns the request's capacity blocks, ceil(P / B): the tail of a partial block occupies a
// block too, though it is never hashed.
func (p Prompt) Blocks() uint64 {
	if p.BlockSize == 0 {
		return 0
	}
	return (p.Tokens + uint64(p.BlockSize) - 1) / uint64(p.BlockSize)
}

// OverlapCredit returns the overlap credit in blocks: credit x decay on the device prefix, plus the
// tier weights on the lower tiers beyond it (§3.3).
func (w Weights) OverlapCredit(overlap kvstate.TierCounts, decay float64) float64 {
	return w.Credit*decay*float64(overlap[kvstate.TierDevice]) +
		w.HostWeight*float64(overlap[kvstate.TierHost]) +
		w.DiskWeight*float64(overlap[kvstate.TierDisk]) +
		w.SharedMultiplier*float64(overlap[kvstate.TierExternal])
}

// CachedTokens returns the tier-weighted cached prefix in tokens, unrounded: device blocks at full
// weight and lower tiers scaled by their weights (§1.3). A 0.75-weight host block of 64 tokens is 48
// tokens, not 64.
func (w Weights) CachedTokens(overlap kvstate.TierCounts, blockSize uint32) float64 {
	blocks := float64(overlap[kvstate.TierDevice]) +
		w.HostWeight*float64(overlap[kvstate.TierHost]) +
		w.DiskWeight*float64(overlap[kvstate.TierDisk]) +
		w.SharedMultiplier*float64(overlap[kvstate.TierExternal])
	return blocks * float64(blockSize)
}

// DecayFactor returns the credit decay for a worker with the given active prefill tokens, where
// minActive is the least active prefill load among the eligible workers: 1 / (1 + decay x excess
// blocks / request blocks). It is 1 when prefill tokens are not tracked or decay is 0 (§3.3).
func (w Weights) DecayFactor(p Prompt, activePrefill, minActive uint64) float64 {
	if !w.TrackPrefillTokens || w.Decay <= 0 || p.BlockSize == 0 {
		return 1
	}
	excess := float64(activePrefill-min(activePrefill, minActive)) / float64(p.BlockSize)
	return 1 / (1 + w.Decay*excess/math.Max(1, float64(p.Blocks())))
}

// Cost returns the worker's cost ("logit") for a request; lower is better (Dynamo §3.3, §2.3).
//
// The ordinary formula charges prefill load net of overlap credit, projected decode blocks and
// active requests. A decode worker scored without prefill tracking and with positive credit takes
// the decode-affinity branch instead: its overlap offsets its decode load, so a cache-hot decode
// worker is preferred while its decode backlog is still charged.
func (w Weights) Cost(c *Candidate, p Prompt, minActivePrefill uint64) float64 {
	activeReqCost := w.DecodeActiveRequestWeight * float64(c.Load.ActiveRequests)
	if c.Worker != nil && c.Worker.Info.Role == kvstate.RoleDecode && !w.TrackPrefillTokens && w.Credit > 0 {
		return math.Max(0, float64(c.PotentialDecodeBlocks)-w.OverlapCredit(c.Overlap, 1)) + activeReqCost
	}
	var rawPrefillBlocks float64
	if w.TrackPrefillTokens && p.BlockSize > 0 {
		rawPrefillBlocks = float64(c.Load.ActivePrefillTokens+p.Tokens) / float64(p.BlockSize)
	}
	decay := w.DecayFactor(p, c.Load.ActivePrefillTokens, minActivePrefill)
	prefill := math.Max(0, rawPrefillBlocks-w.OverlapCredit(c.Overlap, decay))
	return w.PrefillLoadScale*prefill + float64(c.PotentialDecodeBlocks) + activeReqCost
}

// Rand is the randomness selection needs; *rand.Rand satisfies it. Tests pass fixed draws.
type Rand interface {
	Float64() float64
	IntN(n int) int
}

// SeededRand is a goroutine-safe source seeded by its caller: the same seed draws the same numbers
// in the same order, so that a replay (the simulator's) decides its ties alike every time.
type SeededRand struct {
	mu sync.Mutex
	r  *rand.Rand
}

// NewSeededRand returns a SeededRand drawing from PCG seeded with seed.
func NewSeededRand(seed uint64) *SeededRand {
	return &SeededRand{r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

// Float64 returns a number in [0, 1).
func (s *SeededRand) Float64() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r.Float64()
}

// IntN returns a number in [0, n).
func (s *SeededRand) IntN(n int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r.IntN(n)
}

// GlobalRand draws from math/rand/v2's goroutine-safe global source.
type GlobalRand struct{}

// Float64 returns a number in [0, 1).
func (GlobalRand) Float64() float64 { return rand.Float64() }

// IntN returns a number in [0, n).
func (GlobalRand) IntN(n int) int { return rand.IntN(n) }

// Pick returns the index of the chosen cost (Dynamo §3.4). With temperature 0 it is the minimum,
// exact ties broken uniformly at random. With temperature T > 0 it samples a softmax over the costs
// normalised to [0, 1]: p_i ∝ exp(-(c_i - c_min) / ((c_max - c_min) T)). Costs too far apart to
// subtract (such as ±MaxFloat64) are first scaled by the largest magnitude. Pick panics on no costs.
func Pick(costs []float64, temperature float64, r Rand) int {
	if temperature <= 0 {
		best, ties := 0, 1
		for i := 1; i < len(costs); i++ {
			switch {
			case costs[i] < costs[best]:
				best, ties = i, 1
			case costs[i] == costs[best]:
				ties++
				if r.IntN(ties) == 0 { // reservoir sampling keeps each tie with probability 1/ties
					best = i
				}
			}
		}
		return best
	}
	lo, hi := costs[0], costs[0]
	for _, c := range costs[1:] {
		lo, hi = math.Min(lo, c), math.Max(hi, c)
	}
	if lo == hi {
		return r.IntN(len(costs))
	}
	scale := 1.0
	if span := hi - lo; math.IsInf(span, 0) || math.IsNaN(span) {
		scale = math.Max(math.Abs(lo), math.Abs(hi))
	}
	lo, hi = lo/scale, hi/scale
	span := (hi - lo) * temperature
	var total float64
	for _, c := range costs {
		total += math.Exp(-(c/scale - lo) / span)
	}
	u := r.Float64()
	var cum float64
	for i, c := range costs {
		cum += math.Exp(-(c/scale-lo)/span) / total
		if cum >= u {
			return i
		}
	}
	return len(costs) - 1
}
