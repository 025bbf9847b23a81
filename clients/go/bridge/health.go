package bridge

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrouter/kvrouter/clients/go/enginefeed"
)

// health is what a rank knows of its engine: up or down, and why down. The watch goroutine sets
// it; the run goroutine waits for it and is told, by the cancellation of its subscription, when the
// engine goes down.
type health struct {
	mu      sync.Mutex
	up      bool
	reason  string
	changed chan struct{} // closed and replaced at every change
	cancel  context.CancelFunc
	// subscribed has a value when a subscription started: the engine is checked at once, so that
	// the worker registers without waiting for the next check.
	subscribed chan struct{}
}

func newHealth() *health {
	return &health{changed: make(chan struct{}), subscribed: make(chan struct{}, 1)}
}

// connected tells the watch that a subscription started.
func (h *health) connected() {
	select {
	case h.subscribed <- struct{}{}:
	default:
	}
}

// set records the engine up or down; going down cancels the running subscription.
func (h *health) set(up bool, reason string) (changed bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.up == up {
		return false
	}
	h.up, h.reason = up, reason
	close(h.changed)
	h.changed = make(chan struct{})
	if !up && h.cancel != nil {
		h.cancel()
	}
	return true
}

// subscribing records the cancel function of the subscription that runs (nil: none runs).
func (h *health) subscribing(cancel context.CancelFunc) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.cancel = cancel
}

func (h *health) isUp() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.up
}

func (h *health) downReason() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.reason
}

// waitUp waits until the engine is up, or ctx ends.
func (h *health) waitUp(ctx context.Context) error {
	for {
		h.mu.Lock()
		up, ch := h.up, h.changed
		h.mu.Unlock()
		if up {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// watch checks the engine every CheckInterval until ctx ends. The engine is up once the rank is
// subscribed to its PUB endpoint and its checks pass, and down once either failed for DownAfter. The checks are the engine's health endpoint
// (HealthURL) and its replay endpoint, asked for batches past any it can hold: a process that is
// gone, hung or stopped answers neither, while a live one answers the replay request with its end
// marker at once.
func (r *rank) watch(ctx context.Context) {
	opts := &r.b.opts
	lastGood := time.Now()
	for {
		err := r.check(ctx)
		if ctx.Err() != nil {
			return
		}
		now, up := time.Now(), r.health.isUp()
		switch {
		case err == nil && r.connected.Load():
			lastGood = now
			if r.health.set(true, "") {
				r.log.Info("the engine is up", "endpoint", r.endpoint)
				r.b.metrics.engineUp.WithLabelValues(r.label).Set(1)
			}
		case up && now.Sub(lastGood) >= opts.DownAfter:
			reason := fmt.Sprintf("not subscribed to the engine's endpoint %s for %v", r.endpoint, opts.DownAfter)
			if err != nil {
				reason = fmt.Sprintf("%v, for %v", err, opts.DownAfter)
			}
			r.health.set(false, reason)
			r.b.metrics.engineUp.WithLabelValues(r.label).Set(0)
		}
		select {
		case <-ctx.Done():
			return
		case <-r.health.subscribed:
		case <-time.After(opts.CheckInterval):
		}
	}
}

// check runs the engine's checks once, each bounded by CheckInterval.
func (r *rank) check(ctx context.Context) error {
	opts := &r.b.opts
	cctx, cancel := context.WithTimeout(ctx, opts.CheckInterval)
	defer cancel()
	if opts.HealthURL != "" {
		req, err := http.NewRequestWithContext(cctx, http.MethodGet, opts.HealthURL, nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return fmt.Errorf("health check %s: %w", opts.HealthURL, unwrapURLError(err))
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		if resp.StatusCode/100 != 2 {
			return fmt.Errorf("health check %s: %s", opts.HealthURL, resp.Status)
		}
	}
	if r.replay != "" {
		if err := r.probeReplay(cctx); err != nil {
			return fmt.Errorf("replay endpoint %s: %w", r.replay, err)
		}
	}
	return nil
}

// probeReplay asks the replay endpoint for the batches from the largest sequence number a signed
// reader takes as positive on: none can be held, so a live engine answers with its end marker alone.
func (r *rank) probeReplay(ctx context.Context) error {
	d := zmq4.NewDealer(ctx, zmq4.WithDialerMaxRetries(0))
	defer d.Close()
	if err := d.Dial(r.replay); err != nil {
		return err
	}
	if err := d.SendMulti(zmq4.NewMsgFrom(enginefeed.ReplayRequest(math.MaxInt64)...)); err != nil {
		return err
	}
	for {
		msg, err := d.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return errors.New("no answer")
			}
			return err
		}
		if _, end, err := enginefeed.ParseReplay(msg.Frames); err != nil || end {
			return err
		}
	}
}

// unwrapURLError drops the method and URL that net/http's errors repeat.
func unwrapURLError(err error) error {
	var uerr interface{ Unwrap() error }
	if errors.As(err, &uerr) {
		if inner := uerr.Unwrap(); inner != nil {
			return inner
		}
	}
	return err
}
