package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"time"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
	"github.com/kvrouter/kvrouter/server/auth"
)

// maxRequestIDBytes bounds request ids: they are kept in memory for the life of a booking.
const maxRequestIDBytes = 512

// maxModelBytes, maxSessionIDBytes and maxEndpointBytes bound names a call may make the router keep
// (a session lives for session_affinity_ttl and is replicated through the log; a worker's endpoint
// is in every Route answer naming it) or repeat in a message.
const (
	maxModelBytes     = 256
	maxSessionIDBytes = 512
	maxEndpointBytes  = 1024
)

// maxMultimodalObjects bounds a Route's multimodal inputs and maxBlockMMHashes a stored block's: a
// prompt rarely holds more than a few dozen images, and each costs the hashing of the blocks it
// touches.
const (
	maxMultimodalObjects = 256
	maxBlockMMHashes     = 64
)

// routerService implements RouterService: validate, call the dispatcher, map the result.
type routerService struct {
	kvrouterv1.UnimplementedRouterServiceServer
	dispatcher      app.Routing
	metrics         *metrics
	logger          *slog.Logger
	maxPromptTokens int
}

func (s *routerService) Route(ctx context.Context, req *kvrouterv1.RouteRequest) (*kvrouterv1.RouteResponse, error) {
	defer releaseTokens(req)
	preq, err := s.routeRequest(req)
	if err != nil {
		return nil, err
	}
	if !req.GetQueryOnly() {
		caller := auth.FromContext(ctx)
		if err := caller.TakeRouteTokens(int(preq.PromptTokens())); err != nil {
			return nil, err
		}
		preq.Owner, preq.OwnerMaxBlocks = caller.Bookings()
	}
	start := time.Now()
	dec, err := s.dispatcher.Route(ctx, preq)
	if err != nil {
		traceRoute(ctx, req, nil)
		return nil, toStatus(err)
	}
	s.metrics.observeRoute(req.GetModel(), dec, time.Since(start))
	traceRoute(ctx, req, dec)
	if cd := dec.CD; cd != nil && s.logger.Enabled(ctx, slog.LevelDebug) {
		// The fields of Dynamo's "Conditional disagg decision" line (§5.6).
		s.logger.DebugContext(ctx, "conditional disagg decision", "request_id", req.GetRequestId(),
			"worker_id", cd.Decode.Info.Key.ID, "dp_rank", cd.Decode.Info.Key.Rank, "prompt_tokens", dec.PromptTokens,
			"net_new_tokens", cd.EffectiveISL, "cached_tokens", cd.CachedTokens, "ratio", cd.Ratio,
			"prefill_chosen_worker_busy", signalLog(cd.PrefillEvaluated, cd.PrefillBusy), "decode_chosen_worker_busy", signalLog(cd.GateEvaluated, cd.DecodeBusy),
			"potential_decode_blocks", cd.PotentialBlocks, "decode_gate_decision", string(cd.Gate),
			"bypass", dec.Mode == policy.ModeBypass, "reason", dec.Reason.String())
	}
	return routeResponse(dec), nil
}

func (s *routerService) MarkPrefillComplete(ctx context.Context, req *kvrouterv1.MarkPrefillCompleteRequest) (*kvrouterv1.MarkPrefillCompleteResponse, error) {
	if err := checkRequestID(req.GetRequestId()); err != nil {
		return nil, err
	}
	if err := s.dispatcher.PrefillComplete(ctx, req.GetRequestId()); err != nil {
		return nil, toStatus(err)
	}
	return &kvrouterv1.MarkPrefillCompleteResponse{}, nil
}

func (s *routerService) Free(ctx context.Context, req *kvrouterv1.FreeRequest) (*kvrouterv1.FreeResponse, error) {
	if err := checkRequestID(req.GetRequestId()); err != nil {
		return nil, err
	}
	if err := s.dispatcher.Free(ctx, req.GetRequestId()); err != nil {
		return nil, toStatus(err)
	}
	return &kvrouterv1.FreeResponse{}, nil
}

func checkRequestID(id string) error {
	switch {
	case id == "":
		return invalidArgument("request_id", "must not be empty")
	case len(id) > maxRequestIDBytes:
		return invalidArgumentf("request_id", "must be at most %d bytes (got %d)", maxRequestIDBytes, len(id))
	}
	return nil
}

// routeRequest validates a RouteRequest and converts it to the dispatcher's request.
func (s *routerService) routeRequest(req *kvrouterv1.RouteRequest) (*app.Request, error) {
	if size, ok := tooLarge(req); ok {
		most := maxRouteBytes(s.maxPromptTokens)
		return nil, limitExceeded("ROUTE_MESSAGE_TOO_LARGE", "message", "max_prompt_tokens", most, size,
			"%d bytes, more than the %d a Route of max_prompt_tokens (%d) token ids takes; it was not decoded", size, most, s.maxPromptTokens)
	}
	if !req.GetQueryOnly() || req.GetRequestId() != "" {
		if err := checkRequestID(req.GetRequestId()); err != nil {
			return nil, err
		}
	}
	switch m := req.GetModel(); {
	case m == "":
		return nil, invalidArgument("model", "must not be empty")
	case len(m) > maxModelBytes:
		return nil, invalidArgumentf("model", "must be at most %d bytes (got %d)", maxModelBytes, len(m))
	}
	if n := len(req.GetSessionId()); n > maxSessionIDBytes {
		return nil, invalidArgumentf("session_id", "must be at most %d bytes (got %d)", maxSessionIDBytes, n)
	}
	dreq := &app.Request{SessionID: req.GetSessionId(), Request: policy.Request{
		ID: req.GetRequestId(), Model: req.GetModel(),
		QueryOnly: req.GetQueryOnly(), Annotations: req.GetAnnotations(), Explain: req.GetExplain(),
	}}
	out := &dreq.Request
	if err := s.prompt(req, out); err != nil {
		return nil, err
	}
	if h := req.GetHints(); h != nil {
		if h.PrefillDpRank != nil && h.PrefillWorkerId == nil {
			return nil, invalidArgument("hints.prefill_dp_rank", "needs hints.prefill_worker_id")
		}
		if h.DecodeDpRank != nil && h.DecodeWorkerId == nil {
			return nil, invalidArgument("hints.decode_dp_rank", "needs hints.decode_worker_id")
		}
		if h.PrefillWorkerId != nil {
			out.PrefillPin = &policy.Pin{Worker: h.GetPrefillWorkerId(), Rank: h.PrefillDpRank}
		}
		if h.DecodeWorkerId != nil {
			out.DecodePin = &policy.Pin{Worker: h.GetDecodeWorkerId(), Rank: h.DecodeDpRank}
		}
		out.AllowedWorkers = h.GetAllowedWorkerIds()
	}
	if o := req.GetConfigOverride(); o != nil {
		out.Override = policy.Override{
			OverlapScoreCredit:    o.OverlapScoreCredit,
			PrefillLoadScale:      o.PrefillLoadScale,
			OverlapScoreWeight:    o.OverlapScoreWeight,
			RouterTemperature:     o.RouterTemperature,
			SharedCacheMultiplier: o.SharedCacheMultiplier,
			AssumeKVReuse:         o.AssumeKvReuse,
			TrackPrefillTokens:    o.TrackPrefillTokens,
		}
		if err := out.Override.Validate(); err != nil {
			if fe, ok := err.(*policy.FieldError); ok {
				return nil, invalidArgument("config_override."+fe.Field, fe.Rule)
			}
			return nil, toStatus(err)
		}
		if cd := o.GetConditionalDisagg(); cd != nil {
			cdo, err := s.cdOverride(cd)
			if err != nil {
				return nil, err
			}
			out.CDOverride = cdo
		}
	}
	return dreq, nil
}

// prompt validates a Route's prompt, its token ids or the block hashes a caller keyed it with, and
// sets it in out.
func (s *routerService) prompt(req *kvrouterv1.RouteRequest, out *policy.Request) error {
	if req.GetBlockSize() == 0 {
		if len(req.GetBlockHashes()) > 0 {
			return invalidArgument("block_size", "must be set with block_hashes (the block size they were hashed with)")
		}
		if req.GetPromptTokens() != 0 {
			return invalidArgument("prompt_tokens", "must be set only with block_size and block_hashes (token_ids count themselves)")
		}
		switch n := len(req.GetTokenIds()); {
		case n == 0:
			return invalidArgument("token_ids", "must not be empty")
		case n > s.maxPromptTokens:
			return invalidArgumentf("token_ids", "has %d tokens, more than the maximum of %d (max_prompt_tokens)", n, s.maxPromptTokens)
		}
		multimodal, err := multimodalObjects(req.GetMultimodalObjects(), len(req.GetTokenIds()))
		if err != nil {
			return err
		}
		out.Tokens, out.LoraName, out.CacheNamespace, out.Multimodal = req.GetTokenIds(), req.GetLoraName(), req.GetCacheNamespace(), multimodal
		return nil
	}
	// A hashed prompt: the salts and inputs are in its hashes, so the fields that make them must
	// be empty rather than silently ignored.
	for _, f := range []struct {
		name string
		set  bool
	}{
		{"token_ids", len(req.GetTokenIds()) > 0}, {"lora_name", req.GetLoraName() != ""},
		{"cache_namespace", req.GetCacheNamespace() != ""}, {"multimodal_objects", len(req.GetMultimodalObjects()) > 0},
	} {
		if f.set {
			return invalidArgumentf(f.name, "must be empty with block_size and block_hashes (fold it into the hashes)")
		}
	}
	size, blocks, tokens := uint64(req.GetBlockSize()), uint64(len(req.GetBlockHashes())), uint64(req.GetPromptTokens())
	switch {
	case tokens == 0:
		return invalidArgument("prompt_tokens", "must be at least 1 with block_hashes")
	case tokens > uint64(s.maxPromptTokens):
		return invalidArgumentf("prompt_tokens", "is %d, more than the maximum of %d (max_prompt_tokens)", tokens, s.maxPromptTokens)
	case tokens < blocks*size || tokens >= (blocks+1)*size:
		return invalidArgumentf("prompt_tokens", "must be in [%d, %d): %d block_hashes of block_size %d and a partial block (got %d)",
			blocks*size, (blocks+1)*size, blocks, size, tokens)
	}
	out.Hashed = &policy.HashedPrompt{Locals: req.GetBlockHashes(), BlockSize: req.GetBlockSize(), Tokens: tokens}
	return nil
}

// multimodalObjects validates a Route's multimodal inputs against its n token ids and returns them
// sorted by their first token, as the kernel keys them.
func multimodalObjects(in []*kvrouterv1.MultimodalObject, n int) ([]blockhash.MultimodalObject, error) {
	if len(in) == 0 {
		return nil, nil
	}
	if len(in) > maxMultimodalObjects {
		return nil, invalidArgumentf("multimodal_objects", "must hold at most %d inputs (got %d)", maxMultimodalObjects, len(in))
	}
	type indexed struct {
		blockhash.MultimodalObject
		i int
	}
	objs := make([]indexed, len(in))
	for i, o := range in {
		switch {
		case o.GetEnd() <= o.GetStart():
			return nil, invalidArgumentf(fmt.Sprintf("multimodal_objects[%d].end", i), "must be greater than start %d (got %d)", o.GetStart(), o.GetEnd())
		case int64(o.GetEnd()) > int64(n):
			return nil, invalidArgumentf(fmt.Sprintf("multimodal_objects[%d].end", i), "must be at most the number of token_ids %d (got %d)", n, o.GetEnd())
		}
		objs[i] = indexed{blockhash.MultimodalObject{Hash: o.GetMmHash(), Start: o.GetStart(), End: o.GetEnd()}, i}
	}
	slices.SortFunc(objs, func(a, b indexed) int { return cmp.Compare(a.Start, b.Start) })
	out := make([]blockhash.MultimodalObject, len(objs))
	for k, o := range objs {
		if k > 0 && objs[k-1].End > o.Start {
			p := objs[k-1]
			return nil, invalidArgumentf(fmt.Sprintf("multimodal_objects[%d]", o.i), "tokens [%d, %d) overlap those of multimodal_objects[%d], [%d, %d)",
				o.Start, o.End, p.i, p.Start, p.End)
		}
		out[k] = o.MultimodalObject
	}
	return out, nil
}

// cdOverride converts a per-request conditional-disaggregation override and checks it with the
// rules of the startup configuration (policy/cdrules.go), naming the override's fields.
func (s *routerService) cdOverride(o *kvrouterv1.ConditionalDisaggOverride) (policy.CDOverride, error) {
	out := policy.CDOverride{
		Enabled: o.Enabled, EffISLThreshold: o.EffIslThreshold, EffISLRatioThreshold: o.EffIslRatioThreshold,
		PrefillBusyThreshold: o.PrefillBusyThreshold, DecodeBusyThreshold: o.DecodeBusyThreshold,
	}
	if o.Policy != nil {
		p, err := policy.LookupCDPolicy(o.GetPolicy())
		if err != nil {
			return out, cdOverrideError(err)
		}
		out.Policy = &p
	}
	if _, err := s.dispatcher.Config().EffectiveCD(out); err != nil {
		return out, cdOverrideError(err)
	}
	return out, nil
}

// cdOverrideError is INVALID_ARGUMENT naming the override's field that broke a conditional-
// disaggregation rule.
func cdOverrideError(err error) error {
	const field = "config_override.conditional_disagg."
	var (
		fe *policy.FieldError
		re *policy.RuleError
	)
	switch {
	case errors.As(err, &fe):
		return invalidArgument(field+fe.Field, fe.Rule)
	case errors.As(err, &re):
		return invalidArgument(field+re.Field, re.Msg)
	}
	return toStatus(err)
}

var reasonToProto = map[policy.Reason]kvrouterv1.DecisionReason{
	policy.ReasonNoPrefillWorkers:         kvrouterv1.DecisionReason_DECISION_REASON_NO_PREFILL_WORKERS,
	policy.ReasonConditionalDisaggOff:     kvrouterv1.DecisionReason_DECISION_REASON_CONDITIONAL_DISAGG_OFF,
	policy.ReasonPrefillWorkerPinned:      kvrouterv1.DecisionReason_DECISION_REASON_PREFILL_WORKER_PINNED,
	policy.ReasonEmptyPrompt:              kvrouterv1.DecisionReason_DECISION_REASON_EMPTY_PROMPT,
	policy.ReasonDecodePinUnresolved:      kvrouterv1.DecisionReason_DECISION_REASON_DECODE_PIN_UNRESOLVED,
	policy.ReasonDecodeSelectionFailed:    kvrouterv1.DecisionReason_DECISION_REASON_DECODE_SELECTION_FAILED,
	policy.ReasonPolicyDeclined:           kvrouterv1.DecisionReason_DECISION_REASON_POLICY_DECLINED,
	policy.ReasonDecodeCannotBypass:       kvrouterv1.DecisionReason_DECISION_REASON_DECODE_CANNOT_BYPASS,
	policy.ReasonDecodeBusy:               kvrouterv1.DecisionReason_DECISION_REASON_DECODE_BUSY,
	policy.ReasonDecodeBusyUnknown:        kvrouterv1.DecisionReason_DECISION_REASON_DECODE_BUSY_UNKNOWN,
	policy.ReasonBypass:                   kvrouterv1.DecisionReason_DECISION_REASON_BYPASS,
	policy.ReasonDecodeAffinityUnresolved: kvrouterv1.DecisionReason_DECISION_REASON_DECODE_AFFINITY_UNRESOLVED,
}

// signalLog formats a busy signal for logs, as "not_evaluated" when it was not needed.
func signalLog(evaluated bool, t policy.Signal) string {
	if !evaluated {
		return "not_evaluated"
	}
	return t.String()
}

// busySignal maps a signal to the wire: UNSPECIFIED when it was not evaluated.
func busySignal(evaluated bool, t policy.Signal) kvrouterv1.BusySignal {
	switch {
	case !evaluated:
		return kvrouterv1.BusySignal_BUSY_SIGNAL_UNSPECIFIED
	case t == policy.SignalYes:
		return kvrouterv1.BusySignal_BUSY_SIGNAL_BUSY
	case t == policy.SignalNo:
		return kvrouterv1.BusySignal_BUSY_SIGNAL_NOT_BUSY
	}
	return kvrouterv1.BusySignal_BUSY_SIGNAL_UNKNOWN
}

var routeModes = map[policy.Mode]kvrouterv1.RouteMode{
	policy.ModeDisaggregated: kvrouterv1.RouteMode_ROUTE_MODE_DISAGGREGATED,
	policy.ModeBypass:        kvrouterv1.RouteMode_ROUTE_MODE_BYPASS,
	policy.ModeAggregated:    kvrouterv1.RouteMode_ROUTE_MODE_AGGREGATED,
}

func routeResponse(d *policy.Decision) *kvrouterv1.RouteResponse {
	resp := &kvrouterv1.RouteResponse{
		Mode:        routeModes[d.Mode],
		Decode:      workerTarget(d.Decode.Worker),
		Annotations: d.Annotations,
		Booked:      d.Booked,
		Diagnostics: &kvrouterv1.RouteDiagnostics{
			PromptTokens: d.PromptTokens,
			PromptBlocks: d.PromptBlocks,
			BlockSize:    d.BlockSize,
			Decode:       hopDiagnostics(&d.Decode),
			Reason:       reasonToProto[d.Reason],
		},
	}
	if cd := d.CD; cd != nil {
		resp.Diagnostics.ConditionalDisagg = &kvrouterv1.ConditionalDisaggDiagnostics{
			Policy: cd.Policy.String(), Decode: workerTarget(cd.Decode), CachedTokens: cd.CachedTokens,
			EffectiveIsl: cd.EffectiveISL, Ratio: cd.Ratio,
			PrefillBusy: busySignal(cd.PrefillEvaluated, cd.PrefillBusy), DecodeBusy: busySignal(cd.GateEvaluated, cd.DecodeBusy),
			PolicySaysBypass: cd.PolicySaysBypass, GateDecision: string(cd.Gate), PotentialDecodeBlocks: cd.PotentialBlocks,
			EffIslThreshold: cd.EffISLThreshold, EffIslRatioThreshold: cd.RatioThreshold,
		}
	}
	if d.Prefill != nil {
		resp.Prefill = workerTarget(d.Prefill.Worker)
		resp.Diagnostics.Prefill = hopDiagnostics(d.Prefill)
	}
	for _, c := range d.Candidates {
		resp.Diagnostics.Candidates = append(resp.Diagnostics.Candidates, &kvrouterv1.CandidateCost{
			Worker:                workerTarget(c.Worker),
			Role:                  roleToProto[c.Worker.Info.Role],
			Hop:                   c.Hop,
			OverlapBlocks:         tierBlocks(c.Overlap),
			Cost:                  finite(c.Cost),
			Chosen:                c.Chosen,
			Load:                  &kvrouterv1.WorkerLoad{ActiveBlocks: c.Load.ActiveBlocks, ActivePrefillTokens: c.Load.ActivePrefillTokens, ActiveRequests: c.Load.ActiveRequests},
			PotentialDecodeBlocks: c.PotentialDecodeBlocks,
		})
	}
	return resp
}

func hopDiagnostics(c *policy.Choice) *kvrouterv1.HopDiagnostics {
	return &kvrouterv1.HopDiagnostics{OverlapBlocks: tierBlocks(c.Overlap), CachedTokens: c.CachedTokens, Cost: finite(c.Cost)}
}

func workerTarget(w *kvstate.Worker) *kvrouterv1.WorkerTarget {
	return &kvrouterv1.WorkerTarget{WorkerId: w.Info.Key.ID, DpRank: w.Info.Key.Rank, Endpoint: w.Info.Endpoint}
}

func tierBlocks(c kvstate.TierCounts) *kvrouterv1.TierBlocks {
	return &kvrouterv1.TierBlocks{
		Device: c[kvstate.TierDevice], Host: c[kvstate.TierHost], Disk: c[kvstate.TierDisk], External: c[kvstate.TierExternal],
	}
}

// finite keeps JSON encodings (grpcurl) valid: costs are always finite in practice, but a NaN or Inf
// in a diagnostic must never break a response.
func finite(v float64) float64 {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0
	}
	return v
}
