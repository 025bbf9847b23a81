package memstore_test

import (
	"testing"

	"github.com/kvrouter/kvrouter/kvstate/logstore"
	"github.com/kvrouter/kvrouter/kvstate/logstore/memstore"
	"github.com/kvrouter/kvrouter/kvstate/logstore/storetest"
)

// TestConformance runs the store conformance suite in memory.
func TestConformance(t *testing.T) {
	storetest.Run(t, func(*testing.T) logstore.Store { return memstore.New(memstore.Options{}) })
}
