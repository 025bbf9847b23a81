package server

import (
	"context"
	"strings"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/stats"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
)

// Traces (docs/operations.md, "Traces"). With Options.TracerProvider set, otelgrpc makes the server
// span of every kvrouter.v1 call, from the W3C trace context of the call's metadata; Route sets its
// decision on that span, and Publish makes a span per applied message. Without one nothing of this
// runs: no stats handler, no span, no attribute is built. No attribute ever holds a token id.

// TracerName is the instrumentation scope of kvrouter's own spans.
const TracerName = "github.com/kvrouter/kvrouter/server"

// SpanPick is the endpoint picker's span of one HTTP request, from its pick to the end of its
// booking, a child of the request's own trace context (its traceparent header).
const SpanPick = "kvrouter.pick"

// Names of the spans of Publish messages.
const (
	SpanPublishHello  = "kvrouter.publish.hello"
	SpanPublishEvents = "kvrouter.publish.events"
	SpanPublishDump   = "kvrouter.publish.dump"
	// SpanLogApply is a replica's apply of a shared-log entry appended by a traced call, linked to
	// that call's span: one per replica that applies it.
	SpanLogApply = "kvrouter.log.apply"
)

// Attribute keys of kvrouter's spans.
const (
	AttrModel          = attribute.Key("kvrouter.model")
	AttrRequestID      = attribute.Key("kvrouter.request_id")
	AttrMode           = attribute.Key("kvrouter.mode")
	AttrReason         = attribute.Key("kvrouter.reason")
	AttrGate           = attribute.Key("kvrouter.gate")
	AttrPrefillWorker  = attribute.Key("kvrouter.prefill_worker")
	AttrDecodeWorker   = attribute.Key("kvrouter.decode_worker")
	AttrOverlapBlocks  = attribute.Key("kvrouter.overlap_blocks")
	AttrPrefillOverlap = attribute.Key("kvrouter.prefill_overlap_blocks")
	AttrCachedTokens   = attribute.Key("kvrouter.cached_tokens")
	AttrPromptTokens   = attribute.Key("kvrouter.prompt_tokens")
	AttrEffectiveISL   = attribute.Key("kvrouter.effective_isl")
	AttrQueryOnly      = attribute.Key("kvrouter.query_only")
	AttrBooked         = attribute.Key("kvrouter.booked")
	AttrHTTPStatus     = attribute.Key("http.response.status_code")
	AttrFreeCause      = attribute.Key("kvrouter.free_cause")

	AttrWorkerID    = attribute.Key("kvrouter.worker_id")
	AttrDPRank      = attribute.Key("kvrouter.dp_rank")
	AttrRole        = attribute.Key("kvrouter.role")
	AttrEpoch       = attribute.Key("kvrouter.epoch")
	AttrEvents      = attribute.Key("kvrouter.events")
	AttrBlocks      = attribute.Key("kvrouter.blocks")
	AttrApplied     = attribute.Key("kvrouter.applied")
	AttrAppendMS    = attribute.Key("kvrouter.append_ms")
	AttrSharedLog   = attribute.Key("kvrouter.shared_log")
	AttrBuffered    = attribute.Key("kvrouter.buffered")
	AttrLastEventID = attribute.Key("kvrouter.last_event_id")
	AttrGap         = attribute.Key("kvrouter.gap")
	AttrLogEntry    = attribute.Key("kvrouter.log_entry")
)

// propagator reads the W3C trace context and baggage of a call's metadata.
var propagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// statsHandler makes the server spans of kvrouter.v1 calls; health checks and reflection are not
// traced (probes would fill the collector). otelgrpc's metrics go nowhere: the service's metrics are
// Prometheus'.
func statsHandler(tp trace.TracerProvider) stats.Handler {
	return otelgrpc.NewServerHandler(
		otelgrpc.WithTracerProvider(tp),
		otelgrpc.WithPropagators(propagator),
		otelgrpc.WithMeterProvider(metricnoop.NewMeterProvider()),
		otelgrpc.WithFilter(func(info *stats.RPCTagInfo) bool {
			return strings.HasPrefix(info.FullMethodName, "/kvrouter.v1.")
		}),
	)
}

// traceRoute sets a Route call's decision (nil when it failed) on the call's span. It builds nothing
// unless the span records.
func traceRoute(ctx context.Context, req *kvrouterv1.RouteRequest, dec *policy.Decision) {
	if !tracingBuilt {
		return
	}
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(routeAttributes(req, dec)...)
}

// routeAttributes describes a Route call: the request's model, id and size, and the decision's mode,
// reason, workers and overlap. Never the prompt's tokens.
func routeAttributes(req *kvrouterv1.RouteRequest, dec *policy.Decision) []attribute.KeyValue {
	attrs := make([]attribute.KeyValue, 0, 16)
	attrs = append(attrs, AttrModel.String(req.GetModel()), AttrQueryOnly.Bool(req.GetQueryOnly()))
	if id := req.GetRequestId(); id != "" {
		attrs = append(attrs, AttrRequestID.String(id))
	}
	if dec == nil {
		n := len(req.GetTokenIds())
		if req.GetBlockSize() != 0 {
			n = int(req.GetPromptTokens())
		}
		return append(attrs, AttrPromptTokens.Int(n))
	}
	return appendDecision(attrs, dec)
}

// appendDecision appends a decision's mode, reason, workers and overlap to attrs.
func appendDecision(attrs []attribute.KeyValue, dec *policy.Decision) []attribute.KeyValue {
	attrs = append(attrs,
		AttrPromptTokens.Int64(int64(dec.PromptTokens)),
		AttrMode.String(dec.Mode.String()),
		AttrReason.String(dec.Reason.String()),
		AttrBooked.Bool(dec.Booked),
		AttrDecodeWorker.String(dec.Decode.Worker.Info.Key.String()),
		AttrOverlapBlocks.Int64(int64(dec.Decode.Overlap[kvstate.TierDevice])),
		AttrCachedTokens.Float64(dec.Decode.CachedTokens),
	)
	if p := dec.Prefill; p != nil {
		attrs = append(attrs,
			AttrPrefillWorker.String(p.Worker.Info.Key.String()),
			AttrPrefillOverlap.Int64(int64(p.Overlap[kvstate.TierDevice])))
	}
	if cd := dec.CD; cd != nil {
		attrs = append(attrs, AttrEffectiveISL.Float64(cd.EffectiveISL))
		if cd.Gate != "" {
			attrs = append(attrs, AttrGate.String(string(cd.Gate)))
		}
	}
	return attrs
}

// publishObserver hears what the Publish sessions do (app.PublishObserver): it counts applied
// events, resyncs and superseded streams, and, with a tracer, makes the span of each applied
// message. Each span is the root of its own trace, linked to the stream's span: a stream lives as
// long as its worker, and one trace of all its messages would grow without end.
type publishObserver struct {
	metrics *metrics
	tracer  trace.Tracer // nil: tracing is off
}

func (o publishObserver) Applied(res kvstate.Result) { o.metrics.observeEvents(res) }
func (o publishObserver) Resynced()                  { o.metrics.resyncs.Inc() }
func (o publishObserver) Superseded()                { o.metrics.superseded.Inc() }

// Appending starts the span of a Publish message's append, and returns ctx carrying it (for the
// append, which a shared log links its replicas' applies to) and the function that ends it; it
// returns ctx unchanged and no function when tracing is off or the span would not be recorded, so
// that an untraced message costs a nil check.
func (o publishObserver) Appending(ctx context.Context, log kvstate.Log, info kvstate.WorkerInfo, change kvstate.Change) (context.Context, func(kvstate.Result, error)) {
	if o.tracer == nil {
		return ctx, nil
	}
	name, attrs := publishSpanOf(info, change)
	if name == "" {
		return ctx, nil
	}
	spanCtx, span := o.tracer.Start(ctx, name, trace.WithNewRoot(), trace.WithLinks(trace.LinkFromContext(ctx)))
	if !span.IsRecording() {
		span.End()
		return ctx, nil
	}
	span.SetAttributes(AttrWorkerID.Int64(int64(info.Key.ID)), AttrDPRank.Int64(int64(info.Key.Rank)), AttrModel.String(info.Model))
	_, shared := log.(kvstate.SharedLog)
	start := time.Now()
	return spanCtx, func(res kvstate.Result, err error) { endPublishSpan(span, start, shared, change, res, err, attrs) }
}

// publishSpanOf returns the span name of a Publish message's change and the attributes known before
// its append; no name for a change that is not traced (load reports).
func publishSpanOf(info kvstate.WorkerInfo, change kvstate.Change) (string, []attribute.KeyValue) {
	switch c := change.(type) {
	case kvstate.WorkerUp:
		return SpanPublishHello, []attribute.KeyValue{AttrRole.String(info.Role.String())}
	case kvstate.KVEvents:
		return SpanPublishEvents, eventAttributes(c.Events)
	case kvstate.KVDump:
		return SpanPublishDump, eventAttributes(c.Events)
	}
	return "", nil
}

// endPublishSpan records the append that applied the message and ends its span.
func endPublishSpan(span trace.Span, start time.Time, shared bool, change kvstate.Change, res kvstate.Result, err error, attrs []attribute.KeyValue) {
	if _, hello := change.(kvstate.WorkerUp); hello {
		attrs = append(attrs, AttrEpoch.Int64(int64(res.Epoch)))
	} else {
		attrs = append(attrs, AttrApplied.Int(res.Applied))
	}
	attrs = append(attrs,
		AttrAppendMS.Float64(float64(time.Since(start).Microseconds())/1000),
		// The append waited for the shared store (Redis), unless the store was unreachable and the
		// change was kept in this replica's outage buffer (its ack then waits).
		AttrSharedLog.Bool(shared),
		AttrBuffered.Bool(res.Buffered),
	)
	if res.HasLastEvent {
		attrs = append(attrs, AttrLastEventID.Int64(int64(res.LastEventID)))
	}
	if res.Gap {
		attrs = append(attrs, AttrGap.Bool(true))
	}
	span.SetAttributes(attrs...)
	if err != nil {
		span.SetStatus(otelcodes.Error, err.Error())
	}
	span.End()
}

// traceLog adds to a shared log's observers the hooks that link each replica's apply of an entry
// to the traced call that appended it: the entry carries the call's W3C traceparent (only a
// sampled call's: an untraced append costs a nil check and a context lookup), and every replica
// that applies it makes a SpanLogApply span, the root of its own trace, linked to the call's span
// (to each traced call's, when the entry joins the changes of several).
func traceLog(tracer trace.Tracer, obs *kvstate.Observers) {
	traceContext := propagation.TraceContext{}
	obs.TraceParent = func(ctx context.Context) string {
		if !trace.SpanContextFromContext(ctx).IsSampled() {
			return ""
		}
		carrier := propagation.MapCarrier{}
		traceContext.Inject(ctx, carrier)
		return carrier.Get("traceparent")
	}
	obs.ApplyTraced = func(traceParents, entryID string) func() {
		var links []trace.Link
		for tp := range strings.SplitSeq(traceParents, ",") {
			appender := traceContext.Extract(context.Background(), propagation.MapCarrier{"traceparent": tp})
			if link := trace.LinkFromContext(appender); link.SpanContext.IsValid() {
				links = append(links, link)
			}
		}
		_, span := tracer.Start(context.Background(), SpanLogApply,
			trace.WithNewRoot(),
			trace.WithLinks(links...),
			trace.WithAttributes(AttrLogEntry.String(entryID)))
		return func() { span.End() }
	}
}

// eventAttributes counts a batch's events and blocks (stored and removed).
func eventAttributes(events []kvstate.Event) []attribute.KeyValue {
	blocks := 0
	for _, ev := range events {
		blocks += len(ev.Blocks) + len(ev.Removed)
	}
	return []attribute.KeyValue{AttrEvents.Int(len(events)), AttrBlocks.Int(blocks)}
}
