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
