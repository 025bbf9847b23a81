package kvstate

import "context"

// Liveness keeps workers alive while a replica holds their stream. When the holder lets go (the
// stream ended) or dies, the worker is removed after a grace period, by whichever replica notices.
type Liveness interface {
	// Hold marks the worker rank at this registration epoch as alive until release is called. ctx
	// is the holder's (a Publish stream's); the lease outlives it by the grace period.
	Hold(ctx context.Context, key WorkerKey, epoch uint64) (release func())
}

// LocalLiveness is the embedded mode's liveness: the Housekeeper removes workers whose streams on
// this (only) replica stayed closed past the grace period, so holding needs no bookkeeping here.
type LocalLiveness struct{}

// Hold does nothing: State.Connected and State.Disconnected track streams.
func (LocalLiveness) Hold(context.Context, WorkerKey, uint64) func() { return func() {} }
