#!/usr/bin/python3
"""Generate golden test vectors for Dynamo-compatible KV block hashing.

The vectors are computed independently of kvrouter's Go implementation
(which uses github.com/zeebo/xxh3) so the Go tests can check it against a
second XXH3 implementation: the reference C libxxhash, reached through
Debian's python3-xxhash binding.

How to run (from the repository root)
-------------------------------------
    apt-get update && apt-get install -y python3-xxhash xxhash
    /usr/bin/python3 scripts/gen-hash-vectors.py > kvstate/blockhash/testdata/hash_vectors.json

Use /usr/bin/python3 (the Debian interpreter that python3-xxhash is built
for), not another python3 that may come first on PATH. The `xxhash` package
(which provides the `xxhsum` command-line tool) is optional: if it is
installed, every seed-0 raw vector is checked against `xxhsum -H3`, and the
"generator" field of the output says whether that check ran. The script uses
only the standard library plus `xxhash`. The output is deterministic: running
it twice on the same machine gives byte-identical JSON.

Hashing spec (NVIDIA Dynamo KV router)
--------------------------------------
XXH3(data, seed) means the 64-bit XXH3 hash (XXH3_64bits_withSeed).

* Tokens are uint32. With block size B, only complete blocks are hashed:
  there are floor(len(tokens) / B) blocks. A tail of fewer than B tokens is
  not hashed. B == 0 gives no blocks.
* salt: start at 1337. If lora_name is non-empty, add
  XXH3(UTF-8 bytes of lora_name, seed 0). If cache_namespace is non-empty, add
  XXH3(UTF-8 bytes of cache_namespace, seed 1). Additions wrap mod 2^64. An
  empty string means "absent".
* local hash of block i: XXH3(bytes, seed = salt), where bytes is the block's
  B tokens, each written as a 4-byte little-endian uint32, concatenated
  (4*B bytes).
* sequence (chained) hash: seq_0 = local_0;
  seq_i = XXH3(LE_u64(seq_{i-1}) || LE_u64(local_i), seed = 1337)
  (16 input bytes). The seed here is always the constant 1337, never the salt.
* multimodal objects: a prompt may carry objects {hash, start, end}, each a
  multimodal input (an image, an audio clip) named by a uint64 hash whose
  placeholder tokens are tokens[start:end]. Block i (tokens [i*B, (i+1)*B))
  carries every object with start < (i+1)*B and end > i*B (and start < end).
  A block that carries objects is hashed over its token bytes followed by the
  objects' hashes, sorted ascending (duplicates kept), each as a little-endian
  uint64: 4*B + 8*k bytes, same salt. Blocks without objects hash as above.
* multimodal identifier -> hash: an identifier of exactly 64 hex digits (the
  engine's own digest of the item, as vLLM computes it) maps to its first 16
  hex digits read as an unsigned integer; any other identifier (one the
  frontend chose) maps to XXH3(UTF-8 bytes of the identifier, seed 2).

Output format (JSON, indent 1, trailing newline)
------------------------------------------------
All uint64 values are decimal strings so JSON number precision cannot lose
them.

  generator  how the file was produced (script, library versions, whether
             the xxhsum cross-check ran)
  spec       one-paragraph restatement of the spec above
  raw        direct XXH3 checks: {name, input_hex, seed, xxh3_64}. They cover
             every XXH3 length path (0, 1-3, 4-8, 9-16, 17-128, 129-240,
             >240 bytes, including more than one 1024-byte block), with
             seed 0, with small seeds, and with seeds above 2^63.
  cases      block-hash cases: {name, block_size, lora_name, cache_namespace,
             tokens, salt, local_hashes, sequence_hashes}
  multimodal_ids
             identifier -> hash: {identifier, mm_hash}
  multimodal_cases
             block-hash cases with multimodal objects: the fields of cases,
             plus objects [{hash, start, end}] (in the order a caller sends
             them, not always sorted) and block_mm_hashes (per block, the
             sorted hashes the block carries)

Test inputs
-----------
* Token generator gen_tokens(n, k): token i = (i * 2654435761 + k) mod 2^32,
  for i in 0..n-1. 2654435761 is Knuth's multiplicative-hash constant, so the
  values spread over the whole uint32 range, including values >= 2^31.
* Byte generator gen_bytes(n, k) for raw vectors: byte j = (j * 167 + k) mod 256.
* Each case names its k (or lists its tokens) in the CASES section below.

The script asserts the structural facts (block counts, which hashes must be
equal or different, that one salt sum wraps past 2^64) so that a wrong
generator fails loudly instead of writing bad vectors.
"""

import json
import re
import shutil
import struct
import subprocess
import sys

import xxhash

MASK64 = (1 << 64) - 1
BASE_SALT = 1337
SEQ_SEED = 1337
LORA_SEED = 0
NAMESPACE_SEED = 1
MULTIMODAL_ID_SEED = 2
KNUTH = 2654435761

SCRIPT = "scripts/gen-hash-vectors.py"

SPEC = (
    "XXH3 = 64-bit XXH3 (XXH3_64bits_withSeed). Tokens are uint32; with block "
    "size B only complete blocks are hashed (floor(len/B) blocks; a tail of "
    "fewer than B tokens is ignored; B == 0 gives no blocks). "
    "salt = 1337, plus XXH3(UTF-8 lora_name, seed 0) if lora_name is non-empty, "
    "plus XXH3(UTF-8 cache_namespace, seed 1) if cache_namespace is non-empty, "
    "all additions mod 2^64 (empty string = absent). "
    "local_i = XXH3(concatenation of block i's B tokens as 4-byte little-endian "
    "uint32, seed = salt). "
    "seq_0 = local_0; seq_i = XXH3(LE_u64(seq_{i-1}) || LE_u64(local_i), "
    "seed = 1337) over 16 bytes, the seed always the constant 1337, never the "
    "salt. A block carrying multimodal objects (start < block end, end > "
    "block start) appends their hashes, sorted ascending, as little-endian "
    "uint64 after its tokens. A multimodal identifier of 64 hex digits hashes "
    "to its first 16 digits as an integer, any other to XXH3(UTF-8, seed 2). "
    "All uint64 values in this file are decimal strings."
)


# ---------------------------------------------------------------------------
# Hashing (the spec)
# ---------------------------------------------------------------------------

def xxh3(data, seed):
    assert 0 <= seed <= MASK64
    return xxhash.xxh3_64_intdigest(bytes(data), seed=seed)


def salt_parts(lora_name, cache_namespace):
    """Return (salt, unwrapped sum) for the given names."""
    total = BASE_SALT
    if lora_name:
        total += xxh3(lora_name.encode("utf-8"), LORA_SEED)
    if cache_namespace:
        total += xxh3(cache_namespace.encode("utf-8"), NAMESPACE_SEED)
    return total & MASK64, total


def compute_salt(lora_name, cache_namespace):
    return salt_parts(lora_name, cache_namespace)[0]


def block_bytes(block):
    for t in block:
        assert 0 <= t <= 0xFFFFFFFF, t
    return struct.pack("<%dI" % len(block), *block)


def local_hashes(tokens, block_size, salt):
    if block_size == 0:
        return []
    n = len(tokens) // block_size
    return [
        xxh3(block_bytes(tokens[i * block_size:(i + 1) * block_size]), salt)
        for i in range(n)
    ]


def block_objects(objects, block_size, i):
    """The sorted hashes of the objects block i carries."""
    lo, hi = i * block_size, (i + 1) * block_size
    return sorted(h for h, start, end in objects
                  if start < end and start < hi and end > lo)


def local_hashes_mm(tokens, block_size, salt, objects):
    if block_size == 0:
        return [], []
    out, per_block = [], []
    for i in range(len(tokens) // block_size):
        hashes = block_objects(objects, block_size, i)
        for h in hashes:
            assert 0 <= h <= MASK64, h
        data = block_bytes(tokens[i * block_size:(i + 1) * block_size])
        data += struct.pack("<%dQ" % len(hashes), *hashes)
        out.append(xxh3(data, salt))
        per_block.append(hashes)
    return out, per_block


def multimodal_hash(identifier):
    if re.fullmatch(r"[0-9a-fA-F]{64}", identifier):
        return int(identifier[:16], 16)
    return xxh3(identifier.encode("utf-8"), MULTIMODAL_ID_SEED)


def sequence_hashes(local):
    seq = []
    for i, h in enumerate(local):
        if i == 0:
            seq.append(h)
        else:
            seq.append(xxh3(struct.pack("<QQ", seq[-1], h), SEQ_SEED))
    return seq


# ---------------------------------------------------------------------------
# Input generators
# ---------------------------------------------------------------------------

def gen_tokens(n, k):
    return [(i * KNUTH + k) & 0xFFFFFFFF for i in range(n)]


def gen_bytes(n, k):
    return bytes((j * 167 + k) & 0xFF for j in range(n))


# ---------------------------------------------------------------------------
# xxhsum cross-check (seed 0 only: xxhsum has no seed option)
# ---------------------------------------------------------------------------

def xxhsum_h3(data):
    """XXH3_64 (seed 0) of data according to the `xxhsum -H3` C tool."""
    out = subprocess.run(
        ["xxhsum", "-H3", "-"], input=data, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, check=True,
    ).stdout.decode("ascii", "replace").strip()
    # 0.8.1 prints "XXH3 (stdin) = <hex>"; other versions print
    # "XXH3_<hex>  -" or "<hex>  -". Accept exactly one 16-hex-digit token.
    found = []
    for tok in out.split():
        if tok.startswith("XXH3_"):
            tok = tok[len("XXH3_"):]
        if re.fullmatch(r"[0-9a-fA-F]{16}", tok):
            found.append(int(tok, 16))
    assert len(found) == 1, "cannot parse xxhsum output: %r" % out
    return found[0]


def debian_version(package):
    """Debian package version via dpkg-query, or "unknown"."""
    try:
        p = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           check=False)
        v = p.stdout.decode("ascii", "replace").strip()
        return v if p.returncode == 0 and v else "unknown"
    except OSError:
        return "unknown"


def xxhsum_version():
    try:
        p = subprocess.run(["xxhsum", "--version"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, check=False)
        line = p.stdout.decode("ascii", "replace").strip().splitlines()[0]
        m = re.search(r"xxhsum\s+(\S+)", line)
        return m.group(1) if m else line
    except (OSError, IndexError):
        return "unknown"


# ---------------------------------------------------------------------------
# Raw XXH3 vectors
# ---------------------------------------------------------------------------

# (name, input bytes, seed). Lengths cover each XXH3 code path:
#   0 | 1-3 | 4-8 | 9-16 | 17-128 | 129-240 | >240 (1024-byte blocks, last stripe)
HIGH_SEED = 0xFFFFFFFFFFFFFFFF        # seed >= 2^63: checks unsigned handling
SALT_LIKE_SEED = compute_salt("a", "tenant-1")

RAW_INPUTS = [
    ("len0-seed0", b"", 0),
    ("len0-seed1337", b"", 1337),
    ("a-seed0", b"a", 0),
    ("a-seed1", b"a", 1),
    ("b-seed0", b"b", 0),
    ("abc-seed0", b"abc", 0),
    ("abc-seed1337", b"abc", 1337),
    ("len4-seed0", gen_bytes(4, 1), 0),
    ("len8-seed0", gen_bytes(8, 2), 0),
    ("len8-seed1337", gen_bytes(8, 2), 1337),
    ("tenant-1-seed1", b"tenant-1", 1),
    ("tenant-1-seed0", b"tenant-1", 0),
    ("len9-seed0", gen_bytes(9, 3), 0),
    ("len16-seed0", gen_bytes(16, 4), 0),
    ("len16-seed1337", gen_bytes(16, 4), 1337),
    ("len16-seedmax", gen_bytes(16, 4), HIGH_SEED),
    ("len17-seed0", gen_bytes(17, 5), 0),
    ("len64-seed0", gen_bytes(64, 6), 0),
    ("len64-seed1337", gen_bytes(64, 6), 1337),
    ("len64-seedsalt", gen_bytes(64, 6), SALT_LIKE_SEED),
    ("len128-seed0", gen_bytes(128, 7), 0),
    ("len128-seed1337", gen_bytes(128, 7), 1337),
    ("len129-seed0", gen_bytes(129, 8), 0),
    ("len129-seed1337", gen_bytes(129, 8), 1337),
    ("len240-seed0", gen_bytes(240, 9), 0),
    ("len240-seed1337", gen_bytes(240, 9), 1337),
    ("len241-seed0", gen_bytes(241, 10), 0),
    ("len241-seed1337", gen_bytes(241, 10), 1337),
    ("len256-seedmax", gen_bytes(256, 11), HIGH_SEED),
    ("len300-seed0", gen_bytes(300, 12), 0),
    ("len300-seed42", gen_bytes(300, 12), 42),
    ("len1024-seed0", gen_bytes(1024, 13), 0),
    ("len1024-seed1337", gen_bytes(1024, 13), 1337),
    ("len2049-seed0", gen_bytes(2049, 14), 0),
    ("len2049-seedsalt", gen_bytes(2049, 14), SALT_LIKE_SEED),
]


def build_raw():
    names = set()
    raw = []
    for name, data, seed in RAW_INPUTS:
        assert name not in names, name
        names.add(name)
        raw.append({
            "name": name,
            "input_hex": data.hex(),
            "seed": str(seed),
            "xxh3_64": str(xxh3(data, seed)),
        })
    # Every XXH3 length path must be covered.
    lengths = {len(d) for _, d, _ in RAW_INPUTS}
    for lo, hi in [(0, 0), (1, 3), (4, 8), (9, 16), (17, 128), (129, 240),
                   (241, 1 << 30)]:
        assert any(lo <= n <= hi for n in lengths), (lo, hi)
    # Well-known published value: XXH3_64("") == 0x2D06800538D394C2.
    assert xxh3(b"", 0) == 0x2D06800538D394C2
    return raw


def cross_check_xxhsum():
    """Check every seed-0 raw vector against the xxhsum C tool.

    Returns a short description for the "generator" field.
    """
    if shutil.which("xxhsum") is None:
        return "xxhsum cross-check NOT run (xxhsum not installed)"
    n = 0
    for name, data, seed in RAW_INPUTS:
        if seed != 0:
            continue
        want = xxhsum_h3(data)
        got = xxh3(data, 0)
        assert got == want, "%s: python xxhash %d != xxhsum %d" % (name, got, want)
        n += 1
    assert n >= 7, n
    return ("xxhsum %s -H3 cross-check ran: %d seed-0 raw vectors agree"
            % (xxhsum_version(), n))


# ---------------------------------------------------------------------------
# Block-hash cases
# ---------------------------------------------------------------------------

def make_case(name, block_size, tokens, lora_name="", cache_namespace=""):
    salt = compute_salt(lora_name, cache_namespace)
    local = local_hashes(tokens, block_size, salt)
    seq = sequence_hashes(local)
    expected_blocks = 0 if block_size == 0 else len(tokens) // block_size
    assert len(local) == expected_blocks, (name, len(local), expected_blocks)
    assert len(seq) == len(local)
    if local:
        assert seq[0] == local[0], name
    return {
        "name": name,
        "block_size": block_size,
        "lora_name": lora_name,
        "cache_namespace": cache_namespace,
        "tokens": list(tokens),
        "salt": str(salt),
        "local_hashes": [str(h) for h in local],
        "sequence_hashes": [str(h) for h in seq],
        # Kept only for the assertions below; removed before output.
        "_local": local,
        "_seq": seq,
    }


def first_wrapping_namespace(lora_name):
    """First "tenant-N" (N = 2, 3, ...) whose salt sum with lora_name wraps.

    N starts at 2 so the result never repeats the "tenant-1" case.
    """
    for n in range(2, 10000):
        ns = "tenant-%d" % n
        if salt_parts(lora_name, ns)[1] > MASK64:
            return ns
    raise AssertionError("no wrapping namespace found")


def first_non_wrapping_namespace(lora_name):
    """First "tenant-N" (N = 2, 3, ...) whose salt sum does not wrap."""
    for n in range(2, 10000):
        ns = "tenant-%d" % n
        if salt_parts(lora_name, ns)[1] <= MASK64:
            return ns
    raise AssertionError("no non-wrapping namespace found")


def collector(make):
    """Returns a list of cases and add(), which makes a case with make and appends it (names unique)."""
    cases = []

    def add(*args, **kwargs):
        c = make(*args, **kwargs)
        assert all(c["name"] != o["name"] for o in cases), c["name"]
        cases.append(c)
        return c

    return cases, add


def build_cases():
    cases, add = collector(make_case)

    # -- trivial / boundary ---------------------------------------------------
    c = add("empty-b16", 16, [])
    assert c["_local"] == []
    c = add("tail-only-15-b16", 16, gen_tokens(15, 1))            # k = 1
    assert c["_local"] == []
    c = add("one-block-16-b16", 16, gen_tokens(16, 1))            # k = 1
    assert len(c["_local"]) == 1
    c17 = add("one-block-plus-tail-17-b16", 16, gen_tokens(17, 1))  # k = 1
    # The tail token must not affect anything.
    assert c17["_local"] == c["_local"] and c17["_seq"] == c["_seq"]

    # -- 1800 tokens, B = 64, salt variants (k = 7) ---------------------------
    t1800 = gen_tokens(1800, 7)
    plain = add("1800-b64-nosalt", 64, t1800)
    assert len(plain["_local"]) == 28
    assert plain["salt"] == str(BASE_SALT)
    lora_a = add("1800-b64-lora-a", 64, t1800, lora_name="a")
    lora_b = add("1800-b64-lora-b", 64, t1800, lora_name="b")
    ns = add("1800-b64-ns-tenant-1", 64, t1800, cache_namespace="tenant-1")
    both = add("1800-b64-lora-a-ns-tenant-1", 64, t1800,
               lora_name="a", cache_namespace="tenant-1")
    # lora_name and cache_namespace with the same string differ (seed 0 vs 1).
    lora_t1 = add("1800-b64-lora-tenant-1", 64, t1800, lora_name="tenant-1")
    # Non-ASCII names are hashed as UTF-8 bytes.
    utf8 = add("1800-b64-lora-utf8", 64, t1800,
               lora_name="lora-\u00e9\u00df-\u9002\u914d\u5668",
               cache_namespace="ns-\u00fc")
    # One salt sum that wraps past 2^64 and one that does not.
    wrap_ns = first_wrapping_namespace("a")
    nowrap_ns = first_non_wrapping_namespace("a")
    wrap = add("1800-b64-lora-a-ns-wrapping", 64, t1800,
               lora_name="a", cache_namespace=wrap_ns)
    nowrap = add("1800-b64-lora-a-ns-nonwrapping", 64, t1800,
                 lora_name="a", cache_namespace=nowrap_ns)
    assert salt_parts("a", wrap_ns)[1] > MASK64
    assert salt_parts("a", nowrap_ns)[1] <= MASK64

    variants = [plain, lora_a, lora_b, ns, both, lora_t1, utf8, wrap, nowrap]
    for v in variants:
        assert len(v["_local"]) == 28, v["name"]
    # All salts are distinct, and so every local and sequence hash differs.
    assert len({v["salt"] for v in variants}) == len(variants)
    for i, x in enumerate(variants):
        for y in variants[i + 1:]:
            for j in range(28):
                assert x["_local"][j] != y["_local"][j], (x["name"], y["name"], j)
                assert x["_seq"][j] != y["_seq"][j], (x["name"], y["name"], j)
    # Salt arithmetic cross-check.
    assert int(lora_a["salt"]) == (BASE_SALT + xxh3(b"a", 0)) & MASK64
    assert int(ns["salt"]) == (BASE_SALT + xxh3(b"tenant-1", 1)) & MASK64
    assert int(both["salt"]) == (int(lora_a["salt"]) + xxh3(b"tenant-1", 1)) & MASK64
    # Note: lora "a" + namespace "tenant-1" already wraps past 2^64.
    assert salt_parts("a", "tenant-1")[1] > MASK64

    # -- large token values, B = 4: 3 blocks + 2-token tail --------------------
    big = [0xFFFFFFFF, 0x80000000, 0, 1,
           0x7FFFFFFF, 0x80000001, 0xFFFFFFFE, 0x00010000,
           0xDEADBEEF, 0, 0xFFFFFFFF, 0x80000000,
           0xFFFFFFFF, 0x80000000]
    c = add("large-values-b4", 4, big)
    assert len(c["_local"]) == 3
    assert c["_local"][0] == xxh3(bytes.fromhex("ffffffff00000080" "0000000001000000"),
                                  BASE_SALT)

    # -- B = 1, 5 tokens --------------------------------------------------------
    c = add("b1-5-tokens", 1, [0, 1, 2, 3, 0xFFFFFFFF])
    assert len(c["_local"]) == 5

    # -- B = 0, 10 tokens -> empty -------------------------------------------
    c = add("b0-10-tokens", 0, list(range(10)))
    assert c["_local"] == [] and c["_seq"] == []

    # -- repeated block: same local hash, different sequence hash -------------
    blk = gen_tokens(16, 3)                                        # k = 3
    c = add("repeated-block-b16", 16, blk + blk + blk)
    assert c["_local"][0] == c["_local"][1] == c["_local"][2]
    assert len(set(c["_seq"])) == 3

    # -- shared prefix: 64 tokens, B = 16, first 32 tokens shared --------------
    pa = gen_tokens(64, 11)                                        # k = 11
    pb = pa[:32] + gen_tokens(64, 12)[32:]                         # tail k = 12
    assert pa[:32] == pb[:32]
    assert all(pa[i] != pb[i] for i in range(32, 64))
    a = add("shared-prefix-a", 16, pa)
    b = add("shared-prefix-b", 16, pb)
    assert len(a["_local"]) == len(b["_local"]) == 4
    for i in range(2):
        assert a["_local"][i] == b["_local"][i], i
        assert a["_seq"][i] == b["_seq"][i], i
    for i in range(2, 4):
        assert a["_local"][i] != b["_local"][i], i
        assert a["_seq"][i] != b["_seq"][i], i

    # -- 2048 tokens, B = 16, no salt: 128 blocks (k = 42) --------------------
    c = add("2048-b16-nosalt", 16, gen_tokens(2048, 42))
    assert len(c["_local"]) == 128
    assert len(set(c["_local"])) == 128 and len(set(c["_seq"])) == 128
    # A prefix of the prompt gives a prefix of the hashes.
    c2 = make_case("tmp", 16, gen_tokens(1000, 42))
    assert c2["_local"] == c["_local"][:62] and c2["_seq"] == c["_seq"][:62]

    for c in cases:
        del c["_local"]
        del c["_seq"]
    return cases


def build_multimodal_ids():
    ids = [
        "0f3a9c2b7d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8",
        "FFEEDDCCBBAA99887766554433221100ffeeddccbbaa99887766554433221100",
        "8000000000000000000000000000000000000000000000000000000000000001",
        "0f3a9c2b7d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e",   # 63 digits
        "0f3a9c2b7d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f",  # 65 digits
        "0f3a9c2b7d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7eg",   # not hex
        "cat.png",
        "user-image-42",
        "my-lora:0f3a9c2b7d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8",
        "",
        "bild-\u00e4\u00f6\u00fc-\u56fe\u7247",
    ]
    out = []
    for ident in ids:
        h = multimodal_hash(ident)
        out.append({"identifier": ident, "mm_hash": str(h)})
    assert int(out[0]["mm_hash"]) == 0x0f3a9c2b7d4e5f60
    assert int(out[1]["mm_hash"]) == 0xFFEEDDCCBBAA9988
    assert int(out[2]["mm_hash"]) == 1 << 63
    assert int(out[3]["mm_hash"]) == xxh3(ids[3].encode(), MULTIMODAL_ID_SEED)
    assert int(out[9]["mm_hash"]) == xxh3(b"", MULTIMODAL_ID_SEED)
    return out


def make_mm_case(name, block_size, tokens, objects, lora_name="", cache_namespace=""):
    salt = compute_salt(lora_name, cache_namespace)
    local, per_block = local_hashes_mm(tokens, block_size, salt, objects)
    seq = sequence_hashes(local)
    return {
        "name": name,
        "block_size": block_size,
        "lora_name": lora_name,
        "cache_namespace": cache_namespace,
        "tokens": list(tokens),
        "objects": [{"hash": str(h), "start": s, "end": e} for h, s, e in objects],
        "salt": str(salt),
        "block_mm_hashes": [[str(h) for h in b] for b in per_block],
        "local_hashes": [str(h) for h in local],
        "sequence_hashes": [str(h) for h in seq],
        "_local": local,
        "_seq": seq,
        "_blocks": per_block,
    }


def build_multimodal_cases():
    cases, add = collector(make_mm_case)

    cat, dog = multimodal_hash("cat.png"), multimodal_hash("user-image-42")
    high = 0xFFFFFFFFFFFFFF01
    t = gen_tokens(96, 21)                                      # k = 21, 6 blocks of 16
    plain = local_hashes(t, 16, BASE_SALT)
    # No objects: the same hashes as a plain prompt.
    c = add("mm-none-b16", 16, t, [])
    assert c["_local"] == plain
    # One image over tokens [20, 52): blocks 1, 2, 3 carry it; 0, 4, 5 do not.
    c = add("mm-one-image-b16", 16, t, [(cat, 20, 52)])
    assert c["_blocks"] == [[], [cat], [cat], [cat], [], []]
    assert c["_local"][0] == plain[0] and c["_local"][4:] == plain[4:]
    assert all(c["_local"][i] != plain[i] for i in (1, 2, 3))
    assert c["_seq"][0] == sequence_hashes(plain)[0]
    assert all(c["_seq"][i] != sequence_hashes(plain)[i] for i in range(1, 6))
    # The same tokens with another image: the blocks that carry it differ.
    d = add("mm-other-image-b16", 16, t, [(dog, 20, 52)])
    assert all(c["_local"][i] != d["_local"][i] for i in (1, 2, 3))
    assert c["_local"][0] == d["_local"][0] and c["_local"][4:] == d["_local"][4:]
    # An image ending exactly on a block boundary: the next block does not carry it;
    # one starting exactly on a boundary: the block before does not.
    c = add("mm-aligned-b16", 16, t, [(cat, 16, 32), (dog, 48, 64)])
    assert c["_blocks"] == [[], [cat], [], [dog], [], []]
    # Two images in one block, sent in prompt order whose hashes are not sorted.
    objs = [(high, 66, 70), (dog, 72, 75), (cat, 76, 80)]
    c = add("mm-three-in-one-block-b16", 16, t, objs)
    assert c["_blocks"][4] == sorted([high, dog, cat])
    assert c["_blocks"][4][-1] == high
    # The same objects sent in another order hash alike.
    c2 = make_mm_case("tmp", 16, t, list(reversed(objs)))
    assert c2["_local"] == c["_local"]
    # The same image twice in one block is hashed twice.
    c = add("mm-same-image-twice-b16", 16, t, [(cat, 1, 3), (cat, 5, 9)])
    assert c["_blocks"][0] == [cat, cat]
    once = make_mm_case("tmp", 16, t, [(cat, 1, 9)])
    assert once["_local"][0] != c["_local"][0]
    # An object in the tail only (tokens 96..99 of 100): no complete block carries it.
    t100 = gen_tokens(100, 21)
    c = add("mm-tail-only-b16", 16, t100, [(cat, 97, 100)])
    assert c["_local"] == plain
    # An empty object (start == end) is carried by no block.
    c = add("mm-empty-object-b16", 16, t, [(cat, 20, 20)])
    assert c["_local"] == plain
    # With a LoRA adapter and a cache namespace the salt applies to every block.
    c = add("mm-lora-ns-b16", 16, t, [(cat, 20, 52)], lora_name="a", cache_namespace="tenant-1")
    assert c["salt"] == str(compute_salt("a", "tenant-1"))
    m = make_mm_case("tmp", 16, t, [(cat, 20, 52)])
    assert all(c["_local"][i] != m["_local"][i] for i in range(6))
    # An image spanning many blocks, block size 4 (7 blocks, objects of hash >= 2^63).
    t28 = gen_tokens(28, 5)
    c = add("mm-long-image-b4", 4, t28, [(high, 2, 27)])
    assert c["_blocks"] == [[high]] * 7
    for c in cases:
        del c["_local"], c["_seq"], c["_blocks"]
    return cases


def main():
    raw = build_raw()
    cross = cross_check_xxhsum()
    cases = build_cases()
    mm_ids = build_multimodal_ids()
    mm_cases = build_multimodal_cases()
    generator = (
        "%s run with /usr/bin/python3 %d.%d.%d; Debian python3-xxhash %s "
        "(module reports xxhash.VERSION %s), libxxhash %s (Debian libxxhash0 "
        "%s); %s"
        % (SCRIPT, sys.version_info[0], sys.version_info[1],
           sys.version_info[2], debian_version("python3-xxhash"),
           xxhash.VERSION, xxhash.XXHASH_VERSION,
           debian_version("libxxhash0"), cross)
    )
    out = {
        "generator": generator,
        "spec": SPEC,
        "raw": raw,
        "cases": cases,
        "multimodal_ids": mm_ids,
        "multimodal_cases": mm_cases,
    }
    text = json.dumps(out, indent=1) + "\n"
    # Round-trip check: the output parses and every uint64 is a decimal string.
    parsed = json.loads(text)
    for r in parsed["raw"]:
        assert 0 <= int(r["xxh3_64"]) <= MASK64 and 0 <= int(r["seed"]) <= MASK64
    for c in parsed["cases"]:
        for h in c["local_hashes"] + c["sequence_hashes"] + [c["salt"]]:
            assert isinstance(h, str) and str(int(h)) == h and int(h) <= MASK64
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
