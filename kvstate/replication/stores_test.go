package replication_test

import (
	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/logstore"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore"
	"github.com/kvrouter/kvrouter/kvstate/replication"
)

// redisStore is the Redis store over rdb, with its default pieces.
func redisStore(rdb redis.UniversalClient) logstore.Store {
	return redisstore.New(rdb, redisstore.Options{})
}

// redisLog is the log under prefix in Redis.
func redisLog(rdb redis.UniversalClient, prefix string) logstore.LogStore {
	return redisStore(rdb).Log(prefix)
}

// newLog is a replication log of st over the Redis log under o.Prefix.
func newLog(rdb redis.UniversalClient, st *kvstate.State, o replication.Options) *replication.Log {
	return replication.New(redisLog(rdb, o.Prefix), st, o)
}

// keysOf names the Redis keys of the log under prefix, for tests that break them.
func keysOf(prefix string) redisstore.Keys { return redisstore.Keys{Prefix: prefix} }
