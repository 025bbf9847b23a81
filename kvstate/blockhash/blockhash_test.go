package blockhash

import (
	"encoding/hex"
	"encoding/json"
	"os"
	"strconv"
	"testing"

	"github.com/google/go-cmp/cmp"
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
	if len(v.Cases) == 0 || len(v.Raw) == 0 {
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
}
