package kvstate_test

// The memory curve of the prefix index (issue 12, item 4 c): heap bytes per (block, worker) entry
// and per distinct block against the index's size, on the peers' workload, measured as
// TestPeerIndexBench measures its fill. Run it with scripts/bench.sh curves, or:
//
//	KVROUTER_CURVES=1 go test -run 'TestMemoryCurve' -count=1 -v -timeout 30m ./kvstate
//
// Without KVROUTER_CURVES it is skipped: a plain `go test` runs none of this.

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// memoryCurveBlocks are the index sizes of the curve; KVROUTER_CURVE_BLOCKS (comma-separated, with
// k and M suffixes) replaces them.
var memoryCurveBlocks = []int{10_000, 100_000, 1_000_000, 5_000_000, 20_000_000}

// TestMemoryCurve fills an empty Index with the peers' prompts (kvtest.Workload: 512 blocks sharing
// 128-384 with one of 100 roots, on one of 64 pods, through Index.Store) until it holds each size's
// distinct blocks, and prints the live heap it added: runtime.MemStats.HeapAlloc after two forced
// collections, after the fill minus before it, the generator built beforehand and each prompt's
// own data dropped once stored, so that only the index is counted. Every size starts from an empty
// index, so each point is what an index of that size costs, not the growth between points.
func TestMemoryCurve(t *testing.T) {
	if os.Getenv("KVROUTER_CURVES") == "" {
		t.Skip("set KVROUTER_CURVES=1 to run the index memory curve (about a minute, up to 4 GB of heap)")
	}
	sizes := memoryCurveBlocks
	if s := os.Getenv("KVROUTER_CURVE_BLOCKS"); s != "" {
		sizes = nil
		for _, f := range strings.Split(s, ",") {
			f, mult := strings.TrimSpace(f), 1
			switch {
			case strings.HasSuffix(f, "k"):
				f, mult = strings.TrimSuffix(f, "k"), 1_000
			case strings.HasSuffix(f, "M"):
				f, mult = strings.TrimSuffix(f, "M"), 1_000_000
			}
			n, err := strconv.Atoi(f)
			if err != nil || n < 1 {
				t.Fatalf("KVROUTER_CURVE_BLOCKS=%q: want comma-separated positive integers (k and M suffixes allowed)", s)
			}
			sizes = append(sizes, n*mult)
		}
	}
	for _, size := range sizes {
		w := kvtest.NewWorkload(kvtest.Seed)
		buf := make([]kvstate.Block, 0, kvtest.PromptBlocks)
		start := time.Now()
		ix := kvstate.NewIndex()
		base := kvtest.HeapAlloc()
		prompts := 0
		for ix.Len() < size {
			p := w.Next()
			if _, err := ix.Store(p.Pod, kvstate.TierDevice, 0, false, w.Blocks(p, buf[:0])); err != nil {
				t.Fatalf("Index.Store(prompt %d) = %v, want nil", prompts, err)
			}
			prompts++
		}
		heap := kvtest.HeapAlloc() - base
		blocks, pairs := ix.Len(), indexPairs(ix)
		t.Logf("%d prompts: %d blocks, %d (block, pod) pairs, heap %.1f MB: %.1f B/pair, %.1f B/block (%v)",
			prompts, blocks, pairs, float64(heap)/1e6, float64(heap)/float64(pairs), float64(heap)/float64(blocks), time.Since(start).Round(time.Millisecond))
		benchLine(fmt.Sprintf("CurveMemory/curve=index/blocks=%d", size), prompts, blocks, "blocks", pairs, "pairs",
			fmt.Sprintf("%.1f", float64(heap)/1e6), "heap-MB",
			fmt.Sprintf("%.1f", float64(heap)/float64(pairs)), "B/pair", fmt.Sprintf("%.1f", float64(heap)/float64(blocks)), "B/block")
		runtime.KeepAlive(ix)
		runtime.KeepAlive(w)
	}
}
