package storetest_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/kvrouter/kvrouter/kvstate/logstore"
	"github.com/kvrouter/kvrouter/kvstate/logstore/memstore"
	"github.com/kvrouter/kvrouter/kvstate/logstore/storetest"
)

// countingStore is a test-only store, the shape of a new one: it keeps its data in another store
// and counts the appends that reach it. A real store implements every method of logstore.Store,
// logstore.LogStore and logstore.Deployment itself.
type countingStore struct {
	logstore.Store
	appends *atomic.Int64
}

func (s countingStore) Log(prefix string) logstore.LogStore {
	return countingLog{LogStore: s.Store.Log(prefix), appends: s.appends}
}

type countingLog struct {
	logstore.LogStore
	appends *atomic.Int64
}

func (l countingLog) Append(ctx context.Context, gen string, entries []logstore.Entry) []error {
	l.appends.Add(int64(len(entries)))
	return l.LogStore.Append(ctx, gen, entries)
}

// TestExampleStore runs the conformance suite on the test-only store, as a new store's own test
// does.
func TestExampleStore(t *testing.T) {
	var appends atomic.Int64
	storetest.Run(t, func(*testing.T) logstore.Store {
		return countingStore{Store: memstore.New(memstore.Options{}), appends: &appends}
	})
	if appends.Load() == 0 {
		t.Fatal("the suite appended nothing through the store")
	}
}
