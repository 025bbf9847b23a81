package server

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
)

// limitListener holds at most cap(slots) connections at once. A connection accepted past the cap
// is closed at once, and counted: held open, idle connections would exhaust the process's file
// descriptors and buffers (18,924 of 20,000 descriptors in a test, before), and waiting in the
// kernel's backlog instead would leave a caller hanging with no answer. A connection's slot frees
// when gRPC closes it. The connections held are registered by remote address (conns), so that one
// whose calls are refused over and over can be cut (cutRefused).
type limitListener struct {
	net.Listener
	slots   chan struct{}
	open    prometheus.Gauge
	refused prometheus.Counter
	conns   *connRegistry
}

// limitConnections returns lis holding at most max connections at once, reporting the open ones in
// open and the refused ones in refused, and registering those it holds in conns.
func limitConnections(lis net.Listener, max int, open prometheus.Gauge, refused prometheus.Counter, conns *connRegistry) net.Listener {
	return &limitListener{Listener: lis, slots: make(chan struct{}, max), open: open, refused: refused, conns: conns}
}

// Accept returns the next connection within the cap, closing those past it.
func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.conns.penalized(c.RemoteAddr(), time.Now()) {
			l.refused.Inc()
			_ = c.Close()
			continue
		}
		select {
		case l.slots <- struct{}{}:
			l.open.Inc()
			lc := &limitedConn{Conn: c}
			key := c.RemoteAddr().String()
			lc.release = sync.OnceFunc(func() {
				l.conns.forget(key, lc)
				<-l.slots
				l.open.Dec()
			})
			l.conns.add(key, lc)
			return lc, nil
		default:
			l.refused.Inc()
			_ = c.Close()
		}
	}
}

// limitedConn gives its slot back once closed, and counts the calls refused on it.
type limitedConn struct {
	net.Conn
	release func()
	// The calls refused in the current second (window: its start, unix ns).
	window, refusals atomic.Int64
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.release()
	return err
}

// refusedOnce counts a refused call at now, and reports whether the connection has had more than
// max in the current second.
func (c *limitedConn) refusedOnce(now time.Time, max int64) bool {
	w := c.window.Load()
	if now.UnixNano()-w > int64(time.Second) && c.window.CompareAndSwap(w, now.UnixNano()) {
		c.refusals.Store(0)
	}
	return c.refusals.Add(1) > max
}

// connRegistry finds a held connection by its remote address, and remembers for cutPenalty the
// hosts whose connections were cut (cutRefused).
type connRegistry struct {
	m sync.Map // string -> *limitedConn

	mu  sync.Mutex
	cut map[string]time.Time // host -> when its connection was cut last
	// penalty overrides cutPenalty when set (nanoseconds; tests).
	penalty atomic.Int64
}

func (r *connRegistry) penaltyTime() time.Duration {
	if p := r.penalty.Load(); p > 0 {
		return time.Duration(p)
	}
	return cutPenalty
}

// cutPenalty is how long a host whose connection was cut for its refused calls has its next
// connections closed at once, before their TLS handshake: a client that floods refused calls, or
// resets each call as it opens it, would otherwise reconnect at once, and each reconnection costs
// the router a handshake, far more than the calls it refuses. A legitimate client reconnects after
// its own backoff (gRPC's first is a second), so it never meets the penalty; behind a NAT or a
// gateway, the hosts sharing the address wait this long at most.
const cutPenalty = 100 * time.Millisecond

// maxCutHosts bounds the hosts remembered: an attacker spreading over many addresses fills it, and
// then a cut host goes unremembered (the connection cap still bounds what they all hold).
const maxCutHosts = 4096

// penalize remembers that host's connection was cut at now.
func (r *connRegistry) penalize(addr net.Addr, now time.Time) {
	host := hostOf(addr)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cut == nil {
		r.cut = make(map[string]time.Time)
	}
	if len(r.cut) >= maxCutHosts {
		for h, at := range r.cut {
			if now.Sub(at) >= r.penaltyTime() {
				delete(r.cut, h)
			}
		}
		if len(r.cut) >= maxCutHosts {
			return
		}
	}
	r.cut[host] = now
}

// penalized reports whether a connection from addr comes within cutPenalty of its host's last cut.
func (r *connRegistry) penalized(addr net.Addr, now time.Time) bool {
	host := hostOf(addr)
	r.mu.Lock()
	defer r.mu.Unlock()
	at, ok := r.cut[host]
	if !ok {
		return false
	}
	if now.Sub(at) >= r.penaltyTime() {
		delete(r.cut, host)
		return false
	}
	return true
}

// hostOf is addr's host, without its port.
func hostOf(addr net.Addr) string {
	if addr == nil {
		return ""
	}
	if host, _, err := net.SplitHostPort(addr.String()); err == nil {
		return host
	}
	return addr.String()
}

func (r *connRegistry) add(key string, c *limitedConn) { r.m.Store(key, c) }

func (r *connRegistry) forget(key string, c *limitedConn) { r.m.CompareAndDelete(key, c) }

func (r *connRegistry) of(ctx context.Context) *limitedConn {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return nil
	}
	if c, ok := r.m.Load(p.Addr.String()); ok {
		return c.(*limitedConn)
	}
	return nil
}

// cutRefused wraps the admission of calls (auth.TapHandle): a connection that gets more than max
// calls refused for their credentials (UNAUTHENTICATED, PERMISSION_DENIED) within a second is
// closed. A client that cancels each call as it opens it (HTTP/2 "rapid reset") or floods calls
// without credentials costs the router a stream's admission each, on the connection's reader
// goroutine, for as long as the connection lives. A legitimate client is refused so only when
// misconfigured, and then a reconnect costs it nothing. A call over its credential's rate
// (RESOURCE_EXHAUSTED, with RetryInfo) does not count: a busy, authenticated client keeps its
// connection.
func cutRefused(admit tap.ServerInHandle, conns *connRegistry, max int64, cut prometheus.Counter) tap.ServerInHandle {
	return func(ctx context.Context, info *tap.Info) (context.Context, error) {
		out, err := admit(ctx, info)
		if code := status.Code(err); code == codes.Unauthenticated || code == codes.PermissionDenied {
			if c := conns.of(ctx); c != nil && c.refusedOnce(time.Now(), max) {
				cut.Inc()
				conns.penalize(c.RemoteAddr(), time.Now())
				_ = c.Close()
			}
		}
		return out, err
	}
}
