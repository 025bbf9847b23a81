package filewatch

import (
	"context"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// TestPollSeesReplacement: replacing a file by a rename (as a secret volume or a careful operator
// does), rewriting it in place, and removing it each trigger a reload; an unchanged file does not.
// It runs in a synctest bubble: the poller's ticks and the test's waits are on the bubble's clock,
// so "no reload over ten polls" is exactly ten polls, however busy the machine.
func TestPollSeesReplacement(t *testing.T) { synctest.Test(t, testPollSeesReplacement) }

func testPollSeesReplacement(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "cert.pem")
	write := func(content string) {
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	write("one")
	var reloads atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		Poll(ctx, 5*time.Millisecond, []string{path}, func() { reloads.Add(1) })
		close(done)
	}()
	defer func() { cancel(); <-done }()
	waitFor := func(n int32, what string) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for reloads.Load() < n {
			if time.Now().After(deadline) {
				t.Fatalf("%s: %d reloads, want %d", what, reloads.Load(), n)
			}
			time.Sleep(time.Millisecond) // the bubble's clock: no real time passes
		}
	}
	time.Sleep(50 * time.Millisecond) // ten polls on the bubble's clock, not real time
	if n := reloads.Load(); n != 0 {
		t.Fatalf("%d reloads of an unchanged file, want 0", n)
	}
	write("two, same inode? no: a rename")
	waitFor(1, "after a rename")
	if err := os.WriteFile(path, []byte("three, in place, longer than before"), 0o600); err != nil {
		t.Fatal(err)
	}
	waitFor(2, "after a rewrite in place")
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	waitFor(3, "after a removal")
	time.Sleep(50 * time.Millisecond) // ten polls on the bubble's clock, not real time
	if n := reloads.Load(); n != 3 {
		t.Errorf("%d reloads once nothing changes any more, want 3", n)
	}
}
