package redisstore_test

import (
	"testing"

	"github.com/kvrouter/kvrouter/kvstate/logstore"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/storetest"
)

// TestConformance runs the store conformance suite on one private Redis server, with pieces of
// 64 KiB so that a snapshot of the suite spans many.
func TestConformance(t *testing.T) {
	rdb := redistest.Start(t).Client()
	storetest.Run(t, func(*testing.T) logstore.Store {
		return redisstore.New(rdb, redisstore.Options{SnapshotChunkBytes: 64 << 10})
	})
}

// TestConformanceCluster runs it on a private 3-master Redis Cluster: every log's keys share a
// hash tag, so each log's atomic steps run on one node.
func TestConformanceCluster(t *testing.T) {
	rdb := redistest.StartCluster(t, 3).Client()
	storetest.Run(t, func(*testing.T) logstore.Store {
		return redisstore.New(rdb, redisstore.Options{SnapshotChunkBytes: 64 << 10})
	})
}
