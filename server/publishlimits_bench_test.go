package server

import (
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/server/config"
)

// largestMessages are Publish messages as large as the default limits let through, one per shape,
// and the worst case the limits refuse before decoding (a 15.6 MB batch of empty blocks).
func largestMessages() map[string]*kvrouterv1.PublishRequest {
	const blocks = config.DefaultMaxBatchBlocks
	tokenBlocks := &kvrouterv1.BlocksStored{}
	hashBlocks := &kvrouterv1.BlocksStored{}
	for i := range blocks {
		toks := make([]uint32, 16)
		for k := range toks {
			toks[k] = uint32(100_000 + i*16 + k) // 3-byte varints, as real vocabularies give
		}
		tokenBlocks.Blocks = append(tokenBlocks.Blocks, &kvrouterv1.StoredBlock{BlockHash: uint64(i) << 40, TokenIds: toks})
		h := uint64(i) * 0x9e3779b97f4a7c15
		hashBlocks.Blocks = append(hashBlocks.Blocks, &kvrouterv1.StoredBlock{BlockHash: uint64(i) << 40, TokensHash: &h})
	}
	removedHashes := &kvrouterv1.BlocksRemoved{}
	for i := range blocks {
		removedHashes.BlockHashes = append(removedHashes.BlockHashes, uint64(i)<<40)
	}
	var clearedEvents []*kvrouterv1.KvEvent
	for i := range blocks {
		clearedEvents = append(clearedEvents, cleared(uint64(i)))
	}
	// One block as long as the byte limit allows (a worker with a huge block_size): the most tokens.
	longBlock := make([]uint32, 0, config.DefaultMaxPublishMsgBytes/3)
	for len(longBlock) < cap(longBlock)-16 {
		longBlock = append(longBlock, uint32(100_000+len(longBlock)%1_000_000))
	}
	ev := func(st *kvrouterv1.BlocksStored) *kvrouterv1.KvEvent {
		return &kvrouterv1.KvEvent{EventId: 0, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE, Data: &kvrouterv1.KvEvent_Stored{Stored: st}}
	}
	// What the fault test sent: a 15.6 MB batch of 16-token blocks, received without limits (as before
	// they existed) and with them.
	huge := &kvrouterv1.BlocksStored{}
	for i := range 250_000 {
		toks := make([]uint32, 16)
		for k := range toks {
			toks[k] = uint32(100_000 + (i*16+k)%1_000_000)
		}
		huge.Blocks = append(huge.Blocks, &kvrouterv1.StoredBlock{BlockHash: uint64(i) << 40, TokenIds: toks})
	}
	empty := &kvrouterv1.BlocksStored{Blocks: make([]*kvrouterv1.StoredBlock, 7_800_000)}
	for i := range empty.Blocks {
		empty.Blocks[i] = &kvrouterv1.StoredBlock{}
	}
	return map[string]*kvrouterv1.PublishRequest{
		"stored-16-token-ids": events(ev(tokenBlocks)),
		"stored-tokens-hash":  events(ev(hashBlocks)),
		"removed-hashes": events(&kvrouterv1.KvEvent{StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
			Data: &kvrouterv1.KvEvent_Removed{Removed: removedHashes}}),
		"cleared-events":       events(clearedEvents...),
		"one-long-block":       events(ev(&kvrouterv1.BlocksStored{Blocks: []*kvrouterv1.StoredBlock{{BlockHash: 1, TokenIds: longBlock}}})),
		"refused-15MB-empties": events(ev(empty)),
		"15MB-token-ids":       events(ev(huge)),
	}
}

// BenchmarkPublishMessageMemory measures what receiving one message costs the router, from the wire
// bytes to the log entry: the codec (sizing, counting, decoding), validation and conversion to
// kvstate events (hashing token ids), and the entry's encoding. B/op is the memory one message in
// flight holds at most (docs/BENCHMARKS.md, "Publish message memory").
func BenchmarkPublishMessageMemory(b *testing.B) {
	codec := newLimitingCodec(maxRouteBytes(1 << 20))
	limits := publishLimits{maxBytes: config.DefaultMaxPublishMsgBytes, maxBlocks: config.DefaultMaxBatchBlocks}
	refused := map[string]bool{"refused-15MB-empties": true, "15MB-token-ids": true}
	for name, msg := range largestMessages() {
		wire, err := proto.Marshal(msg)
		if err != nil {
			b.Fatal(err)
		}
		blockSize := uint32(16)
		if name == "one-long-block" {
			blockSize = uint32(len(msg.GetEvents().GetEvents()[0].GetStored().GetBlocks()[0].GetTokenIds()))
		}
		info := kvstate.WorkerInfo{BlockSize: blockSize}
		for _, limited := range []bool{true, false} {
			if !limited && name != "15MB-token-ids" {
				continue
			}
			lim, label := limits, name
			if !limited {
				lim, label = publishLimits{maxBytes: 1 << 30, maxBlocks: 1 << 30}, "no-limits-"+name
			}
			b.Run(label, func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					if accepted := receiveMessage(b, codec, lim, info, wire); accepted == (limited && refused[name]) {
						b.Fatalf("%s: accepted %v, want %v", label, accepted, !(limited && refused[name]))
					}
				}
				b.ReportMetric(float64(len(wire)), "wire-bytes")
			})
		}
	}
}

// receiveMessage does what the router does with one Publish message up to its log entry; it
// reports false when the limits refuse the message.
func receiveMessage(b *testing.B, codec limitingCodec, limits publishLimits, info kvstate.WorkerInfo, wire []byte) bool {
	f := &publishFrame{limits: limits}
	if err := codec.Unmarshal(mem.BufferSlice{mem.SliceBuffer(wire)}, f); err != nil {
		b.Fatal(err)
	}
	if f.check() != nil {
		return false
	}
	evs, err := convertEvents("events.events", f.msg.GetEvents().GetEvents(), info, true)
	if err != nil {
		b.Fatal(err)
	}
	_ = kvstate.EncodeEntry(nil, kvstate.KVEvents{Events: evs})
	return true
}
