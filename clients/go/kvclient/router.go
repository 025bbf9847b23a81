// Package kvclient is kvrouter's Go client. Router is a frontend's side: it routes requests and makes
// sure every booking it made is freed. Hashing a worker's blocks the way the router does is
// kvstate/blockhash, which imports nothing else of the router.
package kvclient

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// Defaults of RouterOptions, the server's own limits.
const (
	DefaultMaxPromptTokens = 1 << 20
	maxRequestIDBytes      = 512
	defaultEndTimeout      = 5 * time.Second
)

// RouterOptions tune a Router. The zero value is usable.
type RouterOptions struct {
	// MaxPromptTokens refuses longer prompts before sending them, as the server's max_prompt_tokens
	// would; 0 means DefaultMaxPromptTokens.
	MaxPromptTokens int
	// EndTimeout bounds the Free a Router sends on its own: for a Route whose context ended while the
	// call was in flight, and for Do's booking when the caller's context has ended. 0 means 5 s.
	EndTimeout time.Duration
}

// Router routes requests through kvrouter's RouterService. It is safe for concurrent use.
type Router struct {
	client kvrouterv1.RouterServiceClient
	opts   RouterOptions
}

// NewRouter returns a Router calling cc.
func NewRouter(cc grpc.ClientConnInterface, opts RouterOptions) *Router {
	if opts.MaxPromptTokens <= 0 {
		opts.MaxPromptTokens = DefaultMaxPromptTokens
	}
	if opts.EndTimeout <= 0 {
		opts.EndTimeout = defaultEndTimeout
	}
	return &Router{client: kvrouterv1.NewRouterServiceClient(cc), opts: opts}
}

// Route asks where req runs. Unless req is query-only, the router books the answer: end the booking
// with Booking.Free (after Booking.PrefillComplete when the request was prefilled remotely), or use
// Do, which always frees. A booking request without request_id gets a random one, written into
// req. A request the server would refuse fails before it is sent, with the server's status and
// message.
//
// When ctx ends while the call is in flight the router may have booked the request already, and
// nobody would learn its answer: Route then frees it (NOT_FOUND, nothing was booked, is fine) before
// it returns ctx's error, so a cancelled request never leaves load behind.
func (r *Router) Route(ctx context.Context, req *kvrouterv1.RouteRequest) (*Booking, error) {
	if !req.GetQueryOnly() && req.GetRequestId() == "" {
		req.RequestId = newRequestID()
	}
	if err := r.check(req); err != nil {
		return nil, err
	}
	resp, err := r.client.Route(ctx, req)
	if err != nil {
		if !req.GetQueryOnly() && ctx.Err() != nil {
			r.endDetached(ctx, req.GetRequestId())
		}
		return nil, err
	}
	return &Booking{RouteResponse: resp, RequestID: req.GetRequestId(), router: r, ended: req.GetQueryOnly()}, nil
}

// Do routes req, calls fn with its booking, and frees the booking when fn returns or panics, also
// when ctx has ended by then. It returns fn's error, or the Free's when fn succeeded.
func (r *Router) Do(ctx context.Context, req *kvrouterv1.RouteRequest, fn func(context.Context, *Booking) error) (err error) {
	b, err := r.Route(ctx, req)
	if err != nil {
		return err
	}
	defer func() {
		freeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.opts.EndTimeout)
		defer cancel()
		if ferr := b.Free(freeCtx); err == nil {
			err = ferr
		}
	}()
	return fn(ctx, b)
}

// check refuses, before sending, what the server would refuse, with its message.
func (r *Router) check(req *kvrouterv1.RouteRequest) error {
	if id := req.GetRequestId(); len(id) > maxRequestIDBytes {
		return invalidArgument("request_id", fmt.Sprintf("must be at most %d bytes (got %d)", maxRequestIDBytes, len(id)))
	}
	if req.GetModel() == "" {
		return invalidArgument("model", "must not be empty")
	}
	switch n := len(req.GetTokenIds()); {
	case n == 0:
		return invalidArgument("token_ids", "must not be empty")
	case n > r.opts.MaxPromptTokens:
		return invalidArgument("token_ids", fmt.Sprintf("has %d tokens, more than the maximum of %d (max_prompt_tokens)", n, r.opts.MaxPromptTokens))
	}
	return nil
}

// endDetached frees id with a context of its own (ctx has ended), accepting that nothing was booked.
func (r *Router) endDetached(ctx context.Context, id string) {
	freeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.opts.EndTimeout)
	defer cancel()
	_, _ = r.client.Free(freeCtx, &kvrouterv1.FreeRequest{RequestId: id})
}

// Booking is a routed request: the router's answer and the load it booked. PrefillComplete and Free
// may be called any number of times, from any goroutine; each reaches the server until it succeeds
// once.
type Booking struct {
	*kvrouterv1.RouteResponse
	RequestID string

	router *Router
	mu     sync.Mutex
	// prefillDone: the prefill part ended; ended: the whole booking ended (or none was made).
	prefillDone, ended bool
}

// PrefillComplete tells the router the request's remote prefill finished: its prefill worker no
// longer carries the prompt. After Free, or once it succeeded, it does nothing.
func (b *Booking) PrefillComplete(ctx context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.prefillDone || b.ended {
		return nil
	}
	_, err := b.router.client.MarkPrefillComplete(ctx, &kvrouterv1.MarkPrefillCompleteRequest{RequestId: b.RequestID})
	if err := gone(err); err != nil {
		return err
	}
	b.prefillDone = true
	return nil
}

// Free ends the booking on every worker. Once it succeeded it does nothing; a booking the router no
// longer holds (it expired) counts as freed.
func (b *Booking) Free(ctx context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ended {
		return nil
	}
	_, err := b.router.client.Free(ctx, &kvrouterv1.FreeRequest{RequestId: b.RequestID})
	if err := gone(err); err != nil {
		return err
	}
	b.ended = true
	return nil
}

// gone treats NOT_FOUND (the booking expired, or ended through another caller) as done.
func gone(err error) error {
	if status.Code(err) == codes.NotFound {
		return nil
	}
	return err
}

func invalidArgument(field, rule string) error {
	return status.Error(codes.InvalidArgument, field+": "+rule)
}

// newRequestID returns 16 random bytes in hex: unique without coordination.
func newRequestID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(errors.Join(errors.New("kvclient: no randomness for a request id"), err))
	}
	return hex.EncodeToString(b[:])
}
