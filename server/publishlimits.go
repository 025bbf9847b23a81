package server

import (
	"fmt"
	"strconv"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/server/app"
)

// publishLimits bound one Publish message, so that receiving it costs a bounded amount of memory
// whatever it holds. gRPC's own receive limit is server-wide and must stay large enough for a
// Route carrying a 1M-token prompt; a Publish message is held to these tighter ones.
//
// Bytes alone would not bound memory: a stored block can take 2 bytes on the wire and about 80 once
// decoded, so 4 MiB of empty blocks would decode into some 170 MiB. The events and blocks are
// therefore counted on the wire, without decoding, and the message is decoded only within both
// limits: it then costs at most about 4 bytes per wire byte (token ids) plus a fixed amount per
// event and per block (measured in docs/BENCHMARKS.md, "Publish message memory").
type publishLimits struct {
	maxBytes  int // wire size of one message
	maxBlocks int // events in one message, and stored blocks plus removed hashes in one message
}

// publishFrame is what the Publish handler receives: the message's size and counts, and the message
// itself, decoded only when it is within the limits (msg is nil otherwise).
type publishFrame struct {
	limits publishLimits
	size   int
	counts publishCounts
	msg    *kvrouterv1.PublishRequest
}

// limitingCodec is the server's codec: the standard protobuf codec, except that a publishFrame is
// sized and counted before it is decoded, and a RouteRequest's token ids are decoded by a fast path
// (unmarshalRoute).
//
// A RouteRequest larger than maxRouteBytes is not decoded at all: it is marked (markTooLarge) and
// the handler refuses it. Decoding is where a message's memory multiplies (a one-byte token id
// becomes four bytes, a two-byte annotation a 16-byte string header and an allocation), so a
// Route's cost is bounded by what the largest legitimate one needs, not by gRPC's server-wide limit.
type limitingCodec struct {
	base          encoding.CodecV2
	maxRouteBytes int
}

func newLimitingCodec(maxRouteBytes int) limitingCodec {
	return limitingCodec{base: encoding.GetCodecV2(grpcproto.Name), maxRouteBytes: maxRouteBytes}
}

// routeOverhead is what a Route may hold besides its token ids: its names (model, request and
// session ids, LoRA and namespace), annotations, hints and configuration override, and its
// multimodal inputs (at most 24 bytes each: a tag and length, a 10-byte hash, two 5-byte positions).
const routeOverhead = 64<<10 + maxMultimodalObjects*24

// maxRouteBytes is the largest Route message with at most maxPromptTokens token ids: five bytes
// per token id (the longest varint of a uint32) plus routeOverhead.
func maxRouteBytes(maxPromptTokens int) int { return 5*maxPromptTokens + routeOverhead }

// tooLargeField is the field number that marks a message too large to decode (markTooLarge): the
// largest protobuf allows, which no kvrouter message uses.
const tooLargeField = protowire.Number(1<<29 - 1)

// markTooLarge leaves m empty but for a mark holding the size of the message that was not decoded.
func markTooLarge(m proto.Message, size int) {
	b := protowire.AppendTag(nil, tooLargeField, protowire.VarintType)
	m.ProtoReflect().SetUnknown(protowire.AppendVarint(b, uint64(size)))
}

// tooLarge returns the size markTooLarge recorded in m, if it holds the mark.
func tooLarge(m proto.Message) (int, bool) {
	b := m.ProtoReflect().GetUnknown()
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 || num != tooLargeField || typ != protowire.VarintType {
		return 0, false
	}
	size, k := protowire.ConsumeVarint(b[n:])
	if k < 0 || n+k != len(b) {
		return 0, false
	}
	return int(size), true
}

func (c limitingCodec) Name() string { return c.base.Name() }
func (c limitingCodec) Marshal(v any) (mem.BufferSlice, error) {
	if e, ok := v.(*encodedMessage); ok {
		return e.data, nil // marshaled by the handler pool; gRPC frees it once sent
	}
	return c.base.Marshal(v)
}

func (c limitingCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if m, ok := v.(*kvrouterv1.RouteRequest); ok {
		if size := data.Len(); size > c.maxRouteBytes {
			markTooLarge(m, size)
			return nil
		}
		buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
		defer buf.Free()
		return unmarshalRoute(buf.ReadOnlyData(), m)
	}
	f, ok := v.(*publishFrame)
	if !ok {
		return c.base.Unmarshal(data, v)
	}
	f.size = data.Len()
	if f.size > f.limits.maxBytes {
		return nil
	}
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	b := buf.ReadOnlyData()
	if counts, ok := countPublish(b); ok {
		f.counts = counts
		if counts.events > f.limits.maxBlocks || counts.blocks > f.limits.maxBlocks || counts.helloBytes > maxHelloBytes {
			return nil
		}
	}
	// Malformed bytes are counted as far as they go; decoding says what is wrong with them.
	f.msg = new(kvrouterv1.PublishRequest)
	return proto.Unmarshal(b, f.msg)
}

// check returns the error for a frame over a limit, or nil.
func (f *publishFrame) check() error {
	switch {
	case f.size > f.limits.maxBytes:
		return limitExceeded("PUBLISH_MESSAGE_TOO_LARGE", "message", "max_publish_msg_bytes", f.limits.maxBytes, f.size,
			"%d bytes, more than max_publish_msg_bytes %d: split event batches, and send a large dump in parts (KvDump.more_follows)", f.size, f.limits.maxBytes)
	case f.counts.events > f.limits.maxBlocks:
		return limitExceeded("PUBLISH_BATCH_TOO_LARGE", f.counts.field+".events", "max_batch_blocks", f.limits.maxBlocks, f.counts.events,
			"holds %d events, more than max_batch_blocks %d: split the batch", f.counts.events, f.limits.maxBlocks)
	case f.counts.helloBytes > maxHelloBytes:
		return invalidArgumentf("hello", "must be at most %d bytes encoded (got %d): its model at most %d bytes, its endpoint at most %d", maxHelloBytes, f.counts.helloBytes, maxModelBytes, maxEndpointBytes)
	case f.counts.leaveBytes > maxLeaveBytes:
		return invalidArgumentf("leave.reason", "must be at most %d bytes (the leave is %d bytes encoded)", app.MaxLeaveReasonBytes, f.counts.leaveBytes)
	case f.counts.blocks > f.limits.maxBlocks:
		return limitExceeded("PUBLISH_BATCH_TOO_LARGE", f.counts.field+".events", "max_batch_blocks", f.limits.maxBlocks, f.counts.blocks,
			"holds %d blocks (stored blocks plus removed hashes), more than max_batch_blocks %d: split the batch", f.counts.blocks, f.limits.maxBlocks)
	}
	return nil
}

// limitExceeded returns RESOURCE_EXHAUSTED for a message over a limit: the message names the field
// and the limit, the ErrorInfo carries them for clients. There is no RetryInfo: resending the same
// message cannot succeed.
func limitExceeded(reason, field, limit string, max, got int, format string, args ...any) error {
	st := status.New(codes.ResourceExhausted, field+": "+fmt.Sprintf(format, args...))
	return withDetails(st, &errdetails.ErrorInfo{Reason: reason, Domain: errorDomain, Metadata: map[string]string{
		"field": field, "limit": limit, "max": strconv.Itoa(max), "got": strconv.Itoa(got),
	}})
}

// publishCounts is what one encoded PublishRequest carries: events, and stored blocks plus removed
// hashes, in its event batch or dump (field names which).
type publishCounts struct {
	field          string // "events" or "dump"
	events, blocks int
	helloBytes     int // the encoded hello's size, when the message is one
	leaveBytes     int // the encoded leave's size, when the message is one
}

// maxLeaveBytes is the largest encoded leave that can be valid: its reason at its limit.
const maxLeaveBytes = app.MaxLeaveReasonBytes + 8

// maxHelloBytes is the largest encoded hello that can be valid: its model and endpoint at their
// limits and every other field at its largest, with room to spare. A larger one is refused before
// it is decoded: decoding a 1 MB endpoint only to refuse it cost the router 5x the memory of the
// message, and the frontends' Route p99 grew 4x while two attackers sent them.
const maxHelloBytes = maxModelBytes + maxEndpointBytes + 1024

// Field numbers of the messages countPublish walks (proto/kvrouter/v1/worker.proto).
const (
	fieldPublishHello  = 1 // PublishRequest.hello
	fieldPublishEvents = 2 // PublishRequest.events
	fieldPublishDump   = 3 // PublishRequest.dump
	fieldPublishLeave  = 5 // PublishRequest.leave
	fieldBatchEvents   = 1 // EventBatch.events
	fieldDumpEvents    = 2 // KvDump.events
	fieldEventStored   = 4 // KvEvent.stored
	fieldEventRemoved  = 5 // KvEvent.removed
	fieldStoredBlocks  = 2 // BlocksStored.blocks
	fieldRemovedHashes = 1 // BlocksRemoved.block_hashes
)

// countPublish counts a PublishRequest's events and blocks on the wire, allocating nothing. It
// reports false for bytes that are not a well-formed message.
func countPublish(b []byte) (publishCounts, bool) {
	var c publishCounts
	ok := eachField(b, func(num protowire.Number, typ protowire.Type, v []byte) bool {
		eventsField := protowire.Number(0)
		switch {
		case num == fieldPublishHello && typ == protowire.BytesType:
			c.helloBytes = len(v)
			return true
		case num == fieldPublishLeave && typ == protowire.BytesType:
			c.leaveBytes = len(v)
			return true
		case num == fieldPublishEvents && typ == protowire.BytesType:
			c.field, eventsField = "events", fieldBatchEvents
		case num == fieldPublishDump && typ == protowire.BytesType:
			c.field, eventsField = "dump", fieldDumpEvents
		default:
			return true
		}
		return eachField(v, func(num protowire.Number, typ protowire.Type, ev []byte) bool {
			if num != eventsField || typ != protowire.BytesType {
				return true
			}
			c.events++
			return countEventBlocks(ev, &c.blocks)
		})
	})
	return c, ok
}

// countEventBlocks adds a KvEvent's stored blocks and removed hashes to n.
func countEventBlocks(ev []byte, n *int) bool {
	return eachField(ev, func(num protowire.Number, typ protowire.Type, v []byte) bool {
		switch {
		case num == fieldEventStored && typ == protowire.BytesType:
			return eachField(v, func(num protowire.Number, typ protowire.Type, _ []byte) bool {
				if num == fieldStoredBlocks {
					*n++
				}
				return true
			})
		case num == fieldEventRemoved && typ == protowire.BytesType:
			return eachField(v, func(num protowire.Number, typ protowire.Type, hashes []byte) bool {
				switch {
				case num != fieldRemovedHashes:
				case typ == protowire.BytesType: // packed: one varint per hash
					for _, x := range hashes {
						if x < 0x80 {
							*n++
						}
					}
				default:
					*n++
				}
				return true
			})
		}
		return true
	})
}

// eachField calls f with every field of an encoded message (v is the value's bytes for
// length-delimited fields, nil otherwise) until f returns false; it reports false for malformed bytes.
func eachField(b []byte, f func(num protowire.Number, typ protowire.Type, v []byte) bool) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		var v []byte
		if typ == protowire.BytesType {
			v, n = protowire.ConsumeBytes(b)
		} else {
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return false
		}
		b = b[n:]
		if !f(num, typ, v) {
			return false
		}
	}
	return true
}
