package trace

import (
	"cmp"
	"math"
	"slices"
	"time"
)

// Dist summarises a distribution of token counts. Percentiles interpolate linearly between the
// two nearest ranks (numpy's default): the q-quantile of the sorted values x[0..n-1] is
// x[i] + f*(x[i+1]-x[i]) with i + f = q*(n-1).
type Dist struct {
	// Mean is the arithmetic mean.
	Mean float64
	// Median, P90 and P99 are the 0.5, 0.9 and 0.99 quantiles.
	Median, P90, P99 float64
	// Min and Max are the smallest and the largest value.
	Min, Max int
}

// Summary describes a trace: its size, arrivals, lengths, and the prefix reuse it offers.
type Summary struct {
	// Requests is the number of requests.
	Requests int
	// Span is the time from the first arrival to the last.
	Span time.Duration
	// Rate is the mean arrival rate, Requests / Span, in requests a second; 0 if Span is 0.
	Rate float64
	// Input and Output are the distributions of the prompt lengths and of the output lengths.
	Input, Output Dist
	// InputTokens and OutputTokens are the totals of the prompt and of the output lengths.
	InputTokens, OutputTokens int

	// BlockSize is the block size, in tokens, of the fields below; they are 0 when it is.
	BlockSize int
	// Blocks is the number of blocks of all prompts, a partial last block counting as one:
	// the sum of ceil(InputTokens/BlockSize) over the requests.
	Blocks int
	// FullBlocks is the number of complete blocks: the sum of floor(InputTokens/BlockSize).
	FullBlocks int
	// HitBlocks is the number of complete blocks already in one infinite cache when their request
	// arrives, the cache having received every complete block of every earlier request (by Arrival,
	// then by index). A block is identified by all the tokens from the start of its prompt to its
	// end, as a prefix cache hashes it; a partial block is never cached.
	HitBlocks int
	// IdealReuse is HitBlocks / Blocks: the fraction of the blocks an engine allocates (a partial
	// block needs one too) that any routing could serve from cache, at best.
	IdealReuse float64
	// IdealTokenReuse is HitBlocks*BlockSize / InputTokens: the fraction of the prompt tokens that
	// need no prefill, at best.
	IdealTokenReuse float64
}

// Stats summarises reqs. With blockSize > 0 it also measures the ideal reuse with blocks of that
// many tokens (see Summary); with blockSize <= 0 it leaves the block fields 0.
//
// The reuse is computed from the requests' segments without materialising any prompt, in time and
// memory proportional to the number of segments whatever the block size: blocks of the same segment
// that follow the same earlier segments can only be cached up to some offset, so the cache is
// represented by that largest offset for each (earlier segments, segment) pair. It equals, with
// overwhelming probability, what hashing the real token ids block by block gives.
//
// For the Mooncake trace with blockSize 512, Blocks is 288,500 (the trace's number of hash ids),
// HitBlocks 105,592, IdealReuse 0.3660 and IdealTokenReuse 0.3734. The trace's README, which counts
// hash ids rather than tokens, finds 0.366 and 0.374: it also counts as hits the 118 partial last
// blocks whose id was used before, which an engine could not serve from cache.
func Stats(reqs []Request, blockSize int) Summary {
	s := Summary{Requests: len(reqs)}
	if len(reqs) == 0 {
		return s
	}
	in := make([]int, len(reqs))
	out := make([]int, len(reqs))
	first, last := reqs[0].Arrival, reqs[0].Arrival
	for i := range reqs {
		in[i] = reqs[i].InputTokens()
		out[i] = reqs[i].OutputTokens
		first, last = min(first, reqs[i].Arrival), max(last, reqs[i].Arrival)
	}
	s.Span = last - first
	if s.Span > 0 {
		s.Rate = float64(len(reqs)) / s.Span.Seconds()
	}
	s.Input, s.InputTokens = dist(in)
	s.Output, s.OutputTokens = dist(out)
	if blockSize > 0 {
		s.BlockSize = blockSize
		s.Blocks, s.FullBlocks, s.HitBlocks = reuse(reqs, blockSize)
		s.IdealReuse = ratio(s.HitBlocks, s.Blocks)
		s.IdealTokenReuse = ratio(s.HitBlocks*blockSize, s.InputTokens)
	}
	return s
}

// ratio returns a/b, or 0 if b is 0.
func ratio(a, b int) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// dist sorts xs and summarises it, returning its sum too.
func dist(xs []int) (Dist, int) {
	slices.Sort(xs)
	sum := 0
	for _, x := range xs {
		sum += x
	}
	quantile := func(q float64) float64 {
		h := q * float64(len(xs)-1)
		i := int(math.Floor(h))
		if i+1 >= len(xs) {
			return float64(xs[len(xs)-1])
		}
		return float64(xs[i]) + (h-float64(i))*float64(xs[i+1]-xs[i])
	}
	return Dist{
		Mean:   float64(sum) / float64(len(xs)),
		Median: quantile(0.5),
		P90:    quantile(0.9),
		P99:    quantile(0.99),
		Min:    xs[0],
		Max:    xs[len(xs)-1],
	}, sum
}

// reuse replays reqs in arrival order against one infinite prefix cache of blocks of b tokens and
// counts all blocks, complete blocks, and complete blocks found in the cache.
//
// A block is identified by its prompt's tokens up to its end, that is by the segments before the
// one it ends in (hashed into a chain) and that segment's key and the block's end offset in it.
// All blocks ending in one segment after one chain start at the same alignment, and a request
// that caches a block there caches every earlier one, so the cached ones are exactly those ending
// at offsets up to the largest cached end offset, which is all the cache needs to hold.
func reuse(reqs []Request, b int) (blocks, full, hits int) {
	order := make([]int, len(reqs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(i, j int) int { return cmp.Compare(reqs[i].Arrival, reqs[j].Arrival) })
	cached := make(map[uint64]int) // combine(chain, key) -> largest cached block end offset
	for _, i := range order {
		chain, pos := uint64(tagChain), 0
		for _, seg := range reqs[i].Segments {
			if seg.Len <= 0 {
				continue
			}
			before, through := pos/b, (pos+seg.Len)/b // block ends up to the segment's start, end
			if through > before {
				k := combine(chain, seg.Key)
				end := cached[k]
				hits += (pos+min(end, seg.Len))/b - before
				if last := through*b - pos; last > end {
					cached[k] = last
				}
			}
			chain = combine(combine(chain, seg.Key), uint64(seg.Len))
			pos += seg.Len
		}
		full += pos / b
		blocks += (pos + b - 1) / b
	}
	return blocks, full, hits
}
