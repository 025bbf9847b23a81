package app

import (
	"context"
	"fmt"
	"strconv"

	"github.com/kvrouter/kvrouter/kvstate"
)

// DumpPart is a dump, or one part of a dump sent in parts: the blocks a worker rank holds, as
// stored events, through its event ThroughEventID. A dump replaces everything the router held for
// the rank. Parts with MoreFollows wait (in the log's encoding, 16 bytes a block, counted against
// max_dump_bytes_in_flight) until the last applies them, whole.
type DumpPart struct {
	ThroughEventID uint64
	Events         []kvstate.Event
	MoreFollows    bool
}

// pendingDump is a dump whose first parts arrived: it applies, whole, with the last.
type pendingDump struct {
	through uint64
	events  kvstate.EncodedEvents
	held    int64 // bytes taken from the dumpBudget
}

// Dump applies a dump, or keeps a part of one until its last part, and acks it once durable. A dump
// holds stored events only, over max_dump_blocks blocks in all its parts is refused, and a part
// that would pass the replica's max_dump_bytes_in_flight is refused for later; a refused dump in
// parts is dropped whole.
func (s *PublishSession) Dump(ctx context.Context, part DumpPart) error {
	blocks := 0
	for i, ev := range part.Events {
		if ev.Kind != kvstate.EventStored {
			return invalidField(fmt.Sprintf("dump.events[%d]", i), "must be a stored event (a dump lists the blocks the worker holds)")
		}
		blocks += len(ev.Blocks)
	}
	if d := s.dump; d != nil {
		if part.ThroughEventID != d.through {
			return invalidField("dump.through_event_id", "must be the same in every part of a dump (the first part had %d, got %d)", d.through, part.ThroughEventID)
		}
		blocks += d.events.Blocks()
	}
	if most := s.p.opts.MaxDumpBlocks; most > 0 && blocks > most {
		s.dropDump()
		return overLimit("DUMP_TOO_LARGE", "dump.events", "max_dump_blocks", most, blocks,
			"the dump holds %d blocks (all its parts so far), more than max_dump_blocks %d", blocks, most)
	}
	if part.MoreFollows {
		return s.holdPart(part)
	}
	events := part.Events
	if d := s.dump; d != nil {
		all, err := d.events.Events(events)
		s.dropDump()
		if err != nil {
			return &Refusal{Kind: RefusedInternal, Message: "dump: decoding its earlier parts: " + err.Error()}
		}
		events = all
	}
	res, err := s.p.append(ctx, s.shard, s.info, kvstate.KVDump{Worker: s.info.Key, Epoch: s.epoch, ThroughEventID: part.ThroughEventID, Events: events})
	if err != nil {
		return s.appendError(err)
	}
	s.p.opts.Observer.Applied(res)
	s.dumpAsked = false
	s.logger.Info("applied dump", "through_event_id", part.ThroughEventID, "events", len(events), "blocks", blocks)
	if res.Buffered {
		return nil
	}
	return s.ack(res)
}

// holdPart keeps a part of a dump until its last part, within the replica's budget for dumps in
// parts.
func (s *PublishSession) holdPart(part DumpPart) error {
	if s.dump == nil {
		s.dump = &pendingDump{through: part.ThroughEventID}
	}
	d := s.dump
	d.events.Append(part.Events)
	grow := int64(d.events.Size()) - d.held
	if !s.p.dumps.take(grow) {
		size := d.events.Size()
		s.dropDump()
		return &Refusal{Kind: RefusedLimit, Reason: "DUMPS_IN_FLIGHT", RetryAfter: dumpRetryDelay,
			Message: fmt.Sprintf("dump.events: the dumps in parts that this replica's streams hold take %d bytes, and this one's %d more would pass max_dump_bytes_in_flight %d; send the dump again later (or to another replica)",
				s.p.dumps.used.Load(), size, s.p.dumps.limit),
			Metadata: map[string]string{"field": "dump.events", "limit": "max_dump_bytes_in_flight", "max": strconv.FormatInt(s.p.dumps.limit, 10)}}
	}
	d.held += grow
	return nil
}

// dropDump gives up the session's dump in parts, and the memory it held.
func (s *PublishSession) dropDump() {
	if s.dump != nil {
		s.p.dumps.take(-s.dump.held)
		s.dump = nil
	}
}
