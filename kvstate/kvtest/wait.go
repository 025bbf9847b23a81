package kvtest

import (
	"testing"
	"time"
)

// Eventually waits until cond holds, polling every millisecond, and fails the test after timeout.
// Tests wait for the effect they check this way, never for an assumed order or a fixed sleep: under
// CPU load an apply, an ack or a health change comes later than on an idle machine.
func Eventually(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	if !Poll(timeout, time.Millisecond, cond) {
		tb.Fatalf("timed out after %v waiting for %s", timeout, what)
	}
}

// Poll calls cond every interval until it holds or timeout has passed, and reports whether it held.
// It is Eventually for a test with more to say when the wait fails (a process's logs, the last value
// seen), or whose condition costs a call to another process (hence the interval).
func Poll(timeout, interval time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(interval)
	}
	return true
}
