// Package kvclient is kvrouter's Go client. Router is a frontend's side: it routes requests and makes
// sure every booking it made is freed. Hashing a worker's blocks the way the router does is
// kvstate/blockhash, which imports nothing else of the router.
package kvclient

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	mrand "math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// Defaults of RouterOptions, the server's own limits.
const (
	DefaultMaxPromptTokens = 1 << 20
	maxRequestIDBytes      = 512
	maxMultimodalObjects   = 256 // the router's bound on a prompt's multimodal inputs
	defaultEndTimeout      = 5 * time.Second
	defaultEndRetryFor     = 5 * time.Minute
	defaultMaxPendingEnds  = 100_000
)

// RouterOptions tune a Router. The zero value is usable.
type RouterOptions struct {
	// MaxPromptTokens refuses longer prompts before sending them, as the server's max_prompt_tokens
	// would; 0 means DefaultMaxPromptTokens.
	MaxPromptTokens int
	// EndTimeout bounds the Free a Router sends on its own: for a Route whose context ended while the
	// call was in flight, and for Do's booking when the caller's context has ended. 0 means 5 s.
	EndTimeout time.Duration
	// EndRetryFor is how long a Free or PrefillComplete the router could not accept yet
	// (UNAVAILABLE: its shared state is being re-established, or the replica that holds the booking
	// has not published it) is retried in the background once the caller's context has ended,
	// counted from the call: the booking would otherwise load its workers until the router expires
	// it. 0 means 5 minutes (the router's booking_expiry default); negative: no retry in the
	// background.
	EndRetryFor time.Duration
	// MaxPendingEnds bounds the ends retried in the background at once; past it an end that
	// cannot be made is given up (its booking expires on the router). 0 means 100,000.
	MaxPendingEnds int
}

// Router routes requests through kvrouter's RouterService. It is safe for concurrent use. Close it
// to stop the ends it retries in the background.
type Router struct {
	client kvrouterv1.RouterServiceClient
	opts   RouterOptions

	// Ends retried in the background (retryEnd), until bg ends (Close).
	bg        context.Context
	stop      context.CancelFunc
	pending   sync.WaitGroup
	npend     atomic.Int64 // ends retried in the background now
	abandoned atomic.Int64 // ends given up at Close
}

// NewRouter returns a Router calling cc.
func NewRouter(cc grpc.ClientConnInterface, opts RouterOptions) *Router {
	if opts.MaxPromptTokens <= 0 {
		opts.MaxPromptTokens = DefaultMaxPromptTokens
	}
	if opts.EndTimeout <= 0 {
		opts.EndTimeout = defaultEndTimeout
	}
	if opts.EndRetryFor == 0 {
		opts.EndRetryFor = defaultEndRetryFor
	}
	if opts.MaxPendingEnds <= 0 {
		opts.MaxPendingEnds = defaultMaxPendingEnds
	}
	bg, stop := context.WithCancel(context.Background())
	return &Router{client: kvrouterv1.NewRouterServiceClient(cc), opts: opts, bg: bg, stop: stop}
}

// Close stops retrying ends in the background, and returns how many it gave up (their bookings
// expire on the router).
func (r *Router) Close() int {
	r.stop()
	r.pending.Wait()
	return int(r.abandoned.Load())
}

// PendingEnds returns how many Free and PrefillComplete calls are being retried in the background.
func (r *Router) PendingEnds() int { return int(r.npend.Load()) }

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
	resp, err := r.route(ctx, req)
	if err != nil {
		if !req.GetQueryOnly() && ctx.Err() != nil {
			r.endDetached(ctx, req.GetRequestId())
		}
		return nil, err
	}
	return &Booking{RouteResponse: resp, RequestID: req.GetRequestId(), router: r, ended: req.GetQueryOnly(), at: time.Now()}, nil
}

// Existing returns the Booking of a request routed elsewhere (by another Router, or another
// process: the request id is all it takes), for this Router to end: its PrefillComplete and Free
// behave as those of a Booking that Route returned, retried from now on.
func (r *Router) Existing(requestID string) *Booking {
	return &Booking{RouteResponse: &kvrouterv1.RouteResponse{}, RequestID: requestID, router: r, at: time.Now()}
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

// route calls Route, and calls it again while the router answers that its shared state is not
// ready to route from (UNAVAILABLE with reason LOG_UNAVAILABLE: it is loading or re-establishing
// it, and booked nothing), after the delay it suggests, until ctx ends.
func (r *Router) route(ctx context.Context, req *kvrouterv1.RouteRequest) (*kvrouterv1.RouteResponse, error) {
	for attempt := 0; ; attempt++ {
		resp, err := r.client.Route(ctx, req)
		if err == nil || !logUnavailable(err) {
			return resp, err
		}
		if !sleep(ctx, retryAfter(err, attempt)) {
			return nil, err
		}
	}
}

// check refuses, before sending, what the server would refuse, with its message.
func (r *Router) check(req *kvrouterv1.RouteRequest) error {
	if id := req.GetRequestId(); len(id) > maxRequestIDBytes {
		return invalidArgument("request_id", fmt.Sprintf("must be at most %d bytes (got %d)", maxRequestIDBytes, len(id)))
	}
	if req.GetModel() == "" {
		return invalidArgument("model", "must not be empty")
	}
	if req.GetBlockSize() != 0 { // hashed (HashPrompt): the router checks the hashes' fields
		if n := int(req.GetPromptTokens()); n > r.opts.MaxPromptTokens {
			return invalidArgument("prompt_tokens", fmt.Sprintf("is %d, more than the maximum of %d (max_prompt_tokens)", n, r.opts.MaxPromptTokens))
		}
		return nil
	}
	switch n := len(req.GetTokenIds()); {
	case n == 0:
		return invalidArgument("token_ids", "must not be empty")
	case n > r.opts.MaxPromptTokens:
		return invalidArgument("token_ids", fmt.Sprintf("has %d tokens, more than the maximum of %d (max_prompt_tokens)", n, r.opts.MaxPromptTokens))
	}
	return nil
}

// HashPrompt keys req's prompt as the router would for blocks of blockSize tokens (the model's
// block size, as its workers registered it), and sends the keys instead of the prompt: it sets
// block_hashes, block_size and prompt_tokens, and clears token_ids, lora_name, cache_namespace and
// multimodal_objects, which the hashes then hold. The router answers such a request as it would
// the token ids, without decoding or hashing them; see docs/clients.md for when that pays. A
// prompt the router would refuse (no tokens, more than 256 multimodal inputs, one outside the
// prompt or overlapping another) is refused here with the router's field and rule, and req is left
// as it was.
func HashPrompt(req *kvrouterv1.RouteRequest, blockSize int) error {
	switch {
	case blockSize <= 0:
		return invalidArgument("block_size", fmt.Sprintf("must be at least 1 (got %d)", blockSize))
	case uint64(blockSize) > math.MaxUint32:
		return invalidArgument("block_size", fmt.Sprintf("must be a uint32 (got %d)", blockSize))
	}
	tokens := req.GetTokenIds()
	if len(tokens) == 0 {
		return invalidArgument("token_ids", "must not be empty")
	}
	objects, err := multimodalObjects(req.GetMultimodalObjects(), len(tokens))
	if err != nil {
		return err
	}
	salt := blockhash.Salt(req.GetLoraName(), req.GetCacheNamespace())
	req.BlockHashes = blockhash.LocalsMultimodal(req.BlockHashes[:0], tokens, blockSize, salt, objects)
	req.BlockSize, req.PromptTokens = uint32(blockSize), uint32(len(tokens))
	req.TokenIds, req.LoraName, req.CacheNamespace, req.MultimodalObjects = nil, "", "", nil
	return nil
}

// multimodalObjects checks a prompt's multimodal inputs against its n token ids with the router's
// rules and messages, and returns them sorted by their first token.
func multimodalObjects(in []*kvrouterv1.MultimodalObject, n int) ([]blockhash.MultimodalObject, error) {
	if len(in) > maxMultimodalObjects {
		return nil, invalidArgument("multimodal_objects", fmt.Sprintf("must hold at most %d inputs (got %d)", maxMultimodalObjects, len(in)))
	}
	type indexed struct {
		blockhash.MultimodalObject
		i int
	}
	objs := make([]indexed, len(in))
	for i, o := range in {
		field := fmt.Sprintf("multimodal_objects[%d]", i)
		switch {
		case o.GetEnd() <= o.GetStart():
			return nil, invalidArgument(field+".end", fmt.Sprintf("must be greater than start %d (got %d)", o.GetStart(), o.GetEnd()))
		case int64(o.GetEnd()) > int64(n):
			return nil, invalidArgument(field+".end", fmt.Sprintf("must be at most the number of token_ids %d (got %d)", n, o.GetEnd()))
		}
		objs[i] = indexed{blockhash.MultimodalObject{Hash: o.GetMmHash(), Start: o.GetStart(), End: o.GetEnd()}, i}
	}
	slices.SortFunc(objs, func(a, b indexed) int { return cmp.Compare(a.Start, b.Start) })
	out := make([]blockhash.MultimodalObject, len(objs))
	for k, o := range objs {
		if k > 0 && objs[k-1].End > o.Start {
			p := objs[k-1]
			return nil, invalidArgument(fmt.Sprintf("multimodal_objects[%d]", o.i),
				fmt.Sprintf("tokens [%d, %d) overlap those of multimodal_objects[%d], [%d, %d)", o.Start, o.End, p.i, p.Start, p.End))
		}
		out[k] = o.MultimodalObject
	}
	return out, nil
}

// endDetached frees id with a context of its own (ctx has ended), accepting that nothing was booked.
func (r *Router) endDetached(ctx context.Context, id string) {
	freeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.opts.EndTimeout)
	defer cancel()
	_ = r.end(freeCtx, id, true, time.Now())
}

// end sends a Free (or a MarkPrefillComplete) for id, and sends it again while the router cannot
// accept it yet (UNAVAILABLE: it may not see the booking, which another replica holds and has not
// published, or its shared state is being re-established), after the delay it suggests, until ctx
// ends; then it goes on in the background until EndRetryFor after since. NOT_FOUND (the booking
// expired, or ended through another caller) counts as done.
func (r *Router) end(ctx context.Context, id string, free bool, since time.Time) error {
	call := func(ctx context.Context) error {
		var err error
		if free {
			_, err = r.client.Free(ctx, &kvrouterv1.FreeRequest{RequestId: id})
		} else {
			_, err = r.client.MarkPrefillComplete(ctx, &kvrouterv1.MarkPrefillCompleteRequest{RequestId: id})
		}
		return gone(err)
	}
	for attempt := 0; ; attempt++ {
		err := call(ctx)
		if !retryableEnd(err) {
			return err
		}
		if !sleep(ctx, retryAfter(err, attempt)) {
			r.retryEnd(call, since)
			return err
		}
	}
}

// retryEnd keeps calling an end the router could not accept, in the background, until it is
// accepted, EndRetryFor after since, or Close.
func (r *Router) retryEnd(call func(context.Context) error, since time.Time) {
	if r.opts.EndRetryFor < 0 || r.bg.Err() != nil {
		return
	}
	if r.npend.Add(1) > int64(r.opts.MaxPendingEnds) {
		r.npend.Add(-1)
		return
	}
	ctx, cancel := context.WithDeadline(r.bg, since.Add(r.opts.EndRetryFor))
	r.pending.Go(func() {
		defer cancel()
		defer r.npend.Add(-1)
		for attempt := 0; ; attempt++ {
			cctx, ccancel := context.WithTimeout(ctx, r.opts.EndTimeout)
			err := call(cctx)
			ccancel()
			if !retryableEnd(err) {
				return
			}
			if !sleep(ctx, retryAfter(err, attempt)) {
				if r.bg.Err() != nil {
					r.abandoned.Add(1)
				}
				return
			}
		}
	})
}

// retryableEnd reports whether an end failed in a way worth another try: the router could not tell
// where the booking is yet, or could not be reached.
func retryableEnd(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted:
		return true
	}
	return false
}

// logUnavailable reports whether err is the router's LOG_UNAVAILABLE: its shared state cannot
// answer yet, and the call changed nothing.
func logUnavailable(err error) bool {
	st := status.Convert(err)
	if st.Code() != codes.Unavailable {
		return false
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetReason() == "LOG_UNAVAILABLE" {
			return true
		}
	}
	return false
}

// retryAfter returns how long to wait before attempt+1: what the router's RetryInfo suggests, or
// 100 ms doubling per attempt, at most 2 s, with jitter.
func retryAfter(err error, attempt int) time.Duration {
	d := 100 * time.Millisecond << min(attempt, 5)
	for _, det := range status.Convert(err).Details() {
		if ri, ok := det.(*errdetails.RetryInfo); ok {
			d = max(ri.GetRetryDelay().AsDuration(), d/2)
		}
	}
	d = min(d, 2*time.Second)
	return d/2 + time.Duration(mrand.Int64N(int64(d/2)+1))
}

// sleep waits d, or until ctx ends (false).
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
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
	at                 time.Time // when it was routed: background retries of its ends stop EndRetryFor after
}

// PrefillComplete tells the router the request's remote prefill finished: its prefill worker no
// longer carries the prompt. After Free, or once it succeeded, it does nothing. While the router
// cannot accept it yet (UNAVAILABLE) it is sent again until ctx ends, then in the background (see
// RouterOptions.EndRetryFor), and its error is returned.
func (b *Booking) PrefillComplete(ctx context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.prefillDone || b.ended {
		return nil
	}
	if err := b.router.end(ctx, b.RequestID, false, b.at); err != nil {
		return err
	}
	b.prefillDone = true
	return nil
}

// Free ends the booking on every worker. Once it succeeded it does nothing; a booking the router no
// longer holds (it expired) counts as freed. While the router cannot accept it yet (UNAVAILABLE: a
// replica that cannot see the booking, which another holds and has not published) it is sent again
// until ctx ends, then in the background (see RouterOptions.EndRetryFor), and its error is
// returned: the booking is freed once the router accepts it.
func (b *Booking) Free(ctx context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ended {
		return nil
	}
	if err := b.router.end(ctx, b.RequestID, true, b.at); err != nil {
		if retryableEnd(err) && b.router.opts.EndRetryFor >= 0 {
			b.ended = true // the background retry owns it now
		}
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
