package server

import (
	"context"
	"fmt"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/server/config"
)

// adminService implements AdminService.
type adminService struct {
	kvrouterv1.UnimplementedAdminServiceServer
	state    *kvstate.State
	presence *kvstate.Presence
	log      kvstate.Log
	config   []config.Entry
}

func (s *adminService) GetState(context.Context, *kvrouterv1.GetStateRequest) (*kvrouterv1.GetStateResponse, error) {
	resp := &kvrouterv1.GetStateResponse{Log: "embedded", LogPosition: s.log.Position(), SharedStateComplete: true}
	if sl, ok := s.log.(kvstate.SharedLog); ok {
		resp.Log, resp.LogLastId, resp.PendingChanges = sl.Backend(), sl.LastID(), uint64(sl.Pending())
		resp.LogGeneration, resp.SharedStateComplete = sl.Generation(), !sl.Incomplete()
	}
	resp.Digest = fmt.Sprintf("%016x", s.state.Digest())
	for _, m := range s.state.Models() {
		resp.Workers += uint64(len(m.Workers()))
		resp.IndexBlocks += uint64(m.Index.Len())
	}
	resp.Bookings = uint64(s.state.Load().Bookings())
	return resp, nil
}

func (s *adminService) ListWorkers(_ context.Context, req *kvrouterv1.ListWorkersRequest) (*kvrouterv1.ListWorkersResponse, error) {
	resp := &kvrouterv1.ListWorkersResponse{}
	load := s.state.Load()
	for _, m := range s.state.Models() {
		if req.GetModel() != "" && m.Name != req.GetModel() {
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
			resp.Workers = append(resp.Workers, ws)
		}
	}
	return resp, nil
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
