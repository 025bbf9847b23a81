package app

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/kvrouter/kvrouter/policy"
)

// ErrQueueFull: the router's queue holds router_queue_max_depth requests already. It wraps
// ErrAllWorkersOverloaded, since that is why requests queue.
var ErrQueueFull = fmt.Errorf("%w and the router queue is full", policy.ErrAllWorkersOverloaded)

// queue holds requests whose every eligible worker is overloaded (Dynamo §3.5) until capacity frees.
// Only its head retries, on each change that may free capacity (a prefill done, a free, an expiry, a
// worker joining), so waiting requests are served in policy order: FCFS by arrival, or WSPT (shortest
// uncached prompt first). A new request that finds capacity free is routed at once.
type queue struct {
	mu       sync.Mutex
	waiters  []*waiter // sorted by (key, seq)
	seq      uint64
	maxDepth int
	changed  func() <-chan struct{}
}

type waiter struct {
	key  float64
	seq  uint64
	turn chan struct{} // signalled when the waiter becomes the head
}

func newQueue(maxDepth int, changed func() <-chan struct{}) *queue {
	return &queue{maxDepth: maxDepth, changed: changed}
}

func (q *queue) depth() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.waiters)
}

// wait queues a request and retries it with try when it is at the head and capacity may have
// freed, until try stops answering ErrAllWorkersOverloaded or ctx ends.
func (q *queue) wait(ctx context.Context, key float64, try func() (*policy.Decision, error)) (*policy.Decision, error) {
	w, err := q.enter(key)
	if err != nil {
		return nil, err
	}
	defer q.leave(w)
	for {
		if !q.isHead(w) {
			select {
			case <-w.turn:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			continue
		}
		changed := q.changed() // taken before trying, so a change during the try is not missed
		dec, err := try()
		if !errors.Is(err, policy.ErrAllWorkersOverloaded) {
			return dec, err
		}
		// Wait for capacity to change; a request that overtook this one (WSPT) takes the next try.
		select {
		case <-changed:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

func (q *queue) isHead(w *waiter) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.waiters) > 0 && q.waiters[0] == w
}

func (q *queue) enter(key float64) (*waiter, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.waiters) >= q.maxDepth {
		return nil, ErrQueueFull
	}
	q.seq++
	w := &waiter{key: key, seq: q.seq, turn: make(chan struct{}, 1)}
	i, _ := slices.BinarySearchFunc(q.waiters, w, compareWaiters)
	q.waiters = slices.Insert(q.waiters, i, w)
	if i == 0 {
		q.signalHeadLocked()
	}
	return w, nil
}

func (q *queue) leave(w *waiter) {
	q.mu.Lock()
	defer q.mu.Unlock()
	i := slices.Index(q.waiters, w)
	if i < 0 {
		return
	}
	q.waiters = slices.Delete(q.waiters, i, i+1)
	if i == 0 {
		q.signalHeadLocked()
	}
}

func (q *queue) signalHeadLocked() {
	if len(q.waiters) == 0 {
		return
	}
	select {
	case q.waiters[0].turn <- struct{}{}:
	default:
	}
}

func compareWaiters(a, b *waiter) int {
	switch {
	case a.key < b.key:
		return -1
	case a.key > b.key:
		return 1
	case a.seq < b.seq:
		return -1
	case a.seq > b.seq:
		return 1
	}
	return 0
}
