package blockhash

import (
	"encoding/hex"
	"encoding/json"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/zeebo/xxh3"
)

// hashVectors is testdata/hash_vectors.json, produced by scripts/gen-hash-vectors.py with the C
// libxxhash (through Debian's python3-xxhash), independently of the Go implementation under test.
type hashVectors struct {
	Raw []struct {
		Name     string `json:"name"`
		InputHex string `json:"input_hex"`
		Seed     string `json:"seed"`
		XXH3     string `json:"xxh3_64"`
	} `json:"raw"`
	Cases []struct {
		Name           string   `json:"name"`
		BlockSize      int      `json:"block_size"`
		LoraName       string   `json:"lora_name"`
		CacheNamespace string   `json:"cache_namespace"`
		Tokens         []uint32 `json:"tokens"`
		Salt           string   `json:"salt"`
		LocalHashes    []string `json:"local_hashes"`
		Sequence       []string `json:"sequence_hashes"`
	} `json:"cases"`
	MultimodalIDs []struct {
		Identifier string `json:"identifier"`
		Hash       string `json:"mm_hash"`
	} `json:"multimodal_ids"`
	MultimodalCases []struct {
		Name           string   `json:"name"`
		BlockSize      int      `json:"block_size"`
		LoraName       string   `json:"lora_name"`
		CacheNamespace string   `json:"cache_namespace"`
		Tokens         []uint32 `json:"tokens"`
		Objects        []struct {
			Hash       string `json:"hash"`
			Start, End uint32
		} `json:"objects"`
		BlockMMHashes [][]string `json:"block_mm_hashes"`
		LocalHashes   []string   `json:"local_hashes"`
		Sequence      []string   `json:"sequence_hashes"`
	} `json:"multimodal_cases"`
}

func loadHashVectors(t *testing.T) hashVectors {
	t.Helper()
	b, err := os.ReadFile("testdata/hash_vectors.json")
	if err != nil {
		t.Fatalf("reading golden vectors: %v", err)
	}
	var v hashVectors
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("decoding golden vectors: %v", err)
	}
	if len(v.Cases) == 0 || len(v.Raw) == 0 || len(v.MultimodalIDs) == 0 || len(v.MultimodalCases) == 0 {
		t.Fatal("golden vectors file has no cases")
	}
	return v
}

func parseU64s(t *testing.T, ss []string) []uint64 {
	t.Helper()
	out := make([]uint64, 0, len(ss))
	for _, s := range ss {
		out = append(out, parseU64(t, s))
	}
	return out
}

func parseU64(t *testing.T, s string) uint64 {
	t.Helper()
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		t.Fatalf("bad uint64 %q: %v", s, err)
	}
	return v
}

func TestXXH3MatchesReference(t *testing.T) {
	for _, c := range loadHashVectors(t).Raw {
		in, err := hex.DecodeString(c.InputHex)
		if err != nil {
			t.Fatalf("%s: bad hex: %v", c.Name, err)
		}
		if got, want := xxh3.HashSeed(in, parseU64(t, c.Seed)), parseU64(t, c.XXH3); got != want {
			t.Errorf("%s: xxh3.Seed = %d, want %d", c.Name, got, want)
		}
	}
}

func TestBlockHashesMatchGoldenVectors(t *testing.T) {
	for _, c := range loadHashVectors(t).Cases {
		t.Run(c.Name, func(t *testing.T) {
			salt := Salt(c.LoraName, c.CacheNamespace)
			if want := parseU64(t, c.Salt); salt != want {
				t.Errorf("Salt(%q, %q) = %d, want %d", c.LoraName, c.CacheNamespace, salt, want)
			}
			local := Locals(nil, c.Tokens, c.BlockSize, salt)
			if diff := cmp.Diff(parseU64s(t, c.LocalHashes), local, cmp.Comparer(func(a, b []uint64) bool {
				return len(a) == len(b) && (len(a) == 0 || cmp.Equal(a, b))
			})); diff != "" {
				t.Errorf("Locals mismatch (-want +got):\n%s", diff)
			}
			seq := Sequence(nil, local)
			if len(seq) != len(c.Sequence) {
				t.Fatalf("Sequence returned %d hashes, want %d", len(seq), len(c.Sequence))
			}
			for i, want := range parseU64s(t, c.Sequence) {
				if seq[i] != want {
					t.Errorf("sequence hash %d = %d, want %d", i, seq[i], want)
				}
			}
		})
	}
}

func TestMultimodalHashMatchesGoldenVectors(t *testing.T) {
	for _, c := range loadHashVectors(t).MultimodalIDs {
		if got, want := MultimodalHash(c.Identifier), parseU64(t, c.Hash); got != want {
			t.Errorf("MultimodalHash(%q) = %d, want %d", c.Identifier, got, want)
		}
	}
}

func TestMultimodalBlockHashesMatchGoldenVectors(t *testing.T) {
	for _, c := range loadHashVectors(t).MultimodalCases {
		t.Run(c.Name, func(t *testing.T) {
			objects := make([]MultimodalObject, len(c.Objects))
			for i, o := range c.Objects {
				objects[i] = MultimodalObject{Hash: parseU64(t, o.Hash), Start: o.Start, End: o.End}
			}
			sent := slices.Clone(objects)
			salt := Salt(c.LoraName, c.CacheNamespace)
			local := LocalsMultimodal(nil, c.Tokens, c.BlockSize, salt, objects)
			if diff := cmp.Diff(parseU64s(t, c.LocalHashes), local, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("LocalsMultimodal mismatch (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(sent, objects); diff != "" {
				t.Errorf("LocalsMultimodal changed its objects (-sent +after):\n%s", diff)
			}
			for i, block := range c.BlockMMHashes {
				tokens := c.Tokens[i*c.BlockSize : (i+1)*c.BlockSize]
				if got, want := LocalMultimodal(tokens, parseU64s(t, block), salt), parseU64(t, c.LocalHashes[i]); got != want {
					t.Errorf("LocalMultimodal of block %d = %d, want %d", i, got, want)
				}
			}
			if diff := cmp.Diff(parseU64s(t, c.Sequence), Sequence(nil, local), cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("Sequence mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// TestLocalsMultimodalMatchesBlockByBlock checks the sweep over sorted objects against the rule it
// implements, block by block, on random prompts whose objects overlap, repeat, nest and come in any
// order.
func TestLocalsMultimodalMatchesBlockByBlock(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 500 {
		bs := 1 + r.IntN(8)
		tokens := make([]uint32, r.IntN(60))
		for i := range tokens {
			tokens[i] = r.Uint32()
		}
		objects := make([]MultimodalObject, r.IntN(6))
		for i := range objects {
			start := uint32(r.IntN(len(tokens) + 2))
			objects[i] = MultimodalObject{Hash: uint64(r.IntN(4)) << 62, Start: start, End: start + uint32(r.IntN(20)) - 2}
		}
		var want []uint64
		for start := 0; start+bs <= len(tokens); start += bs {
			var hashes []uint64
			for _, o := range objects {
				if o.Start < o.End && int(o.Start) < start+bs && int(o.End) > start {
					hashes = append(hashes, o.Hash)
				}
			}
			slices.Sort(hashes)
			want = append(want, LocalMultimodal(tokens[start:start+bs], hashes, Seed))
		}
		if diff := cmp.Diff(want, LocalsMultimodal(nil, tokens, bs, Seed, objects), cmpopts.EquateEmpty()); diff != "" {
			t.Fatalf("block size %d, %d tokens, objects %+v (-block by block +sweep):\n%s", bs, len(tokens), objects, diff)
		}
	}
}

// TestHashingStructure checks the structural vectors of §10.10.
func TestHashingStructure(t *testing.T) {
	tokens := make([]uint32, 1800)
	for i := range tokens {
		tokens[i] = uint32(i * 7)
	}
	if got := len(Locals(nil, tokens, 64, Salt("", ""))); got != 28 {
		t.Errorf("1800 tokens at block size 64 hashed %d blocks, want 28", got)
	}
	if got := len(Locals(nil, tokens, 0, Salt("", ""))); got != 0 {
		t.Errorf("block size 0 hashed %d blocks, want 0", got)
	}
	if Salt("", "") != Seed {
		t.Errorf("Salt with no LoRA and no namespace = %d, want %d", Salt("", ""), Seed)
	}
	if Salt("a", "") == Salt("b", "") {
		t.Error("LoRA a and b share a salt")
	}
	other := append([]uint32(nil), tokens...)
	other[64*3] = 1 // differs from block 3 on
	a := Sequence(nil, Locals(nil, tokens, 64, Seed))
	b := Sequence(nil, Locals(nil, other, 64, Seed))
	if diff := cmp.Diff(a[:3], b[:3]); diff != "" {
		t.Errorf("shared first 3 blocks hash differently (-a +b):\n%s", diff)
	}
	for i := 3; i < len(a); i++ {
		if a[i] == b[i] {
			t.Errorf("sequence hash %d equal after the prompts diverged", i)
		}
	}
}

func TestHashingAllocatesNothing(t *testing.T) {
	tokens := make([]uint32, 2048)
	local := make([]uint64, 0, 128)
	seq := make([]uint64, 0, 128)
	allocs := testing.AllocsPerRun(100, func() {
		local = Locals(local[:0], tokens, 16, Seed)
		seq = Sequence(seq[:0], local)
	})
	if allocs != 0 {
		t.Errorf("hashing a 2048-token prompt allocated %v times, want 0", allocs)
	}
	images := []MultimodalObject{{Hash: 7, Start: 40, End: 600}, {Hash: 9, Start: 700, End: 1000}}
	allocs = testing.AllocsPerRun(100, func() {
		local = LocalsMultimodal(local[:0], tokens, 16, Seed, images)
	})
	if allocs != 0 {
		t.Errorf("hashing a 2048-token prompt with two images allocated %v times, want 0", allocs)
	}
}
