package auth

import (
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// bucket is a token bucket: rate tokens a second, up to burst. A taker may go into debt by up to
// maxWait's worth and then waits that long, which is how a stream is slowed rather than refused.
type bucket struct {
	// limited is rate > 0, read without the lock: a credential without a limit (the default) takes
	// no lock on its calls.
	limited atomic.Bool
	mu      sync.Mutex
	rate    float64 // tokens a second; 0 means no limit
	burst   float64
	tokens  float64
	last    time.Time
}

// maxBucketWait bounds the wait a bucket computes.
const maxBucketWait = time.Hour

func newBucket(rate, burst float64, now time.Time) *bucket {
	b := &bucket{last: now}
	b.set(rate, burst, now)
	b.tokens = b.burst
	return b
}

// set changes the rate and burst (a reload), keeping what was spent.
func (b *bucket) set(rate, burst float64, now time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(now)
	b.rate, b.burst = rate, max(burst, 1)
	b.tokens = min(b.tokens, b.burst)
	b.limited.Store(rate > 0)
}

func (b *bucket) refill(now time.Time) {
	if dt := now.Sub(b.last).Seconds(); dt > 0 {
		b.tokens = min(b.burst, b.tokens+dt*b.rate)
	}
	b.last = now
}

// take takes n tokens if they are there, or will be within maxWait: ok, and how long to wait first.
// Otherwise it takes nothing and says how long until a take of n would succeed (retry). A bucket
// of rate 0 never limits.
func (b *bucket) take(n float64, now time.Time, maxWait time.Duration) (wait time.Duration, ok bool) {
	if !b.limited.Load() {
		return 0, true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.rate == 0 {
		return 0, true
	}
	b.refill(now)
	need := n - b.tokens
	if need <= 0 {
		b.tokens -= n
		return 0, true
	}
	// A tiny rate (1e-12/s) would overflow a Duration into a negative wait, which passed: the
	// wait is capped at maxBucketWait instead.
	wait = time.Duration(math.Ceil(min(need/b.rate, maxBucketWait.Seconds()) * float64(time.Second)))
	if wait <= maxWait {
		b.tokens -= n
		return wait, true
	}
	return wait - maxWait, false
}
