package replication

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine a test started outlives it.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
