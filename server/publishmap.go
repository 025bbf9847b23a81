package server

import (
	"fmt"
	"slices"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
	"github.com/kvrouter/kvrouter/server/app"
)

// This file maps the messages of a Publish stream to the values of kvstate and app: field by field,
// naming the field of every value it refuses.

var roleFromProto = map[kvrouterv1.WorkerRole]kvstate.Role{
	kvrouterv1.WorkerRole_WORKER_ROLE_PREFILL:    kvstate.RolePrefill,
	kvrouterv1.WorkerRole_WORKER_ROLE_DECODE:     kvstate.RoleDecode,
	kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED: kvstate.RoleAggregated,
}

var roleToProto = map[kvstate.Role]kvrouterv1.WorkerRole{
	kvstate.RolePrefill:    kvrouterv1.WorkerRole_WORKER_ROLE_PREFILL,
	kvstate.RoleDecode:     kvrouterv1.WorkerRole_WORKER_ROLE_DECODE,
	kvstate.RoleAggregated: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED,
}

var tierFromProto = map[kvrouterv1.StorageTier]kvstate.Tier{
	kvrouterv1.StorageTier_STORAGE_TIER_DEVICE:   kvstate.TierDevice,
	kvrouterv1.StorageTier_STORAGE_TIER_HOST:     kvstate.TierHost,
	kvrouterv1.StorageTier_STORAGE_TIER_DISK:     kvstate.TierDisk,
	kvrouterv1.StorageTier_STORAGE_TIER_EXTERNAL: kvstate.TierExternal,
}

// workerInfo validates a hello and converts it.
func workerInfo(h *kvrouterv1.WorkerHello) (kvstate.WorkerInfo, error) {
	role, ok := roleFromProto[h.GetRole()]
	switch {
	case h.GetWorkerId() == 0:
		return kvstate.WorkerInfo{}, invalidArgument("hello.worker_id", "must not be 0")
	case h.GetModel() == "":
		return kvstate.WorkerInfo{}, invalidArgument("hello.model", "must not be empty")
	case len(h.GetModel()) > maxModelBytes:
		return kvstate.WorkerInfo{}, invalidArgumentf("hello.model", "must be at most %d bytes (got %d)", maxModelBytes, len(h.GetModel()))
	case !ok:
		return kvstate.WorkerInfo{}, invalidArgumentf("hello.role", "must be PREFILL, DECODE or AGGREGATED (got %v)", h.GetRole())
	case h.GetBlockSize() == 0:
		return kvstate.WorkerInfo{}, invalidArgument("hello.block_size", "must be > 0")
	case h.GetEndpoint() == "" && !h.GetNoEndpoint():
		// A frontend handed an empty target cannot reach the worker: say so at registration rather
		// than in every routing decision.
		return kvstate.WorkerInfo{}, invalidArgument("hello.endpoint", "must be set to the address frontends reach the worker at (or set hello.no_endpoint for a fleet whose frontends find workers by worker_id)")
	case h.GetEndpoint() != "" && h.GetNoEndpoint():
		return kvstate.WorkerInfo{}, invalidArgument("hello.no_endpoint", "must not be set with hello.endpoint")
	case len(h.GetEndpoint()) > maxEndpointBytes:
		// Every Route answer and ListWorkers carries it: a 4 MB endpoint broke ListWorkers for
		// clients with the default 4 MiB receive limit.
		return kvstate.WorkerInfo{}, invalidArgumentf("hello.endpoint", "must be at most %d bytes (got %d)", maxEndpointBytes, len(h.GetEndpoint()))
	}
	return kvstate.WorkerInfo{
		Key:   kvstate.WorkerKey{ID: h.GetWorkerId(), Rank: h.GetDpRank()},
		Model: h.GetModel(), Role: role, BlockSize: h.GetBlockSize(),
		TotalKVBlocks: h.GetTotalKvBlocks(), MaxNumBatchedTokens: h.GetMaxNumBatchedTokens(),
		Endpoint: h.GetEndpoint(), SupportsBypass: h.GetSupportsBypass(), KVEventsEnabled: h.GetKvEventsEnabled(),
	}, nil
}

// convertEvents validates a batch of events completely before converting it, so a bad event rejects
// the whole batch and nothing of it is applied. With checkOrder, event ids must strictly increase
// (app.EventOrder); the rules that need no more than the converted events are the session's.
func convertEvents(field string, in []*kvrouterv1.KvEvent, info kvstate.WorkerInfo, checkOrder bool) ([]kvstate.Event, error) {
	out := make([]kvstate.Event, 0, len(in))
	var salt uint64
	saltFor := ""
	for i, ev := range in {
		// Field paths are formatted only for errors: a batch can hold thousands of blocks.
		f := func() string { return fmt.Sprintf("%s[%d]", field, i) }
		if checkOrder && i > 0 {
			if err := app.EventOrder(field, i, in[i-1].GetEventId(), ev.GetEventId()); err != nil {
				return nil, err
			}
		}
		if ev.GetDpRank() != info.Key.Rank {
			return nil, invalidArgumentf(f()+".dp_rank", "must equal the stream's registered dp_rank %d (got %d)", info.Key.Rank, ev.GetDpRank())
		}
		tier, ok := tierFromProto[ev.GetStorageTier()]
		if !ok {
			return nil, invalidArgumentf(f()+".storage_tier", "must be DEVICE, HOST, DISK or EXTERNAL (got %v)", ev.GetStorageTier())
		}
		e := kvstate.Event{ID: ev.GetEventId(), Tier: tier}
		switch d := ev.GetData().(type) {
		case *kvrouterv1.KvEvent_Stored:
			st := d.Stored
			if key := st.GetLoraName() + "\x00" + st.GetCacheNamespace(); key != saltFor || i == 0 {
				salt, saltFor = blockhash.Salt(st.GetLoraName(), st.GetCacheNamespace()), key
			}
			var err error
			if e, err = storedEvent(f, e, st, info.BlockSize, salt); err != nil {
				return nil, err
			}
		case *kvrouterv1.KvEvent_Removed:
			if len(d.Removed.GetBlockHashes()) == 0 {
				return nil, invalidArgument(f()+".removed.block_hashes", "must not be empty")
			}
			e.Kind, e.Removed = kvstate.EventRemoved, d.Removed.GetBlockHashes()
		case *kvrouterv1.KvEvent_Cleared:
			e.Kind = kvstate.EventCleared
		default:
			return nil, invalidArgument(f(), "must set one of stored, removed, cleared")
		}
		out = append(out, e)
	}
	return out, nil
}

// storedEvent converts the stored blocks st of event e (field f()), keying blocks sent as token
// ids of blockSize tokens with salt and their multimodal hashes.
func storedEvent(f func() string, e kvstate.Event, st *kvrouterv1.BlocksStored, blockSize uint32, salt uint64) (kvstate.Event, error) {
	if len(st.GetBlocks()) == 0 {
		return e, invalidArgument(f()+".stored.blocks", "must not be empty")
	}
	e.Kind = kvstate.EventStored
	if st.ParentHash != nil {
		e.Parent, e.HasParent = st.GetParentHash(), true
	}
	e.Blocks = make([]kvstate.Block, len(st.GetBlocks()))
	for j, b := range st.GetBlocks() {
		bf := func() string { return fmt.Sprintf("%s.stored.blocks[%d]", f(), j) }
		switch {
		case b.TokensHash != nil && len(b.GetTokenIds()) > 0:
			return e, invalidArgument(bf(), "must set exactly one of token_ids and tokens_hash (both are set)")
		case b.TokensHash != nil && len(b.GetMmHashes()) > 0:
			return e, invalidArgument(bf()+".mm_hashes", "must be empty with tokens_hash, which already holds them")
		case b.TokensHash != nil:
			e.Blocks[j] = kvstate.Block{Hash: b.GetBlockHash(), Local: b.GetTokensHash()}
		case len(b.GetTokenIds()) != int(blockSize):
			if len(b.GetTokenIds()) == 0 {
				return e, invalidArgument(bf(), "must set exactly one of token_ids and tokens_hash (neither is set)")
			}
			return e, invalidArgumentf(bf()+".token_ids", "must hold exactly block_size %d tokens (got %d)", blockSize, len(b.GetTokenIds()))
		case len(b.GetMmHashes()) > maxBlockMMHashes:
			return e, invalidArgumentf(bf()+".mm_hashes", "must hold at most %d hashes (got %d)", maxBlockMMHashes, len(b.GetMmHashes()))
		case len(b.GetMmHashes()) > 0:
			var buf [maxBlockMMHashes]uint64
			mm := append(buf[:0], b.GetMmHashes()...)
			slices.Sort(mm)
			e.Blocks[j] = kvstate.Block{Hash: b.GetBlockHash(), Local: blockhash.LocalMultimodal(b.GetTokenIds(), mm, salt)}
		default:
			e.Blocks[j] = kvstate.Block{Hash: b.GetBlockHash(), Local: blockhash.Local(b.GetTokenIds(), salt)}
		}
	}
	return e, nil
}
