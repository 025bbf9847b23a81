"""The router's block hashing (kvstate/blockhash): local block hashes, salts and sequence hashes.

A worker that sends a stored block's ``tokens_hash`` instead of its ``token_ids`` (see
``Publisher(hash_tokens=True)``) must compute it exactly as the router does:

- ``salt(lora_name, cache_namespace)``: 1337, plus XXH3(lora_name, seed 0) when a LoRA adapter is
  used, plus XXH3(cache_namespace, seed 1) when a cache namespace is set (UTF-8, additions wrap at
  2**64; an empty string counts as absent).
- ``local(tokens, salt)``: XXH3 over the block's tokens as little-endian uint32s, seeded with the salt.
- ``chain(parent, local)``: XXH3 over the two as little-endian uint64s, seed 1337: the sequence hash
  of a block after its parent's. ``sequence(locals)`` chains a whole prompt; its first block's
  sequence hash is its local hash.

XXH3 is the 64-bit XXH3 of Debian's python3-xxhash (the C libxxhash); this module needs it
(``apt-get install -y python3-xxhash``), the rest of kvrouter_client does not. Every hash is an int
in [0, 2**64). The golden vectors in kvstate/blockhash/testdata/hash_vectors.json check it.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple

try:
    import xxhash
except ImportError as _e:  # pragma: no cover - depends on the machine
    raise ImportError(
        "kvrouter_client.blockhash needs the xxhash module (Debian: apt-get install -y python3-xxhash, "
        "for /usr/bin/python3); it is used by Publisher(hash_tokens=True)"
    ) from _e

__all__ = ["SEED", "salt", "local", "local_hashes", "chain", "sequence", "prompt_hashes"]

SEED = 1337
"""The XXH3 seed of block hashing, and of chaining sequence hashes."""

_MASK64 = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest

# local_hashes() packs a whole prompt at once into an array of C unsigned ints, 4 bytes on every
# platform CPython supports (struct packs block by block where it is not), byte-swapped on big-endian.
_ARRAY = array("I").itemsize == 4
_SWAP = sys.byteorder != "little"
_STRUCTS: Dict[int, struct.Struct] = {}  # "<nI" by n: block sizes are few (at most 64 are kept)
_PAIR = struct.Struct("<QQ")


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


def local_hashes(tokens: Sequence[int], block_size: int, salt: int = SEED) -> List[int]:
    """Returns the local hash of every complete block of ``tokens``.

    A tail shorter than ``block_size`` is not hashed, and a block_size of 0 hashes nothing, as the
    router does with a prompt.
    """
    _check_u64("salt", salt)
    if block_size <= 0:
        return []
    n = len(tokens) // block_size
    if n == 0:
        return []
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


def prompt_hashes(tokens: Sequence[int], block_size: int, lora_name: str = "", cache_namespace: str = "") -> List[int]:
    """Returns the sequence hashes of a prompt's complete blocks, as the router computes them."""
    return sequence(local_hashes(tokens, block_size, salt(lora_name, cache_namespace)))


def _stored_hasher(block_size: int) -> Callable[[Sequence[Any]], None]:
    """Returns what Publisher(hash_tokens=True) applies to validated events: every stored block
    with token ids (exactly ``block_size`` of them) gets its tokens_hash and loses its token ids."""
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
                    # Slicing first copies the repeated field out in one C call, faster than unpacking it.
                    b.tokens_hash = xxh3(pack(*b.token_ids[:]), seed=seed)
                    b.ClearField("token_ids")

    return hash_events
