#!/usr/bin/env python3
"""Publisher throughput: stored blocks per second through one Publisher to one kvrouter replica.

Each round publishes ``--events`` stored events of ``--blocks`` blocks of ``--block-size`` tokens
(distinct tokens, so distinct blocks; each event continues the chain of the one before), one event
per publish() call, then close(), which waits for the router's last ack. The events are built
before the timer starts, as an engine has them at hand; the timer starts once the stream is
registered and covers publish() (validation, and hashing with hash_tokens) and close(). Rounds
with token ids and with hash_tokens=True alternate; every round re-registers the same worker with
fresh_start (the router drops its blocks), and afterwards the router's worker status is checked
(last event id, cached blocks).

    clients/python/bench.sh                        # builds and starts the server, runs this
    python3 bench.py --addr 127.0.0.1:50051        # against a running `kvrouter serve`
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpc  # noqa: E402
import xxhash  # noqa: E402
from google.protobuf import __version__ as protobuf_version  # noqa: E402
from google.protobuf.internal import api_implementation  # noqa: E402

from kvrouter_client import Publisher, events, pb  # noqa: E402

WORKER_ID = 100


def wait_ready(channel: grpc.Channel, timeout: float) -> None:
    admin = pb.admin_grpc.AdminServiceStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin.GetState(pb.admin.GetStateRequest(), timeout=1)
            return
        except grpc.RpcError as e:
            if time.monotonic() > deadline:
                raise SystemExit(f"bench.py: the router did not answer: {e}")
            time.sleep(0.05)


def build(round_no: int, n_events: int, n_blocks: int, bs: int) -> List["pb.worker.KvEvent"]:
    """Returns the round's events; tokens (and block hashes) never repeat across rounds."""
    base = round_no * n_events * n_blocks  # first block number of the round
    out = []
    for i in range(n_events):
        first = base + i * n_blocks
        blocks = [(b + 1, range(b * bs, (b + 1) * bs)) for b in range(first, first + n_blocks)]
        out.append(events.stored(blocks, parent_hash=first if i > 0 else None))
    return out


def run_round(addr: str, channel: grpc.Channel, evs: List["pb.worker.KvEvent"], args: argparse.Namespace, hash_tokens: bool) -> float:
    hello = pb.worker.WorkerHello(
        worker_id=WORKER_ID, model="bench", role=pb.types.WORKER_ROLE_AGGREGATED, block_size=args.block_size,
        total_kv_blocks=1 << 30, max_num_batched_tokens=8192, kv_events_enabled=True, endpoint="10.0.0.100:8000", fresh_start=True,
    )
    p = Publisher(hello, addr, hash_tokens=hash_tokens, max_batch_events=args.max_batch_events)
    deadline = time.monotonic() + 10
    while p.stats.streams == 0:  # time the stream, not the connection
        if p.error is not None or time.monotonic() > deadline:
            p.close(1)
            raise SystemExit(f"bench.py: the publisher did not register: {p.error}")
        time.sleep(0.001)
    t0 = time.perf_counter()
    for ev in evs:
        p.publish(ev)
    p.close(timeout=120)
    elapsed = time.perf_counter() - t0
    # The router holds every block, once.
    admin = pb.admin_grpc.AdminServiceStub(channel)
    ws = [w for w in admin.ListWorkers(pb.admin.ListWorkersRequest(model="bench"), timeout=5).workers if w.worker.worker_id == WORKER_ID]
    want_blocks = len(evs) * args.blocks
    if len(ws) != 1 or ws[0].last_event_id != len(evs) - 1 or ws[0].cached_blocks.device != want_blocks:
        got = (ws[0].last_event_id, ws[0].cached_blocks.device) if ws else None
        raise SystemExit(f"bench.py: the router holds (last event id, blocks) {got}, want {(len(evs) - 1, want_blocks)}")
    if p.stats.failures or p.stats.resync_requests:
        raise SystemExit(f"bench.py: the stream failed or resynced: {p.stats}")
    return want_blocks / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--addr", required=True, help="the router's address")
    ap.add_argument("--events", type=int, default=5000, help="stored events a round")
    ap.add_argument("--blocks", type=int, default=64, help="blocks an event")
    ap.add_argument("--block-size", type=int, default=16, help="tokens a block")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each mode (interleaved)")
    ap.add_argument("--max-batch-events", type=int, default=256, help="Publisher max_batch_events (1: one event a message, as the Go benchmark)")
    args = ap.parse_args()
    if (args.rounds * 2) * args.events * args.blocks * args.block_size > 1 << 32:
        raise SystemExit("bench.py: too many tokens for distinct uint32 token ids")

    print(f"python {platform.python_version()} ({sys.executable}), grpcio {grpc.__version__}, protobuf {protobuf_version} "
          f"({api_implementation.Type()}), xxhash {xxhash.VERSION} (libxxhash {xxhash.XXHASH_VERSION}), {platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{args.events} events x {args.blocks} blocks x {args.block_size} tokens a round, max_batch_events {args.max_batch_events}, "
          f"{args.rounds} rounds of each mode, interleaved; router {args.addr}", flush=True)
    channel = grpc.insecure_channel(args.addr)
    wait_ready(channel, 10)
    results: Dict[str, List[float]] = {"token_ids": [], "hash_tokens": []}
    t_start = time.monotonic()
    round_no = 0
    for r in range(args.rounds):
        for mode in ("token_ids", "hash_tokens"):
            evs = build(round_no, args.events, args.blocks, args.block_size)
            round_no += 1
            rate = run_round(args.addr, channel, evs, args, hash_tokens=mode == "hash_tokens")
            results[mode].append(rate)
            print(f"round {r + 1} {mode:<11}: {rate:>10,.0f} blocks/s", flush=True)
    channel.close()
    for mode, rates in results.items():
        print(f"{mode:<11}: median {statistics.median(rates):>10,.0f} blocks/s  (rounds: {', '.join(f'{x:,.0f}' for x in rates)})")
    print(f"total {time.monotonic() - t_start:.1f} s")


if __name__ == "__main__":
    main()
