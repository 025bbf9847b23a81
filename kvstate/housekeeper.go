package kvstate

import (
	"context"
	"log/slog"
	"time"
)

// Housekeeper turns the passing of time into changes: it removes workers whose streams stayed closed
// past the grace period, expires bookings nobody freed, and forgets expired session bindings. It only appends changes to the log, so
// every replica applies the same removals, whichever replica noticed first.
type Housekeeper struct {
	State *State
	Log   Log
	// Presence is this replica's streams: the workers whose streams closed here are its to remove.
	Presence *Presence
	// Grace is how long a worker may stay disconnected before it is removed with its blocks.
	Grace time.Duration
	// BookingExpiry is how long a booking lives if nobody frees it (Dynamo: 300 s).
	BookingExpiry time.Duration
	// Now returns the current time; tests replace it.
	Now func() time.Time
	// Logger receives removals and expiries; nil means slog.Default().
	Logger *slog.Logger
}

func (h *Housekeeper) logger() *slog.Logger {
	if h.Logger == nil {
		return slog.Default()
	}
	return h.Logger
}

// Sweep performs one round: it removes expired workers and bookings as of now.
func (h *Housekeeper) Sweep(ctx context.Context) {
	now := h.Now()
	for key, d := range h.Presence.Disconnections() {
		if now.Sub(time.Unix(0, d.Since)) < h.Grace {
			continue
		}
		res, err := h.Log.Append(ctx, WorkerRemoved{Key: key, Epoch: d.Epoch})
		if err != nil {
			h.logger().Warn("removing disconnected worker failed", "worker", key, "err", err)
			continue
		}
		// Removed, or skipped because a newer stream (here or elsewhere) holds the rank: either
		// way this replica owes nothing more for that close.
		h.Presence.Forget(key, d)
		if !res.Skipped {
			h.logger().Info("removed worker after grace period", "worker", key, "grace", h.Grace)
		}
	}
	if oldest, ok := h.State.oldestSessionExpiry(); ok && oldest < now.UnixNano() {
		if _, err := h.Log.Append(ctx, SessionsExpired{Before: now.UnixNano()}); err != nil {
			h.logger().Warn("expiring session bindings failed", "err", err)
		}
	}
	before := now.Add(-h.BookingExpiry).UnixNano()
	if oldest, ok := h.State.Load().oldest(); ok && oldest < before {
		res, err := h.Log.Append(ctx, BookingsExpired{Before: before})
		if err != nil {
			h.logger().Warn("expiring bookings failed", "err", err)
		} else if res.Expired > 0 {
			h.logger().Warn("expired bookings that were never freed", "count", res.Expired, "expiry", h.BookingExpiry)
		}
	}
}

// Run sweeps every interval until ctx ends.
func (h *Housekeeper) Run(ctx context.Context, interval time.Duration) { Every(ctx, interval, h.Sweep) }

// Every calls f every interval until ctx ends: the sweeps of the housekeeper and of every log
// backend's leases run on it.
func Every(ctx context.Context, interval time.Duration, f func(context.Context)) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f(ctx)
		}
	}
}
