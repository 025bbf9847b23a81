"""The router's block hashing (kvstate/blockhash): local block hashes, salts and sequence hashes.

A worker that sends a stored block's ``tokens_hash`` instead of its ``token_ids`` (see
``Publisher(hash_tokens=True)``) must compute it exactly as the router does:

- ``salt(lora_name, cache_namespace)``: 1337, plus XXH3(lora_name, seed 0) when a LoRA adapter is
  used, plus XXH3(cache_namespace, seed 1) when a cache namespace is set (UTF-8, additions wrap at
  2**64; an empty string counts as absent).
- ``local(tokens, salt)``: XXH3 over the block's tokens as little-endian uint32s, seeded with the salt.
- ``local_multimodal(tokens, mm_hashes, salt)``: the same for a block that holds multimodal inputs
  (images, audio): the tokens followed by the inputs' hashes, sorted ascending, as little-endian
  uint64s. ``multimodal_hash(identifier)`` names an input: the first 16 hex digits of an engine's
  64-hex-digit digest, or XXH3(identifier, seed 2) for any other identifier.
- ``chain(parent, local)``: XXH3 over the two as little-endian uint64s, seed 1337: the sequence hash
  of a block after its parent's. ``sequence(locals)`` chains a whole prompt; its first block's
  sequence hash is its local hash.

XXH3 is the 64-bit XXH3 of the xxhash package (pip's xxhash, Debian's python3-xxhash: the C
libxxhash). Every hash is an int in [0, 2**64). The golden vectors in kvstate/blockhash/testdata/hash_vectors.json check it.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import xxhash  # kvrouter_client's import says what to install when it is missing

__all__ = [
    "SEED",
    "MULTIMODAL_ID_SEED",
    "MultimodalObject",
    "salt",
    "multimodal_hash",
    "local",
    "local_multimodal",
    "local_hashes",
    "chain",
    "sequence",
    "prompt_hashes",
]

SEED = 1337
"""The XXH3 seed of block hashing, and of chaining sequence hashes."""

MULTIMODAL_ID_SEED = 2
"""The XXH3 seed multimodal_hash() hashes an identifier that is not an engine digest with (0 and 1
salt LoRA names and cache namespaces)."""

MultimodalObject = Tuple[int, int, int]
"""One multimodal input of a prompt, as local_hashes() and prompt_hashes() take it: ``(mm_hash,
start, end)``, the input's hash (multimodal_hash()) and the positions ``[start, end)`` of the prompt
tokens its placeholder tokens fill, as in a RouteRequest's MultimodalObject (``(o.mm_hash, o.start,
o.end)``)."""

_MASK64 = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest

# local_hashes() packs a whole prompt at once into an array of C unsigned ints, 4 bytes on every
# platform CPython supports (struct packs block by block where it is not), byte-swapped on big-endian.
_ARRAY = array("I").itemsize == 4
_SWAP = sys.byteorder != "little"
_STRUCTS: Dict[int, struct.Struct] = {}  # "<nI" by n: block sizes are few (at most 64 are kept)
_PAIR = struct.Struct("<QQ")
_HEX = frozenset("0123456789abcdefABCDEF")


def _packer(n: int) -> struct.Struct:
    s = _STRUCTS.get(n)
    if s is None:
        s = struct.Struct(f"<{n}I")
        if len(_STRUCTS) < 64:
            _STRUCTS[n] = s
    return s


def _check_u64(name: str, v: int) -> None:
    if not 0 <= v <= _MASK64:
        raise ValueError(f"{name} must be in [0, 2**64) (got {v})")


def salt(lora_name: str = "", cache_namespace: str = "") -> int:
    """Returns the seed of local hashes for blocks of this LoRA adapter and cache namespace."""
    s = SEED
    if lora_name:
        s += _xxh3(lora_name.encode("utf-8"), seed=0)
    if cache_namespace:
        s += _xxh3(cache_namespace.encode("utf-8"), seed=1)
    return s & _MASK64


def multimodal_hash(identifier: str) -> int:
    """Returns the hash that names a multimodal input in block hashes (MultimodalObject.mm_hash and
    StoredBlock.mm_hashes), from the identifier the engine keys its prefix cache with.

    vLLM's own identifier of an item is a 64-hex-digit digest of its content; its first 16 digits,
    read as an integer, are the hash (as Dynamo reads them). Any other identifier, such as one the
    frontend chose and passed to the engine (vLLM's multi_modal_uuids), is hashed with XXH3 (UTF-8,
    seed 2), so that the frontend and the worker agree on it without sharing anything but the string.
    """
    if len(identifier) == 64 and _HEX.issuperset(identifier):
        return int(identifier[:16], 16)
    return _xxh3(identifier.encode("utf-8"), seed=MULTIMODAL_ID_SEED)


def local(tokens: Sequence[int], salt: int = SEED) -> int:
    """Returns one block's local hash (its tokens_hash): XXH3 of its tokens, seeded with ``salt``.

    ``tokens`` are uint32 token ids (any sequence, a protobuf repeated field included); ``salt``
    comes from salt() (1337, the default, when no LoRA adapter nor cache namespace applies).
    """
    if not 0 <= salt <= _MASK64:
        _check_u64("salt", salt)
    pack = _STRUCTS.get(len(tokens)) or _packer(len(tokens))
    try:
        # struct checks that each token is a uint32 and writes it little-endian.
        return _xxh3(pack.pack(*tokens), seed=salt)
    except struct.error as e:
        raise ValueError(f"tokens must be uint32 token ids ({e})") from None


def local_multimodal(tokens: Sequence[int], mm_hashes: Iterable[int], salt: int = SEED) -> int:
    """Returns the local hash of one block that holds multimodal inputs: XXH3 of its tokens as
    little-endian uint32s followed by the inputs' hashes as little-endian uint64s, seeded with ``salt``.

    ``mm_hashes`` are the hashes of the inputs whose tokens lie in the block, once per input (the
    same image twice counts twice), in any order: they are sorted here, as the router sorts a stored
    block's mm_hashes, so that the key of a block does not depend on the order its inputs were listed
    in. Without any it equals local().
    """
    mm = sorted(mm_hashes)
    if not mm:
        return local(tokens, salt)
    _check_u64("salt", salt)
    try:
        data = _packer(len(tokens)).pack(*tokens)
    except struct.error as e:
        raise ValueError(f"tokens must be uint32 token ids ({e})") from None
    try:
        return _xxh3(data + struct.pack(f"<{len(mm)}Q", *mm), seed=salt)
    except struct.error as e:
        raise ValueError(f"mm_hashes must be in [0, 2**64) ({e})") from None


def _carried(objects: Iterable[MultimodalObject], block_size: int, n: int) -> Dict[int, List[int]]:
    """Returns, by block index (of n blocks), the hashes of the objects whose tokens the block holds:
    block i holds tokens [i*block_size, (i+1)*block_size), and an object [start, end) is held by every
    block its tokens overlap (none when start >= end)."""
    out: Dict[int, List[int]] = {}
    for o in objects:
        try:
            h, start, end = o
        except (TypeError, ValueError):
            raise ValueError(f"multimodal objects must be (mm_hash, start, end) tuples (got {o!r})") from None
        if not isinstance(h, int):
            raise ValueError(f"mm_hash must be in [0, 2**64) (got {h!r})")
        _check_u64("mm_hash", h)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < 1 << 32 and 0 <= end < 1 << 32):
            raise ValueError(f"multimodal object start and end must be uint32 token positions (got {start!r}, {end!r})")
        if start >= end:
            continue
        for i in range(start // block_size, min((end - 1) // block_size, n - 1) + 1):
            out.setdefault(i, []).append(h)
    return out


def local_hashes(tokens: Sequence[int], block_size: int, salt: int = SEED, objects: Optional[Iterable[MultimodalObject]] = None) -> List[int]:
    """Returns the local hash of every complete block of ``tokens``.

    A tail shorter than ``block_size`` is not hashed, and a block_size of 0 hashes nothing, as the
    router does with a prompt. ``objects`` are the prompt's multimodal inputs as ``(mm_hash, start,
    end)`` tuples (MultimodalObject), in any order, overlapping or not: a block whose tokens overlap
    an input's ``[start, end)`` is hashed with the input's hash (local_multimodal()), as the router
    hashes a RouteRequest with multimodal_objects; an empty input (start >= end) is held by no block.
    """
    _check_u64("salt", salt)
    if block_size <= 0:
        return []
    n = len(tokens) // block_size
    if n == 0:
        return []
    carried = _carried(objects, block_size, n) if objects else {}
    if carried:
        out = local_hashes(tokens, block_size, salt)
        for i, mm in carried.items():
            out[i] = local_multimodal(tokens[i * block_size : (i + 1) * block_size], mm, salt)
        return out
    if not _ARRAY:
        return [local(tokens[i : i + block_size], salt) for i in range(0, n * block_size, block_size)]
    try:
        buf = array("I", tokens[: n * block_size])
    except (OverflowError, TypeError) as e:
        raise ValueError(f"tokens must be uint32 token ids ({e})") from None
    if _SWAP:
        buf.byteswap()
    mv = memoryview(buf).cast("B")
    step = 4 * block_size
    return [_xxh3(mv[i : i + step], seed=salt) for i in range(0, n * step, step)]


def chain(parent: int, local: int) -> int:
    """Returns a block's sequence hash from its parent's sequence hash and its own local hash."""
    try:
        return _xxh3(_PAIR.pack(parent, local), seed=SEED)
    except struct.error as e:
        raise ValueError(f"parent and local must be in [0, 2**64) ({e})") from None


def sequence(locals_: Iterable[int]) -> List[int]:
    """Returns the sequence hash of each of a prompt's local hashes (the first is its own local hash)."""
    out: List[int] = []
    for h in locals_:
        out.append(chain(out[-1], h) if out else h)
    return out


def prompt_hashes(
    tokens: Sequence[int],
    block_size: int,
    lora_name: str = "",
    cache_namespace: str = "",
    objects: Optional[Iterable[MultimodalObject]] = None,
) -> List[int]:
    """Returns the sequence hashes of a prompt's complete blocks, as the router computes them
    (``objects``: its multimodal inputs as ``(mm_hash, start, end)`` tuples, see local_hashes())."""
    return sequence(local_hashes(tokens, block_size, salt(lora_name, cache_namespace), objects))


def _stored_hasher(block_size: int) -> Callable[[Sequence[Any]], None]:
    """Returns what Publisher(hash_tokens=True) applies to validated events: every stored block
    with token ids (exactly ``block_size`` of them) gets its tokens_hash and loses its token ids, and
    its mm_hashes, which the tokens_hash holds (the router refuses mm_hashes beside a tokens_hash)."""
    pack = _packer(block_size).pack
    xxh3 = _xxh3
    salts: Dict[Tuple[str, str], int] = {}

    def hash_events(events: Sequence[Any]) -> None:
        for ev in events:
            if ev.WhichOneof("data") != "stored":
                continue
            st = ev.stored
            key = (st.lora_name, st.cache_namespace)
            seed = salts.get(key)
            if seed is None:
                seed = salt(*key)
                if len(salts) < 1024:  # a few adapters and tenants; do not grow without bound
                    salts[key] = seed
            for b in st.blocks:
                if len(b.token_ids):
                    if len(b.mm_hashes):
                        b.tokens_hash = local_multimodal(b.token_ids[:], b.mm_hashes[:], seed)
                        b.ClearField("mm_hashes")
                    else:
                        # Slicing first copies the repeated field out in one C call, faster than unpacking it.
                        b.tokens_hash = xxh3(pack(*b.token_ids[:]), seed=seed)
                    b.ClearField("token_ids")

    return hash_events
