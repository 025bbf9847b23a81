package redisstore

import (
	"context"
	"errors"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate/logstore"
)

// writeWatermark sets replica ARGV[1]'s watermark (ARGV[2], unless "") in the hash KEYS[1] and
// returns Redis's time in microseconds. With ARGV[2] "new" it announces the replica ("new <µs>").
// A script, so that TIME runs on the node holding the key on a cluster (its masters' clocks
// differ).
var writeWatermark = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if ARGV[2] == 'new' then
  redis.call('HSET', KEYS[1], ARGV[1], 'new ' .. string.format('%.0f', now))
elseif ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
return now
`)

// readWatermarks returns Redis's time in microseconds, the stream KEYS[2]'s last entry id ("0-0"
// when empty), the hash KEYS[1] of watermarks, and the score of member ARGV[1] in the booking index
// KEYS[3] (false: none), in that order and in one step: every entry the watermarks promise is at or
// before that id.
var readWatermarks = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local tip = '0-0'
if #last > 0 then tip = last[1][1] end
return {now, tip, redis.call('HGETALL', KEYS[1]), redis.call('ZSCORE', KEYS[3], ARGV[1])}
`)

// WriteMark sets replica's watermark and returns Redis's time.
func (l *Log) WriteMark(ctx context.Context, replica, value string) (int64, error) {
	return writeWatermark.Run(ctx, l.rdb, []string{l.keys.Replicas()}, replica, value).Int64()
}

// SetMark sets replica's watermark as it is.
func (l *Log) SetMark(ctx context.Context, replica, value string) error {
	return l.rdb.HSet(ctx, l.keys.Replicas(), replica, value).Err()
}

// DeleteMark forgets replica's watermark.
func (l *Log) DeleteMark(ctx context.Context, replica string) error {
	return l.rdb.HDel(ctx, l.keys.Replicas(), replica).Err()
}

// ReadMarks reads the clock, the tip, the watermarks and the booking index in one script.
func (l *Log) ReadMarks(ctx context.Context, booking string) (logstore.Marks, error) {
	v, err := readWatermarks.Run(ctx, l.rdb, []string{l.keys.Replicas(), l.keys.Stream(), l.keys.Bookings()}, booking).Slice()
	if err != nil && !errors.Is(err, redis.Nil) {
		return logstore.Marks{}, err
	}
	if len(v) != 4 {
		return logstore.Marks{}, errors.New("unexpected reply to the watermark script")
	}
	r := logstore.Marks{Indexed: v[3] != nil}
	r.Now, _ = v[0].(int64)
	r.Tip, _ = v[1].(string)
	pairs, _ := v[2].([]any)
	r.Marks = make(map[string]string, len(pairs)/2)
	for i := 0; i+1 < len(pairs); i += 2 {
		k, _ := pairs[i].(string)
		val, _ := pairs[i+1].(string)
		r.Marks[k] = val
	}
	return r, nil
}

// RefreshLeases sets the worker leases' deadline in the sorted set of leases.
func (l *Log) RefreshLeases(ctx context.Context, members []string, deadlineMs int64, onlyNew bool) error {
	if len(members) == 0 {
		return nil
	}
	zs := make([]redis.Z, len(members))
	for i, m := range members {
		zs[i] = redis.Z{Score: float64(deadlineMs), Member: m}
	}
	if onlyNew {
		return l.rdb.ZAddNX(ctx, l.keys.Leases(), zs...).Err()
	}
	return l.rdb.ZAdd(ctx, l.keys.Leases(), zs...).Err()
}

// claimExpired removes and returns up to ARGV[2] members whose deadline is before ARGV[1].
var claimExpired = redis.NewScript(`
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #expired > 0 then
  redis.call('ZREM', KEYS[1], unpack(expired))
end
return expired
`)

// ClaimExpired claims expired worker leases in one script.
func (l *Log) ClaimExpired(ctx context.Context, beforeMs int64, max int) ([]string, error) {
	claimed, err := claimExpired.Run(ctx, l.rdb, []string{l.keys.Leases()}, beforeMs, max).StringSlice()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	return claimed, err
}

// HasLease scans the worker leases for a member starting with prefix.
func (l *Log) HasLease(ctx context.Context, prefix string) (bool, error) {
	match := globEscape(prefix) + "*"
	for cursor := uint64(0); ; {
		found, next, err := l.rdb.ZScan(ctx, l.keys.Leases(), cursor, match, 1000).Result()
		if err != nil {
			return false, err
		}
		if len(found) > 0 {
			return true, nil
		}
		if cursor = next; cursor == 0 {
			return false, nil
		}
	}
}

// globEscape escapes the characters a Redis MATCH pattern gives a meaning to.
func globEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[]\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}
