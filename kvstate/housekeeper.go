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
	// Shards are the shards to keep (a log sharded by model); nil means the one of State and Log.
	Shards ShardSource
	State  *State
	Log    Log
	// Presence is this replica's streams: the workers whose streams closed here are its to remove.
	Presence *Presence
	// Grace is how long a worker may stay disconnected before it is removed with its blocks.
	Grace time.Duration
	// BookingExpiry is how long a booking lives if nobody frees it (Dynamo: 300 s).
	BookingExpiry time.Duration
	// Clock tells the time of sweeps; nil: SystemClock.
	Clock Clock
	// Logger receives removals and expiries; nil means slog.Default().
	Logger *slog.Logger
}

func (h *Housekeeper) logger() *slog.Logger {
	if h.Logger == nil {
		return slog.Default()
	}
	return h.Logger
}

// Sweep performs one round: it removes expired workers and bookings as of now, in every shard.
func (h *Housekeeper) Sweep(ctx context.Context) {
	now := ClockOr(h.Clock).Now()
	shards := []*Shard{{State: h.State, Log: h.Log}}
	if h.Shards != nil {
		shards = h.Shards.Shards()
	}
	for key, d := range h.Presence.Disconnections() {
		if now.Sub(time.Unix(0, d.Since)) < h.Grace {
			continue
		}
		if h.removeWorker(ctx, shards, key, d) {
			// Removed, or skipped because a newer stream (here or elsewhere) holds the rank:
			// either way this replica owes nothing more for that close.
			h.Presence.Forget(key, d)
		}
	}
	for _, sh := range shards {
		h.expire(ctx, sh, now)
	}
}

// removeWorker removes the worker of a stream closed here past the grace period, from the shard
// holding it (a stream registers in its model's shard only). One shard holds every worker, so it
// is asked even when its state no longer holds this one (the removal is then skipped). It reports
// whether every removal was appended.
func (h *Housekeeper) removeWorker(ctx context.Context, shards []*Shard, key WorkerKey, d Disconnection) bool {
	done := true
	for _, sh := range shards {
		w := sh.State.Worker(key)
		if len(shards) > 1 && w == nil {
			continue
		}
		// The worker's own model, as "worker connected" logged it: a shard serving every model
		// has none of its own.
		model := sh.Model
		if w != nil {
			model = w.Info.Model
		}
		res, err := sh.Log.Append(ctx, WorkerRemoved{Key: key, Epoch: d.Epoch})
		if err != nil {
			h.logger().Warn("removing disconnected worker failed", "worker", key.String(), "model", model, "err", err)
			done = false
			continue
		}
		if !res.Skipped {
			h.logger().Info("removed worker after grace period", "worker", key.String(), "model", model, "grace", h.Grace)
		}
	}
	return done
}

// expire forgets sh's expired session bindings and ends its bookings past the expiry.
func (h *Housekeeper) expire(ctx context.Context, sh *Shard, now time.Time) {
	if oldest, ok := sh.State.oldestSessionExpiry(); ok && oldest < now.UnixNano() {
		if _, err := sh.Log.Append(ctx, SessionsExpired{Before: now.UnixNano()}); err != nil {
			h.logger().Warn("expiring session bindings failed", "model", sh.Model, "err", err)
		}
	}
	before := now.Add(-h.BookingExpiry).UnixNano()
	if oldest, ok := sh.State.Load().oldest(); ok && oldest < before {
		res, err := sh.Log.Append(ctx, BookingsExpired{Before: before})
		if err != nil {
			h.logger().Warn("expiring bookings failed", "model", sh.Model, "err", err)
		} else if res.Expired > 0 {
			h.logger().Warn("expired bookings that were never freed", "count", res.Expired, "model", sh.Model, "expiry", h.BookingExpiry)
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
