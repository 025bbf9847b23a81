package main

import (
	"context"
	"log/slog"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/credentials"

	"github.com/kvrouter/kvrouter/server"
	"github.com/kvrouter/kvrouter/server/auth"
	"github.com/kvrouter/kvrouter/server/config"
	"github.com/kvrouter/kvrouter/server/filewatch"
	"github.com/kvrouter/kvrouter/server/servertls"
)

// portSecurity is the gRPC port's TLS and authenticator, and the goroutines that reload their
// files when they change.
type portSecurity struct {
	creds   credentials.TransportCredentials // nil: plaintext
	auth    *auth.Authenticator
	watches []func(context.Context) error
}

// newPortSecurity loads the TLS files and the credentials file; serving cannot start without a good
// first version of each. Later versions are reloaded every file_reload_interval; one that does not
// load is logged and counted, and the previous one stays in force.
func newPortSecurity(cfg *config.Options, registry *prometheus.Registry, logger *slog.Logger) (portSecurity, error) {
	var ps portSecurity
	a, err := auth.New(auth.Options{
		CredentialsFile: cfg.CredentialsFile,
		Services:        server.Services,
		Open:            openServices(cfg),
		AnyCaller:       append(slices.Clone(server.HealthServices), server.ReflectionServices...), // when not open
		RouteMethod:     server.RouteMethod, PublishMethod: server.PublishMethod,
		RouteRateLimit: cfg.RouteRateLimit, EventRateLimit: cfg.EventRateLimit,
		RouteTokenRate: cfg.RouteTokenRateLimit, RouteTokenBurst: cfg.MaxPromptTokens,
		MaxPublishStreams: cfg.MaxPublishStreams, EventBurst: cfg.MaxBatchBlocks, MaxBookedBlocks: cfg.MaxBookedBlocksPerCredential,
		Registry: registry, Logger: logger,
	})
	if err != nil {
		return ps, err
	}
	ps.auth = a
	if path := a.Path(); path != "" {
		ps.watches = append(ps.watches, func(ctx context.Context) error {
			filewatch.Poll(ctx, cfg.FileReloadInterval, []string{path}, func() {
				if err := a.Reload(); err != nil {
					logger.Error("credentials file not reloaded; the previous version stays in force", "err", err)
					return
				}
				logger.Info("credentials file reloaded", "path", path)
			})
			return nil
		})
	}
	if cfg.TLSCertFile == "" {
		return ps, nil
	}
	src, err := servertls.Load(servertls.Files{Cert: cfg.TLSCertFile, Key: cfg.TLSKeyFile, ClientCA: cfg.TLSClientCAFile,
		ClientCertOptional: cfg.TLSClientAuth == "optional", MinVersion: cfg.TLSMinVersion})
	if err != nil {
		return ps, err
	}
	reloads := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvrouter_tls_reloads_total",
		Help: "Reloads of the TLS certificate, key and client CA files, by result (ok, error: the previous version keeps serving).",
	}, []string{"result"})
	expiry := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvrouter_tls_certificate_expiry_timestamp_seconds",
		Help: "When the serving certificate expires (Unix time): alert well before.",
	}, func() float64 { return float64(src.NotAfter().Unix()) })
	registry.MustRegister(reloads, expiry)
	ps.creds = credentials.NewTLS(src.Config())
	ps.watches = append(ps.watches, func(ctx context.Context) error {
		filewatch.Poll(ctx, cfg.FileReloadInterval, src.Paths(), func() {
			if err := src.Reload(); err != nil {
				reloads.WithLabelValues("error").Inc()
				logger.Error("TLS files not reloaded; the previous certificate keeps serving", "err", err)
				return
			}
			reloads.WithLabelValues("ok").Inc()
			logger.Info("TLS files reloaded", "not_after", src.NotAfter(), "mutual_tls", src.MutualTLS())
			if left := time.Until(src.NotAfter()); left < 7*24*time.Hour {
				logger.Warn("the serving certificate expires within 7 days: rotate it", "not_after", src.NotAfter(), "left", left.Round(time.Minute))
			}
		})
		return nil
	})
	return ps, nil
}

// openServices are the services callers without credentials may use, by configuration.
func openServices(cfg *config.Options) []string {
	var open []string
	if cfg.AuthOpenHealth {
		open = append(open, server.HealthServices...)
	}
	if cfg.AuthOpenReflection {
		open = append(open, server.ReflectionServices...)
	}
	return open
}
