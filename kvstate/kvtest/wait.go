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
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(time.Millisecond)
	}
}
