package engine

import (
	"fmt"
	"math"
	"time"
)

// CostModel says how long a simulated engine's forward pass takes, and how big its cache is. One
// formula times every pass, whatever it holds (vLLM V1 schedules decodes and prefill chunks into the
// same pass), so local prefill on a decode worker slows that worker's decode steps exactly by what
// its chunk costs: the inter-token latency that conditional disaggregation trades for a shorter
// time to first token.
//
//	step = StepOverhead
//	     + max(LinearFloor, LinearBase + LinearPerToken·(B + P))   the weights: read once, then compute-bound
//	     + DecodePerContextTokenNs·C                               decode attention: KV read of the batch's context
//	     + PrefillPerTokenPair·Σ p·(l + p/2)                        prefill attention: each new token against the prompt so far
//
// B is the number of decoding sequences in the pass and C their context tokens; P is the prefill
// tokens of the pass, in chunks of p new tokens after l tokens already in the cache (a cached
// prefix costs no compute, but its tokens are attended).
type CostModel struct {
	// Name says which model and hardware the numbers describe.
	Name           string
	StepOverhead   time.Duration
	LinearFloor    time.Duration
	LinearBase     time.Duration
	LinearPerToken time.Duration
	// DecodePerContextTokenNs and PrefillPerTokenPairNs are below a nanosecond or close to it, so
	// they are float nanoseconds: per context token of a decode, per (new, attended) token pair.
	DecodePerContextTokenNs float64
	PrefillPerTokenPairNs   float64
	// TransferSetup and TransferPerBlock time a remote prefill's KV transfer to the decode worker.
	TransferSetup    time.Duration
	TransferPerBlock time.Duration

	// The engine's limits, as vLLM's flags name them.
	BlockSize           int
	TotalKVBlocks       int
	MaxNumBatchedTokens int
	MaxNumSeqs          int
}

// Scaled returns m with its attention constants (DecodePerContextTokenNs, PrefillPerTokenPairNs)
// multiplied by attention and its KV transfer times by network: the numbers the model is least
// sure of, which kvsim sensitivity varies.
func (m CostModel) Scaled(attention, network float64) CostModel {
	m.DecodePerContextTokenNs *= attention
	m.PrefillPerTokenPairNs *= attention
	m.TransferSetup = time.Duration(float64(m.TransferSetup) * network)
	m.TransferPerBlock = time.Duration(float64(m.TransferPerBlock) * network)
	if attention != 1 || network != 1 {
		m.Name = fmt.Sprintf("%s (attention %gx, network %gx)", m.Name, attention, network)
	}
	return m
}

// Llama31_8B_H100 is Llama-3.1-8B-Instruct in BF16 on one H100-SXM-80GB under vLLM V1. Where the
// numbers come from:
//   - LinearFloor, LinearBase, LinearPerToken: fitted to Vidur's H100 MLP profiles (microsoft/vidur
//     data/profiling/compute/h100, Llama-2-7B, scaled to the 8B's shapes): flat at 6.2 ms up to
//     about 64 tokens a pass, then 3.1 ms + 21.8 µs a token.
//   - DecodePerContextTokenNs: 128 KiB of KV a token (32 layers × 8 KV heads × 128 × 2 × 2 bytes, from
//     the model's config.json) read at an assumed 2.5 TB/s (75% of HBM3's 3.35 TB/s): 52.4 ns.
//   - PrefillPerTokenPairNs: 32 layers × 4 × 4096 FLOP a token pair at an assumed 400 TFLOP/s
//     (FlashAttention, BF16): 1.31 ns.
//   - StepOverhead 1.5 ms: lm_head, sampling and launch, assumed; with it a batch of one decodes in
//     7.8 ms a token, and NVIDIA NIM's published 4.6 ms for the FP8 model is met when the weight
//     floor is halved.
//   - TransferPerBlock: a 16-token block is 2 MiB, at 25 GB/s a GPU (Mooncake's 87 GB/s over four
//     200 Gb/s NICs): 83.9 µs; TransferSetup 1 ms, assumed.
//   - TotalKVBlocks 28,000: 0.9 × 79.65 GiB less 14.96 GiB of weights and about 2 GiB of
//     activations, in 2 MiB blocks (448k tokens).
//   - MaxNumBatchedTokens 8192 and MaxNumSeqs 1024: vLLM's defaults for its OpenAI server on a GPU
//     of at least 70 GiB other than an A100, such as this H100 (EngineArgs.get_batch_defaults;
//     256 and 2048 are the defaults of smaller GPUs).
func Llama31_8B_H100() CostModel {
	return CostModel{
		Name:                    "Llama-3.1-8B-Instruct BF16, 1x H100-SXM-80GB, vLLM V1",
		StepOverhead:            1500 * time.Microsecond,
		LinearFloor:             6200 * time.Microsecond,
		LinearBase:              3100 * time.Microsecond,
		LinearPerToken:          21800 * time.Nanosecond,
		DecodePerContextTokenNs: 52.4,
		PrefillPerTokenPairNs:   1.31,
		TransferSetup:           time.Millisecond,
		TransferPerBlock:        83900 * time.Nanosecond,
		BlockSize:               16,
		TotalKVBlocks:           28_000,
		MaxNumBatchedTokens:     8192,
		MaxNumSeqs:              1024,
	}
}

// Chunk is the prefill part of one sequence in a pass: New tokens computed after Done tokens
// already in the cache (a cached prefix, or earlier chunks).
type Chunk struct {
	New, Done int
}

// Step returns the time of one forward pass: decodes sequences decoding one token each, with
// context tokens of context over all of them, and the prefill chunks.
func (m *CostModel) Step(decodes, context int, chunks []Chunk) time.Duration {
	tokens := decodes
	attention := 0.0
	for _, c := range chunks {
		tokens += c.New
		attention += float64(c.New) * (float64(c.Done) + float64(c.New)/2)
	}
	if tokens == 0 {
		return 0
	}
	linear := max(float64(m.LinearFloor), float64(m.LinearBase)+float64(m.LinearPerToken)*float64(tokens))
	ns := float64(m.StepOverhead) + linear + m.DecodePerContextTokenNs*float64(context) + m.PrefillPerTokenPairNs*attention
	return time.Duration(math.Round(ns))
}

// Transfer returns the time to move blocks of KV from a prefill worker to a decode worker.
func (m *CostModel) Transfer(blocks int) time.Duration {
	return m.TransferSetup + time.Duration(blocks)*m.TransferPerBlock
}
