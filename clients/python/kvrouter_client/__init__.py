"""kvrouter_client: the Python client of kvrouter.

- ``Router`` routes requests (RouterService) and returns ``Booking`` handles that free themselves.
- ``Publisher`` streams one worker rank's KV-cache events and load (WorkerService/Publish), resuming
  across reconnects without losing or repeating an event.
- ``pb`` holds the generated messages and stubs; ``events`` builds KvEvent messages.
- ``kvrouter_client.blockhash`` is the router's block hashing (tokens_hash); import it on its own: it
  needs xxhash (Debian's python3-xxhash), which nothing else here does.
"""

import logging

from kvrouter_client import events, pb
from kvrouter_client.errors import (
    KvRouterError,
    PublisherClosedError,
    PublisherError,
    UnackedWindowFullError,
    ValidationError,
    WorkerSupersededError,
    error_reason,
    retry_delay,
)
from kvrouter_client.publisher import DEFAULT_CHANNEL_OPTIONS, DumpFunction, Publisher, PublisherStats
from kvrouter_client.router import Booking, Router

__all__ = [
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
    "pb",
    "retry_delay",
]

# A library logs, the application decides where to: nothing is printed unless it configures logging.
logging.getLogger("kvrouter_client").addHandler(logging.NullHandler())
