"""Client-side checks of what the router would refuse, with the router's own messages.

The messages follow server/router.go, server/publishmap.go and server/worker.go, so that an error
raised here reads as the router's INVALID_ARGUMENT would.
"""

from __future__ import annotations

from typing import Optional, Sequence

from kvrouter_client import pb
from kvrouter_client.errors import ValidationError

MAX_REQUEST_ID_BYTES = 512
"""The router's limit on request ids, in bytes (server/router.go)."""

MAX_BATCH_BLOCKS = 16_384
"""The router's default max_batch_blocks: most events, and most blocks, of one Publish message."""

MAX_MULTIMODAL_OBJECTS = 256
"""The most multimodal inputs of one RouteRequest (server/router.go): each costs the hashing of the
blocks it touches."""

MAX_BLOCK_MM_HASHES = 64
"""The most mm_hashes of one stored block (server/router.go)."""

MAX_LEAVE_REASON_BYTES = 256
"""The router's limit on a WorkerLeave's reason, in bytes: it goes to the router's log."""

_TIERS = {pb.types.STORAGE_TIER_DEVICE, pb.types.STORAGE_TIER_HOST, pb.types.STORAGE_TIER_DISK, pb.types.STORAGE_TIER_EXTERNAL}
_ROLES = {pb.types.WORKER_ROLE_PREFILL, pb.types.WORKER_ROLE_DECODE, pb.types.WORKER_ROLE_AGGREGATED}


def check_request_id(request_id: str) -> None:
    """Raises ValidationError for a request id the router refuses (empty or over 512 bytes)."""
    if request_id == "":
        raise ValidationError("request_id", "must not be empty")
    n = len(request_id.encode("utf-8"))
    if n > MAX_REQUEST_ID_BYTES:
        raise ValidationError("request_id", f"must be at most {MAX_REQUEST_ID_BYTES} bytes (got {n})")


def check_route_request(req: "pb.router.RouteRequest", max_prompt_tokens: Optional[int]) -> None:
    """Raises ValidationError for a RouteRequest the router would refuse before routing it: its
    prompt as token ids, or as the block hashes of a hashed prompt (block_size set, see
    kvrouter_client.hash_prompt), each checked as the router checks it (server/router.go, prompt)."""
    if not req.query_only or req.request_id != "":
        check_request_id(req.request_id)
    if req.model == "":
        raise ValidationError("model", "must not be empty")
    if req.block_size != 0:
        check_hashed_prompt(req, max_prompt_tokens)
    else:
        if len(req.block_hashes) > 0:
            raise ValidationError("block_size", "must be set with block_hashes (the block size they were hashed with)")
        if req.prompt_tokens != 0:
            raise ValidationError("prompt_tokens", "must be set only with block_size and block_hashes (token_ids count themselves)")
        n = len(req.token_ids)
        if n == 0:
            raise ValidationError("token_ids", "must not be empty")
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            raise ValidationError("token_ids", f"has {n} tokens, more than the maximum of {max_prompt_tokens} (max_prompt_tokens)")
        check_multimodal_objects(req.multimodal_objects, n)
    if req.HasField("hints"):
        h = req.hints
        if h.HasField("prefill_dp_rank") and not h.HasField("prefill_worker_id"):
            raise ValidationError("hints.prefill_dp_rank", "needs hints.prefill_worker_id")
        if h.HasField("decode_dp_rank") and not h.HasField("decode_worker_id"):
            raise ValidationError("hints.decode_dp_rank", "needs hints.decode_worker_id")


def check_hashed_prompt(req: "pb.router.RouteRequest", max_prompt_tokens: Optional[int]) -> None:
    """Raises ValidationError for a hashed prompt (block_size set) the router refuses: one that
    also sets a field its hashes hold (token_ids, lora_name, cache_namespace, multimodal_objects),
    or whose prompt_tokens is 0, over max_prompt_tokens (None skips that check), or does not fit
    its block_hashes: at least len(block_hashes) * block_size and less than one block more."""
    for name, is_set in (
        ("token_ids", len(req.token_ids) > 0),
        ("lora_name", req.lora_name != ""),
        ("cache_namespace", req.cache_namespace != ""),
        ("multimodal_objects", len(req.multimodal_objects) > 0),
    ):
        if is_set:
            raise ValidationError(name, "must be empty with block_size and block_hashes (fold it into the hashes)")
    size, blocks, tokens = req.block_size, len(req.block_hashes), req.prompt_tokens
    if tokens == 0:
        raise ValidationError("prompt_tokens", "must be at least 1 with block_hashes")
    if max_prompt_tokens is not None and tokens > max_prompt_tokens:
        raise ValidationError("prompt_tokens", f"is {tokens}, more than the maximum of {max_prompt_tokens} (max_prompt_tokens)")
    if not blocks * size <= tokens < (blocks + 1) * size:
        raise ValidationError(
            "prompt_tokens",
            f"must be in [{blocks * size}, {(blocks + 1) * size}): {blocks} block_hashes of block_size {size} and a partial block (got {tokens})",
        )


def check_multimodal_objects(objects: Sequence["pb.router.MultimodalObject"], n: int) -> None:
    """Raises ValidationError for a RouteRequest's multimodal_objects that the router refuses with a
    prompt of n tokens: more than 256, one with end <= start or past the prompt, or two whose tokens
    overlap (an input's placeholder tokens are its own)."""
    if len(objects) > MAX_MULTIMODAL_OBJECTS:
        raise ValidationError("multimodal_objects", f"must hold at most {MAX_MULTIMODAL_OBJECTS} inputs (got {len(objects)})")
    for i, o in enumerate(objects):
        if o.end <= o.start:
            raise ValidationError(f"multimodal_objects[{i}].end", f"must be greater than start {o.start} (got {o.end})")
        if o.end > n:
            raise ValidationError(f"multimodal_objects[{i}].end", f"must be at most the number of token_ids {n} (got {o.end})")
    # The router sorts them by their first token and names the first that overlaps the one before it.
    order = sorted(range(len(objects)), key=lambda k: objects[k].start)
    for p, i in zip(order, order[1:]):
        a, b = objects[p], objects[i]
        if a.end > b.start:
            raise ValidationError(f"multimodal_objects[{i}]", f"tokens [{b.start}, {b.end}) overlap those of multimodal_objects[{p}], [{a.start}, {a.end})")


def check_leave_reason(reason: str) -> None:
    """Raises ValidationError for a WorkerLeave reason the router refuses (over 256 bytes)."""
    n = len(reason.encode("utf-8"))
    if n > MAX_LEAVE_REASON_BYTES:
        raise ValidationError("leave.reason", f"must be at most {MAX_LEAVE_REASON_BYTES} bytes (got {n})")


def check_hello(h: "pb.worker.WorkerHello") -> None:
    """Raises ValidationError for a WorkerHello the router would refuse."""
    if h.worker_id == 0:
        raise ValidationError("hello.worker_id", "must not be 0")
    if h.model == "":
        raise ValidationError("hello.model", "must not be empty")
    if h.role not in _ROLES:
        raise ValidationError("hello.role", f"must be PREFILL, DECODE or AGGREGATED (got {pb.types.WorkerRole.Name(h.role)})")
    if h.block_size == 0:
        raise ValidationError("hello.block_size", "must be > 0")
    if h.endpoint == "" and not h.no_endpoint:
        raise ValidationError("hello.endpoint", "must be set to the address frontends reach the worker at (or set hello.no_endpoint for a fleet whose frontends find workers by worker_id)")
    if h.endpoint != "" and h.no_endpoint:
        raise ValidationError("hello.no_endpoint", "must not be set with hello.endpoint")


def check_events(events: Sequence["pb.worker.KvEvent"], block_size: int, field: str = "events.events") -> None:
    """Raises ValidationError for an event the router would refuse on a stream of this block size.

    Event ids and dp_rank are not checked: the publisher sets them. ``field`` prefixes the field
    names, as the router does ("events.events" for a batch, "dump.events" for a dump).
    """
    for i, ev in enumerate(events):
        f = f"{field}[{i}]"
        if ev.storage_tier not in _TIERS:
            raise ValidationError(f + ".storage_tier", f"must be DEVICE, HOST, DISK or EXTERNAL (got {pb.types.StorageTier.Name(ev.storage_tier)})")
        kind = ev.WhichOneof("data")
        if kind == "stored":
            if len(ev.stored.blocks) == 0:
                raise ValidationError(f + ".stored.blocks", "must not be empty")
            for j, b in enumerate(ev.stored.blocks):
                bf = f"{f}.stored.blocks[{j}]"
                has_hash = b.HasField("tokens_hash")
                if has_hash and len(b.token_ids) > 0:
                    raise ValidationError(bf, "must set exactly one of token_ids and tokens_hash (both are set)")
                if has_hash and len(b.mm_hashes) > 0:
                    raise ValidationError(bf + ".mm_hashes", "must be empty with tokens_hash, which already holds them")
                if not has_hash:
                    if len(b.token_ids) == 0:
                        raise ValidationError(bf, "must set exactly one of token_ids and tokens_hash (neither is set)")
                    if len(b.token_ids) != block_size:
                        raise ValidationError(bf + ".token_ids", f"must hold exactly block_size {block_size} tokens (got {len(b.token_ids)})")
                    if len(b.mm_hashes) > MAX_BLOCK_MM_HASHES:
                        raise ValidationError(bf + ".mm_hashes", f"must hold at most {MAX_BLOCK_MM_HASHES} hashes (got {len(b.mm_hashes)})")
        elif kind == "removed":
            if len(ev.removed.block_hashes) == 0:
                raise ValidationError(f + ".removed.block_hashes", "must not be empty")
        elif kind is None:
            raise ValidationError(f, "must set one of stored, removed, cleared")


def event_blocks(ev: "pb.worker.KvEvent") -> int:
    """Returns the blocks an event counts for against max_batch_blocks (stored blocks plus removed hashes)."""
    return len(ev.stored.blocks) + len(ev.removed.block_hashes)
