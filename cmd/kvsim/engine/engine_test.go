package engine

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// recorder is an Observer that keeps what the engine announced.
type recorder struct {
	held     map[uint64]bool // stored and not removed since
	chains   [][]uint64
	parents  []uint64
	first    map[string]time.Duration
	tokens   map[string][]time.Duration // when each token came out
	finished map[string]time.Duration
}

func newRecorder() *recorder {
	return &recorder{held: map[uint64]bool{}, first: map[string]time.Duration{}, tokens: map[string][]time.Duration{}, finished: map[string]time.Duration{}}
}

func (r *recorder) Stored(_ *Engine, hashes []uint64, parent uint64, hasParent bool, tokens func(int) []uint32) {
	for i, h := range hashes {
		if r.held[h] {
			panic(fmt.Sprintf("block %d stored twice", h))
		}
		if len(tokens(i)) == 0 {
			panic("a stored block without tokens")
		}
		r.held[h] = true
	}
	r.chains = append(r.chains, append([]uint64(nil), hashes...))
	if hasParent {
		r.parents = append(r.parents, parent)
	}
}

func (r *recorder) Removed(_ *Engine, hashes []uint64) {
	for _, h := range hashes {
		delete(r.held, h)
	}
}

func (r *recorder) FirstToken(_ *Engine, s *Seq, at time.Duration) {
	r.first[s.ID] = at
	r.tokens[s.ID] = append(r.tokens[s.ID], at)
}

func (r *recorder) Token(_ *Engine, s *Seq, at time.Duration) {
	r.tokens[s.ID] = append(r.tokens[s.ID], at)
}

func (r *recorder) Finished(_ *Engine, s *Seq, at time.Duration) { r.finished[s.ID] = at }

// prompt returns a sequence of n tokens whose first shared tokens are those of the shared prompt:
// block hashes follow the tokens, so equal prefixes share blocks.
func prompt(id string, n, shared, blockSize, output int) *Seq {
	s := &Seq{ID: id, OutputTokens: output}
	for i := range n {
		tok := uint32(i + 1)
		if i >= shared {
			tok = uint32(1_000_000 + len(id)*7919 + i)
		}
		s.Prompt = append(s.Prompt, tok)
	}
	var h uint64
	for b := 0; (b+1)*blockSize <= n; b++ {
		for _, t := range s.Prompt[b*blockSize : (b+1)*blockSize] {
			h = (h ^ uint64(t)) * 1099511628211
		}
		s.Blocks = append(s.Blocks, h)
	}
	return s
}

// run steps the engine until it is idle and returns the virtual time it ends at.
func run(t *testing.T, e *Engine, now time.Duration) time.Duration {
	t.Helper()
	for steps := 0; !e.Idle(); steps++ {
		d := e.Step(now)
		if d == 0 {
			t.Fatalf("the engine has work (%d waiting, %d running) but ran nothing", e.Waiting(), e.Running())
		}
		now += d
		if steps > 1_000_000 {
			t.Fatal("the engine does not finish")
		}
	}
	return now
}

func TestEnginePrefillDecodeAndPrefixReuse(t *testing.T) {
	m := Llama31_8B_H100()
	rec := newRecorder()
	e := New("agg", m, rec)
	a := prompt("a", 2048, 2048, m.BlockSize, 10)
	e.Submit(a)
	end := run(t, e, 0)
	if want := m.Step(0, 0, []Chunk{{New: 2048}}); rec.first["a"] != want {
		t.Errorf("TTFT of a 2k prompt = %v, want one prefill pass, %v", rec.first["a"], want)
	}
	if n := len(rec.tokens["a"]); n != 10 || rec.finished["a"] != end {
		t.Errorf("a produced %d tokens and finished at %v, want 10 tokens and %v", n, rec.finished["a"], end)
	}
	if len(rec.chains) != 1 || len(rec.chains[0]) != 128 || len(rec.parents) != 0 {
		t.Errorf("stored chains %d (first of %d blocks), want one chain of 128 blocks without parent", len(rec.chains), len(rec.chains[0]))
	}
	if e.Cache().Referenced() != 0 || e.Cache().Used() != 128 {
		t.Errorf("after the request: %d referenced, %d held; want 0 and 128 (cached for reuse)", e.Cache().Referenced(), e.Cache().Used())
	}

	// b shares the first 1,024 tokens: they are not computed again.
	b := prompt("b", 2048, 1024, m.BlockSize, 1)
	e.Submit(b)
	start := end
	run(t, e, start)
	if b.CachedTokens() != 1024 {
		t.Errorf("b found %d cached tokens, want 1024", b.CachedTokens())
	}
	if want := m.Step(0, 0, []Chunk{{New: 1024, Done: 1024}}); rec.first["b"]-start != want {
		t.Errorf("TTFT of b = %v, want %v (only its uncached half computed)", rec.first["b"]-start, want)
	}
	if got := rec.parents[len(rec.parents)-1]; got != a.Blocks[63] {
		t.Errorf("b's stored chain hangs off block %d, want a's block 63", got)
	}
}

// TestLocalPrefillSlowsDecode: a prompt prefilled on a worker that is decoding (the bypass of
// conditional disaggregation) lengthens the decode steps it shares: the ITL cost the policy weighs.
func TestLocalPrefillSlowsDecode(t *testing.T) {
	m := Llama31_8B_H100()
	rec := newRecorder()
	e := New("decode", m, rec)
	long := prompt("long", 512, 0, m.BlockSize, 200)
	e.Submit(long)
	now := time.Duration(0)
	for len(rec.tokens["long"]) < 50 {
		now += e.Step(now)
	}
	e.Submit(prompt("local", 16_384, 0, m.BlockSize, 1))
	for len(rec.tokens["long"]) < 60 {
		now += e.Step(now)
	}
	gaps := func(from, to int) (worst time.Duration) {
		ts := rec.tokens["long"]
		for i := from; i < to; i++ {
			worst = max(worst, ts[i+1]-ts[i])
		}
		return worst
	}
	before, during := gaps(40, 49), gaps(49, 52)
	if before > 10*time.Millisecond || during < 200*time.Millisecond {
		t.Errorf("ITL before the local prefill %v, while it runs %v; want under 10 ms, then over 200 ms (an 8k chunk a step)", before, during)
	}
	if _, ok := rec.first["local"]; !ok {
		t.Error("the local prefill never finished")
	}
}

// TestPrefillOnlyAndTransferred: a prefill worker's job ends at its first token with its blocks
// cached; the decode worker's copy arrives with its KV, computes no prefill and decodes at once.
func TestPrefillOnlyAndTransferred(t *testing.T) {
	m := Llama31_8B_H100()
	rec := newRecorder()
	p := New("prefill", m, rec)
	s := prompt("r", 4096, 0, m.BlockSize, 5)
	s.PrefillOnly = true
	p.Submit(s)
	end := run(t, p, 0)
	if rec.finished["r"] != end || len(rec.tokens["r"]) != 1 || p.Cache().Referenced() != 0 || p.Cache().Used() != 256 {
		t.Errorf("prefill-only: finished %v (end %v), %d tokens, %d referenced, %d held; want end, 1, 0, 256",
			rec.finished["r"], end, len(rec.tokens["r"]), p.Cache().Referenced(), p.Cache().Used())
	}
	rec2 := newRecorder()
	d := New("decode", m, rec2)
	s2 := prompt("r", 4096, 0, m.BlockSize, 5)
	s2.Transferred = true
	d.Submit(s2)
	run(t, d, 0)
	if want := m.Step(1, 4096, nil); rec2.first["r"] != want {
		t.Errorf("the transferred request's first token at %v, want one decode step, %v", rec2.first["r"], want)
	}
	if len(rec2.held) != 256 {
		t.Errorf("the decode worker announced %d blocks, want the 256 transferred", len(rec2.held))
	}
}

// TestEngineInvariants runs a random workload through a small cache: every request finishes, the
// cache never holds more than its capacity, and what the engine announced equals what it holds.
func TestEngineInvariants(t *testing.T) {
	m := Llama31_8B_H100()
	m.TotalKVBlocks, m.MaxNumSeqs = 600, 16
	rec := newRecorder()
	e := New("agg", m, rec)
	rng := rand.New(rand.NewPCG(3, 4))
	now := time.Duration(0)
	submitted := 0
	for step := 0; step < 20_000 && (submitted < 300 || !e.Idle()); step++ {
		if submitted < 300 && rng.IntN(3) == 0 {
			e.Submit(prompt(fmt.Sprintf("r%d", submitted), 256+rng.IntN(4096), rng.IntN(3)*1024, m.BlockSize, 1+rng.IntN(64)))
			submitted++
		}
		if d := e.Step(now); d > 0 {
			now += d
		} else {
			now += time.Millisecond
		}
		if e.Cache().Used() > m.TotalKVBlocks {
			t.Fatalf("step %d: the cache holds %d blocks, capacity %d", step, e.Cache().Used(), m.TotalKVBlocks)
		}
		if len(rec.held) != e.Cache().Used() {
			t.Fatalf("step %d: announced %d blocks, the cache holds %d", step, len(rec.held), e.Cache().Used())
		}
	}
	if len(rec.finished) != 300 {
		t.Errorf("%d of 300 requests finished", len(rec.finished))
	}
	for h := range rec.held {
		if !e.Cache().Contains(h) {
			t.Fatalf("block %d announced but not held", h)
		}
	}
}
