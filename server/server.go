// Package server is kvrouter's gRPC edge: it validates requests, calls the domain (policy, kvstate),
// and maps results and errors to the public contract. It also assembles the gRPC server: interceptors,
// health, reflection, metrics, limits and graceful shutdown.
package server

import (
	"context"
	"log/slog"
	"net"
	"runtime/debug"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/server/app"
	"github.com/kvrouter/kvrouter/server/auth"
	"github.com/kvrouter/kvrouter/server/config"
)

// Options configure a Server.
type Options struct {
	// Shards hold the state and log of each model: kvstate.OneShard, one shard for every model, or
	// a log sharded by model (kvstate/replication.Shards); server/replica builds them. Nil means
	// one shard of State, Log and Liveness (a shortcut for tests).
	Shards   kvstate.ShardSource
	State    *kvstate.State
	Log      kvstate.Log
	Liveness kvstate.Liveness // nil: kvstate.LocalLiveness (embedded mode)
	// Dispatcher routes: a app.Dispatcher over the one shard, or a app.Sharded.
	Dispatcher app.Routing
	Config     []config.Entry // the effective configuration, for GetConfig
	Logger     *slog.Logger
	Registry   *prometheus.Registry
	Clock      kvstate.Clock     // when streams close (the housekeeper's grace period); nil: the system clock
	Presence   *kvstate.Presence // this replica's streams (the housekeeper's too); nil: a new one

	MaxPromptTokens      int    // longest accepted prompt, in tokens
	MaxRecvMsgBytes      int    // largest accepted message (any method)
	MaxConcurrentStreams uint32 // per connection
	// Publish limits; zero means the default (config.DefaultMaxPublishMsgBytes, at most MaxRecvMsgBytes;
	// config.DefaultMaxBatchBlocks; config.DefaultMaxDumpBlocks).
	MaxPublishMsgBytes int // largest Publish message
	MaxBatchBlocks     int // events, and blocks (stored plus removed), in one Publish message
	MaxDumpBlocks      int // blocks of one dump, over all its parts
	// MaxDumpBytesInFlight bounds what the dumps in parts of every stream hold between their parts,
	// together; zero means config.DefaultMaxDumpBytesInFlight.
	MaxDumpBytesInFlight int
	MaxWorkersPerModel   int // worker ranks one model may register (0: no cap)
	MaxRanksPerWorker    int // ranks one worker id may register in a model (0: no cap)
	MaxModels            int // models hellos may create (0: no cap)
	// Connections each port holds at once (0: config.DefaultMaxConnections and
	// config.DefaultHealthMaxConnections), and the largest header list a call may send (0:
	// config.DefaultMaxHeaderListBytes).
	MaxConnections, HealthMaxConnections int
	MaxHeaderListBytes                   int
	// MaxRefusedCallsPerConn: a connection with more calls refused for their credentials within a
	// second is closed (0: config.DefaultMaxRefusedCallsPerConn).
	MaxRefusedCallsPerConn int

	// Creds is the port's transport security (servertls); nil serves plaintext.
	Creds credentials.TransportCredentials
	// Auth checks who may call what (server/auth); nil lets every call in unchecked.
	Auth *auth.Authenticator
	// Connections: clients pinging more often than KeepaliveMinTime are disconnected (0: 10s);
	// connections are asked to go away after MaxConnectionAge (0: never), and closed
	// MaxConnectionAgeGrace later.
	KeepaliveMinTime      time.Duration
	MaxConnectionAge      time.Duration
	MaxConnectionAgeGrace time.Duration
	// TracerProvider records the spans of kvrouter.v1 calls and Publish messages (server/tracing.go);
	// nil turns tracing off: no stats handler runs and no span is made.
	TracerProvider trace.TracerProvider
	// Picker configures the ext_proc endpoint picker (ServePicker); its Dispatcher, metrics and
	// logger are the server's. Nil serves no picker.
	Picker *PickerOptions
}

// Services maps each service to the role (server/auth) its callers need.
var Services = map[string]auth.Role{
	kvrouterv1.RouterService_ServiceDesc.ServiceName: auth.RoleFrontend,
	kvrouterv1.WorkerService_ServiceDesc.ServiceName: auth.RoleWorker,
	kvrouterv1.AdminService_ServiceDesc.ServiceName:  auth.RoleAdmin,
	// The endpoint picker routes and books, as a frontend does.
	extprocv3.ExternalProcessor_ServiceDesc.ServiceName: auth.RoleFrontend,
}

// Health and reflection service names, which the configuration may open to callers without
// credentials.
var (
	HealthServices     = []string{healthpb.Health_ServiceDesc.ServiceName}
	ReflectionServices = []string{"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
)

// Methods whose calls and streams a credential's limits count.
const (
	RouteMethod   = "/kvrouter.v1.RouterService/Route"
	PublishMethod = "/kvrouter.v1.WorkerService/Publish"
)

// healthStreamsPerConn bounds the streams of one health port connection: a probe needs one.
const healthStreamsPerConn = 4

// Server is kvrouter's gRPC server.
type Server struct {
	grpc   *grpc.Server
	health *health.Server
	// healthOnly serves the health service alone, in plaintext (ServeHealth): probes that cannot
	// speak TLS or carry credentials (Kubernetes' gRPC probes) check it there.
	healthOnly *grpc.Server
	// picker serves the ext_proc endpoint picker and health on a port of its own (ServePicker),
	// with the main port's transport security, credentials and limits; nil without one.
	picker *grpc.Server
	// Connection caps of the two ports (limitListener).
	maxConns, healthMaxConns int
	connsOpen                *prometheus.GaugeVec
	connsRefused             *prometheus.CounterVec
	conns                    *connRegistry // the gRPC port's, for cutRefused
	stopping                 chan struct{}
	stopOnce                 sync.Once
	bg                       sync.WaitGroup // the server's own goroutines (the shared-log watcher); Shutdown joins them
	logger                   *slog.Logger
	handlers                 *handlerPool // runs the unary calls of every port (handlerPool)
}

// serviceNames are the services whose health is reported (besides "", the whole server).
var serviceNames = []string{
	kvrouterv1.RouterService_ServiceDesc.ServiceName,
	kvrouterv1.WorkerService_ServiceDesc.ServiceName,
	kvrouterv1.AdminService_ServiceDesc.ServiceName,
}

// New assembles the gRPC server with every service registered and reporting SERVING.
func New(o Options) *Server {
	o.Clock = kvstate.ClockOr(o.Clock)
	if o.Shards == nil {
		o.Shards = kvstate.OneShard{Shard: &kvstate.Shard{State: o.State, Log: o.Log, Liveness: o.Liveness}}
	}
	_, one := o.Shards.(kvstate.OneShard)
	sharded := !one
	limits := publishLimits{maxBytes: o.MaxPublishMsgBytes, maxBlocks: o.MaxBatchBlocks}
	if limits.maxBytes <= 0 {
		limits.maxBytes = min(config.DefaultMaxPublishMsgBytes, o.MaxRecvMsgBytes)
	}
	if limits.maxBlocks <= 0 {
		limits.maxBlocks = config.DefaultMaxBatchBlocks
	}
	maxDumpBlocks := o.MaxDumpBlocks
	if maxDumpBlocks <= 0 {
		maxDumpBlocks = config.DefaultMaxDumpBlocks
	}
	maxDumpBytes := int64(o.MaxDumpBytesInFlight)
	if maxDumpBytes <= 0 {
		maxDumpBytes = config.DefaultMaxDumpBytesInFlight
	}
	grpcMetrics := grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram(
		grpcprom.WithHistogramBuckets([]float64{50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25, 1}),
	))
	panics := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvrouter_panics_recovered_total",
		Help: "Panics in gRPC handlers, recovered and answered with INTERNAL.",
	})
	o.Registry.MustRegister(grpcMetrics, panics)
	recover := recovery.WithRecoveryHandler(func(p any) error {
		panics.Inc()
		o.Logger.Error("recovered from panic in handler", "panic", p, "stack", string(debug.Stack()))
		return status.Error(codes.Internal, "internal error")
	})
	sampler := newCallLogSampler()
	codec := newLimitingCodec(maxRouteBytes(o.MaxPromptTokens))
	handlers := newHandlerPool(handlerPoolSize(), codec)
	unary := []grpc.UnaryServerInterceptor{grpcMetrics.UnaryServerInterceptor(), unaryCallLog(o.Logger, sampler)}
	callLog := logging.WithLevels(func(c codes.Code) logging.Level { return logging.Level(callLevel(c)) })
	logger := interceptorLogger(o.Logger, sampler)
	stream := []grpc.StreamServerInterceptor{
		grpcMetrics.StreamServerInterceptor(),
		logging.StreamServerInterceptor(logger, callLog, logging.WithLogOnEvents(logging.StartCall, logging.FinishCall)),
	}
	// Who may call what is decided before the call reaches an interceptor (auth.TapHandle): a
	// refused call is counted in kvrouter_auth_failures_total and logged, sampled, by the
	// Authenticator. The interceptors put the admitted Caller in the handler's context.
	if o.Auth != nil {
		unary = append(unary, o.Auth.UnaryServerInterceptor())
		stream = append(stream, o.Auth.StreamServerInterceptor())
	}
	unary = append(unary, recovery.UnaryServerInterceptor(recover))
	stream = append(stream, recovery.StreamServerInterceptor(recover))
	if o.KeepaliveMinTime <= 0 {
		o.KeepaliveMinTime = 10 * time.Second
	}
	if o.MaxConnections <= 0 {
		o.MaxConnections = config.DefaultMaxConnections
	}
	if o.HealthMaxConnections <= 0 {
		o.HealthMaxConnections = config.DefaultHealthMaxConnections
	}
	if o.MaxHeaderListBytes <= 0 {
		o.MaxHeaderListBytes = config.DefaultMaxHeaderListBytes
	}
	connsOpen := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvrouter_connections",
		Help: "Connections a port holds now (port grpc or health); at max_connections (health_max_connections) new ones are refused.",
	}, []string{"port"})
	connsRefused := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvrouter_connections_refused_total",
		Help: "Connections closed as soon as accepted because the port held max_connections (health_max_connections) already, by port.",
	}, []string{"port"})
	connsCut := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvrouter_connections_cut_total",
		Help: "gRPC connections closed because more than max_refused_calls_per_conn of their calls were refused for their credentials within a second (a flood of calls without credentials, or HTTP/2 rapid reset).",
	})
	o.Registry.MustRegister(connsOpen, connsRefused, connsCut)
	if o.MaxRefusedCallsPerConn <= 0 {
		o.MaxRefusedCallsPerConn = config.DefaultMaxRefusedCallsPerConn
	}
	conns := &connRegistry{}
	serverParams := keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}
	if o.MaxConnectionAge > 0 {
		serverParams.MaxConnectionAge = o.MaxConnectionAge
		serverParams.MaxConnectionAgeGrace = o.MaxConnectionAgeGrace
	}
	opts := []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(unary...),
		grpc.ChainStreamInterceptor(stream...),
		grpc.MaxRecvMsgSize(o.MaxRecvMsgBytes),
		// The standard codec, except that a Publish message is sized and counted before it is
		// decoded (publishLimits), and a Route larger than max_prompt_tokens allows is not decoded.
		grpc.ForceServerCodecV2(codec),
		grpc.MaxConcurrentStreams(o.MaxConcurrentStreams),
		grpc.MaxHeaderListSize(uint32(o.MaxHeaderListBytes)),
		// A connection that has not finished its TLS handshake and HTTP/2 preface by then is
		// closed: it holds one of max_connections meanwhile (gRPC's default waits 120 s).
		grpc.ConnectionTimeout(10 * time.Second),
		// Stop returns once every handler has: a Publish stream has released its worker's lease by
		// then, so the leases may stop right after the server (replica.Run's contract).
		grpc.WaitForHandlers(true),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: o.KeepaliveMinTime, PermitWithoutStream: true}),
		grpc.KeepaliveParams(serverParams),
	}
	if o.Creds != nil {
		opts = append(opts, grpc.Creds(o.Creds))
	}
	if o.Auth != nil {
		// Callers are admitted on their headers, before any message is read (auth.TapHandle).
		opts = append(opts, grpc.InTapHandle(cutRefused(o.Auth.TapHandle(), conns, int64(o.MaxRefusedCallsPerConn), connsCut)))
	}
	var tracer trace.Tracer
	if tracingBuilt && o.TracerProvider != nil {
		opts = append(opts, grpc.StatsHandler(statsHandler(o.TracerProvider)))
		tracer = o.TracerProvider.Tracer(TracerName)
	}
	s := &Server{
		grpc:     grpc.NewServer(opts...),
		health:   health.NewServer(),
		maxConns: o.MaxConnections, healthMaxConns: o.HealthMaxConnections,
		connsOpen: connsOpen, connsRefused: connsRefused, conns: conns,
		stopping: make(chan struct{}),
		logger:   o.Logger,
		handlers: handlers,
	}
	if o.Presence == nil {
		o.Presence = kvstate.NewPresence()
	}
	m := newMetrics(o.Registry, o.Shards, o.Presence, o.Dispatcher)
	ready := o.Shards.Ready() // nil: nothing to catch up with
	if ready != nil {
		obs := m.logObservers
		if tracer != nil {
			traceLog(tracer, &obs)
		}
		o.Shards.Observe(obs)
	}
	// The router service's calls run on the handler pool (handlerPool): Route is the hot path.
	s.grpc.RegisterService(handlers.wrap(&kvrouterv1.RouterService_ServiceDesc),
		&routerService{dispatcher: o.Dispatcher, metrics: m, logger: o.Logger, maxPromptTokens: o.MaxPromptTokens})
	publishing := app.NewPublishing(app.PublishOptions{Shards: o.Shards, Presence: o.Presence, Clock: o.Clock, Logger: o.Logger,
		ConditionalDisagg:  o.Dispatcher.Config().ConditionalDisagg.Enabled,
		MaxWorkersPerModel: o.MaxWorkersPerModel, MaxRanksPerWorker: o.MaxRanksPerWorker, MaxModels: o.MaxModels,
		MaxDumpBlocks: maxDumpBlocks, MaxDumpBytesInFlight: maxDumpBytes,
		Observer: publishObserver{metrics: m, tracer: tracer}})
	o.Registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvrouter_publish_dump_bytes_in_flight",
		Help: "Bytes the dumps in parts of this replica's Publish streams hold between their parts, together; a part that would pass max_dump_bytes_in_flight is refused (RESOURCE_EXHAUSTED, DUMPS_IN_FLIGHT).",
	}, func() float64 { return float64(publishing.DumpBytesInFlight()) }))
	kvrouterv1.RegisterWorkerServiceServer(s.grpc, &workerService{publishing: publishing, logger: o.Logger, limits: limits, stopping: s.stopping})
	kvrouterv1.RegisterAdminServiceServer(s.grpc, &adminService{shards: o.Shards, sharded: sharded, presence: o.Presence, config: o.Config})
	healthpb.RegisterHealthServer(s.grpc, s.health)
	// The health port takes callers without credentials, so everything a caller could grow there
	// is small: a probe's message, its headers, a few streams a connection (a Watch holds one), and
	// a connection idle for a minute or still handshaking after 5 s is closed.
	s.healthOnly = grpc.NewServer(grpc.MaxRecvMsgSize(4<<10), grpc.MaxHeaderListSize(uint32(o.MaxHeaderListBytes)),
		grpc.MaxConcurrentStreams(healthStreamsPerConn), grpc.ConnectionTimeout(5*time.Second),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: o.KeepaliveMinTime}),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: time.Minute, Time: 30 * time.Second, Timeout: 10 * time.Second}))
	healthpb.RegisterHealthServer(s.healthOnly, s.health)
	if o.Picker != nil {
		po := *o.Picker
		po.Dispatcher, po.Logger, po.MaxPromptTokens = o.Dispatcher, o.Logger, o.MaxPromptTokens
		po.Metrics, po.Tracer = NewPickerMetrics(o.Registry), tracer
		s.picker = grpc.NewServer(opts...)
		extprocv3.RegisterExternalProcessorServer(s.picker, NewPicker(po))
		healthpb.RegisterHealthServer(s.picker, s.health) // the protocol asks for health on the picker's port
		grpcMetrics.InitializeMetrics(s.picker)
	}
	reflection.Register(s.grpc)
	grpcMetrics.InitializeMetrics(s.grpc)
	serving := healthpb.HealthCheckResponse_SERVING
	if ready != nil {
		// A replica sharing state through a store serves once it has caught up with the log: before,
		// it would route from a partial view.
		serving = healthpb.HealthCheckResponse_NOT_SERVING
	}
	for _, name := range append([]string{""}, serviceNames...) {
		s.health.SetServingStatus(name, serving)
	}
	if ready != nil {
		s.bg.Go(func() { s.watchSharedLog(ready, o.Shards) })
	}
	return s
}

// SharedStateService is the health entry of the state shared through a store (Redis): NOT_SERVING
// while the store is unreachable, an outage's changes wait to be published, or this replica knows
// its state may be incomplete (the shared log was lost and is not re-established yet, it follows a
// fresh log that a replica with state may still reseed, or it stopped at a newer version). The
// routing services stay SERVING meanwhile, since routing goes on from local state.
const SharedStateService = "kvrouter.v1.SharedState"

func (s *Server) watchSharedLog(ready <-chan struct{}, shards kvstate.ShardSource) {
	select {
	case <-ready:
		for _, name := range append([]string{""}, serviceNames...) {
			s.health.SetServingStatus(name, healthpb.HealthCheckResponse_SERVING)
		}
	case <-s.stopping:
		return
	}
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	last, lastRouting := healthpb.HealthCheckResponse_UNKNOWN, healthpb.HealthCheckResponse_SERVING
	for {
		st := sharedLogStats(shards)
		want, routing := healthpb.HealthCheckResponse_SERVING, healthpb.HealthCheckResponse_SERVING
		if st.Degraded || st.Incomplete {
			want = healthpb.HealthCheckResponse_NOT_SERVING
		}
		if st.Incomplete {
			// The state may not be the shared one (the log was lost and is being re-established,
			// or a replica holding it may still reseed it): not ready to route. Routing from a
			// state that is only behind (Redis unreachable) goes on.
			routing = healthpb.HealthCheckResponse_NOT_SERVING
		}
		if want != last {
			s.health.SetServingStatus(SharedStateService, want)
			last = want
		}
		if routing != lastRouting {
			s.health.SetServingStatus(kvrouterv1.RouterService_ServiceDesc.ServiceName, routing)
			lastRouting = routing
		}
		select {
		case <-s.stopping:
			return
		case <-t.C:
		}
	}
}

// Serve accepts connections on lis until Shutdown.
func (s *Server) Serve(lis net.Listener) error {
	lis = limitConnections(lis, s.maxConns, s.connsOpen.WithLabelValues("grpc"), s.connsRefused.WithLabelValues("grpc"), s.conns)
	err := s.grpc.Serve(lis)
	if err == grpc.ErrServerStopped {
		return nil
	}
	return err
}

// ServeHealth serves only the health service, in plaintext, on lis until Shutdown: the answers of
// the main port's health service, for probes that cannot use its TLS or credentials.
func (s *Server) ServeHealth(lis net.Listener) error {
	lis = limitConnections(lis, s.healthMaxConns, s.connsOpen.WithLabelValues("health"), s.connsRefused.WithLabelValues("health"), &connRegistry{})
	err := s.healthOnly.Serve(lis)
	if err == grpc.ErrServerStopped {
		return nil
	}
	return err
}

// ServePicker serves the ext_proc endpoint picker on lis until Shutdown; New must have been given
// PickerOptions. Its connections count against max_connections with the main port's.
func (s *Server) ServePicker(lis net.Listener) error {
	lis = limitConnections(lis, s.maxConns, s.connsOpen.WithLabelValues("picker"), s.connsRefused.WithLabelValues("picker"), s.conns)
	err := s.picker.Serve(lis)
	if err == grpc.ErrServerStopped {
		return nil
	}
	return err
}

// Shutdown stops the server in order: health turns NOT_SERVING so balancers stop sending new calls,
// the drain period lets them notice, Publish streams end with UNAVAILABLE so workers reconnect to
// another replica, in-flight calls finish, and whatever still runs when ctx ends is cut.
func (s *Server) Shutdown(ctx context.Context, drain time.Duration) {
	s.health.Shutdown()
	s.logger.Info("shutting down: health NOT_SERVING", "drain", drain)
	select {
	case <-time.After(drain):
	case <-ctx.Done():
	}
	s.stopOnce.Do(func() { close(s.stopping) })
	for _, g := range s.grpcServers() {
		done := make(chan struct{})
		go func() {
			g.GracefulStop()
			close(done)
		}()
		select {
		case <-done:
		case <-ctx.Done():
			s.logger.Warn("graceful stop timed out; closing remaining connections")
			g.Stop()
			<-done
		}
	}
	s.healthOnly.Stop() // last: probes see NOT_SERVING until the end
	s.handlers.close()
	s.bg.Wait()
}

// Stop ends the server at once: streams and calls are cut, and the server's goroutines joined.
func (s *Server) Stop() {
	s.stopOnce.Do(func() { close(s.stopping) })
	for _, g := range s.grpcServers() {
		g.Stop()
	}
	s.healthOnly.Stop()
	s.handlers.close()
	s.bg.Wait()
}

// grpcServers are the servers of the main port and of the picker's, in the order they stop: the
// picker's streams end their bookings through the dispatcher, which outlives both.
func (s *Server) grpcServers() []*grpc.Server {
	if s.picker == nil {
		return []*grpc.Server{s.grpc}
	}
	return []*grpc.Server{s.picker, s.grpc}
}
