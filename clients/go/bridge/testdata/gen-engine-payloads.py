#!/usr/bin/python3
"""Writes the engine payloads the bridge's tests decode (TestEnginePayloads), as vLLM and SGLang
publish them (msgpack from Debian's python3-msgpack, not the bridge's own encoder). Run from this
folder:

    /usr/bin/python3 gen-engine-payloads.py

Block i of the prompts holds tokens 10*i+1 .. 10*i+4 and has the engine hash 100+i; blocks are 4
tokens.
"""
import msgpack


def tokens(*blocks):
    return [10 * i + k for i in blocks for k in range(1, 5)]


def stored(hashes, parent, token_ids, block_size, medium):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": token_ids, "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": None, "extra_keys": None, "group_idx": 0,
            "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None,
            "locality": None, "ownership": None}


def removed(hashes, medium):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0,
            "locality": None, "ownership": None}


def write(name, ts, events):
    with open(name, "wb") as f:
        f.write(msgpack.packb([ts, events, 0], use_bin_type=True))


# Placeholder events (self_describing_kv_events off, the default): one stored event per offloaded
# chunk, naming it by its last block's hash, with no parent, no token ids and block_size 0.
write("vllm_offload_placeholder.msgpack", 1789095808.5, [
    stored([100, 101, 102, 103], None, tokens(0, 1, 2, 3), 4, "GPU"),
    stored([100], None, [], 0, "CPU"),
    stored([101], None, [], 0, "CPU"),
    stored([999], None, [], 0, "CPU"),  # a block the GPU events never named
    removed([100, 101, 102, 103], "GPU"),
    removed([100], "CPU"),
])

# Self-describing events (self_describing_kv_events on) with chunks of 2 blocks: a chunk's stored
# event lists its blocks with their tokens and parent; its removal lists the same blocks. Prompt A
# is blocks 0-3; prompt B shares blocks 0-2 and ends with its own block (hash 203, the tokens of
# block 7), so its second chunk lists block 2 again.
write("vllm_offload_chunks.msgpack", 1789095809.5, [
    stored([100, 101], None, tokens(0, 1), 4, "CPU"),
    stored([102, 103], 101, tokens(2, 3), 4, "CPU"),
    stored([102, 203], 101, tokens(2, 7), 4, "CPU"),
    removed([102, 103], "CPU"),
    removed([102, 203], "CPU"),
])

# vLLM caches one hash in several GPU blocks when two requests compute it at once, announcing each,
# and each eviction's BlockRemoved says how many copies are left (remaining_copy_counts, vLLM 0.19 on;
# map-encoded events).
write("vllm_copies.msgpack", 1789095810.5, [
    stored([100, 101], None, tokens(0, 1), 4, "GPU"),
    stored([100, 101], None, tokens(0, 1), 4, "GPU"),
    {"type": "BlockRemoved", "block_hashes": [100, 101], "medium": "GPU", "group_idx": 0,
     "remaining_copy_counts": [1, 0]},
    {"type": "BlockRemoved", "block_hashes": [100], "medium": "GPU", "group_idx": 0,
     "remaining_copy_counts": [0]},
])

# SGLang's positional events: a salted request's BlockStored carries {"cache_salt": ...} where vLLM
# has lora_name, and with EAGLE speculative decoding a page's token_ids are [token, next] pairs.
write("sglang_salted_eagle.msgpack", 1789095811.5, [
    ["BlockStored", [100], None, tokens(0), 4, None, "GPU", {"cache_salt": "tenant-1"}],
    ["BlockStored", [101], 100, [[t, t + 1] for t in tokens(1)], 4, None, "GPU",
     {"cache_salt": "tenant-1"}],
    ["BlockRemoved", [101], "GPU"],
])
