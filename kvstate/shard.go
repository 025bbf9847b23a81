package kvstate

// Shard is one state machine: a State and the Log every change to it goes through. A deployment
// whose shared log is split by model (kvstate/redislog.Shards) runs one shard per model, each
// applied on its own and in its own order; otherwise one shard holds every model. Nothing in a
// shard's state depends on another shard's changes (docs/architecture.md, "The shared log's order,
// and sharding it by model").
type Shard struct {
	// Model is the model the shard holds; "" for a shard that holds every model.
	Model string
	State *State
	Log   Log
}

// ShardSource finds the shards a replica holds: redislog.Shards for a log sharded by model, OneShard
// otherwise.
type ShardSource interface {
	// Lookup returns the shard holding model on this replica, if there is one.
	Lookup(model string) (*Shard, bool)
	// Shards returns every shard this replica holds.
	Shards() []*Shard
}

// OneShard is the ShardSource of a replica whose log is not sharded: its one shard holds every
// model.
type OneShard struct{ Shard *Shard }

// Lookup returns the one shard, whatever the model.
func (o OneShard) Lookup(string) (*Shard, bool) { return o.Shard, true }

// Shards returns the one shard.
func (o OneShard) Shards() []*Shard { return []*Shard{o.Shard} }
