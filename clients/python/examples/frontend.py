#!/usr/bin/env python3
"""An example frontend: routes a prompt through kvrouter, prints the chosen worker, frees the booking.

    python3 examples/frontend.py --addr 127.0.0.1:50051 --tokens 34

It needs kvrouter_client installed (pip install ./clients/python, or clients/python/install.sh
VENV_DIR without PyPI), or clients/python on PYTHONPATH.
"""

import argparse

from kvrouter_client import Router, pb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--addr", default="127.0.0.1:50051", help="router address")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=34, help="route the prompt 1..N")
    ap.add_argument("--request-id", default=None, help="the request id (random by default)")
    args = ap.parse_args()

    with Router(args.addr) as router:
        with router.route(list(range(1, args.tokens + 1)), args.model, args.request_id) as booking:
            d = booking.decode
            overlap = booking.response.diagnostics.decode.overlap_blocks.device
            mode = pb.router.RouteMode.Name(booking.mode)
            print(f"request {booking.request_id}: worker {d.worker_id} rank {d.dp_rank} at {d.endpoint} ({mode}, {overlap} cached blocks)", flush=True)
            # ... send the request to d.endpoint here; after a remote prefill: booking.prefill_complete()
        print(f"request {booking.request_id}: freed", flush=True)


if __name__ == "__main__":
    main()
