package trace

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"
)

// MooncakeBlockSize is the number of tokens one hash id of the Mooncake trace stands for.
const MooncakeBlockSize = 512

// mooncakeRow is one line of the Mooncake trace. Pointers tell a missing field from a zero.
type mooncakeRow struct {
	Timestamp    *int64 `json:"timestamp"`
	InputLength  *int   `json:"input_length"`
	OutputLength *int   `json:"output_length"`
	HashIDs      *[]int `json:"hash_ids"`
}

// LoadMooncake reads the Mooncake conversation trace: one JSON object a line, {"timestamp": ms,
// "input_length": tokens, "output_length": tokens, "hash_ids": [id, ...]}, where equal ids at the
// same position of two rows mean equal 512-token blocks up to and including that position.
//
// blockSize is the KV block size of the engines the trace will be replayed against. It must divide
// 512, so that a prefix of k shared hash ids is a prefix of k*512/blockSize whole shared engine
// blocks; LoadMooncake refuses any other. The prompts do not depend on it: hash id h at position i
// becomes the segment {Key: h, Len: 512} (the last one cut to the row's input_length), so sub-block
// j of h, for any block size b dividing 512, is that segment's tokens [j*b, (j+1)*b).
//
// Each row must have non-negative lengths, non-negative hash ids, exactly ceil(input_length/512)
// hash ids, and a timestamp no smaller than the previous row's; blank lines are skipped and unknown
// fields ignored. Errors name the line (counting from 1) and the rule broken. Request i (counting
// from 0) has ID "mooncake-i", Arrival its timestamp minus the first row's, and no Session (the
// trace has none).
func LoadMooncake(r io.Reader, blockSize int) ([]Request, error) {
	if blockSize <= 0 || MooncakeBlockSize%blockSize != 0 {
		return nil, fmt.Errorf("trace: block size %d does not divide the Mooncake block size %d", blockSize, MooncakeBlockSize)
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 64<<20)
	var (
		reqs  []Request
		first int64
		prev  int64
	)
	for line := 1; sc.Scan(); line++ {
		text := bytes.TrimSpace(sc.Bytes())
		if len(text) == 0 {
			continue
		}
		var row mooncakeRow
		if err := json.Unmarshal(text, &row); err != nil {
			return nil, fmt.Errorf("trace: mooncake line %d: %w", line, err)
		}
		req, ts, err := mooncakeRequest(&row, len(reqs))
		if err != nil {
			return nil, fmt.Errorf("trace: mooncake line %d: %w", line, err)
		}
		if len(reqs) == 0 {
			first = ts
		} else if ts < prev {
			return nil, fmt.Errorf("trace: mooncake line %d: timestamp %d is before the previous row's %d", line, ts, prev)
		}
		prev = ts
		req.Arrival = time.Duration(ts-first) * time.Millisecond
		reqs = append(reqs, req)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("trace: reading mooncake trace: %w", err)
	}
	return reqs, nil
}

// mooncakeRequest checks one row and turns it into request number i (without its Arrival), and
// returns its timestamp.
func mooncakeRequest(row *mooncakeRow, i int) (Request, int64, error) {
	switch {
	case row.Timestamp == nil:
		return Request{}, 0, errors.New(`field "timestamp" is missing`)
	case row.InputLength == nil:
		return Request{}, 0, errors.New(`field "input_length" is missing`)
	case row.OutputLength == nil:
		return Request{}, 0, errors.New(`field "output_length" is missing`)
	case row.HashIDs == nil:
		return Request{}, 0, errors.New(`field "hash_ids" is missing`)
	}
	in, out, ids := *row.InputLength, *row.OutputLength, *row.HashIDs
	if in < 0 {
		return Request{}, 0, fmt.Errorf("input_length %d is negative", in)
	}
	if out < 0 {
		return Request{}, 0, fmt.Errorf("output_length %d is negative", out)
	}
	if want := (in + MooncakeBlockSize - 1) / MooncakeBlockSize; len(ids) != want {
		return Request{}, 0, fmt.Errorf("%d hash_ids for input_length %d, want ceil(%d/%d) = %d",
			len(ids), in, in, MooncakeBlockSize, want)
	}
	var segs []Segment
	if len(ids) > 0 {
		segs = make([]Segment, len(ids))
	}
	for k, id := range ids {
		if id < 0 {
			return Request{}, 0, fmt.Errorf("hash_ids[%d] = %d is negative", k, id)
		}
		segs[k] = Segment{Key: uint64(id), Len: min(MooncakeBlockSize, in-k*MooncakeBlockSize)}
	}
	return Request{
		ID:           "mooncake-" + strconv.Itoa(i),
		Segments:     segs,
		OutputTokens: out,
	}, *row.Timestamp, nil
}
