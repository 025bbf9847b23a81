package trace

import (
	"fmt"
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestSharedPrefix(t *testing.T) {
	tests := []struct {
		groups, prompts, system, question, output int
	}{
		{4, 8, 2048, 128, 256},
		{3, 5, 100, 7, 1},
		{2, 3, 0, 10, 5},
		{2, 3, 10, 0, 5},
		{1, 1, 16, 16, 16},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt), func(t *testing.T) {
			reqs := SharedPrefix(tt.groups, tt.prompts, tt.system, tt.question, tt.output, 10, 7)
			if diff := cmp.Diff(reqs, SharedPrefix(tt.groups, tt.prompts, tt.system, tt.question, tt.output, 10, 7)); diff != "" {
				t.Fatalf("two calls with the same seed differ (-first +second):\n%s", diff)
			}
			if len(reqs) != tt.groups*tt.prompts {
				t.Fatalf("%d requests, want %d", len(reqs), tt.groups*tt.prompts)
			}
			systems := make(map[int][]uint32) // group -> its prompts' common prefix
			ids := make(map[string]bool)
			for i, r := range reqs {
				var g, p int
				if _, err := fmt.Sscanf(r.ID, "sp-g%d-p%d", &g, &p); err != nil || g >= tt.groups || p >= tt.prompts || ids[r.ID] {
					t.Fatalf("request ID %q is not a new sp-g<g>-p<p>", r.ID)
				}
				ids[r.ID] = true
				if r.OutputTokens != tt.output || r.Session != "" {
					t.Errorf("%s: OutputTokens %d, Session %q, want %d, \"\"", r.ID, r.OutputTokens, r.Session, tt.output)
				}
				if i > 0 && r.Arrival < reqs[i-1].Arrival {
					t.Errorf("%s arrives at %v, before the previous request (%v)", r.ID, r.Arrival, reqs[i-1].Arrival)
				}
				toks := r.AppendTokens(nil)
				if len(toks) != tt.system+tt.question {
					t.Fatalf("%s has %d tokens, want %d", r.ID, len(toks), tt.system+tt.question)
				}
				if sys, ok := systems[g]; !ok {
					systems[g] = toks
				} else if got := commonPrefix(sys, toks); got != tt.system {
					t.Errorf("%s shares %d tokens with its group's first prompt, want the %d of the system prompt", r.ID, got, tt.system)
				}
			}
			for g := 1; g < tt.groups; g++ {
				if got := commonPrefix(systems[0], systems[g]); got > 2 {
					t.Errorf("groups 0 and %d share %d tokens", g, got)
				}
			}
			// Every group's system prompt is computed once, the rest is new.
			s := Stats(reqs, 1)
			if want := tt.groups * (tt.prompts - 1) * tt.system; s.HitBlocks != want {
				t.Errorf("Stats(reqs, 1).HitBlocks = %d, want %d", s.HitBlocks, want)
			}
		})
	}
}

func TestSharedPrefixShuffled(t *testing.T) {
	reqs := SharedPrefix(16, 16, 64, 8, 8, 0, 1)
	runs := 1 // how many runs of consecutive requests of one group
	for i := 1; i < len(reqs); i++ {
		if reqs[i].Segments[0].Key != reqs[i-1].Segments[0].Key {
			runs++
		}
	}
	if runs < 128 {
		t.Errorf("the 256 requests of 16 groups form %d runs of one group, want them shuffled (about 240)", runs)
	}
	for _, r := range reqs {
		if r.Arrival != 0 {
			t.Fatalf("%s arrives at %v with rate 0, want 0", r.ID, r.Arrival)
		}
	}
	if other := SharedPrefix(16, 16, 64, 8, 8, 0, 2); cmp.Equal(reqs, other) {
		t.Errorf("seeds 1 and 2 give the same requests")
	}
}

func TestMultiTurn(t *testing.T) {
	tests := []struct {
		users, rounds, system, question, answer int
	}{
		{5, 4, 1000, 50, 200},
		{1, 6, 10, 3, 4},
		{3, 3, 0, 8, 0},
		{4, 1, 32, 32, 32},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt), func(t *testing.T) {
			reqs := MultiTurn(tt.users, tt.rounds, tt.system, tt.question, tt.answer, 5, 3)
			if diff := cmp.Diff(reqs, MultiTurn(tt.users, tt.rounds, tt.system, tt.question, tt.answer, 5, 3)); diff != "" {
				t.Fatalf("two calls with the same seed differ (-first +second):\n%s", diff)
			}
			if len(reqs) != tt.users*tt.rounds {
				t.Fatalf("%d requests, want %d", len(reqs), tt.users*tt.rounds)
			}
			var system []uint32            // the first prompt's system prompt
			prev := make(map[int][]uint32) // user -> previous turn's tokens
			next := make(map[int]int)      // user -> next turn expected
			for i, r := range reqs {
				var u, round int
				if _, err := fmt.Sscanf(r.ID, "mt-u%d-r%d", &u, &round); err != nil || u >= tt.users {
					t.Fatalf("request ID %q is not mt-u<u>-r<r>", r.ID)
				}
				if round != next[u] {
					t.Fatalf("%s comes where user %d's turn %d should", r.ID, u, next[u])
				}
				next[u]++
				if round != i/tt.users {
					t.Errorf("%s is request %d, want every user's turn %d before anyone's turn %d", r.ID, i, i/tt.users, i/tt.users+1)
				}
				if r.Session != fmt.Sprintf("user-%d", u) || r.OutputTokens != tt.answer {
					t.Errorf("%s: Session %q, OutputTokens %d, want user-%d, %d", r.ID, r.Session, r.OutputTokens, u, tt.answer)
				}
				if i > 0 && r.Arrival < reqs[i-1].Arrival {
					t.Errorf("%s arrives at %v, before the previous request (%v)", r.ID, r.Arrival, reqs[i-1].Arrival)
				}
				toks := r.AppendTokens(nil)
				if want := tt.system + round*(tt.question+tt.answer) + tt.question; len(toks) != want {
					t.Fatalf("%s has %d tokens, want %d", r.ID, len(toks), want)
				}
				if system == nil {
					system = toks[:tt.system]
				}
				if got := commonPrefix(system, toks); got != tt.system {
					t.Errorf("%s starts with %d tokens of the system prompt, want %d", r.ID, got, tt.system)
				}
				if p, ok := prev[u]; ok {
					if got := commonPrefix(p, toks); got != len(p) {
						t.Errorf("%s repeats %d tokens of the previous turn's %d", r.ID, got, len(p))
					}
					if tt.answer > 0 && countEqual(toks[len(p):len(p)+tt.answer], toks[len(toks)-tt.question:]) > 2 {
						t.Errorf("%s: the answer looks like the question", r.ID)
					}
				}
				prev[u] = toks
			}
			// Every turn reuses all of the user's previous turn, and turn 0 the system prompt.
			s := Stats(reqs, 1)
			want := (tt.users - 1) * tt.system
			if tt.system == 0 {
				want = 0
			}
			for r := 1; r < tt.rounds; r++ {
				want += tt.users * (tt.system + (r-1)*(tt.question+tt.answer) + tt.question)
			}
			if s.HitBlocks != want {
				t.Errorf("Stats(reqs, 1).HitBlocks = %d, want %d", s.HitBlocks, want)
			}
		})
	}
}

func TestPoissonArrivals(t *testing.T) {
	const n, rate = 20000, 8.0
	reqs := SharedPrefix(n, 1, 1, 1, 1, rate, 11)
	gaps := make([]float64, 0, n-1)
	for i := 1; i < n; i++ {
		gaps = append(gaps, (reqs[i].Arrival - reqs[i-1].Arrival).Seconds())
	}
	mean, sd := meanSD(gaps)
	// An exponential distribution has equal mean and standard deviation, 1/rate.
	if math.Abs(mean*rate-1) > 0.03 || math.Abs(sd*rate-1) > 0.05 {
		t.Errorf("gaps have mean %.4f s and sd %.4f s, want both %.4f s", mean, sd, 1/rate)
	}
	if reqs[0].Arrival != 0 {
		t.Errorf("the first request arrives at %v, want 0", reqs[0].Arrival)
	}
	if s := Stats(reqs, 0); math.Abs(s.Rate/rate-1) > 0.03 {
		t.Errorf("Stats rate %.3f, want about %v", s.Rate, rate)
	}
	for _, rate := range []float64{0, -1, math.Inf(1), math.NaN()} {
		for _, r := range MultiTurn(3, 2, 1, 1, 1, rate, 1) {
			if r.Arrival != 0 {
				t.Fatalf("rate %v: %s arrives at %v, want 0", rate, r.ID, r.Arrival)
			}
		}
	}
}

func TestGeneratorsRefuseNegativeCounts(t *testing.T) {
	calls := map[string]func(){
		"SharedPrefix groups":    func() { SharedPrefix(-1, 1, 1, 1, 1, 1, 1) },
		"SharedPrefix question":  func() { SharedPrefix(1, 1, 1, -1, 1, 1, 1) },
		"MultiTurn rounds":       func() { MultiTurn(1, -2, 1, 1, 1, 1, 1) },
		"MultiTurn answerTokens": func() { MultiTurn(1, 1, 1, 1, -1, 1, 1) },
	}
	for name, call := range calls {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			call()
		}()
	}
	if got := SharedPrefix(0, 5, 1, 1, 1, 1, 1); len(got) != 0 {
		t.Errorf("SharedPrefix with no groups gave %d requests", len(got))
	}
}

// meanSD returns the mean and the standard deviation of xs.
func meanSD(xs []float64) (mean, sd float64) {
	for _, x := range xs {
		mean += x
	}
	mean /= float64(len(xs))
	for _, x := range xs {
		sd += (x - mean) * (x - mean)
	}
	return mean, math.Sqrt(sd / float64(len(xs)))
}

func TestMultiTurnShuffled(t *testing.T) {
	reqs := MultiTurn(8, 3, 10, 10, 10, 0, 5)
	orders := make(map[string]bool) // the order of the users in each round
	for r := range 3 {
		order := ""
		for _, req := range reqs[8*r : 8*r+8] {
			order += req.Session + " "
		}
		orders[order] = true
	}
	if len(orders) < 2 {
		t.Errorf("the users come in the same order in all 3 rounds, want a new random order each round")
	}
}
