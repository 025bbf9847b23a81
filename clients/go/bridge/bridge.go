// Package bridge subscribes to an inference engine's KV-cache event feed (vLLM, SGLang and
// TensorRT-LLM publish the same ZMQ feed, read by clients/go/enginefeed) and publishes what it says
// to kvrouter through the Go client's Publisher, one worker rank per data-parallel rank of the
// engine, so that engines take part in routing without a line of code changed.
//
// Nothing acknowledged is lost and nothing lost goes unnoticed: the Publisher keeps every event
// until the router acks it and resumes across replicas; a gap in the engine's sequence numbers is
// filled from the engine's replay endpoint when there is one, and otherwise the worker's blocks are
// cleared at the router (it then under-counts the cache until the engine stores blocks again,
// which costs cache hits, never a wrong route to a block that is gone). A batch counts as received
// only once its payload decoded. A sequence that goes back is an engine restart: a clear. As soon
// as it subscribes, the bridge fetches the engine's replay buffer: after a lost connection it goes
// on where it stopped if the engine still holds the last batch forwarded (the same process), and
// otherwise clears the worker and rebuilds it from the buffer. With a state directory, a restarted
// bridge does the same from its checkpoint while the router still holds the worker. The router's
// ResyncRequest is answered with the bridge's mirror of what it forwarded. Events that cannot be
// read or mapped are counted by reason and skipped.
package bridge

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// Options configure a Bridge. Hello, Conns and Endpoint are required.
type Options struct {
	// Hello registers the engine's worker; each rank registers with its dp_rank, and always with
	// fresh_start: a bridge that starts knows nothing of the engine's cache but what it will hear.
	Hello *kvrouterv1.WorkerHello
	// Conns are the router replicas, tried in turn (kvclient.PublisherOptions.Conns).
	Conns []grpc.ClientConnInterface
	// Endpoint is the engine's PUB endpoint of its first rank ("tcp://127.0.0.1:5557"); rank r
	// publishes on the port plus r, as vLLM and SGLang number them. ReplayEndpoint is its ROUTER
	// replay endpoint ("" when the engine has none), numbered the same way.
	Endpoint, ReplayEndpoint string
	// Topic is the subscription prefix ("" receives every topic).
	Topic string
	// FirstDPRank and DPRanks are the ranks served: FirstDPRank .. FirstDPRank+DPRanks-1 (default 1 rank).
	FirstDPRank, DPRanks int
	// KVGroup is the KV-cache group forwarded for hybrid models (events of other groups are dropped).
	KVGroup int64
	// ExtraKeys says what happens to stored blocks with extra hash keys (default ExtraKeysHash).
	ExtraKeys ExtraKeys
	// ReplayTimeout bounds one request to the replay endpoint (default 10 s).
	ReplayTimeout time.Duration
	// DialRetry is the pause between attempts to subscribe to an engine that is not there (default 500 ms).
	DialRetry time.Duration
	// HealthURL is the engine's HTTP health endpoint ("http://127.0.0.1:8000/health"; "" when not
	// checked). Every CheckInterval (default 1 s) the bridge checks it and the replay endpoint;
	// when they fail, or the rank is not subscribed, for DownAfter (default 5 s), the engine is
	// down: the worker leaves the router (no more requests go to it) until the engine is up again.
	HealthURL                string
	CheckInterval, DownAfter time.Duration
	// StateDir, when set, keeps one checkpoint file per rank (the last engine batch the router
	// acked), written at most every CheckpointInterval (default 1 s) and when Run returns: a
	// bridge restarted within the worker's grace period resumes from it instead of starting afresh.
	StateDir           string
	CheckpointInterval time.Duration
	// MaxUnacked bounds each rank's events waiting for the router's ack (kvclient default when 0).
	MaxUnacked int
	// Registerer receives the metrics (nil: not registered). Logger receives the logs; a reason of
	// dropped input is logged at most once per LogInterval (default 10 s) and rank.
	Registerer  prometheus.Registerer
	Logger      *slog.Logger
	LogInterval time.Duration
}

// Bridge forwards one engine's KV events to kvrouter.
type Bridge struct {
	opts    Options
	metrics *metrics
	ranks   []*rank
}

// New checks the options and returns a Bridge; Run starts it.
func New(opts Options) (*Bridge, error) {
	if opts.Hello == nil || len(opts.Conns) == 0 || opts.Endpoint == "" {
		return nil, errors.New("bridge: Hello, Conns and Endpoint are required")
	}
	if opts.Hello.GetBlockSize() == 0 {
		return nil, errors.New("bridge: Hello.block_size must be > 0")
	}
	if opts.DPRanks == 0 {
		opts.DPRanks = 1
	}
	if opts.DPRanks < 0 || opts.FirstDPRank < 0 {
		return nil, fmt.Errorf("bridge: data-parallel ranks must be >= 0 (first %d, count %d)", opts.FirstDPRank, opts.DPRanks)
	}
	if opts.ReplayTimeout <= 0 {
		opts.ReplayTimeout = 10 * time.Second
	}
	if opts.DialRetry <= 0 {
		opts.DialRetry = 500 * time.Millisecond
	}
	if opts.CheckInterval <= 0 {
		opts.CheckInterval = time.Second
	}
	if opts.DownAfter <= 0 {
		opts.DownAfter = 5 * time.Second
	}
	if opts.CheckpointInterval <= 0 {
		opts.CheckpointInterval = time.Second
	}
	if opts.StateDir != "" {
		if err := os.MkdirAll(opts.StateDir, 0o700); err != nil {
			return nil, fmt.Errorf("bridge: state directory: %w", err)
		}
	}
	if opts.LogInterval <= 0 {
		opts.LogInterval = 10 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	b := &Bridge{opts: opts, metrics: newMetrics(opts.Registerer)}
	for i := range opts.DPRanks {
		dp := opts.FirstDPRank + i
		ep, err := RankEndpoint(opts.Endpoint, dp)
		if err != nil {
			return nil, err
		}
		replay := ""
		if opts.ReplayEndpoint != "" {
			if replay, err = RankEndpoint(opts.ReplayEndpoint, dp); err != nil {
				return nil, err
			}
		}
		r, err := newRank(b, int32(dp), ep, replay)
		if err != nil {
			return nil, err
		}
		b.ranks = append(b.ranks, r)
	}
	return b, nil
}

// RankEndpoint returns the endpoint of data-parallel rank dp: a tcp endpoint's port plus dp, as
// vLLM's offset_endpoint_port numbers them. Only rank 0 may use another transport.
func RankEndpoint(endpoint string, dp int) (string, error) {
	if dp == 0 {
		return endpoint, nil
	}
	addr, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return "", fmt.Errorf("bridge: endpoint %q: ranks after 0 need a tcp:// endpoint to offset its port", endpoint)
	}
	host, port, err := net.SplitHostPort(addr)
	n, perr := strconv.Atoi(port)
	if err != nil || perr != nil || n+dp > 65535 {
		return "", fmt.Errorf("bridge: endpoint %q: want tcp://host:port with room for rank %d", endpoint, dp)
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(n+dp)), nil
}

// Run forwards events until ctx ends, then flushes what the router has not acked (for at most
// drain) and returns. It returns early with the error that stops a rank for good: the router
// refused the worker (another process registered the same worker rank, an invalid hello).
func (b *Bridge) Run(ctx context.Context, drain time.Duration) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var wg sync.WaitGroup
	watchCtx, stopWatching := context.WithCancel(ctx)
	var watchers sync.WaitGroup
	for _, r := range b.ranks {
		watchers.Go(func() { r.watch(watchCtx) })
		wg.Go(func() {
			if err := r.run(ctx); err != nil {
				cancel(err)
			}
		})
	}
	if b.opts.StateDir != "" {
		wg.Go(func() {
			t := time.NewTicker(b.opts.CheckpointInterval)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					b.saveCheckpoints()
				}
			}
		})
	}
	wg.Wait()
	stopWatching()
	watchers.Wait()
	err := context.Cause(ctx)
	if errors.Is(err, context.Canceled) {
		err = nil // stopped by the caller
	}
	dctx, dcancel := context.WithTimeout(context.Background(), drain)
	defer dcancel()
	for _, r := range b.ranks {
		if r.pub == nil {
			continue // the engine was down: the worker left the router
		}
		if cerr := r.pub.Close(dctx); cerr != nil && err == nil && !errors.Is(cerr, kvclient.ErrPublisherClosed) {
			err = fmt.Errorf("dp rank %d: flushing: %w", r.dp, cerr)
		}
	}
	b.saveCheckpoints()
	return err
}

// saveCheckpoints writes each rank's checkpoint when the router acked a newer batch since the last.
func (b *Bridge) saveCheckpoints() {
	for _, r := range b.ranks {
		if r.checkpoints == nil {
			continue
		}
		if err := r.checkpoints.save(r.ackedBatch()); err != nil && time.Since(r.checkpoints.failureLogged) >= b.opts.LogInterval {
			r.checkpoints.failureLogged = time.Now()
			r.log.Warn("writing the bridge's checkpoint failed; a restart resumes from the previous one, or afresh", "file", r.checkpoints.path, "error", err)
		}
	}
}

// Ready returns nil when every rank is subscribed to the engine and its publisher runs, else why not.
func (b *Bridge) Ready() error {
	for _, r := range b.ranks {
		pub := r.pubRef.Load()
		if pub == nil {
			if reason := r.health.downReason(); reason != "" {
				return fmt.Errorf("dp rank %d: the engine is down (%s)", r.dp, reason)
			}
			return fmt.Errorf("dp rank %d: waiting for the engine to be up", r.dp)
		}
		if err := pub.Err(); err != nil {
			return fmt.Errorf("dp rank %d: %w", r.dp, err)
		}
		if !r.connected.Load() {
			return fmt.Errorf("dp rank %d: not subscribed to %s", r.dp, r.endpoint)
		}
	}
	return nil
}
