package trace

import (
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestSegmentTokens(t *testing.T) {
	seg := Segment{Key: 42, Len: 512}
	all := seg.AppendTokens(nil, 0, 512)
	if diff := cmp.Diff(all, seg.AppendTokens(nil, 0, 512)); diff != "" {
		t.Fatalf("tokens of one segment differ between two calls (-first +second):\n%s", diff)
	}
	for _, tok := range all {
		if tok < FirstToken || tok >= TokenLimit {
			t.Fatalf("token %d outside [%d, %d)", tok, FirstToken, TokenLimit)
		}
	}
	if distinct := len(uniq(all)); distinct < 500 {
		t.Errorf("512 tokens have %d distinct ids, want about 511", distinct)
	}
	tests := []struct{ from, to int }{{0, 0}, {0, 16}, {16, 32}, {496, 512}, {100, 357}, {511, 512}}
	for _, tt := range tests {
		prefix := []uint32{7, 8}
		got := seg.AppendTokens(slices.Clone(prefix), tt.from, tt.to)
		want := append(slices.Clone(prefix), all[tt.from:tt.to]...)
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("AppendTokens(%d, %d) (-want +got):\n%s", tt.from, tt.to, diff)
		}
	}
	other := Segment{Key: 43, Len: 512}.AppendTokens(nil, 0, 512)
	if same := countEqual(all, other); same > 2 {
		t.Errorf("keys 42 and 43 give %d equal tokens of 512 at the same positions, want about 0", same)
	}
}

func TestRequestTokenRange(t *testing.T) {
	req := Request{Segments: []Segment{{Key: 1, Len: 10}, {Key: 2, Len: 5}, {Key: 3, Len: 20}}}
	if got := req.InputTokens(); got != 35 {
		t.Fatalf("InputTokens() = %d, want 35", got)
	}
	all := req.AppendTokens(nil)
	want := Segment{Key: 1}.AppendTokens(nil, 0, 10)
	want = Segment{Key: 2}.AppendTokens(want, 0, 5)
	want = Segment{Key: 3}.AppendTokens(want, 0, 20)
	if diff := cmp.Diff(want, all); diff != "" {
		t.Fatalf("AppendTokens (-want +got):\n%s", diff)
	}
	for _, r := range [][2]int{{0, 35}, {0, 0}, {35, 35}, {3, 12}, {10, 15}, {9, 16}, {14, 35}, {0, 10}, {12, 13}} {
		if diff := cmp.Diff(all[r[0]:r[1]], req.AppendTokenRange(nil, r[0], r[1]), cmpEmpty); diff != "" {
			t.Errorf("AppendTokenRange(%d, %d) (-want +got):\n%s", r[0], r[1], diff)
		}
	}
	for _, r := range [][2]int{{-1, 3}, {5, 4}, {30, 36}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("AppendTokenRange(%d, %d) did not panic", r[0], r[1])
				}
			}()
			req.AppendTokenRange(nil, r[0], r[1])
		}()
	}
}

// cmpEmpty makes cmp.Diff treat nil and empty slices alike.
var cmpEmpty = cmp.Comparer(func(a, b []uint32) bool { return slices.Equal(a, b) })

// uniq returns the distinct values of xs.
func uniq(xs []uint32) map[uint32]bool {
	m := make(map[uint32]bool, len(xs))
	for _, x := range xs {
		m[x] = true
	}
	return m
}

// countEqual returns how many positions a and b agree at.
func countEqual(a, b []uint32) int {
	n := 0
	for i := range min(len(a), len(b)) {
		if a[i] == b[i] {
			n++
		}
	}
	return n
}

// commonPrefix returns the length of the longest common prefix of a and b.
func commonPrefix(a, b []uint32) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// wantErr fails t unless err is an error containing every fragment.
func wantErr(t *testing.T, err error, fragments ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want one containing %q", fragments)
	}
	for _, f := range fragments {
		if !strings.Contains(err.Error(), f) {
			t.Errorf("error %q does not contain %q", err, f)
		}
	}
}

// itoa formats n in decimal.
func itoa(n int) string { return strconv.Itoa(n) }
