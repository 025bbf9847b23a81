"""The errors the client raises, and the decoding of the router's error details."""

from __future__ import annotations

from typing import Optional

import grpc

__all__ = [
    "KvRouterError",
    "ValidationError",
    "PublisherError",
    "PublisherClosedError",
    "UnackedWindowFullError",
    "WorkerSupersededError",
    "error_reason",
    "retry_delay",
]


class KvRouterError(Exception):
    """KvRouterError is the base class of every error this package raises itself."""


class ValidationError(KvRouterError, ValueError):
    """ValidationError says a message would be refused by the router, so it was not sent.

    Its text is the router's own INVALID_ARGUMENT message ("field: rule"), and ``field`` and ``rule``
    hold the two parts, as the router's BadRequest detail would.
    """

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


class PublisherError(KvRouterError):
    """PublisherError says the publisher stopped and publishes nothing more; ``cause`` says why."""

    def __init__(self, message: str, cause: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.cause = cause


class PublisherClosedError(PublisherError):
    """PublisherClosedError is raised by a call on a publisher after its close() began."""


class UnackedWindowFullError(PublisherError):
    """UnackedWindowFullError says the events waiting for the router's ack filled the window.

    It is raised by publish() when the window stays full for its whole timeout (or at once with
    ``block=False``); nothing of that call was queued, and the publisher goes on.
    """


class WorkerSupersededError(PublisherError):
    """WorkerSupersededError says a newer Publish stream registered the same worker rank.

    The router ended this stream with FAILED_PRECONDITION (reason WORKER_SUPERSEDED): another process
    probably uses the same worker_id and dp_rank. The publisher does not reconnect after it.
    """


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, object]]:
    """Decodes one protobuf message's top-level fields (enough for google.rpc.Status details)."""
    out: list[tuple[int, object]] = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(buf, i)
            out.append((num, v))
        elif wire == 2:
            n, i = _varint(buf, i)
            out.append((num, buf[i : i + n]))
            i += n
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError("unsupported wire type")
    return out


def _details(err: BaseException) -> list[tuple[str, bytes]]:
    """Returns the (type URL, value) of every detail of the google.rpc.Status the router attached.

    The router sends a google.rpc.Status in the ``grpc-status-details-bin`` trailer; it is decoded
    here by hand, so that no googleapis package is needed. Empty when there is none, or it does not
    decode.
    """
    trailers = getattr(err, "trailing_metadata", None)
    if not callable(trailers):
        return []
    try:
        md = trailers() or ()
    except Exception:  # noqa: BLE001 - a call without trailers
        return []
    out: list[tuple[str, bytes]] = []
    for key, value in md:
        if key != "grpc-status-details-bin" or not isinstance(value, bytes):
            continue
        try:
            for num, detail in _fields(value):
                if num != 3 or not isinstance(detail, bytes):
                    continue
                any_fields = dict(_fields(detail))
                type_url, body = any_fields.get(1, b""), any_fields.get(2, b"")
                if isinstance(type_url, bytes) and isinstance(body, bytes):
                    out.append((str(type_url, "utf-8"), body))
        except (ValueError, IndexError, TypeError, UnicodeDecodeError):
            return []
    return out


def error_reason(err: BaseException) -> Optional[str]:
    """Returns the ErrorInfo reason the router attached to a gRPC error (e.g. "WORKER_SUPERSEDED").

    None when there is no ErrorInfo.
    """
    for type_url, body in _details(err):
        if type_url.endswith("google.rpc.ErrorInfo"):
            try:
                return str(dict(_fields(body)).get(1, b""), "utf-8")  # type: ignore[arg-type]
            except (ValueError, IndexError, TypeError, UnicodeDecodeError):
                return None
    return None


def retry_delay(err: BaseException) -> Optional[float]:
    """Returns the delay, in seconds, that the router's google.rpc.RetryInfo suggests before a retry.

    The router attaches one to LOG_UNAVAILABLE (its shared state cannot answer yet) and to
    RESOURCE_EXHAUSTED. None when there is no RetryInfo.
    """
    for type_url, body in _details(err):
        if not type_url.endswith("google.rpc.RetryInfo"):
            continue
        try:
            duration = dict(_fields(body)).get(1, b"")  # RetryInfo.retry_delay, a google.protobuf.Duration
            if not isinstance(duration, bytes):
                return None
            d = dict(_fields(duration))
            seconds, nanos = d.get(1, 0), d.get(2, 0)
            if not isinstance(seconds, int) or not isinstance(nanos, int):
                return None
            # int64 and int32 varints: a negative value arrives as its 64-bit two's complement.
            seconds -= (1 << 64) if seconds >= 1 << 63 else 0
            nanos -= (1 << 64) if nanos >= 1 << 63 else 0
            return max(0.0, seconds + nanos / 1e9)
        except (ValueError, IndexError, TypeError):
            return None
    return None


def status_code(err: BaseException) -> Optional[grpc.StatusCode]:
    """Returns the gRPC status code of an error raised by a call, or None for any other error."""
    code = getattr(err, "code", None)
    if callable(code):
        try:
            c = code()
        except Exception:  # noqa: BLE001
            return None
        return c if isinstance(c, grpc.StatusCode) else None
    return None
