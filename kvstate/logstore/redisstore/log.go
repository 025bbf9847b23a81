package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

// Log is one shared log in Redis.
type Log struct {
	rdb   redis.UniversalClient
	keys  Keys
	chunk int // snapshot piece size
}

var _ logstore.LogStore = (*Log)(nil)

// Name names the store.
func (l *Log) Name() string { return "redis" }

// Ping checks that Redis answers.
func (l *Log) Ping(ctx context.Context) error { return l.rdb.Ping(ctx).Err() }

// Keys returns the names of the log's keys.
func (l *Log) Keys() Keys { return l.keys }

// Stream entry fields.
const (
	fieldEntry       = "e"
	fieldReplica     = "r"
	fieldSeq         = "s"
	fieldGeneration  = "g"
	fieldNumber      = "n"
	fieldTraceParent = "t"
)

// fencedAdd appends one entry (ARGV[2], appender ARGV[3], the sequence numbers of its changes
// ARGV[4], and the traceparents ARGV[5], "" when none is traced) to the stream KEYS[2] if the
// generation KEYS[1] is ARGV[1], tagging it with the generation and with its number, counted in
// KEYS[3]. The counter and the stream change together, so a Redis that comes back from an AOF
// missing its last writes has both rolled back alike: a replica that applied entry N and finds the
// counter below N knows the log lost entries it holds. ARGV[6..], three at a time, change the
// booking index KEYS[4] with the entry: "b" id score adds a booking, "f" id removes one, "e" _
// score removes those scored below score.
var fencedAdd = redis.NewScript(`
local g = redis.call('GET', KEYS[1])
if g ~= ARGV[1] then
  return redis.error_reply('KVRFENCED ' .. (g or 'none'))
end
local n = redis.call('INCR', KEYS[3])
local id
if ARGV[5] ~= '' then
  id = redis.call('XADD', KEYS[2], '*', 'e', ARGV[2], 'r', ARGV[3], 's', ARGV[4], 'g', ARGV[1], 'n', n, 't', ARGV[5])
else
  id = redis.call('XADD', KEYS[2], '*', 'e', ARGV[2], 'r', ARGV[3], 's', ARGV[4], 'g', ARGV[1], 'n', n)
end
for i = 6, #ARGV - 2, 3 do
  local op = ARGV[i]
  if op == 'b' then
    redis.call('ZADD', KEYS[4], ARGV[i + 2], ARGV[i + 1])
  elseif op == 'f' then
    redis.call('ZREM', KEYS[4], ARGV[i + 1])
  elseif op == 'e' then
    redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. ARGV[i + 2])
  end
end
return id
`)

func isFenced(err error) bool { return err != nil && strings.HasPrefix(err.Error(), "KVRFENCED") }

// Append appends entries in one round trip (a pipeline of fencedAdd), loading the script again
// when Redis lost its script cache.
func (l *Log) Append(ctx context.Context, gen string, entries []logstore.Entry) []error {
	errs := make([]error, len(entries))
	keys := []string{l.keys.Generation(), l.keys.Stream(), l.keys.Seq(), l.keys.Bookings()}
	send := make([]int, len(entries))
	for i := range send {
		send[i] = i
	}
	for attempt := 0; attempt < 2 && len(send) > 0; attempt++ {
		cmds := make([]*redis.Cmd, len(send))
		_, _ = l.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for k, i := range send {
				cmds[k] = fencedAdd.EvalSha(ctx, p, keys, entryArgs(gen, entries[i])...)
			}
			return nil
		})
		var again []int
		for k, c := range cmds {
			i := send[k]
			err := c.Err()
			var reply redis.Error
			switch {
			case err == nil:
				errs[i] = nil
			case redis.HasErrorPrefix(err, "NOSCRIPT"):
				errs[i] = err
				again = append(again, i)
			case isFenced(err):
				errs[i] = fmt.Errorf("%w (%v)", logstore.ErrFenced, err)
			case errors.As(err, &reply):
				errs[i] = err // Redis refused it: not appended
			default:
				// No reply (a transport error fails every command of the pipeline with it): the
				// script may have run, and the entry be in the stream.
				errs[i] = fmt.Errorf("%w: %w", logstore.ErrUnknownOutcome, err)
			}
		}
		if len(again) == 0 {
			break
		}
		// Redis lost its script cache (a restart): load the script and send those again.
		if err := fencedAdd.Load(ctx, l.rdb).Err(); err != nil {
			break
		}
		send = again
	}
	return errs
}

// entryArgs returns fencedAdd's arguments for e in generation gen.
func entryArgs(gen string, e logstore.Entry) []any {
	args := make([]any, 0, 5+3*len(e.Index))
	args = append(args, gen, e.Data, e.Replica, e.Seqs, e.TraceParents)
	for _, o := range e.Index {
		args = append(args, string(o.Op), o.ID, strconv.FormatInt(o.Score, 10))
	}
	return args
}

// Read returns the entries after position after.
func (l *Log) Read(ctx context.Context, after string, count int, block time.Duration) ([]logstore.Record, error) {
	streams, err := l.rdb.XRead(ctx, &redis.XReadArgs{
		Streams: []string{l.keys.Stream(), after}, Count: int64(count), Block: block,
	}).Result()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []logstore.Record
	for _, st := range streams {
		for _, msg := range st.Messages {
			out = append(out, record(msg))
		}
	}
	return out, nil
}

// record converts a stream message.
func record(msg redis.XMessage) logstore.Record {
	r := logstore.Record{ID: msg.ID}
	str := func(f string) string { s, _ := msg.Values[f].(string); return s }
	r.Data = []byte(str(fieldEntry))
	r.Replica = str(fieldReplica)
	r.Seqs = str(fieldSeq)
	r.TraceParent = str(fieldTraceParent)
	r.Generation, r.HasGeneration = msg.Values[fieldGeneration].(string)
	if v, ok := msg.Values[fieldNumber].(string); ok {
		r.Number, _ = strconv.ParseUint(v, 10, 64)
		r.HasNumber = true
	}
	return r
}

// Head reads the log's generation, counter, length and bounds in one round trip.
func (l *Log) Head(ctx context.Context) (logstore.Head, error) {
	var h logstore.Head
	p := l.rdb.Pipeline()
	vals := p.MGet(ctx, l.keys.Generation(), l.keys.Seq())
	n := p.XLen(ctx, l.keys.Stream())
	first := p.XRangeN(ctx, l.keys.Stream(), "-", "+", 1)
	last := p.XRevRangeN(ctx, l.keys.Stream(), "+", "-", 1)
	if _, err := p.Exec(ctx); err != nil {
		return h, err
	}
	v := vals.Val()
	h.Generation, _ = v[0].(string)
	h.Count, _ = strconv.ParseUint(fmt.Sprint(v[1]), 10, 64) // "<nil>" parses to 0
	h.Length = n.Val()
	h.Last = "0-0"
	if f := first.Val(); len(f) > 0 {
		h.First = f[0].ID
	}
	if t := last.Val(); len(t) > 0 {
		h.Last = t[0].ID
	}
	return h, nil
}

// bootstrapGeneration returns the generation KEYS[1], creating it if missing: "adopted" when a
// stream KEYS[2] or snapshot KEYS[3] exists already (written before generations), else "fresh" with
// Redis's time. ARGV[1] is the new id.
var bootstrapGeneration = redis.NewScript(`
local g = redis.call('GET', KEYS[1])
if g then return g end
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then
  g = ARGV[1] .. '/adopted'
else
  local t = redis.call('TIME')
  g = ARGV[1] .. '/fresh/' .. (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
redis.call('SET', KEYS[1], g)
return g
`)

// Bootstrap returns the generation, creating it if missing.
func (l *Log) Bootstrap(ctx context.Context, newID string) (string, error) {
	return bootstrapGeneration.Run(ctx, l.rdb, []string{l.keys.Generation(), l.keys.Stream(), l.keys.Snapshot()}, newID).Text()
}

// reseedGeneration replaces the generation KEYS[1] by ARGV[2] with the snapshot ARGV[3] (KEYS[3],
// position "0-0" in KEYS[4]), an empty stream KEYS[2] and entry counter KEYS[5], if the generation
// is still ARGV[1] ("": missing) and either: ARGV[5] is not 0 and the counter is below it, or the
// generation is missing, or fresh and at most ARGV[4] ms old by Redis's clock. The booking index
// KEYS[6] becomes ARGV[6..], an id and its score at a time. Returns 1 if done.
var reseedGeneration = redis.NewScript(`
local g = redis.call('GET', KEYS[1])
if ARGV[5] ~= '0' then
  if g ~= ARGV[1] then return 0 end
  if tonumber(redis.call('GET', KEYS[5]) or '0') >= tonumber(ARGV[5]) then return 0 end
elseif g then
  if g ~= ARGV[1] then return 0 end
  local created = string.match(g, '^[^/]+/fresh/(%d+)$')
  if not created then return 0 end
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(created) > tonumber(ARGV[4]) then return 0 end
elseif ARGV[1] ~= '' then
  return 0
end
redis.call('DEL', KEYS[2], KEYS[5], KEYS[6])
for i = 6, #ARGV - 1, 2 do
  redis.call('ZADD', KEYS[6], ARGV[i + 1], ARGV[i])
end
redis.call('SET', KEYS[3], ARGV[3])
redis.call('SET', KEYS[4], '0-0')
redis.call('SET', KEYS[1], ARGV[2])
return 1
`)

// Reseed replaces the generation in one script; a reseed is rare and writes its snapshot whole,
// and the pieces of the snapshot it replaced are expired after.
func (l *Log) Reseed(ctx context.Context, r logstore.Reseed) (bool, error) {
	old, err := l.rdb.Get(ctx, l.keys.Snapshot()).Bytes()
	if err != nil && !errors.Is(err, redis.Nil) {
		return false, err
	}
	keys := []string{l.keys.Generation(), l.keys.Stream(), l.keys.Snapshot(), l.keys.SnapshotPosition(), l.keys.Seq(), l.keys.Bookings()}
	args := []any{r.Expected, r.New, r.Snapshot, r.Window.Milliseconds(), r.RewoundBehind}
	for id, score := range r.Bookings {
		args = append(args, id, score)
	}
	ok, err := reseedGeneration.Run(ctx, l.rdb, keys, args...).Int()
	if err != nil || ok != 1 {
		return false, err
	}
	l.expirePieces(ctx, old)
	return true, nil
}

// clock returns Redis's TIME as the node holding KEYS[1] reads it: on a cluster the masters'
// clocks differ, and the log's times are its node's.
var clock = redis.NewScript(`return redis.call('TIME')`)

// Now returns the clock of the node holding the log.
func (l *Log) Now(ctx context.Context) (time.Time, error) {
	v, err := clock.Run(ctx, l.rdb, []string{l.keys.Generation()}).Int64Slice()
	if err != nil {
		return time.Time{}, err
	}
	if len(v) != 2 {
		return time.Time{}, errors.New("unexpected reply to TIME")
	}
	return time.Unix(v[0], v[1]*1000), nil
}

// takeLease takes the lease KEYS[1] for ARGV[1] for ARGV[2] milliseconds, or extends it if ARGV[1]
// holds it already. It returns 1 when ARGV[1] holds the lease.
var takeLease = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return 0
`)

// TakeLease takes or extends the lease name.
func (l *Log) TakeLease(ctx context.Context, name, holder string, ttl time.Duration) (bool, error) {
	held, err := takeLease.Run(ctx, l.rdb, []string{l.keys.Lease(name)}, holder, max(ttl.Milliseconds(), 1)).Int()
	return held == 1, err
}

// ReleaseLease deletes the lease name.
func (l *Log) ReleaseLease(ctx context.Context, name string) error {
	return l.rdb.Del(ctx, l.keys.Lease(name)).Err()
}
