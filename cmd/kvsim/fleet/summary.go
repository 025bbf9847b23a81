package fleet

import (
	"math"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
)

// Goodput bounds: a request is good when its time to first token and the 99th percentile of its
// gaps between tokens are within them.
const (
	GoodTTFT   = 2 * time.Second
	GoodITLP99 = 25 * time.Millisecond
)

// Summary is a replay in the figures the comparison report shows.
type Summary struct {
	Requests                  int
	Span                      time.Duration
	TTFTP50, TTFTP90, TTFTP99 time.Duration
	ITLP50, ITLP99, ITLP999   time.Duration // over every gap between tokens of every request
	E2EP50, E2EP90            time.Duration
	// Throughput is output tokens per second of the span.
	Throughput float64
	// Goodput is the share of requests whose TTFT is at most GoodTTFT and whose own ITL p99 is at
	// most GoodITLP99.
	Goodput float64
	// HitRatio is the share of prompt tokens found in a cache.
	HitRatio float64
	// Bypass is the share of requests the router sent to a decode worker to prefill itself.
	Bypass float64
	// Precision is the share of requests whose prefill ran on a worker holding the longest cached
	// prefix of the prompt among the workers of its role.
	Precision float64
	// PrefillUtil and DecodeUtil are the busy share of the prefill workers and of the decode (or
	// aggregated) workers over the span.
	PrefillUtil, DecodeUtil float64
	Preemptions             int
}

// Summarize computes the report's figures.
func (r *Result) Summarize() Summary {
	s := Summary{Requests: len(r.Records), Span: r.Span}
	ttft := make([]time.Duration, 0, len(r.Records))
	e2e := make([]time.Duration, 0, len(r.Records))
	var out, prompt, cached, good, bypass, precise int
	for i := range r.Records {
		rec := &r.Records[i]
		ttft = append(ttft, rec.TTFT())
		e2e = append(e2e, rec.Done-rec.Arrival)
		out += rec.OutputTokens
		prompt += rec.PromptTokens
		cached += rec.CachedTokens
		if rec.TTFT() <= GoodTTFT && rec.ITLP99 <= GoodITLP99 {
			good++
		}
		if rec.Mode == policy.ModeBypass {
			bypass++
		}
		if rec.Precise {
			precise++
		}
	}
	s.TTFTP50, s.TTFTP90, s.TTFTP99 = percentile(ttft, 0.5), percentile(ttft, 0.9), percentile(ttft, 0.99)
	s.E2EP50, s.E2EP90 = percentile(e2e, 0.5), percentile(e2e, 0.9)
	itl := slices.Clone(r.ITL)
	slices.Sort(itl)
	ms := func(q float64) time.Duration {
		if len(itl) == 0 {
			return 0
		}
		i := max(0, int(math.Ceil(q*float64(len(itl))))-1)
		return time.Duration(float64(itl[i]) * float64(time.Millisecond))
	}
	s.ITLP50, s.ITLP99, s.ITLP999 = ms(0.5), ms(0.99), ms(0.999)
	if n := float64(len(r.Records)); n > 0 {
		s.Goodput, s.Bypass, s.Precision = float64(good)/n, float64(bypass)/n, float64(precise)/n
	}
	if r.Span > 0 {
		s.Throughput = float64(out) / r.Span.Seconds()
	}
	if prompt > 0 {
		s.HitRatio = float64(cached) / float64(prompt)
	}
	util := func(roles ...kvstate.Role) float64 {
		var busy time.Duration
		n := 0
		for _, role := range roles {
			busy += r.Busy[role]
			n += r.Workers[role]
		}
		if n == 0 || r.Span == 0 {
			return 0
		}
		return busy.Seconds() / (float64(n) * r.Span.Seconds())
	}
	s.PrefillUtil, s.DecodeUtil = util(kvstate.RolePrefill), util(kvstate.RoleDecode, kvstate.RoleAggregated)
	s.Preemptions = r.Preemptions
	return s
}
