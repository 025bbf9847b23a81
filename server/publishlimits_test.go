package server

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

func smallLimits(o *Options) {
	o.MaxPublishMsgBytes, o.MaxBatchBlocks, o.MaxDumpBlocks = 2048, 8, 20
}

func dump(through uint64, more bool, evs ...*kvrouterv1.KvEvent) *kvrouterv1.PublishRequest {
	return &kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Dump{Dump: &kvrouterv1.KvDump{ThroughEventId: through, Events: evs, MoreFollows: more}}}
}

func removed(id uint64, hashes ...uint64) *kvrouterv1.KvEvent {
	return &kvrouterv1.KvEvent{EventId: id, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
		Data: &kvrouterv1.KvEvent_Removed{Removed: &kvrouterv1.BlocksRemoved{BlockHashes: hashes}}}
}

func cleared(id uint64) *kvrouterv1.KvEvent {
	return &kvrouterv1.KvEvent{EventId: id, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
		Data: &kvrouterv1.KvEvent_Cleared{Cleared: &kvrouterv1.CacheCleared{}}}
}

// wantLimit checks a RESOURCE_EXHAUSTED status: its message, and the ErrorInfo naming the limit.
func wantLimit(t *testing.T, err error, msg, reason, limit string) {
	t.Helper()
	wantStatus(t, err, codes.ResourceExhausted, msg)
	st, _ := status.FromError(err)
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			if info.GetReason() != reason || info.GetMetadata()["limit"] != limit {
				t.Errorf("ErrorInfo = %v, want reason %s naming limit %s", info, reason, limit)
			}
			return
		}
	}
	t.Errorf("status %v carries no ErrorInfo", st)
}

// TestPublishLimits: a message over a limit ends the stream with RESOURCE_EXHAUSTED naming the limit,
// and nothing of it is applied; a message at the limits is accepted.
func TestPublishLimits(t *testing.T) {
	many := func(from uint64, n int) []*kvrouterv1.KvEvent {
		var out []*kvrouterv1.KvEvent
		for i := range n {
			out = append(out, cleared(from+uint64(i)))
		}
		return out
	}
	hashes := func(n int) []uint64 {
		var out []uint64
		for i := range n {
			out = append(out, uint64(1000+i))
		}
		return out
	}
	big := stored(1, nil, 0, 1)
	big.GetStored().LoraName = string(make([]byte, 2100))
	tests := []struct {
		name          string
		msg           *kvrouterv1.PublishRequest
		msgText       string
		reason, limit string
	}{
		{"bytes", events(big), fmt.Sprintf("message: %d bytes, more than", proto.Size(events(big))) + " max_publish_msg_bytes 2048: split event batches, and send a large dump in parts (KvDump.more_follows)",
			"PUBLISH_MESSAGE_TOO_LARGE", "max_publish_msg_bytes"},
		{"events", events(many(1, 9)...), "events.events: holds 9 events, more than max_batch_blocks 8: split the batch",
			"PUBLISH_BATCH_TOO_LARGE", "max_batch_blocks"},
		{"stored blocks", events(stored(1, nil, 0, 9)), "events.events: holds 9 blocks (stored blocks plus removed hashes), more than max_batch_blocks 8: split the batch",
			"PUBLISH_BATCH_TOO_LARGE", "max_batch_blocks"},
		{"stored and removed", events(stored(1, nil, 0, 5), removed(2, hashes(4)...)), "events.events: holds 9 blocks (stored blocks plus removed hashes), more than max_batch_blocks 8: split the batch",
			"PUBLISH_BATCH_TOO_LARGE", "max_batch_blocks"},
		{"one dump part", dump(5, true, stored(0, nil, 0, 9)), "dump.events: holds 9 blocks (stored blocks plus removed hashes), more than max_batch_blocks 8: split the batch",
			"PUBLISH_BATCH_TOO_LARGE", "max_batch_blocks"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newTestEnv(t, smallLimits)
			p := e.connect(1)
			p.send(events(stored(0, nil, 0, 1)))
			wantMsg(t, p.recv(), ack(0))
			p.send(tt.msg)
			wantLimit(t, p.endErr(), tt.msgText, tt.reason, tt.limit)
			if got := e.cachedBlocks(1); got != 1 {
				t.Errorf("cached blocks after the refused message = %d, want 1 (nothing applied)", got)
			}
		})
	}

	t.Run("at the limits", func(t *testing.T) {
		e := newTestEnv(t, smallLimits)
		p := e.connect(1)
		p.send(events(stored(0, nil, 0, 4), removed(1, 1000, 1001), removed(2, 1002, 1003)))
		wantMsg(t, p.recv(), ack(2))
		p.send(events(many(3, 8)...))
		wantMsg(t, p.recv(), ack(10))
		p.stream.CloseSend()
	})
}

// TestDumpInParts: a dump sent in parts applies, whole, with the last part, and is acked then; other
// events wait until it is complete; parts must agree on through_event_id; the whole dump is bounded.
func TestDumpInParts(t *testing.T) {
	e := newTestEnv(t, smallLimits)
	p := e.connect(1)
	p.send(events(stored(0, nil, 0, 2)))
	wantMsg(t, p.recv(), ack(0))
	p.send(dump(9, true, stored(0, nil, 0, 8)))
	p.send(dump(9, true, stored(0, nil, 8, 8)))
	p.send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Load{Load: &kvrouterv1.LoadReport{KvUsedBlocks: 3}}})
	p.send(dump(9, false, stored(0, nil, 16, 4)))
	wantMsg(t, p.recv(), ack(9))
	if got := e.cachedBlocks(1); got != 20 {
		t.Errorf("cached blocks after a dump of 8+8+4 blocks = %d, want 20", got)
	}
	p.send(events(stored(10, nil, 0, 1)))
	wantMsg(t, p.recv(), ack(10))

	p.send(dump(11, true, stored(0, nil, 0, 2)))
	p.send(events(stored(12, nil, 0, 1)))
	wantStatus(t, p.endErr(), codes.FailedPrecondition, "events: a dump in parts is in progress (through_event_id 11, 2 blocks so far): send its remaining parts, the last without more_follows, first")

	p = e.publish()
	p.send(hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4))
	last := uint64(10)
	wantMsg(t, p.recv(), registered(&last))
	p.send(dump(11, true, stored(0, nil, 0, 2)))
	p.send(dump(12, false, stored(0, nil, 2, 2)))
	wantStatus(t, p.endErr(), codes.InvalidArgument, "dump.through_event_id: must be the same in every part of a dump (the first part had 11, got 12)")

	p = e.publish()
	p.send(hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, 4))
	wantMsg(t, p.recv(), registered(&last))
	p.send(dump(11, true, stored(0, nil, 0, 8)))
	p.send(dump(11, true, stored(0, nil, 8, 8)))
	p.send(dump(11, false, stored(0, nil, 16, 5)))
	wantLimit(t, p.endErr(), "dump.events: the dump holds 21 blocks (all its parts so far), more than max_dump_blocks 20", "DUMP_TOO_LARGE", "max_dump_blocks")
	if got := e.cachedBlocks(1); got != 20 {
		t.Errorf("cached blocks after refused dumps = %d, want the 20 of the first dump (parts of an unfinished dump are dropped)", got)
	}
}

// TestCountPublish: the wire count agrees with the decoded message on random messages, removed
// hashes packed or not.
func TestCountPublish(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 500 {
		var evs []*kvrouterv1.KvEvent
		wantBlocks := 0
		for j := range rng.IntN(6) {
			switch rng.IntN(3) {
			case 0:
				n := 1 + rng.IntN(5)
				evs = append(evs, stored(uint64(j), nil, 0, n))
				wantBlocks += n
			case 1:
				var hs []uint64
				for range 1 + rng.IntN(5) {
					hs = append(hs, rng.Uint64()>>rng.IntN(64))
				}
				evs = append(evs, removed(uint64(j), hs...))
				wantBlocks += len(hs)
			default:
				evs = append(evs, cleared(uint64(j)))
			}
		}
		msg, field := events(evs...), "events"
		if i%2 == 1 {
			msg, field = dump(3, i%4 == 1, evs...), "dump"
		}
		b, err := proto.Marshal(msg)
		if err != nil {
			t.Fatal(err)
		}
		if i%3 == 0 {
			b = unpackRemoved(t, b)
			back := &kvrouterv1.PublishRequest{}
			if err := proto.Unmarshal(b, back); err != nil || !proto.Equal(back, msg) {
				t.Fatalf("unpacked encoding decodes to %v, %v; want the message back", back, err)
			}
		}
		got, ok := countPublish(b)
		want := publishCounts{field: field, events: len(evs), blocks: wantBlocks}
		if len(evs) == 0 {
			want.field = field // an empty batch is still present as a field
		}
		if diff := cmp.Diff(want, got, cmp.AllowUnexported(publishCounts{})); !ok || diff != "" {
			t.Fatalf("countPublish(message %d) ok=%v, diff (-want +got):\n%s", i, ok, diff)
		}
	}
	if _, ok := countPublish([]byte{0x12, 0x05, 0x01}); ok {
		t.Error("countPublish(truncated bytes) reported ok")
	}
}

// unpackRemoved re-encodes a PublishRequest with every packed BlocksRemoved.block_hashes written as
// one field per hash, as another encoder may do (decoders must accept both).
func unpackRemoved(t *testing.T, b []byte) []byte {
	t.Helper()
	// Nested messages on the way to the hashes: PublishRequest > batch or dump > KvEvent > removed.
	var walk func(b []byte, depth int) []byte
	walk = func(b []byte, depth int) []byte {
		var out []byte
		for len(b) > 0 {
			num, typ, n := protowire.ConsumeTag(b)
			if n < 0 {
				t.Fatalf("bad tag at depth %d", depth)
			}
			b = b[n:]
			if typ != protowire.BytesType {
				n = protowire.ConsumeFieldValue(num, typ, b)
				out = protowire.AppendTag(out, num, typ)
				out = append(out, b[:n]...)
				b = b[n:]
				continue
			}
			v, n := protowire.ConsumeBytes(b)
			b = b[n:]
			switch {
			case depth == 3 && num == fieldRemovedHashes:
				for len(v) > 0 {
					x, n := protowire.ConsumeVarint(v)
					v = v[n:]
					out = protowire.AppendTag(out, num, protowire.VarintType)
					out = protowire.AppendVarint(out, x)
				}
				continue
			case depth < 2 || (depth == 2 && num == fieldEventRemoved):
				v = walk(v, depth+1)
			}
			out = protowire.AppendTag(out, num, protowire.BytesType)
			out = protowire.AppendBytes(out, v)
		}
		return out
	}
	return walk(b, 0)
}

// TestDumpsInFlightAreBounded: the dumps in parts of all streams hold at most max_dump_bytes_in_flight
// between their parts, together: with one stream's dump holding part of it, another stream's parts
// past the rest are refused (RESOURCE_EXHAUSTED, DUMPS_IN_FLIGHT, with a retry delay) and what they
// held is given back, while the first stream's dump completes. A part held is counted at 16 bytes a
// block and a few an event, not the ~100 of decoded events. Before, every stream could hold a
// dump of max_dump_blocks, decoded: 170-367 MiB each for a million blocks, with no bound on them all.
func TestDumpsInFlightAreBounded(t *testing.T) {
	const limit = 256 << 10
	e := newTestEnv(t, func(o *Options) { o.MaxDumpBytesInFlight = limit })
	held := func() float64 { return e.metric("kvrouter_publish_dump_bytes_in_flight", "", "").GetGauge().GetValue() }
	a := e.connect(1)
	a.send(dump(5, true, stored(0, nil, 0, 6000)))
	eventually(t, "A's first part held", func() bool { return held() > 0 })
	if got := held(); got > 6000*20 {
		t.Errorf("a part of 6,000 blocks holds %.0f bytes, want about 16 a block", got)
	}

	b := e.connect(2)
	for i := range 8 {
		if b.stream.Send(dump(5, true, stored(0, nil, 6000+i*4000, 4000))) != nil {
			break // refused: the stream ended
		}
	}
	err := b.endErr()
	st := status.Convert(err)
	var reason string
	var delay time.Duration
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			reason = d.GetReason() + "/" + d.GetMetadata()["limit"]
		case *errdetails.RetryInfo:
			delay = d.GetRetryDelay().AsDuration()
		}
	}
	if st.Code() != codes.ResourceExhausted || reason != "DUMPS_IN_FLIGHT/max_dump_bytes_in_flight" || delay <= 0 ||
		!strings.HasPrefix(st.Message(), "dump.events: the dumps in parts that this replica's streams hold take ") {
		t.Fatalf("B's parts past the budget = %v %q (%s, retry after %v), want RESOURCE_EXHAUSTED DUMPS_IN_FLIGHT naming max_dump_bytes_in_flight, with a retry delay",
			st.Code(), st.Message(), reason, delay)
	}
	eventually(t, "B's parts given back", func() bool { return held() <= 6000*20 })

	a.send(dump(5, false, stored(0, nil, 6000, 10)))
	wantMsg(t, a.recv(), ack(5))
	if got := e.cachedBlocks(1); got != 6010 {
		t.Errorf("A's cached blocks after its dump = %d, want 6,010", got)
	}
	eventually(t, "nothing held once the dump applied", func() bool { return held() == 0 })
}
