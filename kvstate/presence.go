package kvstate

import "sync"

// Presence is which workers' Publish streams are open on this replica, and since when the others'
// last stream here closed. It is replica-local bookkeeping, not part of the replicated State (whose
// every change is a log entry): each replica knows only its own streams, and the removal a grace
// period after a close is itself a log entry (Housekeeper).
type Presence struct {
	mu    sync.Mutex
	ranks map[WorkerKey]*streamsHere
}

// streamsHere is one worker rank's streams on this replica.
type streamsHere struct {
	open        int
	closedEpoch uint64 // newest registration epoch among the streams closed since open was last 0
	// While open is 0: when the last stream closed, and the epoch a removal must name (a hello on
	// another replica since bumps the epoch, so the removal is skipped everywhere).
	since int64
	epoch uint64
}

// NewPresence returns an empty presence.
func NewPresence() *Presence { return &Presence{ranks: make(map[WorkerKey]*streamsHere)} }

// Connected records that a stream for the worker rank opened on this replica.
func (p *Presence) Connected(key WorkerKey) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.ranks[key]
	if r == nil {
		r = &streamsHere{}
		p.ranks[key] = r
	}
	if r.since != 0 {
		// Still owed a removal: a stream that opens and then fails to register must not drop it.
		r.closedEpoch = max(r.closedEpoch, r.epoch)
	}
	r.open++
	r.since = 0
}

// Disconnected records that a stream for the worker rank, registered at epoch (0: it never
// registered), closed at now (unix nanoseconds). It returns the time the worker counts as
// disconnected since, or 0 while other streams for it remain open here (or none ever registered:
// there is nothing to remove then). The removal a grace period later names the newest epoch of the
// streams that closed, so it is skipped if a newer stream holds the rank by then.
func (p *Presence) Disconnected(key WorkerKey, now int64, epoch uint64) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.ranks[key]
	if r == nil {
		return 0
	}
	if r.open > 0 {
		r.open--
	}
	r.closedEpoch = max(r.closedEpoch, epoch) // epochs only grow
	if r.open > 0 {
		return 0
	}
	if r.closedEpoch == 0 {
		delete(p.ranks, key)
		return 0
	}
	r.since, r.epoch, r.closedEpoch = now, r.closedEpoch, 0
	return now
}

// IsConnected reports whether a stream for the worker rank is open on this replica.
func (p *Presence) IsConnected(key WorkerKey) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.ranks[key]
	return r != nil && r.open > 0
}

// Disconnection is when a worker's last stream on this replica closed, and its registration epoch.
type Disconnection struct {
	Since int64
	Epoch uint64
}

// Disconnections returns every worker rank whose streams on this replica all closed.
func (p *Presence) Disconnections() map[WorkerKey]Disconnection {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[WorkerKey]Disconnection)
	for k, r := range p.ranks {
		if r.open == 0 && r.since != 0 {
			out[k] = Disconnection{Since: r.since, Epoch: r.epoch}
		}
	}
	return out
}

// Forget drops the record of a worker rank disconnected since d.Since, once its removal was
// appended (applied or skipped): unless a stream opened here again meanwhile, nothing is left to do.
func (p *Presence) Forget(key WorkerKey, d Disconnection) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r := p.ranks[key]; r != nil && r.open == 0 && r.since == d.Since && r.epoch == d.Epoch {
		delete(p.ranks, key)
	}
}
