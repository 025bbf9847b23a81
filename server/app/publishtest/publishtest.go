// Package publishtest is the contract of the Publish protocol, written once and run against every
// way of reaching it: directly against app.PublishSession (server/app's tests) and through the gRPC
// edge with a real client (server's tests). Each case drives worker streams with domain values and
// checks the replies and refusals, classified alike for both (Outcome), so a transport that maps a
// message or an error differently from the session fails here.
package publishtest

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/server/app"
)

// Message is one message a worker sends: exactly one of its fields is set.
type Message struct {
	Hello *Hello
	// Events is a batch of KV events.
	Events []kvstate.Event
	Dump   *app.DumpPart
	Load   *app.LoadReport
	// Leave, when set, is the reason of a leave.
	Leave *string
}

// Hello registers (first on a stream) or repeats the registration of a worker rank.
type Hello struct {
	Info  kvstate.WorkerInfo
	Fresh bool
}

// Reply is what the router sends a worker: a registration's answer, an ack or a resync request.
type Reply struct {
	Kind string // "registered", "ack" or "resync"
	// EventID is the last event id held (registered, when HasLast), the acked one (ack), or the one
	// a dump starts from (resync).
	EventID uint64
	HasLast bool
}

// Outcome is how a stream ended, as the suite compares it: the status code's name as gRPC spells
// it ("OK" for a stream the router ended after a leave; "InvalidArgument", "FailedPrecondition",
// "ResourceExhausted", "Unavailable" for a refusal), the stable reason (none for a bad field) and
// the field it names.
type Outcome struct {
	Code, Reason, Field string
}

// Conn is one worker's Publish stream.
type Conn interface {
	// Send sends m. A refusal is not its answer: the stream ends, and Recv returns it.
	Send(t *testing.T, m Message)
	// Recv returns the next reply or, once the stream ended, how it was refused; it fails the test
	// when neither comes within a few seconds.
	Recv(t *testing.T) (Reply, *Outcome)
	// Close ends the stream from the worker's side.
	Close()
}

// Limits are the caps a case runs under (0: the driver's default).
type Limits struct {
	MaxWorkersPerModel, MaxDumpBlocks int
}

// Env is one router replica a case talks to.
type Env interface {
	// Connect opens a worker stream.
	Connect(t *testing.T) Conn
	// State is the replica's state, for what a case checks beside the replies.
	State() *kvstate.State
}

// Run runs every case, each against a fresh Env from newEnv.
func Run(t *testing.T, newEnv func(t *testing.T, limits Limits) Env) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.run(t, newEnv(t, c.limits)) })
	}
}

// Info returns the hello of worker id's rank 0 of model m, aggregated, with 4-token blocks.
func Info(id uint64) kvstate.WorkerInfo {
	return kvstate.WorkerInfo{Key: kvstate.WorkerKey{ID: id}, Model: "m", Role: kvstate.RoleAggregated, BlockSize: 4,
		TotalKVBlocks: 1000, MaxNumBatchedTokens: 8192, Endpoint: "w:1", KVEventsEnabled: true}
}

// stored returns a stored event of id holding blocks with hashes from, from+1, ... chained.
func stored(id uint64, from, n uint64) kvstate.Event {
	e := kvstate.Event{ID: id, Kind: kvstate.EventStored}
	if from > 1 {
		e.Parent, e.HasParent = from-1, true
	}
	for h := from; h < from+n; h++ {
		e.Blocks = append(e.Blocks, kvstate.Block{Hash: h, Local: h * 31})
	}
	return e
}

var (
	registered   = Reply{Kind: "registered"}
	registeredAt = func(id uint64) Reply { return Reply{Kind: "registered", EventID: id, HasLast: true} }
	ack          = func(id uint64) Reply { return Reply{Kind: "ack", EventID: id} }
	resync       = func(id uint64) Reply { return Reply{Kind: "resync", EventID: id} }
)

// open connects worker id and checks its registration.
func open(t *testing.T, env Env, id uint64, want Reply) Conn {
	t.Helper()
	c := env.Connect(t)
	c.Send(t, Message{Hello: &Hello{Info: Info(id)}})
	expect(t, c, want)
	return c
}

// expect checks that c's next reply is want.
func expect(t *testing.T, c Conn, want Reply) {
	t.Helper()
	got, refused := c.Recv(t)
	if refused != nil {
		t.Fatalf("stream refused with %+v, want reply %+v", *refused, want)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("reply (-want +got):\n%s", diff)
	}
}

// expectRefused checks that c's stream ends refused as want.
func expectRefused(t *testing.T, c Conn, want Outcome) {
	t.Helper()
	got, refused := c.Recv(t)
	if refused == nil {
		t.Fatalf("got reply %+v, want the stream refused with %+v", got, want)
	}
	if diff := cmp.Diff(want, *refused); diff != "" {
		t.Fatalf("refusal (-want +got):\n%s", diff)
	}
}

// cachedBlocks is what the state holds for worker id.
func cachedBlocks(env Env, id uint64) int {
	w := env.State().Worker(kvstate.WorkerKey{ID: id})
	m := env.State().Model("m")
	if w == nil || m == nil {
		return -1
	}
	return int(m.Index.BlockCounts(w.Slot)[kvstate.TierDevice])
}

var cases = []struct {
	name   string
	limits Limits
	run    func(t *testing.T, env Env)
}{
	{name: "registration answers with no event held", run: func(t *testing.T, env Env) {
		open(t, env, 1, registered).Close()
	}},
	{name: "events are acked and applied", run: func(t *testing.T, env Env) {
		c := open(t, env, 1, registered)
		defer c.Close()
		c.Send(t, Message{Events: []kvstate.Event{stored(0, 1, 2), stored(1, 3, 1)}})
		expect(t, c, ack(1))
		if got := cachedBlocks(env, 1); got != 3 {
			t.Errorf("cached blocks = %d, want 3", got)
		}
	}},
	{name: "a new stream of the rank resumes from its last event and supersedes the old one", run: func(t *testing.T, env Env) {
		old := open(t, env, 1, registered)
		defer old.Close()
		old.Send(t, Message{Events: []kvstate.Event{stored(0, 1, 1), stored(1, 2, 1)}})
		expect(t, old, ack(1))
		c := open(t, env, 1, registeredAt(1))
		defer c.Close()
		expectRefused(t, old, Outcome{Code: "FailedPrecondition", Reason: "WORKER_SUPERSEDED"})
	}},
	{name: "an event id gap asks for a dump, which is acked", run: func(t *testing.T, env Env) {
		c := open(t, env, 1, registered)
		defer c.Close()
		c.Send(t, Message{Events: []kvstate.Event{stored(0, 1, 1)}})
		expect(t, c, ack(0))
		c.Send(t, Message{Events: []kvstate.Event{stored(3, 2, 1)}})
		expect(t, c, resync(1))
		c.Send(t, Message{Dump: &app.DumpPart{ThroughEventID: 3, Events: []kvstate.Event{stored(0, 1, 4)}}})
		expect(t, c, ack(3))
		if got := cachedBlocks(env, 1); got != 4 {
			t.Errorf("cached blocks after the dump = %d, want 4", got)
		}
	}},
	{name: "a dump in parts applies whole with its last part", run: func(t *testing.T, env Env) {
		c := open(t, env, 1, registered)
		defer c.Close()
		c.Send(t, Message{Dump: &app.DumpPart{ThroughEventID: 9, Events: []kvstate.Event{stored(0, 1, 2)}, MoreFollows: true}})
		c.Send(t, Message{Load: &app.LoadReport{KVUsedBlocks: 2}}) // a load report may come between parts
		c.Send(t, Message{Dump: &app.DumpPart{ThroughEventID: 9, Events: []kvstate.Event{stored(0, 3, 2)}}})
		expect(t, c, ack(9))
		if got := cachedBlocks(env, 1); got != 4 {
			t.Errorf("cached blocks = %d, want the 4 of both parts", got)
		}
	}},
	{name: "events during a dump in parts are refused", run: func(t *testing.T, env Env) {
		c := open(t, env, 1, registered)
		defer c.Close()
		c.Send(t, Message{Dump: &app.DumpPart{ThroughEventID: 9, Events: []kvstate.Event{stored(0, 1, 2)}, MoreFollows: true}})
		c.Send(t, Message{Events: []kvstate.Event{stored(10, 3, 1)}})
		expectRefused(t, c, Outcome{Code: "FailedPrecondition", Reason: "DUMP_IN_PROGRESS"})
	}},
	{name: "a dump's parts must name one through_event_id", run: func(t *testing.T, env Env) {
		c := open(t, env, 1, registered)
		defer c.Close()
		c.Send(t, Message{Dump: &app.DumpPart{ThroughEventID: 9, Events: []kvstate.Event{stored(0, 1, 2)}, MoreFollows: true}})
		c.Send(t, Message{Dump: &app.DumpPart{ThroughEventID: 8, Events: []kvstate.Event{stored(0, 3, 2)}}})
		expectRefused(t, c, Outcome{Code: "InvalidArgument", Field: "dump.through_event_id"})
	}},
	{name: "a dump holds stored events only", run: func(t *testing.T, env Env) {
		c := open(t, env, 1, registered)
		defer c.Close()
		c.Send(t, Message{Dump: &app.DumpPart{ThroughEventID: 1, Events: []kvstate.Event{{ID: 1, Kind: kvstate.EventCleared}}}})
		expectRefused(t, c, Outcome{Code: "InvalidArgument", Field: "dump.events[0]"})
	}},
	{name: "a dump over max_dump_blocks is refused", limits: Limits{MaxDumpBlocks: 3}, run: func(t *testing.T, env Env) {
		c := open(t, env, 1, registered)
		defer c.Close()
		c.Send(t, Message{Dump: &app.DumpPart{ThroughEventID: 9, Events: []kvstate.Event{stored(0, 1, 2)}, MoreFollows: true}})
		c.Send(t, Message{Dump: &app.DumpPart{ThroughEventID: 9, Events: []kvstate.Event{stored(0, 3, 2)}}})
		expectRefused(t, c, Outcome{Code: "ResourceExhausted", Reason: "DUMP_TOO_LARGE", Field: "dump.events"})
	}},
	{name: "event ids must increase within a batch", run: func(t *testing.T, env Env) {
		c := open(t, env, 1, registered)
		defer c.Close()
		c.Send(t, Message{Events: []kvstate.Event{stored(2, 1, 1), stored(2, 2, 1)}})
		expectRefused(t, c, Outcome{Code: "InvalidArgument", Field: "events.events[1].event_id"})
		if got := cachedBlocks(env, 1); got > 0 {
			t.Errorf("cached blocks = %d, want none: a refused batch applies nothing", got)
		}
	}},
	{name: "a load report names the stream's rank", run: func(t *testing.T, env Env) {
		c := open(t, env, 1, registered)
		defer c.Close()
		c.Send(t, Message{Load: &app.LoadReport{Rank: 1}})
		expectRefused(t, c, Outcome{Code: "InvalidArgument", Field: "load.dp_rank"})
	}},
	{name: "a repeated hello may change the endpoint, not the capacity", run: func(t *testing.T, env Env) {
		c := open(t, env, 1, registered)
		defer c.Close()
		moved := Info(1)
		moved.Endpoint = "w:2"
		c.Send(t, Message{Hello: &Hello{Info: moved}})
		expect(t, c, registered)
		if w := env.State().Worker(kvstate.WorkerKey{ID: 1}); w == nil || w.Info.Endpoint != "w:2" {
			t.Errorf("worker after the second hello = %+v, want endpoint w:2", w)
		}
		bigger := moved
		bigger.TotalKVBlocks++
		c.Send(t, Message{Hello: &Hello{Info: bigger}})
		expectRefused(t, c, Outcome{Code: "FailedPrecondition", Reason: "HELLO_CHANGED"})
	}},
	{name: "a leave removes the worker now and ends the stream with OK", run: func(t *testing.T, env Env) {
		c := open(t, env, 1, registered)
		defer c.Close()
		c.Send(t, Message{Events: []kvstate.Event{stored(0, 1, 2)}})
		expect(t, c, ack(0))
		reason := "engine health check failing"
		c.Send(t, Message{Leave: &reason})
		expectRefused(t, c, Outcome{Code: "OK"})
		if w := env.State().Worker(kvstate.WorkerKey{ID: 1}); w != nil {
			t.Errorf("worker after its leave = %+v, want it removed", w)
		}
		open(t, env, 1, registered).Close() // it may come back, afresh
	}},
	{name: "a leave's reason is at most 256 bytes", run: func(t *testing.T, env Env) {
		c := open(t, env, 1, registered)
		defer c.Close()
		reason := strings.Repeat("x", 300)
		c.Send(t, Message{Leave: &reason})
		expectRefused(t, c, Outcome{Code: "InvalidArgument", Field: "leave.reason"})
		if w := env.State().Worker(kvstate.WorkerKey{ID: 1}); w == nil {
			t.Error("the worker was removed by a refused leave")
		}
	}},
	{name: "a superseded stream's leave removes nothing", run: func(t *testing.T, env Env) {
		old := open(t, env, 1, registered)
		defer old.Close()
		c := open(t, env, 1, registered)
		defer c.Close()
		reason := "old process shutting down"
		old.Send(t, Message{Leave: &reason})
		expectRefused(t, old, Outcome{Code: "FailedPrecondition", Reason: "WORKER_SUPERSEDED"})
		if w := env.State().Worker(kvstate.WorkerKey{ID: 1}); w == nil {
			t.Error("the newer stream's worker was removed by the older stream's leave")
		}
	}},
	{name: "a model holds at most max_workers_per_model ranks", limits: Limits{MaxWorkersPerModel: 1}, run: func(t *testing.T, env Env) {
		first := open(t, env, 1, registered)
		defer first.Close()
		c := env.Connect(t)
		defer c.Close()
		c.Send(t, Message{Hello: &Hello{Info: Info(2)}})
		expectRefused(t, c, Outcome{Code: "ResourceExhausted", Reason: "WORKERS_PER_MODEL", Field: "hello.model"})
		open(t, env, 1, registered).Close() // a rank the model holds registers again
	}},
}
