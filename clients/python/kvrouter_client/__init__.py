"""kvrouter_client: the Python client of kvrouter.

- ``Router`` routes requests (RouterService) and returns ``Booking`` handles that free themselves.
- ``Publisher`` streams one worker rank's KV-cache events and load (WorkerService/Publish), resuming
  across reconnects without losing or repeating an event.
- ``pb`` holds the generated messages and stubs; ``events`` builds KvEvent messages.
- ``kvrouter_client.blockhash`` is the router's block hashing (tokens_hash); ``hash_prompt`` keys a
  RouteRequest's prompt with it, to send its block hashes instead of its token ids.
- ``kvrouter_client.aio`` has the same ``Router`` and ``Publisher`` on grpc.aio, for asyncio code.

It needs grpcio, protobuf and xxhash (``pip install kvrouter-client`` brings them; Debian:
python3-grpcio, python3-protobuf, python3-xxhash); without one of them the import raises an
ImportError that says what to install.
"""

import logging

__version__ = "0.1.0"

from kvrouter_client import _deps  # noqa: E402

_deps.require()

from kvrouter_client import events, pb  # noqa: E402 - after the check of the dependencies
from kvrouter_client.errors import (  # noqa: E402
    KvRouterError,
    PublisherClosedError,
    PublisherError,
    UnackedWindowFullError,
    ValidationError,
    WorkerSupersededError,
    error_reason,
    retry_delay,
)
from kvrouter_client._routecore import hash_prompt  # noqa: E402
from kvrouter_client.publisher import DEFAULT_CHANNEL_OPTIONS, DumpFunction, Publisher, PublisherStats  # noqa: E402
from kvrouter_client.router import Booking, Router  # noqa: E402

__all__ = [
    "__version__",
    "DEFAULT_CHANNEL_OPTIONS",
    "Booking",
    "DumpFunction",
    "KvRouterError",
    "Publisher",
    "PublisherClosedError",
    "PublisherError",
    "PublisherStats",
    "Router",
    "UnackedWindowFullError",
    "ValidationError",
    "WorkerSupersededError",
    "error_reason",
    "events",
    "hash_prompt",
    "pb",
    "retry_delay",
]

# A library logs, the application decides where to: nothing is printed unless it configures logging.
logging.getLogger("kvrouter_client").addHandler(logging.NullHandler())
