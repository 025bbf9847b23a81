#!/usr/bin/env python3
"""An example worker: registers with kvrouter, publishes a few stored blocks, reports its load.

It stores the blocks of the prompt 1..32 (block size 4, so 8 blocks), reports its load, waits for
the router's acks and closes its stream. The router keeps it registered, with its blocks, for the
grace period (30 s by default), so frontend.py can route to it afterwards.

    python3 examples/worker.py --addr 127.0.0.1:50051

It needs kvrouter_client installed (pip install ./clients/python, or clients/python/install.sh
VENV_DIR without PyPI), or clients/python on PYTHONPATH.
"""

import argparse
import logging
import time

from kvrouter_client import Publisher, events, pb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--addr", default="127.0.0.1:50051", help="router address(es), comma-separated")
    ap.add_argument("--worker-id", type=int, default=1)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--endpoint", default="10.0.0.1:8000", help="the address frontends use to reach this worker")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=8, help="how many blocks of the prompt 1..N to store")
    ap.add_argument("--hold", type=float, default=0.0, help="seconds to keep the stream open before closing it")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    bs = args.block_size
    cache = [(args.worker_id * 1_000_000 + i, list(range(i * bs + 1, (i + 1) * bs + 1))) for i in range(args.blocks)]

    def dump() -> list:
        # The whole cache as stored events: what the router asks for after a gap.
        return [events.stored(cache)]

    hello = pb.worker.WorkerHello(
        worker_id=args.worker_id,
        model=args.model,
        role=pb.types.WORKER_ROLE_AGGREGATED,
        block_size=bs,
        total_kv_blocks=1024,
        endpoint=args.endpoint,
        kv_events_enabled=True,
        fresh_start=True,
    )
    with Publisher(hello, args.addr.split(","), dump=dump) as pub:
        # One chain of blocks, stored in two events: the second continues the first.
        half = len(cache) // 2
        pub.publish(events.stored(cache[:half]))
        pub.publish(events.stored(cache[half:], parent_hash=cache[half - 1][0]))
        pub.report_load(kv_used_blocks=len(cache), waiting_requests=0)
        pub.flush(timeout=10)
        print(f"worker {args.worker_id}: published {len(cache)} blocks, acked through event {pub.last_acked}", flush=True)
        time.sleep(args.hold)


if __name__ == "__main__":
    main()
