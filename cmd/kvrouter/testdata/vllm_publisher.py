#!/usr/bin/python3
"""A stand-in for vLLM's KV event publisher (vllm/distributed/kv_events.py, ZmqEventPublisher),
written from the wire format with Debian's python3-zmq (libzmq) and python3-msgpack, for the bridge's
end-to-end test. It is not vLLM's code: it writes what vLLM writes.

- PUB socket bound at --endpoint; each batch is the multipart message
  (topic, seq as 8 bytes big-endian, msgpack([ts, events, data_parallel_rank])).
- ROUTER replay socket bound at --replay-endpoint (optional): a request [identity, b"", seq8] is
  answered with every kept batch from seq on, as [identity, b"", topic, seq8, payload], then the end
  marker [identity, b"", b"", (-1 as 8 bytes), b""].
- Events are positional arrays with the tag first (--style arrays, vLLM before June 2026, every
  field up to kv_cache_spec_sliding_window) or maps with the tag under "type" (--style maps).

- The replay buffer keeps the last --buffer-steps batches (vLLM's buffer_steps, 10,000 by default).
- --health-port serves GET /health (200), as vLLM's API server does while its engine runs.

Commands come on stdin, one JSON object a line; after each, one line "ok <last seq>" on stdout:
  {"op": "store", "first": 0, "n": 4, "parent": true}   blocks first..first+n-1 of the test prompt
      ("medium": "CPU" stores them in the CPU tier, as vLLM's CPU offloading does; default GPU)
      ("lora": "name", "cache_salt": "salt", "images": [{"id": "...", "start": 5, "end": 14}] key the
      blocks as vLLM keys a LoRA, salted or multimodal request: lora_name and per-block extra_keys of
      generate_block_hash_extra_keys, [LoRA name] + [(identifier, offset in block)] per image whose
      tokens (absolute prompt positions [start, end)) the block holds + [cache salt] on the prompt's
      first block; and block hashes that depend on them)
  {"op": "remove", "blocks": [6, 7]}                      ("medium", "lora", "cache_salt", "images" as for store)
  {"op": "offload", "first": 0, "n": 4}                    blocks first..first+n-1 copied to the CPU as vLLM's
      OffloadingConnector reports them by default: one BlockStored per block with its hash only (no
      parent, no token ids, block_size 0, medium CPU); "remove" with "medium": "CPU" evicts them
  {"op": "clear"}
  {"op": "ping"}                                           a batch without events
  {"op": "raw", "hex": "c1"}                               a payload as given (malformed input)
  {"op": "restart"}                                        the sequence starts again at 0
  {"op": "blocks"}                                         answers "blocks <GPU> <CPU>": what the engine holds
Any command with "lost": true is kept for replay but not sent, as if the PUB socket had dropped it;
with "garbled": true it is sent with its payload cut short (damaged on the way) and kept whole for
replay.
"""

import argparse
import collections
import hashlib
import http.server
import json
import sys
import threading
import time

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def block_hash(i, cmd=None):
    # vLLM's default hashes are the low 64 bits of a sha256 digest: large unsigned integers. A keyed
    # request's blocks hash apart, as vLLM's hash covers the extra keys.
    h = (0x9E3779B97F4A7C15 * (i + 1)) & 0xFFFFFFFFFFFFFFFF
    variant = request_variant(cmd or {})
    if variant:
        h ^= int.from_bytes(hashlib.sha256(variant.encode()).digest()[:8], "big")
    return h


def request_variant(cmd):
    return json.dumps([cmd.get("lora"), cmd.get("cache_salt"), cmd.get("images")]) if any(
        cmd.get(k) for k in ("lora", "cache_salt", "images")) else ""


def extra_keys(cmd, i, block_size):
    """Block i's extra keys, as vLLM's generate_block_hash_extra_keys lists them (None for none)."""
    start, end = i * block_size, (i + 1) * block_size
    keys = []
    if cmd.get("lora"):
        keys.append(cmd["lora"])
    for img in cmd.get("images") or []:
        if end > img["start"] and start < img["end"]:
            keys.append((img["id"], img["start"] - start))
    if start == 0 and cmd.get("cache_salt"):
        keys.append(cmd["cache_salt"])
    return tuple(keys) or None


def tokens(i, block_size):
    return [i * block_size + k + 1 for k in range(block_size)]


class Engine:
    def __init__(self, args):
        self.args = args
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(args.endpoint)
        self.topic = args.topic.encode()
        self.seq = 0
        self.buffer = collections.deque(maxlen=args.buffer_steps)  # (seq, payload): sent or lost
        self.lock = threading.Lock()
        self.cache = {"GPU": set(), "CPU": set()}  # what the engine holds, by medium
        if args.replay_endpoint:
            threading.Thread(target=self.serve_replay, daemon=True).start()
        if args.health_port:
            threading.Thread(target=self.serve_health, daemon=True).start()

    def serve_health(self):
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        http.server.HTTPServer(("127.0.0.1", self.args.health_port), Health).serve_forever()

    def serve_replay(self):
        router = self.ctx.socket(zmq.ROUTER)
        router.bind(self.args.replay_endpoint)
        while True:
            frames = router.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs a warning and answers nothing
            client, _, start = frames
            start = int.from_bytes(start, "big")
            with self.lock:
                kept = list(self.buffer)
            for seq, payload in kept:
                if seq >= start:
                    router.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            router.send_multipart((client, b"", b"", END_SEQ, b""))

    def events(self, cmd):
        bs = self.args.block_size
        op = cmd["op"]
        medium = cmd.get("medium", "GPU")
        if op == "offload":
            out = []
            for i in range(cmd["first"], cmd["first"] + cmd["n"]):
                h = block_hash(i, cmd)
                fields = dict(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                              medium="CPU", lora_name=None, extra_keys=None, group_idx=0,
                              kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None)
                self.cache["CPU"].add(h)
                out.append(self.encode("BlockStored", fields))
            return out
        return [self.event(cmd, bs, op, medium)]

    def event(self, cmd, bs, op, medium):
        if op == "store":
            first, n = cmd["first"], cmd["n"]
            hashes = [block_hash(i, cmd) for i in range(first, first + n)]
            parent = block_hash(first - 1, cmd) if cmd.get("parent") and first > 0 else None
            toks = [t for i in range(first, first + n) for t in tokens(i, bs)]
            fields = dict(block_hashes=hashes, parent_block_hash=parent, token_ids=toks, block_size=bs, lora_id=None,
                          medium=medium, lora_name=cmd.get("lora"),
                          extra_keys=[extra_keys(cmd, i, bs) for i in range(first, first + n)], group_idx=0,
                          kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None)
            self.cache[medium].update(hashes)
            return self.encode("BlockStored", fields)
        if op == "remove":
            hashes = [block_hash(i, cmd) for i in cmd["blocks"]]
            self.cache[medium].difference_update(hashes)
            fields = dict(block_hashes=hashes, medium=medium, group_idx=0)
            return self.encode("BlockRemoved", fields)
        if op == "clear":
            for blocks in self.cache.values():
                blocks.clear()
            return self.encode("AllBlocksCleared", {})
        raise ValueError(f"unknown op {op}")

    def encode(self, tag, fields):
        if self.args.style == "arrays":
            return [tag, *fields.values()]
        # msgspec's omit_defaults leaves out the optional fields that hold None.
        return {"type": tag, **{k: v for k, v in fields.items() if v is not None or k in ("parent_block_hash", "lora_id", "medium", "lora_name")}}

    def handle(self, cmd):
        op = cmd["op"]
        if op == "restart":
            with self.lock:
                self.seq = 0
                self.buffer.clear()
            for blocks in self.cache.values():
                blocks.clear()
            return
        if op == "blocks":
            return f"blocks {len(self.cache['GPU'])} {len(self.cache['CPU'])}"
        if op == "raw":
            payload = bytes.fromhex(cmd["hex"])
        else:
            events = [] if op == "ping" else self.events(cmd)
            payload = msgpack.packb([time.time(), events, self.args.dp_rank], use_bin_type=True)
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if cmd.get("garbled"):
            payload = payload[: len(payload) // 2]
        if not cmd.get("lost"):
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay-endpoint", default="")
    ap.add_argument("--topic", default="kv@test-pod@m")
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--style", choices=("arrays", "maps"), default="arrays")
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--health-port", type=int, default=0)
    args = ap.parse_args()
    engine = Engine(args)
    print("ready", flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        answer = engine.handle(json.loads(line))
        print(answer or f"ok {engine.seq - 1}", flush=True)


if __name__ == "__main__":
    main()
