package replication

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

// Leases keeps worker leases beside a log in its store, member "id/rank/epoch", with the lease's
// deadline in unix milliseconds. The replica holding a worker's stream pushes the deadline forward;
// every replica claims expired leases, which the store removes atomically, so exactly one replica
// appends each removal. The removal names the epoch, so a worker that re-registered (on
// any replica) since is left alone.
type Leases struct {
	store  logstore.LogStore
	log    kvstate.Log
	grace  time.Duration
	now    func() time.Time
	logger *slog.Logger

	mu       sync.Mutex
	held     map[string]int // member -> holders on this replica
	releases sync.WaitGroup // final refreshes of released leases in flight
	// reachableFor, if set, says how long Redis has answered without interruption.
	reachableFor func() time.Duration
	// shared, if set, is the log whose generation the leases follow; seededFor is the generation
	// the leases were last seeded for.
	shared    *Log
	seededFor string
}

// AfterOutages makes the leases wait, after Redis was unreachable, for a grace period of Redis
// answering before claiming any: l says how long that has been. And when Redis lost its data (l's
// generation changes), every worker of the state gets a lease again, which its holder refreshes: a
// worker nobody holds any more is then removed a grace period later, instead of never.
func (r *Leases) AfterOutages(l *Log) { r.reachableFor, r.shared = l.ReachableFor, l }

// seed gives every worker of the shared state a lease, unless it has one, after the log's
// generation changed.
func (r *Leases) seed(ctx context.Context) {
	if r.shared == nil {
		return
	}
	g := r.shared.Generation()
	if g == "" || g == r.seededFor {
		return
	}
	if r.seededFor == "" {
		r.seededFor = g // joining at start: the leases in Redis are the deployment's own
		return
	}
	var members []string
	for _, m := range r.shared.state.Models() {
		for _, w := range m.Workers() {
			members = append(members, leaseMember(w.Info.Key, w.Status().Epoch))
		}
	}
	if len(members) > 0 {
		if err := r.store.RefreshLeases(ctx, members, r.now().Add(r.grace).UnixMilli(), true); err != nil {
			r.logger.Warn("seeding worker leases after the shared log changed generation failed", "err", err)
			return
		}
	}
	r.seededFor = g
	r.logger.Info("seeded worker leases for the new generation of the shared log", "generation", g, "workers", len(members))
}

// NewLeases returns the leases kept beside store, whose expired workers are removed through log,
// grace after the last refresh.
func NewLeases(store logstore.LogStore, log kvstate.Log, grace time.Duration, logger *slog.Logger) *Leases {
	if logger == nil {
		logger = slog.Default()
	}
	return &Leases{store: store, log: log, grace: grace, now: time.Now, logger: logger, held: make(map[string]int)}
}

func leaseMember(key kvstate.WorkerKey, epoch uint64) string {
	return fmt.Sprintf("%d/%d/%d", key.ID, key.Rank, epoch)
}

func parseLeaseMember(m string) (kvstate.WorkerKey, uint64, error) {
	parts := strings.Split(m, "/")
	if len(parts) != 3 {
		return kvstate.WorkerKey{}, 0, fmt.Errorf("bad lease member %q", m)
	}
	id, err1 := strconv.ParseUint(parts[0], 10, 64)
	rank, err2 := strconv.ParseUint(parts[1], 10, 32)
	epoch, err3 := strconv.ParseUint(parts[2], 10, 64)
	if err1 != nil || err2 != nil || err3 != nil {
		return kvstate.WorkerKey{}, 0, fmt.Errorf("bad lease member %q", m)
	}
	return kvstate.WorkerKey{ID: id, Rank: uint32(rank)}, epoch, nil
}

// Hold starts refreshing the worker's lease; release stops. The lease then runs out grace after the
// release, not after the last periodic refresh: release refreshes it one last time (in the
// background, so a stream's teardown never waits on Redis; Run waits for it before it returns).
func (r *Leases) Hold(ctx context.Context, key kvstate.WorkerKey, epoch uint64) func() {
	m := leaseMember(key, epoch)
	r.mu.Lock()
	r.held[m]++
	r.mu.Unlock()
	r.refresh(ctx, []string{m})
	var once sync.Once
	return func() {
		once.Do(func() {
			r.mu.Lock()
			last := r.held[m] <= 1
			if r.held[m]--; r.held[m] <= 0 {
				delete(r.held, m)
			}
			r.mu.Unlock()
			if last {
				// The stream's context has ended by now; the final refresh must still happen.
				fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
				r.releases.Go(func() {
					defer cancel()
					r.refresh(fctx, []string{m})
				})
			}
		})
	}
}

func (r *Leases) refresh(ctx context.Context, members []string) {
	if len(members) == 0 {
		return
	}
	if err := r.store.RefreshLeases(ctx, members, r.now().Add(r.grace).UnixMilli(), false); err != nil {
		r.logger.Warn("refreshing worker leases failed", "err", err, "leases", len(members))
	}
}

// Sweep refreshes the leases this replica holds, then claims expired ones and appends a removal for
// each worker it claimed.
func (r *Leases) Sweep(ctx context.Context) {
	r.mu.Lock()
	members := make([]string, 0, len(r.held))
	for m := range r.held {
		members = append(members, m)
	}
	r.mu.Unlock()
	r.refresh(ctx, members)
	r.seed(ctx)
	// After an outage every lease looks expired, those of live workers too: their holders could not
	// refresh. Claim only once Redis has answered for a whole grace period, so holders refresh first.
	if r.reachableFor != nil && r.reachableFor() < r.grace {
		return
	}

	claimed, err := r.store.ClaimExpired(ctx, r.now().UnixMilli(), 100)
	if err != nil {
		r.logger.Warn("claiming expired worker leases failed", "err", err)
		return
	}
	for _, m := range claimed {
		key, epoch, err := parseLeaseMember(m)
		if err != nil {
			r.logger.Error("dropping a malformed lease", "err", err)
			continue
		}
		res, err := r.log.Append(ctx, kvstate.WorkerRemoved{Key: key, Epoch: epoch})
		switch {
		case err != nil:
			r.logger.Error("removing a worker whose lease expired failed", "worker", key.String(), "err", err)
		case !res.Skipped:
			r.logger.Info("removed worker whose lease expired", "worker", key.String(), "epoch", epoch, "grace", r.grace)
		}
	}
}

// Run sweeps every interval until ctx ends, then waits for the final refreshes of leases released
// meanwhile.
func (r *Leases) Run(ctx context.Context, interval time.Duration) {
	kvstate.Every(ctx, interval, r.Sweep)
	r.releases.Wait()
}
