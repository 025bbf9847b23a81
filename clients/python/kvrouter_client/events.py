"""Helpers that build KvEvent messages for Publisher.publish()."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple, Union

from kvrouter_client import pb

__all__ = ["stored", "removed", "cleared"]


def stored(
    blocks: Iterable[Union[Tuple[int, Union[Sequence[int], int]], Tuple[int, Sequence[int], Sequence[int]]]],
    parent_hash: Optional[int] = None,
    tier: int = pb.types.STORAGE_TIER_DEVICE,
    lora_name: str = "",
    cache_namespace: str = "",
) -> "pb.worker.KvEvent":
    """Returns an event saying a chain of blocks was stored.

    Each block is a pair of the engine's block hash and either the block's token ids (exactly
    block_size of them) or, as an int, its tokens_hash (kvrouter_client.blockhash.local of its
    tokens, salted with ``lora_name`` and ``cache_namespace``). A block that holds multimodal inputs
    (images, audio) given by its token ids is a triple: the block hash, the token ids, and the
    hashes of the inputs whose tokens lie in it (blockhash.multimodal_hash; in any order, at most
    64), which the router hashes with the tokens. A tokens_hash already holds them
    (blockhash.local_multimodal), so a block given by one takes none: the router refuses mm_hashes
    beside a tokens_hash. ``parent_hash`` is the hash of the block just before the first one, when
    the chain continues an already stored one.
    """
    st = pb.worker.BlocksStored(
        blocks=[_block(*b) for b in blocks],
        lora_name=lora_name,
        cache_namespace=cache_namespace,
    )
    if parent_hash is not None:
        st.parent_hash = parent_hash
    return pb.worker.KvEvent(storage_tier=tier, stored=st)


def _block(h: int, toks: Union[Sequence[int], int], mm_hashes: Sequence[int] = ()) -> "pb.worker.StoredBlock":
    if isinstance(toks, int):
        return pb.worker.StoredBlock(block_hash=h, tokens_hash=toks, mm_hashes=list(mm_hashes))
    return pb.worker.StoredBlock(block_hash=h, token_ids=list(toks), mm_hashes=list(mm_hashes))


def removed(block_hashes: Iterable[int], tier: int = pb.types.STORAGE_TIER_DEVICE) -> "pb.worker.KvEvent":
    """Returns an event saying blocks were evicted from the cache."""
    return pb.worker.KvEvent(storage_tier=tier, removed=pb.worker.BlocksRemoved(block_hashes=list(block_hashes)))


def cleared(tier: int = pb.types.STORAGE_TIER_DEVICE) -> "pb.worker.KvEvent":
    """Returns an event saying every block of the worker rank is gone.

    The router drops the rank's blocks in every tier, whichever tier the event names (as Dynamo's
    Cleared does); tier is kept for callers that name one.
    """
    return pb.worker.KvEvent(storage_tier=tier, cleared=pb.worker.CacheCleared())
