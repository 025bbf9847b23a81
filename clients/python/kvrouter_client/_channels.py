"""The gRPC channel options of every channel the clients open, and the reading of their targets."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Type, TypeVar, Union

__all__ = ["DEFAULT_CHANNEL_OPTIONS", "split_targets"]

# gRPC's own reconnect backoff starts at 1 s and grows to 120 s; the publisher's backoff is meant to
# decide, and a frontend should reach a restarted router soon, so the channels the clients open
# retry a connection sooner. The keepalive is the Go client's (kvclient.Keepalive): a ping after 15 s
# without traffic, also with no call in flight and on a quiet stream (the router allows one every
# 10 s), and the connection failed when no answer comes within 10 s. It fails a call or stream whose
# router vanished without closing the connection (a crashed host, a partition) within about 25 s,
# instead of leaving it waiting until TCP gives up, many minutes later.
DEFAULT_CHANNEL_OPTIONS: Tuple[Tuple[str, object], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 5000),
    ("grpc.keepalive_time_ms", 15_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)

C = TypeVar("C")


def split_targets(
    targets: Union[str, C, Sequence[Union[str, C]]],
    channel_type: Type[C],
    type_name: str,
    open_channel: Callable[[str], C],
) -> Tuple[List[Optional[str]], List[C]]:
    """Returns the address of each target (None for a channel given) and its channel, opened with
    ``open_channel`` for an address. ``channel_type`` is grpc.Channel or grpc.aio.Channel, named
    ``type_name`` in errors."""
    items = [targets] if isinstance(targets, (str, channel_type)) else list(targets)  # type: ignore[arg-type]
    if len(items) == 0:
        raise ValueError("Publisher needs at least one target")
    for t in items:
        if not isinstance(t, (str, channel_type)):
            raise TypeError(f"Publisher targets are addresses (str) or {type_name} objects, not {type(t).__name__}")
    addresses = [t if isinstance(t, str) else None for t in items]
    channels = [open_channel(t) if isinstance(t, str) else t for t in items]
    return addresses, channels
