package bridge

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"

	"github.com/kvrouter/kvrouter/clients/go/enginefeed"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

const digest = "0f3a9c2b7d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8" // vLLM's identifier of an image

// chain is a stored event of n blocks of 4 tokens (block i holds 10*i+1 .. 10*i+4), hashed 100+i,
// continuing block first-1 when first > 0.
func chain(first, n int, medium string) enginefeed.Event {
	ev := enginefeed.Event{Kind: enginefeed.BlockStored, BlockSize: 4, Medium: medium}
	if first > 0 {
		ev.ParentHash, ev.HasParent = uint64(100+first-1), true
	}
	for i := first; i < first+n; i++ {
		ev.BlockHashes = append(ev.BlockHashes, uint64(100+i))
		ev.TokenIDs = append(ev.TokenIDs, blockTokens(i)...)
	}
	return ev
}

func blockTokens(i int) []uint32 {
	return []uint32{uint32(10*i + 1), uint32(10*i + 2), uint32(10*i + 3), uint32(10*i + 4)}
}

// keyed sets the events' extra keys, one list per block (nil for none), as vLLM lists them.
func keyed(ev enginefeed.Event, lora string, blocks ...[]enginefeed.ExtraKey) enginefeed.Event {
	ev.LoraName = lora
	for _, keys := range blocks {
		ev.ExtraKeys = append(ev.ExtraKeys, keys...)
		ev.ExtraKeyEnds = append(ev.ExtraKeyEnds, int32(len(ev.ExtraKeys)))
	}
	return ev
}

func str(s string) enginefeed.ExtraKey {
	return enginefeed.ExtraKey{Kind: enginefeed.ExtraString, Text: s}
}
func pair(id string, off int64) enginefeed.ExtraKey {
	return enginefeed.ExtraKey{Kind: enginefeed.ExtraPair, Text: id, Offset: off}
}

// want is what the router must hold for block i: its tokens hashed with the salt of lora and ns,
// and the sorted multimodal hashes of the identifiers ids.
func want(i int, lora, ns string, ids ...string) uint64 {
	var mm []uint64
	for _, id := range ids {
		mm = append(mm, blockhash.MultimodalHash(id))
	}
	return blockhash.LocalsMultimodal(nil, blockTokens(i), 4, blockhash.Salt(lora, ns), objects(mm))[0]
}

func objects(mm []uint64) []blockhash.MultimodalObject {
	var out []blockhash.MultimodalObject
	for _, h := range mm {
		out = append(out, blockhash.MultimodalObject{Hash: h, Start: 0, End: 4})
	}
	return out
}

// TestTranslateExtraKeys checks how vLLM's extra keys become the keys Route computes: the LoRA
// name salts, a cache salt on a prompt's first block salts the chain after it (in later events and
// other tiers too), multimodal identifiers are folded into their blocks, and what cannot be keyed is
// dropped from that block on.
func TestTranslateExtraKeys(t *testing.T) {
	cat, dog := pair("cat.png", 0), pair("dog.png", -2)
	tests := []struct {
		name   string
		mode   ExtraKeys
		events []enginefeed.Event
		want   [][]uint64 // per event, the tokens_hash of the blocks forwarded
		drops  []drop
	}{
		{
			name:   "LoRA name in every block",
			events: []enginefeed.Event{keyed(chain(0, 2, "GPU"), "sql-lora", []enginefeed.ExtraKey{str("sql-lora")}, []enginefeed.ExtraKey{str("sql-lora")})},
			want:   [][]uint64{{want(0, "sql-lora", ""), want(1, "sql-lora", "")}},
		},
		{
			name: "cache salt on the first block salts the chain, in later events and other tiers",
			events: []enginefeed.Event{
				keyed(chain(0, 2, "GPU"), "", []enginefeed.ExtraKey{str("tenant-1")}, nil),
				chain(2, 1, "GPU"),
				keyed(chain(2, 1, "CPU"), "", nil), // offloaded: its own namespace, though its parent is not on the CPU
				chain(3, 1, "CPU"),
			},
			want: [][]uint64{{want(0, "", "tenant-1"), want(1, "", "tenant-1")}, {want(2, "", "tenant-1")}, {want(2, "", "tenant-1")}, {want(3, "", "tenant-1")}},
		},
		{
			name:   "LoRA, images and cache salt on the first block, as vLLM orders them",
			events: []enginefeed.Event{keyed(chain(0, 3, "GPU"), "a", []enginefeed.ExtraKey{str("a"), cat, str("tenant-1")}, []enginefeed.ExtraKey{str("a"), cat, dog}, []enginefeed.ExtraKey{str("a")})},
			want:   [][]uint64{{want(0, "a", "tenant-1", "cat.png"), want(1, "a", "tenant-1", "dog.png", "cat.png"), want(2, "a", "tenant-1")}},
		},
		{
			name:   "multimodal identifiers as strings (vLLM before 0.19): a digest anywhere, a chosen name past the first block",
			events: []enginefeed.Event{keyed(chain(0, 2, "GPU"), "", []enginefeed.ExtraKey{str(digest), str("tenant-1")}, []enginefeed.ExtraKey{str("user-image-7")})},
			want:   [][]uint64{{want(0, "", "tenant-1", digest), want(1, "", "tenant-1", "user-image-7")}},
		},
		{
			name:   "a string on a later block is no cache salt",
			events: []enginefeed.Event{chain(0, 1, "GPU"), keyed(chain(1, 1, "GPU"), "", []enginefeed.ExtraKey{str("user-image-7")})},
			want:   [][]uint64{{want(0, "", "")}, {want(1, "", "", "user-image-7")}},
		},
		{
			name:   "prompt embeddings are dropped from their block on",
			events: []enginefeed.Event{keyed(chain(0, 3, "GPU"), "", nil, []enginefeed.ExtraKey{{Kind: enginefeed.ExtraBytes}}, nil)},
			want:   [][]uint64{{want(0, "", "")}},
			drops:  []drop{{ReasonPromptEmbeds, 2}},
		},
		{
			name:   "a key of unknown shape is dropped from its block on",
			events: []enginefeed.Event{keyed(chain(0, 2, "GPU"), "", []enginefeed.ExtraKey{{Kind: enginefeed.ExtraOther}}, nil)},
			want:   [][]uint64{nil},
			drops:  []drop{{ReasonExtraKeys, 2}},
		},
		{
			name:   "keys listed for another number of blocks",
			events: []enginefeed.Event{keyed(chain(0, 2, "GPU"), "", []enginefeed.ExtraKey{cat})},
			want:   [][]uint64{nil},
			drops:  []drop{{ReasonExtraKeys, 2}},
		},
		{
			name:   "skip drops from the first block with keys",
			mode:   ExtraKeysSkip,
			events: []enginefeed.Event{keyed(chain(0, 3, "GPU"), "", nil, []enginefeed.ExtraKey{cat}, nil)},
			want:   [][]uint64{{want(0, "", "")}},
			drops:  []drop{{ReasonExtraKeys, 2}},
		},
		{
			name:   "ignore forwards the tokens with the LoRA name only",
			mode:   ExtraKeysIgnore,
			events: []enginefeed.Event{keyed(chain(0, 1, "GPU"), "a", []enginefeed.ExtraKey{str("a"), cat, str("tenant-1")})},
			want:   [][]uint64{{want(0, "a", "")}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := translator{m: newMirror(), blockSize: 4, extraKeys: tt.mode}
			var got [][]uint64
			var drops []drop
			for i := range tt.events {
				out, d := tr.translate(&tt.events[i], nil)
				var hashes []uint64
				for _, ev := range out {
					for _, b := range ev.GetStored().GetBlocks() {
						hashes = append(hashes, b.GetTokensHash())
					}
				}
				got = append(got, hashes)
				if d.reason != "" {
					drops = append(drops, d)
				}
			}
			if diff := cmp.Diff(tt.want, got, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("tokens_hash of the forwarded blocks (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.drops, drops, cmp.AllowUnexported(drop{}), cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("drops (-want +got):\n%s", diff)
			}
		})
	}
}

// TestTranslateForgetsRemovedNamespaces: the namespace of a salted block is kept while a tier holds
// the block, and forgotten once every tier removed it or the cache was cleared, so that memory
// follows the engine's cache.
func TestTranslateForgetsRemovedNamespaces(t *testing.T) {
	tr := translator{m: newMirror(), blockSize: 4}
	salted := keyed(chain(0, 2, "GPU"), "", []enginefeed.ExtraKey{str("tenant-1")}, nil)
	offloaded := chain(0, 2, "CPU")
	removedGPU := enginefeed.Event{Kind: enginefeed.BlockRemoved, BlockHashes: []uint64{100, 101}, Medium: "GPU"}
	removedCPU := enginefeed.Event{Kind: enginefeed.BlockRemoved, BlockHashes: []uint64{101}, Medium: "CPU"}
	for _, ev := range []enginefeed.Event{salted, offloaded, removedGPU, removedCPU} {
		tr.translate(&ev, nil)
	}
	if diff := cmp.Diff([]uint64{100}, keys(tr.namespaces)); diff != "" {
		t.Errorf("blocks with a namespace after the removals (-want +got):\n%s", diff)
	}
	// Block 1 again on the GPU, under block 0 (still on the CPU): salted by its parent.
	again := chain(1, 1, "GPU")
	out, _ := tr.translate(&again, nil)
	if got, w := out[0].GetStored().GetBlocks()[0].GetTokensHash(), want(1, "", "tenant-1"); got != w {
		t.Errorf("block 1 stored again has tokens_hash %d, want %d (salted as its parent)", got, w)
	}
	cleared := enginefeed.Event{Kind: enginefeed.AllBlocksCleared}
	tr.translate(&cleared, nil)
	if len(tr.namespaces) != 0 {
		t.Errorf("%d namespaces kept after the cache was cleared, want 0", len(tr.namespaces))
	}
}

func keys(m map[uint64]namespaced) []uint64 {
	var out []uint64
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestTranslateRemainingCopies: a removal whose remaining copy count is not 0 evicted one copy of
// a block the engine still holds, and is not forwarded; counts that do not match the hashes one to
// one are not trusted, and every hash is removed.
func TestTranslateRemainingCopies(t *testing.T) {
	tests := []struct {
		name   string
		copies []int64
		want   []uint64
	}{
		{"no counts", nil, []uint64{100, 101, 102}},
		{"one block still cached", []int64{0, 2, 0}, []uint64{100, 102}},
		{"every block still cached", []int64{1, 1, 1}, nil},
		{"counts for another number of blocks", []int64{1, 1}, []uint64{100, 101, 102}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := translator{m: newMirror(), blockSize: 4}
			ev := enginefeed.Event{Kind: enginefeed.BlockRemoved, BlockHashes: []uint64{100, 101, 102}, Medium: "GPU", RemainingCopies: tt.copies}
			out, d := tr.translate(&ev, nil)
			var got []uint64
			for _, e := range out {
				got = append(got, e.GetRemoved().GetBlockHashes()...)
			}
			if diff := cmp.Diff(tt.want, got, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("removed hashes forwarded (-want +got):\n%s", diff)
			}
			if d.reason != "" {
				t.Errorf("dropped %+v, want nothing", d)
			}
		})
	}
}

// TestTranslateSGLang: SGLang's metadata.cache_salt salts every block of its event (it names the salt
// on each), keyed as Route keys the salted prompt.
func TestTranslateSGLang(t *testing.T) {
	tr := translator{m: newMirror(), blockSize: 4}
	salted := chain(0, 2, "GPU")
	salted.CacheSalt = "tenant-1"
	next := chain(2, 1, "GPU")
	next.CacheSalt = "tenant-1"
	var got []uint64
	for _, ev := range []enginefeed.Event{salted, next} {
		out, d := tr.translate(&ev, nil)
		if d.reason != "" {
			t.Fatalf("dropped %+v", d)
		}
		for _, b := range out[0].GetStored().GetBlocks() {
			got = append(got, b.GetTokensHash())
		}
	}
	if diff := cmp.Diff([]uint64{want(0, "", "tenant-1"), want(1, "", "tenant-1"), want(2, "", "tenant-1")}, got); diff != "" {
		t.Errorf("tokens_hash of SGLang's salted blocks (-want +got):\n%s", diff)
	}
}

// forwarded is one kvrouter event as the tests compare it.
type forwarded struct {
	Tier    kvrouterv1.StorageTier
	Parent  *uint64     // stored: the parent block, if any
	Blocks  [][2]uint64 // stored: block hash, tokens_hash
	Removed []uint64
}

func summarize(events []*kvrouterv1.KvEvent) []forwarded {
	var out []forwarded
	for _, ev := range events {
		f := forwarded{Tier: ev.GetStorageTier(), Removed: ev.GetRemoved().GetBlockHashes()}
		if st := ev.GetStored(); st != nil {
			f.Parent = st.ParentHash
			for _, b := range st.GetBlocks() {
				f.Blocks = append(f.Blocks, [2]uint64{b.GetBlockHash(), b.GetTokensHash()})
			}
		}
		out = append(out, f)
	}
	return out
}

const (
	device = kvrouterv1.StorageTier_STORAGE_TIER_DEVICE
	host   = kvrouterv1.StorageTier_STORAGE_TIER_HOST
)

// blk is block i of the test prompts as the router must hold it: engine hash 100+i, its tokens
// hashed without salt.
func blk(i int) [2]uint64 { return [2]uint64{uint64(100 + i), want(i, "", "")} }

// TestEnginePayloads decodes payloads written as the engines write them (testdata, by
// gen-engine-payloads.py with Debian's python3-msgpack) and checks what reaches the router:
//   - vLLM's offloading placeholders name an offloaded block by hash only: a block the GPU events
//     named is keyed as it was there, with its parent; another is dropped;
//   - vLLM's self-describing offload events of chunks list a block that two chunks hold in both,
//     and remove it with each: the router removes it with the last;
//   - vLLM's remaining_copy_counts keep a block that still has a copy, and end one that has none
//     however often it was announced;
//   - SGLang's metadata.cache_salt salts its event's blocks, and EAGLE's bigram pairs are read by
//     their first token.
func TestEnginePayloads(t *testing.T) {
	tests := []struct {
		file  string
		want  [][]forwarded // per engine event
		drops []drop
		held  []forwarded // the mirror's dump after the batch
	}{
		{
			file: "vllm_offload_placeholder.msgpack",
			want: [][]forwarded{
				{{Tier: device, Blocks: [][2]uint64{blk(0), blk(1), blk(2), blk(3)}}},
				{{Tier: host, Blocks: [][2]uint64{blk(0)}}},
				{{Tier: host, Parent: ptr(uint64(100)), Blocks: [][2]uint64{blk(1)}}},
				nil,
				{{Tier: device, Removed: []uint64{100, 101, 102, 103}}},
				{{Tier: host, Removed: []uint64{100}}},
			},
			drops: []drop{{ReasonUnknownBlock, 1}},
			held:  []forwarded{{Tier: host, Parent: ptr(uint64(100)), Blocks: [][2]uint64{blk(1)}}},
		},
		{
			file: "vllm_offload_chunks.msgpack",
			want: [][]forwarded{
				{{Tier: host, Blocks: [][2]uint64{blk(0), blk(1)}}},
				{{Tier: host, Parent: ptr(uint64(101)), Blocks: [][2]uint64{blk(2), blk(3)}}},
				{{Tier: host, Parent: ptr(uint64(101)), Blocks: [][2]uint64{blk(2), {203, want(7, "", "")}}}},
				{{Tier: host, Removed: []uint64{103}}}, // block 2 is still in prompt B's chunk
				{{Tier: host, Removed: []uint64{102, 203}}},
			},
			held: []forwarded{{Tier: host, Blocks: [][2]uint64{blk(0), blk(1)}}},
		},
		{
			file: "vllm_copies.msgpack",
			want: [][]forwarded{
				{{Tier: device, Blocks: [][2]uint64{blk(0), blk(1)}}},
				{{Tier: device, Blocks: [][2]uint64{blk(0), blk(1)}}},
				{{Tier: device, Removed: []uint64{101}}}, // block 0 has a copy left
				{{Tier: device, Removed: []uint64{100}}},
			},
		},
		{
			file: "sglang_salted_eagle.msgpack",
			want: [][]forwarded{
				{{Tier: device, Blocks: [][2]uint64{{100, want(0, "", "tenant-1")}}}},
				{{Tier: device, Parent: ptr(uint64(100)), Blocks: [][2]uint64{{101, want(1, "", "tenant-1")}}}},
				{{Tier: device, Removed: []uint64{101}}},
			},
			held: []forwarded{{Tier: device, Blocks: [][2]uint64{{100, want(0, "", "tenant-1")}}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			payload, err := os.ReadFile(filepath.Join("testdata", tt.file))
			if err != nil {
				t.Fatal(err)
			}
			var b enginefeed.Batch
			if err := enginefeed.NewDecoder().Decode(payload, &b); err != nil {
				t.Fatalf("Decode() = %v", err)
			}
			if len(b.Skipped) > 0 {
				t.Fatalf("the decoder skipped %+v", b.Skipped)
			}
			tr := translator{m: newMirror(), blockSize: 4}
			var got [][]forwarded
			var drops []drop
			for i := range b.Events {
				out, d := tr.translate(&b.Events[i], nil)
				got = append(got, summarize(out))
				if d.reason != "" {
					drops = append(drops, d)
				}
			}
			opts := []cmp.Option{cmp.AllowUnexported(drop{}), cmpopts.EquateEmpty()}
			if diff := cmp.Diff(tt.want, got, opts...); diff != "" {
				t.Errorf("forwarded, per engine event (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.drops, drops, opts...); diff != "" {
				t.Errorf("drops (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.held, summarize(tr.m.dump()), opts...); diff != "" {
				t.Errorf("the mirror after the batch (-want +got):\n%s", diff)
			}
		})
	}
}

// TestTranslateCountsCopies: a block announced n times is removed at the router with its n-th
// removal; the engine's remaining copy counts, when it sends them, replace the bridge's count; a
// cleared cache starts the counts afresh.
func TestTranslateCountsCopies(t *testing.T) {
	removal := func(copies ...int64) enginefeed.Event {
		return enginefeed.Event{Kind: enginefeed.BlockRemoved, BlockHashes: []uint64{100}, Medium: "GPU", RemainingCopies: copies}
	}
	stored, cleared := chain(0, 1, "GPU"), enginefeed.Event{Kind: enginefeed.AllBlocksCleared}
	tests := []struct {
		name   string
		events []enginefeed.Event
		want   []bool // per removal: forwarded
	}{
		{"stored once", []enginefeed.Event{stored, removal()}, []bool{true}},
		{"stored twice", []enginefeed.Event{stored, stored, removal(), removal()}, []bool{false, true}},
		{"stored twice, removed three times", []enginefeed.Event{stored, stored, removal(), removal(), removal()}, []bool{false, true, true}},
		{"stored again after its removal", []enginefeed.Event{stored, removal(), stored, removal()}, []bool{true, true}},
		{"the engine's count: one copy left", []enginefeed.Event{stored, removal(1), removal(0)}, []bool{false, true}},
		{"the engine's count: none left of two", []enginefeed.Event{stored, stored, removal(0)}, []bool{true}},
		{"the engine's count, then the bridge's", []enginefeed.Event{stored, removal(2), removal(), removal()}, []bool{false, false, true}},
		{"cleared between", []enginefeed.Event{stored, stored, cleared, stored, removal()}, []bool{true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := translator{m: newMirror(), blockSize: 4}
			var got []bool
			for _, ev := range tt.events {
				out, d := tr.translate(&ev, nil)
				if d.reason != "" {
					t.Fatalf("dropped %+v", d)
				}
				if ev.Kind == enginefeed.BlockRemoved {
					got = append(got, len(out) == 1)
				}
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("removals forwarded (-want +got):\n%s", diff)
			}
		})
	}
}

// TestTranslateOffloadKeepsKeys: vLLM's self-describing offloading events carry a block's tokens
// but not its extra keys, so a block copied to the CPU takes the key its GPU copy has (an image's
// hash, a cache salt). A block the GPU never reported is keyed from its tokens.
func TestTranslateOffloadKeepsKeys(t *testing.T) {
	tr := translator{m: newMirror(), blockSize: 4}
	onGPU := keyed(chain(0, 2, "GPU"), "", []enginefeed.ExtraKey{pair(digest, 0), str("tenant-1")}, nil)
	offloaded := chain(0, 3, "CPU") // blocks 0 and 1 are on the GPU, block 2 is not
	var got [][]forwarded
	for _, ev := range []enginefeed.Event{onGPU, offloaded} {
		out, d := tr.translate(&ev, nil)
		if d.reason != "" {
			t.Fatalf("dropped %+v", d)
		}
		got = append(got, summarize(out))
	}
	image, second := want(0, "", "tenant-1", digest), want(1, "", "tenant-1")
	w := [][]forwarded{
		{{Tier: device, Blocks: [][2]uint64{{100, image}, {101, second}}}},
		{{Tier: host, Blocks: [][2]uint64{{100, image}, {101, second}, {102, want(2, "", "tenant-1")}}}},
	}
	if diff := cmp.Diff(w, got, cmpopts.EquateEmpty()); diff != "" {
		t.Errorf("forwarded (-want +got):\n%s", diff)
	}
}
