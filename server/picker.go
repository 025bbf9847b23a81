package server

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
	"github.com/kvrouter/kvrouter/server/auth"
	"github.com/kvrouter/kvrouter/server/frontdoor"
)

// The names the Gateway API Inference Extension's endpoint picker protocol (its proposal 004) gives
// the picked endpoint and the proxy's candidate subset, and the header llm-d's P/D sidecar reads the
// prefill worker from. Each header name is a setting (PickerHeaders); the metadata names are the
// protocol's.
const (
	DefaultDestinationHeader = "x-gateway-destination-endpoint"
	DefaultPrefillHeader     = "x-prefiller-host-port"
	destinationNamespace     = "envoy.lb"
	subsetNamespace          = "envoy.lb.subset_hint"
	subsetKey                = "x-gateway-destination-endpoint-subset"
)

// bodyChunkBytes is the size of the body pieces a full-duplex picker sends back: Envoy's ext_proc
// client limits one message, and the protocol's reference picker sends 62 KiB pieces.
const bodyChunkBytes = 62 * 1024

// DefaultMaxPickerBodyBytes bounds a request body the picker buffers: about four times the JSON of
// a 1M-token prompt of token ids, and far beyond any chat a model's context holds.
const DefaultMaxPickerBodyBytes = 32 << 20

// PickerHeaders name the HTTP headers the endpoint picker reads and writes.
type PickerHeaders struct {
	// Destination carries the picked (decode or aggregated) worker to the proxy, besides the
	// protocol's dynamic metadata.
	Destination string
	// Prefill carries the prefill worker of a disaggregated decision to the decode worker's P/D
	// sidecar; it is removed from requests that are not disaggregated, so a client cannot set it.
	Prefill string
	// Session, when set, is the header whose value binds a conversation to its decode worker
	// (session affinity); "" turns it off.
	Session string
	// Model, when set, is a header that names the model instead of the body's "model" (the one a
	// gateway sets after rewriting the model); "" reads the body only.
	Model string
	// RequestID is the header logged with each decision (Envoy's x-request-id).
	RequestID string
}

// PickerOptions configure the endpoint picker.
type PickerOptions struct {
	Dispatcher      app.Routing
	Models          *frontdoor.Models // nil: completions of token ids only
	Headers         PickerHeaders     // empty names take the defaults
	MaxPromptTokens int
	MaxBodyBytes    int // 0: DefaultMaxPickerBodyBytes
	// FreeTimeout bounds the Free of a booking whose stream ended, which runs after the stream's
	// context is gone; 0: 5 s. A Free that fails leaves the booking to its expiry.
	FreeTimeout time.Duration
	Logger      *slog.Logger
	Metrics     *PickerMetrics // nil: not measured
	// Tracer makes a span of each picked request (SpanPick); nil makes none.
	Tracer trace.Tracer
}

// Picker is kvrouter's endpoint picker for Envoy-based inference gateways: an ext_proc server
// that reads each OpenAI request's headers and body, routes its prompt, tells the proxy where to
// send it (the decode or aggregated worker as destination, the prefill worker in a header the P/D
// sidecar reads), and follows the response to end the booking: prefill complete at the first
// response body chunk, free when the response ends or the stream does. Each stream is one HTTP
// request; streams share nothing but the dispatcher, so one stream's failure is its own.
type Picker struct {
	extprocv3.UnimplementedExternalProcessorServer
	opts PickerOptions
	log  *slog.Logger
	m    *PickerMetrics
}

// NewPicker returns an endpoint picker over the options' dispatcher.
func NewPicker(o PickerOptions) *Picker {
	h := &o.Headers
	h.Destination = cmpOr(h.Destination, DefaultDestinationHeader)
	h.Prefill = cmpOr(h.Prefill, DefaultPrefillHeader)
	h.RequestID = cmpOr(h.RequestID, "x-request-id")
	if o.MaxBodyBytes <= 0 {
		o.MaxBodyBytes = DefaultMaxPickerBodyBytes
	}
	if o.FreeTimeout <= 0 {
		o.FreeTimeout = 5 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return &Picker{opts: o, log: o.Logger, m: o.Metrics}
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// Process serves one HTTP request's ext_proc stream.
func (p *Picker) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	x := &exchange{p: p, ctx: stream.Context()}
	defer x.end()
	for {
		req, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err // the proxy is gone: end frees the booking
		}
		out := x.handle(req)
		for _, r := range out {
			if err := stream.Send(r); err != nil {
				return err
			}
		}
		if x.closed {
			return nil
		}
	}
}

// exchange is one HTTP request through the picker: what it read of the request, and the booking
// it made.
type exchange struct {
	p   *Picker
	ctx context.Context

	requestMode, responseMode extprocfilterv3.ProcessingMode_BodySendMode
	path, modelHeader         string
	traceHeaders              propagation.MapCarrier // the request's trace context headers
	span                      trace.Span             // SpanPick, once picking; nil without a tracer
	session, requestID        string
	candidates                []string // nil: any worker
	body                      []byte
	picked                    bool
	trailers                  bool // the request's body ended with trailers, not end_of_stream
	closed                    bool // an immediate response was sent: the stream is over

	booking        string // the booking's id; "" until booked
	prefillMarked  bool
	freed          bool
	responseStatus int
}

// handle answers one message of the proxy.
func (x *exchange) handle(req *extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
	if pc := req.GetProtocolConfig(); pc != nil {
		x.requestMode, x.responseMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
	}
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return x.requestHeaders(req, r.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return x.requestBody(r.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		if x.picked {
			return []*extprocv3.ProcessingResponse{requestTrailersResponse()}
		}
		// Full duplex: a body without end_of_stream ends with the trailers, which then end the
		// stream the picker sends back too.
		x.trailers = true
		return append(x.pick(), requestTrailersResponse())
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return x.responseHeaders(r.ResponseHeaders)
	case *extprocv3.ProcessingRequest_ResponseBody:
		return x.responseBody(r.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		x.finish()
		return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}}
	}
	return x.refuse(typev3.StatusCode_InternalServerError, "picker_error", "the proxy sent an ext_proc message the picker does not know")
}

func (x *exchange) requestHeaders(req *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) []*extprocv3.ProcessingResponse {
	hd := x.p.opts.Headers
	var method string
	for _, kv := range h.GetHeaders().GetHeaders() {
		v := headerValue(kv)
		switch k := strings.ToLower(kv.GetKey()); k {
		case ":path":
			x.path = v
		case ":method":
			method = v
		case strings.ToLower(hd.RequestID):
			x.requestID = v
		}
		if x.p.opts.Tracer != nil && (strings.EqualFold(kv.GetKey(), "traceparent") || strings.EqualFold(kv.GetKey(), "tracestate")) {
			if x.traceHeaders == nil {
				x.traceHeaders = propagation.MapCarrier{}
			}
			x.traceHeaders[strings.ToLower(kv.GetKey())] = v
		}
		if hd.Session != "" && strings.EqualFold(kv.GetKey(), hd.Session) {
			x.session = v
		}
		if hd.Model != "" && strings.EqualFold(kv.GetKey(), hd.Model) {
			x.modelHeader = v
		}
	}
	if c, ok := subset(req.GetMetadataContext()); ok {
		x.candidates = c
	}
	if _, ok := frontdoor.KindOf(x.path); !ok || (method != "" && method != "POST") {
		return x.refuse(typev3.StatusCode_NotFound, "not_found",
			"the endpoint picker routes POST "+frontdoor.CompletionsPath+" and POST "+frontdoor.ChatCompletionsPath+" (got "+method+" "+x.path+")")
	}
	if h.GetEndOfStream() {
		return x.refuse(typev3.StatusCode_BadRequest, "invalid_request_error", "the request has no body")
	}
	switch x.requestMode {
	case extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED, extprocfilterv3.ProcessingMode_NONE:
		// The protocol's mode (and the one assumed when the proxy does not say): the headers are
		// answered with the decision, once the body is in.
		return nil
	case extprocfilterv3.ProcessingMode_BUFFERED:
		return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}}
	}
	return x.refuse(typev3.StatusCode_InternalServerError, "picker_error",
		"ext_proc request_body_mode "+x.requestMode.String()+" cannot carry a routing decision: configure FULL_DUPLEX_STREAMED (or BUFFERED)")
}

func (x *exchange) requestBody(b *extprocv3.HttpBody) []*extprocv3.ProcessingResponse {
	if x.picked {
		return x.refuse(typev3.StatusCode_InternalServerError, "picker_error", "the proxy sent request body after its end")
	}
	if len(x.body)+len(b.GetBody()) > x.p.opts.MaxBodyBytes {
		return x.refuse(typev3.StatusCode_PayloadTooLarge, "invalid_request_error",
			"the request body is larger than the endpoint picker's max_body_bytes ("+strconv.Itoa(x.p.opts.MaxBodyBytes)+")")
	}
	x.body = append(x.body, b.GetBody()...)
	if !b.GetEndOfStream() && x.requestMode != extprocfilterv3.ProcessingMode_BUFFERED {
		return nil
	}
	return x.pick()
}

// pick routes the buffered request and answers with the destination, or refuses it.
func (x *exchange) pick() []*extprocv3.ProcessingResponse {
	x.picked = true
	x.startSpan()
	start := time.Now()
	kind, _ := frontdoor.KindOf(x.path)
	freq, err := frontdoor.Parse(kind, x.body)
	if err != nil {
		return x.refuseErr(err)
	}
	if x.modelHeader != "" {
		freq.Model = x.modelHeader
	}
	switch {
	case freq.Model == "":
		return x.refuse(typev3.StatusCode_BadRequest, "invalid_request_error", "model: must be set")
	case len(freq.Model) > maxModelBytes:
		return x.refuse(typev3.StatusCode_BadRequest, "invalid_request_error", "model: must be at most "+strconv.Itoa(maxModelBytes)+" bytes")
	case len(x.session) > maxSessionIDBytes:
		return x.refuse(typev3.StatusCode_BadRequest, "invalid_request_error", x.p.opts.Headers.Session+": must be at most "+strconv.Itoa(maxSessionIDBytes)+" bytes")
	}
	tokens, err := x.p.opts.Models.Tokens(freq)
	if err != nil {
		return x.refuseErr(err)
	}
	tokenized := time.Now()
	x.p.m.observeTokenize(tokenized.Sub(start))
	switch n := len(tokens); {
	case n == 0:
		return x.refuse(typev3.StatusCode_BadRequest, "invalid_request_error", "the prompt has no tokens")
	case n > x.p.opts.MaxPromptTokens:
		return x.refuse(typev3.StatusCode_BadRequest, "invalid_request_error",
			"the prompt has "+strconv.Itoa(n)+" tokens, more than the router's max_prompt_tokens ("+strconv.Itoa(x.p.opts.MaxPromptTokens)+")")
	}
	if x.candidates != nil && len(x.candidates) == 0 {
		return x.refuse(typev3.StatusCode_ServiceUnavailable, "no_endpoints", "the proxy's candidate subset is empty")
	}
	// The gateway's credential is held to the same limits as a frontend's Route.
	caller := auth.FromContext(x.ctx)
	if err := caller.TakeRouteTokens(len(tokens)); err != nil {
		return x.refuseErr(err)
	}
	id := newBookingID()
	preq := &app.Request{
		Request:   policy.Request{ID: id, Model: freq.Model, Tokens: tokens, AllowedEndpoints: x.candidates},
		SessionID: x.session,
	}
	preq.Owner, preq.OwnerMaxBlocks = caller.Bookings()
	dec, err := x.p.opts.Dispatcher.Route(x.ctx, preq)
	if err != nil {
		return x.refuseErr(err)
	}
	x.booking = id
	x.p.m.observePick(dec, time.Since(tokenized))
	if x.span != nil {
		x.span.SetAttributes(appendDecision([]attribute.KeyValue{AttrModel.String(freq.Model), AttrRequestID.String(id)}, dec)...)
	}
	x.p.log.DebugContext(x.ctx, "picked", "request_id", x.requestID, "booking", id, "model", freq.Model,
		"mode", dec.Mode.String(), "decode", dec.Decode.Worker.Info.Endpoint, "prompt_tokens", len(tokens))
	return x.destination(dec)
}

// destination is the answer that sends the request to its decision's workers.
func (x *exchange) destination(dec *policy.Decision) []*extprocv3.ProcessingResponse {
	hd := x.p.opts.Headers
	target := dec.Decode.Worker.Info.Endpoint
	common := &extprocv3.CommonResponse{
		ClearRouteCache: true,
		HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
			setHeader(hd.Destination, target),
			setHeader("Content-Length", strconv.Itoa(len(x.body))),
		}},
	}
	if dec.Mode == policy.ModeDisaggregated && dec.Prefill != nil {
		common.HeaderMutation.SetHeaders = append(common.HeaderMutation.SetHeaders, setHeader(hd.Prefill, dec.Prefill.Worker.Info.Endpoint))
	} else {
		common.HeaderMutation.RemoveHeaders = []string{hd.Prefill}
	}
	meta := &structpb.Struct{Fields: map[string]*structpb.Value{
		destinationNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			hd.Destination: structpb.NewStringValue(target),
		}}),
	}}
	if x.requestMode == extprocfilterv3.ProcessingMode_BUFFERED {
		return []*extprocv3.ProcessingResponse{{
			Response:        &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: common}},
			DynamicMetadata: meta,
		}}
	}
	// Full duplex: the headers' answer, then the body, which the proxy forwards only as the picker
	// sends it back.
	out := []*extprocv3.ProcessingResponse{{
		Response:        &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: common}},
		DynamicMetadata: meta,
	}}
	body := x.body
	for first := true; first || len(body) > 0; first = false {
		n := min(len(body), bodyChunkBytes)
		out = append(out, streamedBody(false, body[:n], n == len(body) && !x.trailers))
		body = body[n:]
	}
	x.body = nil
	return out
}

func (x *exchange) responseHeaders(h *extprocv3.HttpHeaders) []*extprocv3.ProcessingResponse {
	for _, kv := range h.GetHeaders().GetHeaders() {
		if kv.GetKey() == ":status" {
			x.responseStatus, _ = strconv.Atoi(headerValue(kv))
		}
	}
	if h.GetEndOfStream() {
		x.finish()
	}
	return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}}
}

func (x *exchange) responseBody(b *extprocv3.HttpBody) []*extprocv3.ProcessingResponse {
	if len(b.GetBody()) > 0 && !x.prefillMarked && x.booking != "" && x.responseStatus < 300 {
		// The first token is out: the prefill worker's part is done.
		x.prefillMarked = true
		if x.span != nil {
			x.span.AddEvent("prefill_complete")
		}
		if err := x.p.opts.Dispatcher.PrefillComplete(x.ctx, x.booking); err != nil {
			x.p.log.DebugContext(x.ctx, "prefill complete failed", "booking", x.booking, "error", err)
		}
	}
	if b.GetEndOfStream() {
		x.finish()
	}
	if x.responseMode == extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		return []*extprocv3.ProcessingResponse{streamedBody(true, b.GetBody(), b.GetEndOfStream())}
	}
	return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}}}
}

// finish frees the booking of a request whose response ended.
func (x *exchange) finish() {
	cause := FreedCompleted
	if x.responseStatus >= 400 {
		cause = FreedFailed
	}
	x.free(x.ctx, cause)
}

// end frees the booking of a stream that ended before its response did: the client left, the
// proxy restarted or timed out, or the upstream failed.
func (x *exchange) end() {
	if x.booking == "" || x.freed {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(x.ctx), x.p.opts.FreeTimeout)
	defer cancel()
	x.free(ctx, FreedCancelled)
}

// Causes of a picker's Free.
const (
	FreedCompleted = "completed" // the response ended
	FreedFailed    = "failed"    // the response ended with an HTTP error status
	FreedCancelled = "cancelled" // the stream ended first
)

func (x *exchange) free(ctx context.Context, cause string) {
	if x.booking == "" || x.freed {
		return
	}
	x.freed = true
	err := x.p.opts.Dispatcher.Free(ctx, x.booking)
	if err != nil {
		cause = "error"
		x.p.log.WarnContext(ctx, "free failed; the booking is left to its expiry", "booking", x.booking, "request_id", x.requestID, "error", err)
	}
	x.p.m.observeFreed(cause)
	if x.span != nil {
		x.span.SetAttributes(AttrFreeCause.String(cause))
		if x.responseStatus != 0 {
			x.span.SetAttributes(AttrHTTPStatus.Int(x.responseStatus))
		}
		x.span.End()
	}
}

// startSpan starts the request's SpanPick as a child of the trace context its headers carry (the
// gateway's or the client's), so the decision shows in the request's own trace.
func (x *exchange) startSpan() {
	if x.p.opts.Tracer == nil {
		return
	}
	parent := x.ctx
	if x.traceHeaders != nil {
		parent = propagator.Extract(context.WithoutCancel(x.ctx), x.traceHeaders)
	}
	_, x.span = x.p.opts.Tracer.Start(parent, SpanPick, trace.WithSpanKind(trace.SpanKindServer))
}

// refuseErr answers an error of the front door or of routing with the HTTP status that says whose
// it is.
func (x *exchange) refuseErr(err error) []*extprocv3.ProcessingResponse {
	var bad *frontdoor.BadRequestError
	var unservable *frontdoor.UnservableError
	var tmpl *frontdoor.TemplateError
	switch {
	case errors.As(err, &bad), errors.As(err, &tmpl):
		return x.refuse(typev3.StatusCode_BadRequest, "invalid_request_error", err.Error())
	case errors.As(err, &unservable):
		return x.refuse(typev3.StatusCode_ServiceUnavailable, "model_not_configured", err.Error())
	}
	st := status.Convert(toStatus(err))
	code, kind := httpStatus(st.Code())
	return x.refuse(code, kind, st.Message())
}

// httpStatus maps a routing error's gRPC code to the HTTP status the client gets and the OpenAI
// error type its body names.
func httpStatus(c codes.Code) (typev3.StatusCode, string) {
	switch c {
	case codes.InvalidArgument:
		return typev3.StatusCode_BadRequest, "invalid_request_error"
	case codes.NotFound:
		return typev3.StatusCode_NotFound, "model_not_found"
	case codes.ResourceExhausted:
		return typev3.StatusCode_TooManyRequests, "rate_limit_exceeded"
	case codes.Unavailable, codes.FailedPrecondition, codes.Canceled, codes.DeadlineExceeded:
		return typev3.StatusCode_ServiceUnavailable, "no_endpoints"
	}
	return typev3.StatusCode_InternalServerError, "picker_error"
}

// refuse ends the request with an HTTP error whose JSON body is an OpenAI error object.
func (x *exchange) refuse(code typev3.StatusCode, kind, message string) []*extprocv3.ProcessingResponse {
	x.closed, x.picked = true, true
	x.p.m.observeRefused(int(code))
	if x.span != nil {
		x.span.SetAttributes(AttrHTTPStatus.Int(int(code)))
		x.span.SetStatus(otelcodes.Error, message)
		x.span.End()
	}
	body, _ := json.Marshal(map[string]any{"error": map[string]any{"message": message, "type": kind, "code": int(code)}})
	return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
		Status:  &typev3.HttpStatus{Code: code},
		Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{setHeader("content-type", "application/json")}},
		Body:    body,
		Details: "kvrouter_picker_" + kind,
	}}}}
}

func streamedBody(response bool, body []byte, eos bool) *extprocv3.ProcessingResponse {
	br := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: eos}},
	}}}
	if response {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
}

func requestTrailersResponse() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
}

func setHeader(key, value string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: key, RawValue: []byte(value)}}
}

// headerValue reads a header the proxy sent in either of its fields (Envoy sends raw_value).
func headerValue(h *corev3.HeaderValue) string {
	if len(h.GetRawValue()) > 0 {
		return string(h.GetRawValue())
	}
	return h.GetValue()
}

// subset returns the candidate endpoints the proxy allows, when it names them.
func subset(md *corev3.Metadata) ([]string, bool) {
	s, ok := md.GetFilterMetadata()[subsetNamespace]
	if !ok {
		return nil, false
	}
	v, ok := s.GetFields()[subsetKey]
	if !ok {
		return nil, false
	}
	list := v.GetListValue().GetValues()
	out := make([]string, 0, len(list))
	for _, e := range list {
		// One entry may hold several endpoints separated by commas.
		for ep := range strings.SplitSeq(e.GetStringValue(), ",") {
			if ep = strings.TrimSpace(ep); ep != "" {
				out = append(out, ep)
			}
		}
	}
	return out, true
}

// newBookingID returns a fresh id for a picked request's booking. The picker books under its own
// ids, never the client's x-request-id, so that a client repeating an id cannot collide with or
// free another request's booking.
func newBookingID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return "picker-" + hex.EncodeToString(b[:])
}
