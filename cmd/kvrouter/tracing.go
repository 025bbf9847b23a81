package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvrouter/kvrouter/server/config"
)

// tracingFlushTimeout bounds the flush of the last spans at shutdown (an unreachable collector must
// not hold the exit).
const tracingFlushTimeout = 5 * time.Second

// startTracing sets up OpenTelemetry traces from the standard OTEL_* environment (docs/operations.md,
// "Traces"): spans are exported over OTLP/gRPC when OTEL_EXPORTER_OTLP_ENDPOINT or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set, unless OTEL_SDK_DISABLED is true or
// OTEL_TRACES_EXPORTER is none. Otherwise it returns a nil provider, and nothing of tracing runs.
// The SDK reads the rest itself: the sampler (OTEL_TRACES_SAMPLER, parentbased_always_on by
// default), the batching (OTEL_BSP_*), the exporter's headers, TLS, timeout and compression, and the
// resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES). stop flushes the spans still buffered.
func startTracing(ctx context.Context, cfg *config.Options, getenv func(string) string, logger *slog.Logger) (tp trace.TracerProvider, stop func(), err error) {
	off := func(why string) (trace.TracerProvider, func(), error) {
		logger.Info("tracing off: " + why)
		return nil, func() {}, nil
	}
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return off("OTEL_SDK_DISABLED is true")
	}
	switch exporter := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")); exporter {
	case "", "otlp":
	case "none":
		return off("OTEL_TRACES_EXPORTER is none")
	default:
		return nil, nil, fmt.Errorf("OTEL_TRACES_EXPORTER %q: kvrouter exports traces with otlp only (or none)", exporter)
	}
	endpoint := getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
	if endpoint == "" {
		endpoint = getenv("OTEL_EXPORTER_OTLP_ENDPOINT")
	}
	if endpoint == "" {
		return off("OTEL_EXPORTER_OTLP_ENDPOINT is not set")
	}
	for _, key := range []string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"} {
		if p := strings.TrimSpace(getenv(key)); p != "" {
			if p != "grpc" {
				return nil, nil, fmt.Errorf("%s %q: kvrouter exports traces with OTLP over gRPC only; set grpc, and the endpoint to the collector's gRPC port (usually 4317)", key, p)
			}
			break // the per-signal variable wins
		}
	}
	// The SDK's own errors (an export that failed) go to the JSON log, not to its default logger.
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) { logger.Warn("opentelemetry", "err", err) }))
	exporter, err := otlptracegrpc.New(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("OTLP trace exporter: %w", err)
	}
	instance := cfg.ReplicaID
	if instance == "" {
		host, _ := os.Hostname()
		instance = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	// Later detectors win: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override the defaults.
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", "kvrouter"), attribute.String("service.instance.id", instance)),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv(),
	)
	if err != nil {
		_ = exporter.Shutdown(ctx)
		return nil, nil, fmt.Errorf("OpenTelemetry resource: %w", err)
	}
	provider := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	otel.SetTracerProvider(provider)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	sampler := getenv("OTEL_TRACES_SAMPLER")
	if sampler == "" {
		sampler = "parentbased_always_on"
	}
	logger.Info("tracing on: exporting spans with OTLP over gRPC", "endpoint", redactURL(endpoint), "sampler", sampler,
		"sampler_arg", getenv("OTEL_TRACES_SAMPLER_ARG"), "service_instance_id", instance)
	stop = func() {
		ctx, cancel := context.WithTimeout(context.Background(), tracingFlushTimeout)
		defer cancel()
		if err := provider.Shutdown(ctx); err != nil {
			logger.Warn("tracing: flushing the last spans failed", "err", err)
		}
	}
	return provider, stop, nil
}

// redactURL hides a password an endpoint URL may carry, for the log.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.User == nil {
		return s
	}
	return u.Redacted()
}

// traceLogHandler adds the trace and span ids of the context's span, when there is one, to each
// record: every context-aware line of a traced call (the call log) names its trace.
type traceLogHandler struct{ slog.Handler }

// withTraceIDs wraps h so that records logged with a traced context carry trace_id and span_id.
func withTraceIDs(h slog.Handler) slog.Handler { return traceLogHandler{h} }

func (h traceLogHandler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r.AddAttrs(slog.String("trace_id", sc.TraceID().String()), slog.String("span_id", sc.SpanID().String()))
	}
	return h.Handler.Handle(ctx, r)
}

func (h traceLogHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return traceLogHandler{h.Handler.WithAttrs(attrs)}
}

func (h traceLogHandler) WithGroup(name string) slog.Handler {
	return traceLogHandler{h.Handler.WithGroup(name)}
}
