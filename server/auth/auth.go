// Package auth decides who may call what: it authenticates each call (a bearer token checked
// against the SHA-256 hashes of the credentials file, or the identity of a verified client
// certificate), checks the role the called service needs, and keeps each credential's limits (Route
// rate, KV event volume, concurrent Publish streams). One interceptor does it for unary and stream
// calls; a handler that needs a message's content to decide (which worker a Publish stream speaks
// for) asks the call's Caller, from FromContext.
//
// The credentials file is read again when it changes (filewatch); a version that does not parse
// changes nothing. Rejections are UNAUTHENTICATED (no or unknown credentials) or PERMISSION_DENIED
// (a known credential without the right), with messages that name the credential and the rule but
// never a token or its hash.
package auth

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/kvrouter/kvrouter/kvstate"
)

// MaxEventWait is the longest a Publish stream over its event rate is slowed before it is refused.
const MaxEventWait = time.Second

// Options configure an Authenticator.
type Options struct {
	// CredentialsFile is the YAML file of credentials; "" lets every caller in as Anonymous, with
	// every role (the default on loopback).
	CredentialsFile string
	// Services maps each gRPC service name to the role it needs. Any other service needs RoleAdmin.
	Services map[string]Role
	// Open services answer callers without credentials; AnyCaller services answer any valid one.
	Open, AnyCaller []string
	// RouteMethod is the full method name whose calls RouteRateLimit counts; PublishMethod's streams
	// are the ones MaxPublishStreams bounds.
	RouteMethod, PublishMethod string
	// Defaults of each credential's limits (the file may set its own): Route calls a second, prompt
	// tokens of booked Routes a second, KV event blocks a second (0: no limit), and concurrent
	// Publish streams.
	RouteRateLimit, RouteTokenRate, EventRateLimit float64
	MaxPublishStreams                              int
	// MaxBookedBlocks is the default of the block keys one credential's bookings may hold
	// together (0: no bound); Caller.Bookings hands it to the dispatcher, which counts them.
	MaxBookedBlocks int
	// RouteTokenBurst is the token bucket's least size: the longest prompt (max_prompt_tokens), so
	// that any Route passes once the bucket is full.
	RouteTokenBurst int
	// EventBurst is the event bucket's least size: the most blocks one message may carry, so that
	// any message passes once the bucket is full.
	EventBurst int
	Registry   prometheus.Registerer
	Logger     *slog.Logger
	// Clock tells the time of the rate limits' buckets; nil: the system clock.
	Clock kvstate.Clock
}

// Anonymous is the caller's name when no credentials file is configured.
const Anonymous = "anonymous"

// Authenticator checks every call.
type Authenticator struct {
	opts  Options
	open  map[string]bool // service names
	any   map[string]bool
	table atomic.Pointer[callers]
	// usage keeps each credential's buckets and stream count by name across reloads, so a reload
	// never refills a bucket or forgets an open stream.
	mu    sync.Mutex
	usage map[string]*usage

	// refusals samples the log lines of refused calls (logRefusal).
	refusals struct {
		sync.Mutex
		logged   time.Time
		unlogged int
	}

	failures    *prometheus.CounterVec
	limited     *prometheus.CounterVec
	reloads     *prometheus.CounterVec
	credentials prometheus.Gauge
}

// callers is one version of the credentials, ready for lookups.
type callers struct {
	byToken    map[[32]byte]*Caller
	byIdentity map[string]*Caller
	byName     map[string]*Caller
	anonymous  *Caller // without a credentials file
	// replaced is closed when a reload replaces this version (Caller.Replaced).
	replaced chan struct{}
}

// usage is what a credential has used of its limits.
type usage struct {
	route, routeTokens, events *bucket
	streams                    atomic.Int64
}

// Caller is the credential a call was authenticated as, with its limits.
type Caller struct {
	*Credential
	use        *usage
	maxStreams int
	maxBooked  int
	a          *Authenticator
}

// New reads the credentials file (if any) and returns the Authenticator.
func New(o Options) (*Authenticator, error) {
	o.Clock = kvstate.ClockOr(o.Clock)
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	a := &Authenticator{opts: o, open: map[string]bool{}, any: map[string]bool{}, usage: map[string]*usage{},
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_auth_failures_total",
			Help: "Calls refused by authentication (code unauthenticated) or authorization (permission_denied), by reason.",
		}, []string{"code", "reason"}),
		limited: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_rate_limited_total",
			Help: "Calls and streams refused (RESOURCE_EXHAUSTED) or slowed by a credential's limits, by credential and limit (route, route_tokens, events, events_slowed, publish_streams).",
		}, []string{"credential", "limit"}),
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_credentials_reloads_total",
			Help: "Reloads of the credentials file, by result (ok, error: the previous version stays in force).",
		}, []string{"result"}),
		credentials: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvrouter_credentials",
			Help: "Credentials in force (0 without a credentials file: every caller is let in).",
		}),
	}
	for _, s := range o.Open {
		a.open[s] = true
	}
	for _, s := range o.AnyCaller {
		a.any[s] = true
	}
	if o.Registry != nil {
		o.Registry.MustRegister(a.failures, a.limited, a.reloads, a.credentials)
	}
	if o.CredentialsFile == "" {
		anon := &Credential{Name: Anonymous, Roles: RoleWorker | RoleFrontend | RoleAdmin, AnyWorker: true}
		a.table.Store(&callers{anonymous: a.caller(anon), replaced: make(chan struct{})})
		return a, nil
	}
	if err := a.Reload(); err != nil {
		return nil, err
	}
	return a, nil
}

// Path is the credentials file ("" without one).
func (a *Authenticator) Path() string { return a.opts.CredentialsFile }

// Reload reads the credentials file again. On an error nothing changes: the previous version stays
// in force.
func (a *Authenticator) Reload() error {
	data, err := os.ReadFile(a.opts.CredentialsFile)
	if err == nil {
		var t *table
		if t, err = parseCredentials(data); err == nil {
			next := &callers{byToken: make(map[[32]byte]*Caller, len(t.byToken)), byIdentity: make(map[string]*Caller, len(t.byIdentity)),
				byName: make(map[string]*Caller, len(t.all)), replaced: make(chan struct{})}
			for _, c := range t.all {
				caller := a.caller(c)
				next.byName[c.Name] = caller
				if c.hasToken {
					next.byToken[c.token] = caller
				}
				if c.Identity != "" {
					next.byIdentity[c.Identity] = caller
				}
			}
			if old := a.table.Swap(next); old != nil {
				close(old.replaced)
			}
			a.credentials.Set(float64(len(t.all)))
			a.reloads.WithLabelValues("ok").Inc()
			return nil
		}
	}
	a.reloads.WithLabelValues("error").Inc()
	return fmt.Errorf("--credentials-file %s: %w", a.opts.CredentialsFile, err)
}

// caller binds a credential to its usage (kept by name) with the limits it has now.
func (a *Authenticator) caller(c *Credential) *Caller {
	routeRate, tokenRate, eventRate, streams := a.opts.RouteRateLimit, a.opts.RouteTokenRate, a.opts.EventRateLimit, a.opts.MaxPublishStreams
	if c.RouteRateLimit != nil {
		routeRate = *c.RouteRateLimit
	}
	if c.RouteTokenRate != nil {
		tokenRate = *c.RouteTokenRate
	}
	if c.EventRateLimit != nil {
		eventRate = *c.EventRateLimit
	}
	if c.MaxPublishStreams != nil {
		streams = *c.MaxPublishStreams
	}
	booked := a.opts.MaxBookedBlocks
	if c.MaxBookedBlocks != nil {
		booked = *c.MaxBookedBlocks
	}
	now := a.opts.Clock.Now()
	// A second's worth of calls may come at once; an event bucket holds at least one whole message.
	routeBurst, eventBurst := routeRate, max(eventRate, float64(a.opts.EventBurst))
	tokenBurst := max(tokenRate, float64(a.opts.RouteTokenBurst))
	a.mu.Lock()
	defer a.mu.Unlock()
	u := a.usage[c.Name]
	if u == nil {
		u = &usage{route: newBucket(routeRate, routeBurst, now), routeTokens: newBucket(tokenRate, tokenBurst, now), events: newBucket(eventRate, eventBurst, now)}
		a.usage[c.Name] = u
	} else {
		u.route.set(routeRate, routeBurst, now)
		u.routeTokens.set(tokenRate, tokenBurst, now)
		u.events.set(eventRate, eventBurst, now)
	}
	return &Caller{Credential: c, use: u, maxStreams: streams, maxBooked: booked, a: a}
}

type callerKey struct{}

// FromContext returns the call's Caller; nil when no Authenticator checked the call (or the
// service is open to callers without credentials).
func FromContext(ctx context.Context) *Caller {
	c, _ := ctx.Value(callerKey{}).(*Caller)
	return c
}

// tappedKey marks a call's context as admitted by TapHandle (its value: the Caller, nil for an
// open service).
type tappedKey struct{}

// TapHandle admits a call on its headers alone, before the server reads, decompresses or decodes
// any of its messages: it authenticates the caller, checks the role the service needs, and takes
// a Route call from the credential's rate. A refused call costs the router its headers and
// nothing more (a message body it sends after is discarded unread): without it, a caller without
// credentials could make the router decompress and decode message after message, to be refused
// only then. Install it with grpc.InTapHandle; the interceptors then find the call admitted and
// check nothing again. It runs on the connection's reader goroutine, so it does only lookups.
func (a *Authenticator) TapHandle() tap.ServerInHandle {
	return func(ctx context.Context, info *tap.Info) (context.Context, error) {
		c, err := a.admit(ctx, info.FullMethodName)
		if err != nil {
			return ctx, err
		}
		return context.WithValue(ctx, tappedKey{}, c), nil
	}
}

// admitted returns the Caller TapHandle admitted the call as (nil for an open service), and
// whether it ran.
func admitted(ctx context.Context) (*Caller, bool) {
	c, ok := ctx.Value(tappedKey{}).(*Caller)
	return c, ok
}

// admit authenticates a call to method, checks its role, and takes a Route call from the
// credential's rate: the Caller (nil for an open service), or the status refusing the call.
func (a *Authenticator) admit(ctx context.Context, method string) (*Caller, error) {
	c, err := a.check(ctx, method)
	if err != nil {
		a.logRefusal(ctx, method, err)
		return nil, err
	}
	if c == nil {
		return nil, nil
	}
	if method == a.opts.RouteMethod && c.use.route.limited.Load() {
		if wait, ok := c.use.route.take(1, a.opts.Clock.Now(), 0); !ok {
			a.limited.WithLabelValues(c.Name, "route").Inc()
			return nil, exhausted(wait, "credential %q is over its Route rate limit (%g calls/s); retry in %v", c.Name, c.use.route.rate, wait.Round(time.Millisecond))
		}
	}
	return c, nil
}

// refusalLogEvery is the least time between two log lines about refused calls: a flood of calls
// without credentials must not flood the log (kvrouter_auth_failures_total counts every one).
const refusalLogEvery = time.Second

// logRefusal logs a refused call, at most one line every refusalLogEvery, saying how many were
// refused since the last line.
func (a *Authenticator) logRefusal(ctx context.Context, method string, err error) {
	a.refusals.Lock()
	now := a.opts.Clock.Now()
	if now.Sub(a.refusals.logged) < refusalLogEvery {
		a.refusals.unlogged++
		a.refusals.Unlock()
		return
	}
	unlogged := a.refusals.unlogged
	a.refusals.logged, a.refusals.unlogged = now, 0
	a.refusals.Unlock()
	addr := ""
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		addr = p.Addr.String()
	}
	st := status.Convert(err)
	a.opts.Logger.Info("refused a call", "method", method, "peer", addr, "code", st.Code().String(), "error", st.Message(),
		"refused_since_last_line", unlogged)
}

// UnaryServerInterceptor checks unary calls that TapHandle did not admit already.
func (a *Authenticator) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		c, tapped := admitted(ctx)
		if !tapped {
			var err error
			if c, err = a.admit(ctx, info.FullMethod); err != nil {
				return nil, err
			}
		}
		if c == nil {
			return handler(ctx, req)
		}
		return handler(context.WithValue(ctx, callerKey{}, c), req)
	}
}

// StreamServerInterceptor checks streams that TapHandle did not admit already, and bounds each
// credential's concurrent Publish streams.
func (a *Authenticator) StreamServerInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		c, tapped := admitted(ss.Context())
		if !tapped {
			var err error
			if c, err = a.admit(ss.Context(), info.FullMethod); err != nil {
				return err
			}
		}
		if c == nil {
			return handler(srv, ss)
		}
		if info.FullMethod == a.opts.PublishMethod {
			n := c.use.streams.Add(1)
			defer c.use.streams.Add(-1)
			if n > int64(c.maxStreams) {
				a.limited.WithLabelValues(c.Name, "publish_streams").Inc()
				return status.Errorf(codes.ResourceExhausted, "credential %q holds %d Publish streams, the most it may (max_publish_streams %d); close one first", c.Name, n-1, c.maxStreams)
			}
		}
		return handler(srv, &callerStream{ServerStream: ss, ctx: context.WithValue(ss.Context(), callerKey{}, c)})
	}
}

// callerStream carries the Caller in the stream's context.
type callerStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *callerStream) Context() context.Context { return s.ctx }

// check authenticates a call to method and checks its role: the Caller (nil for an open service),
// or the status refusing the call.
func (a *Authenticator) check(ctx context.Context, method string) (*Caller, error) {
	service := serviceOf(method)
	t := a.table.Load()
	if t.anonymous != nil {
		return t.anonymous, nil
	}
	if a.open[service] {
		return nil, nil
	}
	c, err := t.authenticate(ctx)
	if err != nil {
		a.failures.WithLabelValues("unauthenticated", err.reason).Inc()
		return nil, status.Error(codes.Unauthenticated, err.msg)
	}
	if a.any[service] {
		return c, nil
	}
	need, ok := a.opts.Services[service]
	if !ok {
		need = RoleAdmin
	}
	if c.Roles&need == 0 {
		a.failures.WithLabelValues("permission_denied", "role").Inc()
		return nil, status.Errorf(codes.PermissionDenied, "credential %q (role %v) may not call %s: it needs role %v", c.Name, c.Roles, method, need)
	}
	return c, nil
}

// authError is why a call is not authenticated: a message for the caller, a reason for the metric.
type authError struct{ msg, reason string }

// authenticate finds the call's credential: its bearer token if it sends one (a wrong token is
// refused even with a good certificate, so a mistake never passes silently), else its verified
// client certificate's identities, URI SANs first.
func (t *callers) authenticate(ctx context.Context) (*Caller, *authError) {
	if vals := metadata.ValueFromIncomingContext(ctx, "authorization"); len(vals) > 0 {
		if len(vals) > 1 {
			return nil, &authError{"more than one authorization metadata entry; send one", "malformed"}
		}
		scheme, token, ok := strings.Cut(vals[0], " ")
		if !ok || !strings.EqualFold(scheme, "bearer") || strings.TrimSpace(token) == "" {
			return nil, &authError{"authorization metadata must be \"Bearer <token>\"", "malformed"}
		}
		if c := t.byToken[sha256.Sum256([]byte(strings.TrimSpace(token)))]; c != nil {
			return c, nil
		}
		return nil, &authError{"invalid bearer token: it is not in the credentials file (revoked, mistyped, or for another router)", "bad_token"}
	}
	if p, ok := peer.FromContext(ctx); ok {
		if tlsInfo, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(tlsInfo.State.VerifiedChains) > 0 {
			leaf := tlsInfo.State.VerifiedChains[0][0]
			var ids []string
			for _, u := range leaf.URIs {
				ids = append(ids, u.String())
			}
			for _, id := range ids {
				if c := t.byIdentity[id]; c != nil {
					return c, nil
				}
			}
			// A DNS SAN matches a DNS identity only: one spelled like a URI identity
			// ("spiffe://fleet/fe", which a CA checking DNS names would not sign, but a lax one
			// might) must not pass for it.
			for _, name := range leaf.DNSNames {
				ids = append(ids, name)
				if c := t.byIdentity[name]; c != nil && !strings.Contains(name, "://") {
					return c, nil
				}
			}
			return nil, &authError{fmt.Sprintf("client certificate identities %q match no credential in the credentials file", ids), "unknown_identity"}
		}
	}
	return nil, &authError{"no credentials: send the metadata \"authorization: Bearer <token>\" or a client certificate", "no_credentials"}
}

// serviceOf is the service of a full method name, /pkg.Service/Method.
func serviceOf(method string) string {
	s := strings.TrimPrefix(method, "/")
	if i := strings.LastIndexByte(s, '/'); i >= 0 {
		return s[:i]
	}
	return s
}

// Replaced returns a channel closed when the credentials file in force is replaced by a reload
// (never, without a file); a long-lived stream then checks its caller again (MayStillPublishFor).
// A nil Caller's is nil: it never closes.
func (c *Caller) Replaced() <-chan struct{} {
	if c == nil {
		return nil
	}
	return c.a.table.Load().replaced
}

// MayStillPublishFor checks, against the credentials file in force now, that the caller's credential
// (by name) is still there and may still publish for the worker and model: UNAUTHENTICATED when it
// was removed, PERMISSION_DENIED when its role or scope no longer covers the worker. A Publish
// stream asks it after each reload, so that a revoked credential's open stream ends at once
// rather than at its connection's maximum age (before: up to 30 minutes of acked events). A
// credential kept under its name with a rotated token keeps its open streams, as a rotated
// certificate keeps open connections. A nil Caller may.
func (c *Caller) MayStillPublishFor(worker uint64, model string) error {
	if c == nil {
		return nil
	}
	t := c.a.table.Load()
	if t.anonymous != nil {
		return nil
	}
	now := t.byName[c.Name]
	if now == nil {
		c.a.failures.WithLabelValues("unauthenticated", "revoked").Inc()
		return status.Errorf(codes.Unauthenticated, "credential %q was removed from the credentials file: this stream ends", c.Name)
	}
	return now.MayPublishFor(worker, model)
}

// MayPublishFor checks that the caller may publish for the worker and model (a worker credential's
// worker ids and models): PERMISSION_DENIED otherwise. A nil Caller (no Authenticator) may.
func (c *Caller) MayPublishFor(worker uint64, model string) error {
	if c == nil {
		return nil
	}
	if c.Roles&RoleWorker == 0 {
		return status.Errorf(codes.PermissionDenied, "credential %q (role %v) may not publish: it needs role worker", c.Name, c.Roles)
	}
	if err := c.Credential.MayPublishFor(worker, model); err != nil {
		c.a.failures.WithLabelValues("permission_denied", "worker_scope").Inc()
		return status.Error(codes.PermissionDenied, err.Error())
	}
	return nil
}

// Bookings names the owner of the caller's bookings and the most block keys they may hold
// together (0: no bound), for the dispatcher to check before it books (app.BookingCap). A nil
// Caller and Anonymous (no credentials file: every caller is one) own nothing, so only the bound
// on all bookings applies to them.
func (c *Caller) Bookings() (owner string, maxBlocks int) {
	if c == nil || c.Name == Anonymous && (c.a == nil || c.a.opts.CredentialsFile == "") {
		return "", 0
	}
	return c.Name, c.maxBooked
}

// TakeRouteTokens counts the n prompt tokens of a Route to be booked against the caller's token
// rate: a booking pins its prompt's blocks on every replica until it is freed or expires, and the
// call rate alone would let one caller pin a million tokens a call. Over the rate it refuses with
// RESOURCE_EXHAUSTED carrying RetryInfo, taking nothing. A nil Caller is not limited.
func (c *Caller) TakeRouteTokens(n int) error {
	if c == nil || n == 0 {
		return nil
	}
	if wait, ok := c.use.routeTokens.take(float64(n), c.a.opts.Clock.Now(), 0); !ok {
		c.a.limited.WithLabelValues(c.Name, "route_tokens").Inc()
		return exhausted(wait, "credential %q is over its booked prompt token rate limit (%g tokens/s); retry in %v", c.Name, c.use.routeTokens.rate, wait.Round(time.Millisecond))
	}
	return nil
}

// TakeEvents counts n event blocks against the caller's event rate: it returns at once under the
// rate, waits (up to MaxEventWait) a little over it, and past that refuses with RESOURCE_EXHAUSTED
// carrying RetryInfo. A nil Caller is not limited.
func (c *Caller) TakeEvents(ctx context.Context, n int) error {
	if c == nil || n == 0 {
		return nil
	}
	wait, ok := c.use.events.take(float64(n), c.a.opts.Clock.Now(), MaxEventWait)
	if !ok {
		c.a.limited.WithLabelValues(c.Name, "events").Inc()
		return exhausted(wait, "credential %q is over its KV event rate limit (%g blocks/s); retry in %v", c.Name, c.use.events.rate, wait.Round(time.Millisecond))
	}
	if wait == 0 {
		return nil
	}
	c.a.limited.WithLabelValues(c.Name, "events_slowed").Inc()
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return status.FromContextError(ctx.Err()).Err()
	}
}

// exhausted is RESOURCE_EXHAUSTED with a RetryInfo saying when to try again.
func exhausted(retry time.Duration, format string, args ...any) error {
	st := status.Newf(codes.ResourceExhausted, format, args...)
	if withInfo, err := st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(retry)}); err == nil {
		st = withInfo
	}
	return st.Err()
}
