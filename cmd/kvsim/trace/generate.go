package trace

import (
	"fmt"
	"math"
	"math/bits"
	"strconv"
	"time"
)

// rng is a splitmix64 generator: small, fast, and defined entirely here, so the generators' output
// depends on their arguments alone, not on the Go release.
type rng struct{ state uint64 }

// newRNG returns a generator for the given seed and domain tag.
func newRNG(seed, tag uint64) *rng { return &rng{state: combine(tag, seed)} }

// next returns the next 64 random bits.
func (g *rng) next() uint64 {
	g.state += gamma
	return mix64(g.state)
}

// intn returns a uniform integer in [0, n), n > 0 (Lemire's multiply-shift with rejection).
func (g *rng) intn(n int) int {
	bound := uint64(n)
	for {
		hi, lo := bits.Mul64(g.next(), bound)
		if lo >= -bound%bound {
			return int(hi)
		}
	}
}

// arrivals returns n arrival times of a Poisson process of the given rate (requests a second)
// starting at 0: the first request arrives at 0 and the gaps are exponential with mean 1/rate. A
// rate that is not positive and finite sends every request at 0.
func arrivals(n int, rate float64, seed uint64) []time.Duration {
	at := make([]time.Duration, n)
	if !(rate > 0) || math.IsInf(rate, 1) {
		return at
	}
	g := newRNG(seed, tagArrival)
	t := 0.0 // seconds
	for i := 1; i < n; i++ {
		u := float64(g.next()>>11+1) / (1 << 53) // uniform in (0, 1]
		t += -math.Log(u) / rate
		at[i] = time.Duration(math.Round(t * 1e9))
	}
	return at
}

// mustNotBeNegative panics, naming the generator and the argument, if n is negative.
func mustNotBeNegative(gen, name string, n int) {
	if n < 0 {
		panic(fmt.Sprintf("trace: %s: %s = %d is negative", gen, name, n))
	}
}

// SharedPrefix generates the shared-prefix-groups workload (SGLang's generated-shared-prefix, llm-d's
// shared_prefix): groups × promptsPerGroup requests; every prompt of group g is group g's system
// prompt of systemTokens tokens followed by a question of questionTokens tokens of its own, and
// generates outputTokens tokens. The requests come in a random order (as SGLang sends them unless
// told to keep them ordered), so a group's prompts are spread over the whole run, and arrive as a
// Poisson process of the given rate in requests a second (all at 0 if rate is not positive and
// finite). The result depends only on the arguments. Request IDs are "sp-g<g>-p<p>"; Session is
// "". It panics if a count is negative.
func SharedPrefix(groups, promptsPerGroup, systemTokens, questionTokens, outputTokens int, rate float64, seed uint64) []Request {
	const name = "SharedPrefix"
	mustNotBeNegative(name, "groups", groups)
	mustNotBeNegative(name, "promptsPerGroup", promptsPerGroup)
	mustNotBeNegative(name, "systemTokens", systemTokens)
	mustNotBeNegative(name, "questionTokens", questionTokens)
	mustNotBeNegative(name, "outputTokens", outputTokens)
	keys := newRNG(seed, tagSharedPrefix)
	n := groups * promptsPerGroup
	reqs := make([]Request, 0, n)
	segs := make([]Segment, 0, 2*n) // one array for all prompts, each taking two slots
	for g := range groups {
		system := keys.next()
		for p := range promptsPerGroup {
			start := len(segs)
			segs = appendSegment(segs, system, systemTokens)
			segs = appendSegment(segs, keys.next(), questionTokens)
			req := Request{
				ID:           "sp-g" + strconv.Itoa(g) + "-p" + strconv.Itoa(p),
				OutputTokens: outputTokens,
			}
			if len(segs) > start {
				req.Segments = segs[start:len(segs):len(segs)]
			}
			reqs = append(reqs, req)
		}
	}
	order := newRNG(seed, tagSharedPrefixOrder)
	for i := len(reqs) - 1; i > 0; i-- { // Fisher-Yates
		j := order.intn(i + 1)
		reqs[i], reqs[j] = reqs[j], reqs[i]
	}
	for i, at := range arrivals(n, rate, seed) {
		reqs[i].Arrival = at
	}
	return reqs
}

// MultiTurn generates the multi-turn chat workload (vLLM production-stack's multi-round QA): users
// users hold rounds turns each. Every user's prompt starts with one system prompt of systemTokens
// tokens shared by all users; turn r's prompt is that system prompt, then the user's questions
// (questionTokens tokens each) and answers (answerTokens tokens each) of turns 0 to r-1 in order,
// then the new question, and the request generates answerTokens tokens, the answer the next turn
// appends. Turn r of every user comes before turn r+1 of any user, the users of one round in a
// random order, so a user's turns are in order and about users requests apart (standing for the
// user reading the answer and typing); the requests arrive as a Poisson process of the given rate
// in requests a second (all at 0 if rate is not positive and finite). The result depends only on
// the arguments. Request IDs are "mt-u<u>-r<r>" and Session is "user-<u>". A user's requests share
// one segment array. It panics if a count is negative.
func MultiTurn(users, rounds, systemTokens, questionTokens, answerTokens int, rate float64, seed uint64) []Request {
	const name = "MultiTurn"
	mustNotBeNegative(name, "users", users)
	mustNotBeNegative(name, "rounds", rounds)
	mustNotBeNegative(name, "systemTokens", systemTokens)
	mustNotBeNegative(name, "questionTokens", questionTokens)
	mustNotBeNegative(name, "answerTokens", answerTokens)
	keys := newRNG(seed, tagMultiTurn)
	system := keys.next()
	// turns[u][r] is user u's turn r, built from one history per user:
	// system, q0, a0, q1, a1, ..., q(rounds-1).
	turns := make([][]Request, users)
	for u := range users {
		session := "user-" + strconv.Itoa(u)
		hist := appendSegment(make([]Segment, 0, 1+2*rounds), system, systemTokens)
		turns[u] = make([]Request, rounds)
		for r := range rounds {
			hist = appendSegment(hist, keys.next(), questionTokens)
			turns[u][r] = Request{
				ID:           "mt-u" + strconv.Itoa(u) + "-r" + strconv.Itoa(r),
				OutputTokens: answerTokens,
				Session:      session,
			}
			if len(hist) > 0 {
				turns[u][r].Segments = hist[:len(hist):len(hist)]
			}
			hist = appendSegment(hist, keys.next(), answerTokens)
		}
	}
	order := newRNG(seed, tagMultiTurnOrder)
	perm := make([]int, users)
	reqs := make([]Request, 0, users*rounds)
	for r := range rounds {
		for i := range perm {
			perm[i] = i
		}
		for i := users - 1; i > 0; i-- {
			j := order.intn(i + 1)
			perm[i], perm[j] = perm[j], perm[i]
		}
		for _, u := range perm {
			reqs = append(reqs, turns[u][r])
		}
	}
	for i, at := range arrivals(len(reqs), rate, seed) {
		reqs[i].Arrival = at
	}
	return reqs
}
