package server

import (
	"context"
	"fmt"
	"hash/fnv"
	"strings"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/server/config"
)

// adminService implements AdminService.
type adminService struct {
	kvrouterv1.UnimplementedAdminServiceServer
	shards kvstate.ShardSource
	// sharded: the log is sharded by model, and GetState reports each shard.
	sharded  bool
	presence *kvstate.Presence
	config   []config.Entry
}

func (s *adminService) GetState(context.Context, *kvrouterv1.GetStateRequest) (*kvrouterv1.GetStateResponse, error) {
	shards := s.shards.Shards()
	states := make([]*kvrouterv1.ShardState, len(shards))
	for i, sh := range shards {
		states[i] = shardState(sh)
	}
	if !s.sharded && len(states) == 1 {
		one := states[0]
		return &kvrouterv1.GetStateResponse{Log: logBackend(shards[0].Log), LogPosition: one.LogPosition, LogLastId: one.LogLastId,
			PendingChanges: one.PendingChanges, Digest: one.Digest, Workers: one.Workers, IndexBlocks: one.IndexBlocks,
			Bookings: one.Bookings, LogGeneration: one.LogGeneration, SharedStateComplete: one.SharedStateComplete}, nil
	}
	resp := &kvrouterv1.GetStateResponse{Log: "embedded", SharedStateComplete: true, Shards: states}
	if b, ok := s.shards.(interface{ Backend() string }); ok {
		resp.Log = b.Backend() // named before any shard exists
	}
	var lastIDs, generations []string
	digest := fnv.New64a()
	for _, st := range states {
		resp.LogPosition += st.LogPosition
		resp.PendingChanges += st.PendingChanges
		resp.Workers += st.Workers
		resp.IndexBlocks += st.IndexBlocks
		resp.Bookings += st.Bookings
		resp.SharedStateComplete = resp.SharedStateComplete && st.SharedStateComplete
		lastIDs = append(lastIDs, st.Model+"="+st.LogLastId)
		generations = append(generations, st.Model+"="+st.LogGeneration)
		fmt.Fprintf(digest, "%s=%s;", st.Model, st.Digest)
	}
	resp.LogLastId, resp.LogGeneration = strings.Join(lastIDs, ","), strings.Join(generations, ",")
	resp.Digest = fmt.Sprintf("%016x", digest.Sum64())
	return resp, nil
}

// logBackend names the store of log: "embedded" for an in-process one.
func logBackend(l kvstate.Log) string {
	if sl, ok := l.(kvstate.SharedLog); ok {
		return sl.Backend()
	}
	return "embedded"
}

// shardState reports where this replica stands in sh.
func shardState(sh *kvstate.Shard) *kvrouterv1.ShardState {
	st := &kvrouterv1.ShardState{Model: sh.Model, LogPosition: sh.Log.Position(), SharedStateComplete: true,
		Digest: fmt.Sprintf("%016x", sh.State.Digest()), Bookings: uint64(sh.State.Load().Bookings())}
	if sl, ok := sh.Log.(kvstate.SharedLog); ok {
		st.LogLastId, st.PendingChanges = sl.LastID(), uint64(sl.Pending())
		st.LogGeneration, st.SharedStateComplete = sl.Generation(), !sl.Incomplete()
	}
	for _, m := range sh.State.Models() {
		st.Workers += uint64(len(m.Workers()))
		st.IndexBlocks += uint64(m.Index.Len())
	}
	return st
}

func (s *adminService) ListWorkers(_ context.Context, req *kvrouterv1.ListWorkersRequest) (*kvrouterv1.ListWorkersResponse, error) {
	resp := &kvrouterv1.ListWorkersResponse{}
	for _, sh := range s.shards.Shards() {
		resp.Workers = append(resp.Workers, s.listWorkers(sh.State, req.GetModel())...)
	}
	return resp, nil
}

// listWorkers lists the workers of state's models (of model only, unless it is empty).
func (s *adminService) listWorkers(state *kvstate.State, model string) []*kvrouterv1.WorkerStatus {
	var out []*kvrouterv1.WorkerStatus
	load := state.Load()
	for _, m := range state.Models() {
		if model != "" && m.Name != model {
			continue
		}
		for _, w := range m.Workers() {
			st := w.Status()
			l := load.Slot(w.Slot)
			ws := &kvrouterv1.WorkerStatus{
				Worker:              workerTarget(w),
				Model:               m.Name,
				Role:                roleToProto[w.Info.Role],
				BlockSize:           w.Info.BlockSize,
				TotalKvBlocks:       w.Info.TotalKVBlocks,
				MaxNumBatchedTokens: w.Info.MaxNumBatchedTokens,
				SupportsBypass:      w.Info.SupportsBypass,
				KvEventsEnabled:     w.Info.KVEventsEnabled,
				Connected:           s.presence.IsConnected(w.Info.Key),
				CachedBlocks:        tierBlocks(m.Index.BlockCounts(w.Slot)),
				AwaitingResync:      st.AwaitingResync,
				Load: &kvrouterv1.WorkerLoad{
					ActiveBlocks: l.ActiveBlocks, ActivePrefillTokens: l.ActivePrefillTokens, ActiveRequests: l.ActiveRequests,
					KvUsedBlocks: st.KVUsedBlocks, WaitingRequests: st.WaitingRequests,
				},
			}
			if st.HasLastEvent {
				ws.LastEventId = &st.LastEventID
			}
			out = append(out, ws)
		}
	}
	return out
}

var sourceToProto = map[config.Source]kvrouterv1.ConfigSource{
	config.SourceDefault: kvrouterv1.ConfigSource_CONFIG_SOURCE_DEFAULT,
	config.SourceFile:    kvrouterv1.ConfigSource_CONFIG_SOURCE_FILE,
	config.SourceEnv:     kvrouterv1.ConfigSource_CONFIG_SOURCE_ENV,
	config.SourceFlag:    kvrouterv1.ConfigSource_CONFIG_SOURCE_FLAG,
}

func (s *adminService) GetConfig(context.Context, *kvrouterv1.GetConfigRequest) (*kvrouterv1.GetConfigResponse, error) {
	resp := &kvrouterv1.GetConfigResponse{}
	for _, e := range s.config {
		resp.Entries = append(resp.Entries, &kvrouterv1.ConfigEntry{Key: e.Key, Value: e.Value, Source: sourceToProto[e.Source]})
	}
	return resp, nil
}
