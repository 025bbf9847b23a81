package policy

import (
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/zeebo/xxh3"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// BypassAnnotation marks a request the decode worker must prefill itself. Only the router sets it.
const BypassAnnotation = "x-bypass-remote-prefill"

// PrefillContinueAnnotation is the marker of Dynamo's prefill-continue feature. The router never
// sets it, but the later Dynamo version strips a client-sent copy with the bypass marker (§1.5), so a
// client cannot steer a worker's prefill through the router either way.
const PrefillContinueAnnotation = "x-prefill-continue"

// Mode is the shape of a routing decision.
type Mode uint8

// Routing modes.
const (
	// ModeDisaggregated: prefill on the prefill target, then decode on the decode target.
	ModeDisaggregated Mode = iota + 1
	// ModeBypass: the decode target prefills locally.
	ModeBypass
	// ModeAggregated: the model has no prefill pool; the decode target runs the whole request.
	ModeAggregated
)

// String returns the mode's lower-case name (used as a metric label).
func (m Mode) String() string {
	switch m {
	case ModeDisaggregated:
		return "disaggregated"
	case ModeBypass:
		return "bypass"
	case ModeAggregated:
		return "aggregated"
	}
	return "unspecified"
}

// Hop names, as reported in diagnostics. The preview hops are the advisory (non-booking) selections
// of conditional disaggregation.
const (
	HopPrefill        = "prefill"
	HopDecode         = "decode"
	HopAggregated     = "aggregated"
	HopDecodePreview  = "decode_preview"
	HopPrefillPreview = "prefill_preview"
)

// Pin restricts a hop to one worker, and to one of its ranks when Rank is set.
type Pin struct {
	Worker uint64
	Rank   *uint32
}

func (p *Pin) matches(k kvstate.WorkerKey) bool {
	return p == nil || (k.ID == p.Worker && (p.Rank == nil || *p.Rank == k.Rank))
}

// Request is one routing request, already validated.
type Request struct {
	ID             string
	Model          string
	Tokens         []uint32
	LoraName       string
	CacheNamespace string
	// Multimodal are the prompt's multimodal inputs, sorted by Start and not overlapping; the blocks
	// holding their tokens are keyed with their hashes (blockhash.LocalsMultimodal).
	Multimodal []blockhash.MultimodalObject
	// Hashed, when not nil, is the prompt as the caller keyed it, instead of Tokens: Tokens,
	// LoraName, CacheNamespace and Multimodal are then empty (their salts and inputs are in the
	// hashes).
	Hashed         *HashedPrompt
	QueryOnly      bool
	Annotations    []string
	PrefillPin     *Pin
	DecodePin      *Pin
	AllowedWorkers []uint64 // empty = all
	// AllowedEndpoints, when not nil, are the only worker endpoints either hop may choose: the
	// candidate subset a gateway's proxy sends its endpoint picker. Empty but not nil allows none.
	AllowedEndpoints []string
	Override         Override
	CDOverride       CDOverride
	// SessionWorker is the decode worker the request's session is bound to (session affinity), as
	// the caller found it in the state; nil when there is none. An explicit DecodePin wins over it.
	SessionWorker *kvstate.WorkerKey
	Explain       bool
}

// Choice is the worker chosen for one hop and the numbers behind it.
type Choice struct {
	Candidate
	CachedTokens float64 // tier-weighted, unrounded
}

// Scored is one candidate of one hop, reported when a request asks to explain.
type Scored struct {
	Hop string
	Candidate
	Chosen bool
}

// Decision is the answer to a routing request.
type Decision struct {
	Mode        Mode
	Reason      Reason
	CD          *CDDiagnostics // set when conditional disaggregation evaluated the request
	Prefill     *Choice        // ModeDisaggregated only
	Decode      Choice
	Annotations []string
	// Load is what booking the decision puts on its workers, one entry per hop; nil for a
	// query-only request. The kernel only describes it: the caller books it (server/app).
	Load         []kvstate.HopBooking
	Booked       bool // set by whoever booked Load
	PromptTokens uint64
	PromptBlocks uint64 // complete (hashed) blocks
	BlockSize    uint32
	Candidates   []Scored // when explaining
}

// Kernel is the pure decision kernel: from a read-only View it decides where a request runs and
// what load that puts on the chosen workers. It appends nothing, books nothing and never blocks;
// server/app books its decisions, queues requests it finds overloaded and keeps sessions. Its view
// offers reads only and its configuration is fixed at construction (NewKernel), so the compiler,
// not a convention, keeps it from changing what it reads or being changed while it decides. It is
// safe for concurrent use; deciding reads local memory only and allocates little (scratch space is
// pooled).
type Kernel struct {
	view    View
	cfg     Config
	scorer  Scorer   // cfg.Scorer, or DynamoCost
	picker  Picker   // WithPicker, or TemperaturePicker
	filters []Filter // WithFilters; none by default
	rand    Rand     // WithRand, or GlobalRand

	scratch sync.Pool
}

// NewKernel returns a kernel deciding over view with cfg: its scorer (nil: DynamoCost), Dynamo's
// picker and the global random source unless opts say otherwise. The kernel keeps its own copy of
// cfg, so a caller changing its Config (or a threshold it points to) afterwards changes nothing.
func NewKernel(view View, cfg Config, opts ...Option) *Kernel {
	k := &Kernel{view: view, cfg: cfg.clone()}
	for _, o := range opts {
		o(k)
	}
	if k.scorer = k.cfg.Scorer; k.scorer == nil {
		k.scorer = DynamoCost
	}
	if k.picker == nil {
		k.picker = TemperaturePicker{}
	}
	if k.rand == nil {
		k.rand = GlobalRand{}
	}
	return k
}

// Config returns a copy of the configuration the kernel decides with.
func (r *Kernel) Config() Config { return r.cfg.clone() }

// BlockSize returns the block size of the named model as the kernel's view has it, and false when
// no worker serves the model: what a caller keys the model's prompts for (KeyedPrompt.Key).
func (r *Kernel) BlockSize(model string) (uint32, bool) {
	m := r.view.Model(model)
	if m == nil {
		return 0, false
	}
	return m.BlockSize(), true
}

// scratch is per-call working memory, reused through a pool so routing does not allocate it anew.
type scratch struct {
	key      KeyedPrompt      // the prompt's key when the caller gave none that fits
	overlap  kvstate.Overlaps // per worker: prompt overlap in the prefix index
	active   kvstate.Overlaps // per worker: prompt overlap with its active (booked) blocks
	cands    []Candidate
	costs    []float64
	slots    []uint32
	loads    []kvstate.SlotLoad
	workers  []*kvstate.Worker // the model's workers (a copy: ModelView.AppendWorkers)
	prefill  []*kvstate.Worker // the model's prefill pool
	decode   []*kvstate.Worker // the model's decode (or aggregated) pool
	eligible []*kvstate.Worker // one hop's workers after hints
	hop      Hop               // what the hop's filters, scorer and picker see
}

// getScratch returns pooled scratch space; putScratch gives it back.
func (r *Kernel) getScratch() *scratch {
	if sc, _ := r.scratch.Get().(*scratch); sc != nil {
		return sc
	}
	return &scratch{}
}

func (r *Kernel) putScratch(sc *scratch) { r.scratch.Put(sc) }

// keyFor returns p when it was keyed for blockSize, else req's prompt keyed in sc (the one rule of
// KeyedPrompt's contract).
func keyFor(req *Request, p *KeyedPrompt, blockSize uint32, sc *scratch) *KeyedPrompt {
	if p.KeyedFor(blockSize) {
		return p
	}
	sc.key.Key(req, blockSize)
	return &sc.key
}

// routeCtx is one request's routing inputs, shared by its hops.
type routeCtx struct {
	req    *Request
	sc     *scratch
	key    *KeyedPrompt // the prompt's hashes
	prompt Prompt       // key.Prompt
	dec    *Decision
}

// Decide returns where req runs and, unless it is query-only, the load booking it would put on its
// workers (Decision.Load). p is req's prompt keyed for its model (KeyedPrompt: the kernel uses it
// when it was keyed for the model's block size, and keys the prompt itself otherwise; nil is fine).
// It fails with ErrAllWorkersOverloaded when router_queue_threshold leaves no worker for a hop; the
// caller may queue the request and decide again when capacity changes.
func (r *Kernel) Decide(req *Request, p *KeyedPrompt) (*Decision, error) {
	cd, err := r.cfg.effectiveCD(req.CDOverride)
	if err != nil {
		return nil, err
	}
	m := r.view.Model(req.Model)
	if m == nil {
		return nil, fmt.Errorf("%w: %q", ErrUnknownModel, req.Model)
	}
	if err := req.checkBlockSize(m.BlockSize()); err != nil {
		return nil, err
	}
	sc := r.getScratch()
	defer r.putScratch(sc)

	key := keyFor(req, p, m.BlockSize(), sc)
	rc := &routeCtx{req: req, sc: sc, key: key, prompt: key.Prompt}
	if r.cfg.UseKVEvents {
		m.Overlaps(key.Seq, &sc.overlap)
	} else {
		m.Overlaps(nil, &sc.overlap)
	}
	r.view.Load().ActiveDepths(key.Seq, &sc.active)

	rc.dec = &Decision{
		PromptTokens: rc.prompt.Tokens, PromptBlocks: uint64(len(key.Seq)), BlockSize: key.BlockSize,
		Annotations: StripBypassMarkers(req.Annotations),
	}
	sc.workers = m.AppendWorkers(sc.workers[:0])
	sc.prefill, sc.decode = sc.prefill[:0], sc.decode[:0]
	for _, w := range sc.workers {
		if w.Info.Role == kvstate.RolePrefill {
			sc.prefill = append(sc.prefill, w)
		} else {
			sc.decode = append(sc.decode, w)
		}
	}
	prefillPool, decodePool := sc.prefill, sc.decode
	weights := r.cfg.weights(req.Override)
	dec := rc.dec
	// The decode hop goes to the explicit pin, else to the session's decode worker if it is still here.
	affinity, affinityStale := sessionTarget(req, decodePool)
	decodePin := req.DecodePin
	if decodePin == nil {
		decodePin = affinity
	}
	var hops []hopLoad // what the decision books, built into a booking only if it is booked
	switch {
	case len(prefillPool) == 0:
		// No prefill pool (§5.4): the decode worker runs the whole request.
		if r.cfg.EnforceDisagg {
			return nil, fmt.Errorf("%w: model %q", ErrDisaggRequired, req.Model)
		}
		dc, err := r.choose(rc, HopAggregated, decodePool, weights, decodePin)
		if err != nil {
			return nil, err
		}
		dec.Mode, dec.Reason, dec.Decode = ModeAggregated, ReasonNoPrefillWorkers, dc
		hops = []hopLoad{{&dec.Decode, weights.AssumeKVReuse, weights.TrackPrefillTokens}}
	default:
		if bypass := r.conditionalDisagg(rc, cd, weights, prefillPool, decodePool, affinity, affinityStale); bypass != nil {
			// The decode worker prefills locally: it is booked with the request's own weights,
			// prefill tokens included (§5.2 step 4).
			dec.Mode, dec.Decode = ModeBypass, *bypass
			dec.Annotations = append(dec.Annotations, BypassAnnotation)
			hops = []hopLoad{{&dec.Decode, weights.AssumeKVReuse, weights.TrackPrefillTokens}}
			break
		}
		pc, err := r.choose(rc, HopPrefill, prefillPool, weights, req.PrefillPin)
		if err != nil {
			return nil, err
		}
		// The decode hop after a remote prefill (§5.3): load-only, unless conditional
		// disaggregation keeps the overlap credit so later turns find their cache (§2).
		dc, err := r.choose(rc, HopDecode, decodePool, DecodeHopWeights(weights, cd.Enabled), decodePin)
		if err != nil {
			return nil, err
		}
		dec.Mode, dec.Prefill, dec.Decode = ModeDisaggregated, &pc, dc
		hops = []hopLoad{{dec.Prefill, false, weights.TrackPrefillTokens}, {&dec.Decode, false, false}}
	}
	if !req.QueryOnly {
		dec.Load = hopBookings(rc, hops)
	}
	return dec, nil
}

// sessionTarget returns the decode worker the request's session is bound to, as a pin, when the
// request pins no decode worker itself. stale reports a binding to a worker that is no longer among
// the decode workers.
func sessionTarget(req *Request, decodePool []*kvstate.Worker) (pin *Pin, stale bool) {
	key := req.SessionWorker
	if key == nil || req.DecodePin != nil {
		return nil, false
	}
	for _, w := range decodePool {
		if w.Info.Key == *key {
			if !req.allows(w) {
				return nil, true // outside the candidates this request may use: choose afresh
			}
			return &Pin{Worker: key.ID, Rank: &key.Rank}, false
		}
	}
	return nil, true
}

// allows reports whether the request's allow-lists (worker ids, endpoints) let it use w.
func (req *Request) allows(w *kvstate.Worker) bool {
	if len(req.AllowedWorkers) > 0 && !containsID(req.AllowedWorkers, w.Info.Key.ID) {
		return false
	}
	return req.AllowedEndpoints == nil || slices.Contains(req.AllowedEndpoints, w.Info.Endpoint)
}

// DecodeHopWeights returns the weights of the decode hop after a remote prefill (§5.3): active
// blocks are not deduplicated and prefill is not charged, since the prompt was computed elsewhere.
// The overlap credit is zeroed unless conditional disaggregation keeps it (decode affinity, §2.2).
func DecodeHopWeights(w Weights, keepCredit bool) Weights {
	w.AssumeKVReuse = false
	w.TrackPrefillTokens = false
	if !keepCredit {
		w.Credit = 0
	}
	return w
}

// choose picks one worker for a hop: the kernel's eligibility rules (pool, pin, allow-list,
// router_queue_threshold), then the filters, the scorer and the picker.
func (r *Kernel) choose(rc *routeCtx, hop string, pool []*kvstate.Worker, w Weights, pin *Pin) (Choice, error) {
	sc, req, p := rc.sc, rc.req, rc.prompt
	sc.slots = sc.slots[:0]
	eligible := sc.eligible[:0]
	for _, wk := range pool {
		if !req.allows(wk) || !pin.matches(wk.Info.Key) {
			continue
		}
		eligible = append(eligible, wk)
		sc.slots = append(sc.slots, wk.Slot)
	}
	sc.eligible = eligible
	if len(eligible) == 0 {
		return Choice{}, noEligibleWorker(req, hop, pin)
	}
	sc.loads = r.view.Load().Slots(sc.loads[:0], sc.slots)

	requestBlocks := p.Blocks()
	sc.cands = sc.cands[:0]
	overloaded := 0
	var minActive uint64
	for i, wk := range eligible {
		load := sc.loads[i]
		if r.overloaded(wk, load) {
			overloaded++
			continue
		}
		c := Candidate{Worker: wk, Overlap: sc.overlap.Blocks(wk.Slot), Load: load}
		newBlocks := requestBlocks
		if w.AssumeKVReuse {
			newBlocks -= uint64(sc.active.Depths(wk.Slot)[kvstate.TierDevice])
		}
		c.PotentialDecodeBlocks = load.ActiveBlocks + newBlocks
		if len(sc.cands) == 0 || load.ActivePrefillTokens < minActive {
			minActive = load.ActivePrefillTokens
		}
		sc.cands = append(sc.cands, c)
	}
	if len(sc.cands) == 0 {
		return Choice{}, allOverloaded(hop, pin, overloaded)
	}
	h := &sc.hop
	*h = Hop{Name: hop, Request: req, Prompt: p, Weights: w, MinActivePrefill: minActive}
	for _, f := range r.filters {
		n := len(sc.cands)
		sc.cands = slices.DeleteFunc(sc.cands, func(c Candidate) bool { return !f.Keep(h, &c) })
		if len(sc.cands) == 0 {
			return Choice{}, filteredOut(hop, f, n)
		}
	}
	r.scorer.Score(h, sc.cands)
	sc.costs = sc.costs[:0]
	for i := range sc.cands {
		sc.costs = append(sc.costs, sc.cands[i].Cost)
	}
	best := r.picker.Pick(h, sc.costs, r.rand)
	if req.Explain {
		for i, c := range sc.cands {
			rc.dec.Candidates = append(rc.dec.Candidates, Scored{Hop: hop, Candidate: c, Chosen: i == best})
		}
	}
	chosen := sc.cands[best]
	return Choice{Candidate: chosen, CachedTokens: w.CachedTokens(chosen.Overlap, p.BlockSize)}, nil
}

// The errors of choose are built out of line: their fmt.Errorf arguments would otherwise take
// several hundred bytes of choose's stack frame on every call. Frames matter on this path: a
// gRPC handler's goroutine starts with an 8 KB stack, and the Route path used to overflow it, so
// every call paid for copying its stack to a larger one (9% of the server's CPU per call;
// docs/benchmarks/history.md, "Route over gRPC: kvload and profiles").

//go:noinline
func noEligibleWorker(req *Request, hop string, pin *Pin) error {
	switch {
	case pin != nil:
		return fmt.Errorf("%w: %s hop has no worker %s", ErrPinnedWorkerNotFound, hop, pin)
	case len(req.AllowedWorkers) > 0:
		return fmt.Errorf("%w: %s hop: none of allowed_worker_ids %v serves model %q", ErrNoEligibleWorkers, hop, req.AllowedWorkers, req.Model)
	case req.AllowedEndpoints != nil:
		return fmt.Errorf("%w: %s hop: none of the %d candidate endpoints is a %s worker of model %q", ErrNoEligibleWorkers, hop, len(req.AllowedEndpoints), hopRole(hop), req.Model)
	default:
		return fmt.Errorf("%w: model %q has no %s workers", ErrNoWorkers, req.Model, hopRole(hop))
	}
}

//go:noinline
func allOverloaded(hop string, pin *Pin, overloaded int) error {
	if pin != nil && overloaded == 1 {
		return fmt.Errorf("%w: %s hop, worker %s", ErrPinnedWorkerOverloaded, hop, pin)
	}
	return fmt.Errorf("%w: %s hop, %d workers over router_queue_threshold", ErrAllWorkersOverloaded, hop, overloaded)
}

//go:noinline
func filteredOut(hop string, f Filter, n int) error {
	return fmt.Errorf("%w: %s hop: filter %s dropped all %d workers", ErrNoEligibleWorkers, hop, f, n)
}

// overloaded reports whether the worker's prefill load is over router_queue_threshold times its
// prefill capacity (§3.5). Without a threshold no worker is overloaded.
func (r *Kernel) overloaded(w *kvstate.Worker, load kvstate.SlotLoad) bool {
	t := r.cfg.QueueThreshold
	if t == nil {
		return false
	}
	return float64(load.ActivePrefillTokens) > *t*float64(PrefillTokenCapacity(w))
}

// PrefillTokenCapacity returns the worker's advertised max_num_batched_tokens, or
// DefaultPrefillTokenCapacity when it advertised none.
func PrefillTokenCapacity(w *kvstate.Worker) uint64 {
	if w.Info.MaxNumBatchedTokens == 0 {
		return DefaultPrefillTokenCapacity
	}
	return w.Info.MaxNumBatchedTokens
}

// hopLoad says how one hop of a decision loads its worker.
type hopLoad struct {
	choice *Choice
	// blocks: book the request's blocks; reuse: under their sequence hashes, so requests sharing a
	// prefix share them. A prefill hop books no blocks (Dynamo tracks no active blocks there).
	reuse bool
	// prefill: charge the uncached prompt tokens until MarkPrefillComplete.
	prefill bool
}

// hopBookings builds the load a decision puts on its workers (§3.5, DESIGN "Bookings"): a prefill
// worker carries the uncached prompt tokens; a decode worker carries the request's blocks, plus the
// uncached prompt tokens when it prefills itself (aggregated or bypass).
func hopBookings(rc *routeCtx, hops []hopLoad) []kvstate.HopBooking {
	out := make([]kvstate.HopBooking, 0, len(hops))
	for _, h := range hops {
		hb := kvstate.HopBooking{Worker: h.choice.Worker.Info.Key}
		if h.choice.Worker.Info.Role != kvstate.RolePrefill {
			hb.Blocks = requestBlockKeys(rc, h.reuse)
		}
		if h.prefill {
			hb.PrefillTokens = uncachedTokens(rc.prompt, h.choice.Overlap)
		}
		out = append(out, hb)
	}
	return out
}

// uncachedTokens is the prompt minus its device-cached prefix: what the worker must compute.
func uncachedTokens(p Prompt, overlap kvstate.TierCounts) uint64 {
	cached := overlap[kvstate.TierDevice] * uint64(p.BlockSize)
	return p.Tokens - min(cached, p.Tokens)
}

// requestBlockKeys returns the keys of the request's ceil(P/B) blocks for load tracking. With KV reuse
// assumed, complete blocks use their sequence hashes, so requests sharing a prefix share those
// blocks; the partial tail block, and every block without reuse, gets a key unique to the request.
func requestBlockKeys(rc *routeCtx, reuse bool) []uint64 {
	n := rc.prompt.Blocks()
	keys := make([]uint64, 0, n)
	if reuse {
		keys = append(keys, rc.key.Seq...)
	}
	base := xxh3.HashString(rc.req.ID)
	for i := uint64(len(keys)); i < n; i++ {
		keys = append(keys, blockhash.Chain(base, i))
	}
	return keys
}

// StripBypassMarkers returns the annotations without any client-sent bypass or prefill-continue
// marker, exact or in the "<marker>:<value>" form: only the router may ask a decode worker to prefill
// (§1.5, §8 item 11).
func StripBypassMarkers(annotations []string) []string {
	out := make([]string, 0, len(annotations))
	for _, a := range annotations {
		if isMarker(a, BypassAnnotation) || isMarker(a, PrefillContinueAnnotation) {
			continue
		}
		out = append(out, a)
	}
	return out
}

// isMarker reports whether the annotation a is marker itself or marker followed by ":<value>".
func isMarker(a, marker string) bool {
	return a == marker || strings.HasPrefix(a, marker+":")
}

func (p *Pin) String() string {
	if p.Rank != nil {
		return fmt.Sprintf("%d/%d", p.Worker, *p.Rank)
	}
	return fmt.Sprintf("%d", p.Worker)
}

func hopRole(hop string) string {
	if hop == HopPrefill || hop == HopPrefillPreview {
		return "prefill"
	}
	return "decode or aggregated"
}

func containsID(ids []uint64, id uint64) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

// UncachedTokens returns the prompt tokens that no worker of the request's model holds: the prompt
// minus the longest device-tier cached prefix on any of them (all of it for an unknown model).
// Requests queued for capacity wait shortest-first by it under router_queue_policy wspt. p is req's
// prompt keyed for its model, as Decide takes it (nil: the kernel keys it).
func (r *Kernel) UncachedTokens(req *Request, p *KeyedPrompt) uint64 {
	tokens := req.PromptTokens()
	m := r.view.Model(req.Model)
	if m == nil || m.BlockSize() == 0 || req.checkBlockSize(m.BlockSize()) != nil {
		return tokens
	}
	sc := r.getScratch()
	defer r.putScratch(sc)
	key := keyFor(req, p, m.BlockSize(), sc)
	m.Overlaps(key.Seq, &sc.overlap)
	var best uint32
	sc.workers = m.AppendWorkers(sc.workers[:0])
	for _, w := range sc.workers {
		best = max(best, sc.overlap.Depths(w.Slot)[kvstate.TierDevice])
	}
	return tokens - min(tokens, uint64(best)*uint64(key.BlockSize))
}
