"""What the tests of the threaded clients (test_client.py) and of the asyncio ones (test_aio.py)
share: the test workers, their blocks, and gRPC interceptors (each in a grpc and a grpc.aio form,
with one bookkeeping) that count, lose, corrupt or black-hole messages on the way to the router."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator, Callable, Iterator, List, Optional, Tuple

import grpc
import grpc.aio

from kvrouter_client import pb
from kvserver import Redis, Server

BS = 4  # block size of every test worker


def hello(worker_id: int, model: str = "demo", fresh_start: bool = True) -> "pb.worker.WorkerHello":
    """Returns the hello of an aggregated test worker, with an endpoint as a real one has."""
    return pb.worker.WorkerHello(
        worker_id=worker_id,
        model=model,
        role=pb.types.WORKER_ROLE_AGGREGATED,
        block_size=BS,
        total_kv_blocks=1 << 20,
        endpoint=f"10.0.0.{worker_id}:8000",
        kv_events_enabled=True,
        fresh_start=fresh_start,
    )


def block(i: int) -> Tuple[int, List[int]]:
    """Returns block i of a family of distinct one-block prompts: (hash, tokens)."""
    return 10_000 + i, [i * BS + k + 1 for k in range(BS)]


# The error of a call the router could not accept yet: its answer (UNAVAILABLE), or the call's time
# running out before the answer came (DEADLINE_EXCEEDED).
LATE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def until(cond: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Polls cond() until it is true or the timeout passes, letting the event loop run meanwhile;
    returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v or time.monotonic() > deadline:
            return bool(v)
        await asyncio.sleep(interval)


class StreamFilter:
    """A Publish stream interceptor whose subclass decides, message by message, what reaches the
    router: ``passes(stream, request)`` returns the request to send (possibly another one), or None
    to drop it. ``sync()`` and ``aio()`` give it as a grpc and a grpc.aio interceptor."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.streams = 0

    def passes(self, stream: int, req: "pb.worker.PublishRequest") -> Optional["pb.worker.PublishRequest"]:
        raise NotImplementedError

    def _opened(self) -> int:
        with self.lock:
            self.streams += 1
            self.opened(self.streams)
            return self.streams

    def opened(self, stream: int) -> None:
        """Called with the lock held when stream n (from 1) opens."""

    def sync(self) -> grpc.StreamStreamClientInterceptor:
        return _SyncFilter(self)

    def aio(self) -> grpc.aio.StreamStreamClientInterceptor:
        return _AioFilter(self)


class _SyncFilter(grpc.StreamStreamClientInterceptor):
    def __init__(self, f: StreamFilter) -> None:
        self.f = f

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # noqa: ANN001
        n = self.f._opened()

        def requests() -> Iterator["pb.worker.PublishRequest"]:
            for req in request_iterator:
                out = self.f.passes(n, req)
                if out is not None:
                    yield out

        return continuation(client_call_details, requests())


class _AioFilter(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, f: StreamFilter) -> None:
        self.f = f

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # noqa: ANN001
        n = self.f._opened()

        async def requests() -> AsyncIterator["pb.worker.PublishRequest"]:
            async for req in request_iterator:
                out = self.f.passes(n, req)
                if out is not None:
                    yield out

        return await continuation(client_call_details, requests())


class DropEvent(StreamFilter):
    """Loses one event on the way to the router, once: the router sees a gap in the ids."""

    def __init__(self, event_id: int) -> None:
        super().__init__()
        self.event_id = event_id
        self.dropped = False

    def passes(self, stream: int, req: "pb.worker.PublishRequest") -> Optional["pb.worker.PublishRequest"]:
        with self.lock:
            if req.WhichOneof("message") != "events" or self.dropped:
                return req
            kept = [ev for ev in req.events.events if ev.event_id != self.event_id]
            if len(kept) == len(req.events.events):
                return req
            self.dropped = True
        return pb.worker.PublishRequest(events=pb.worker.EventBatch(events=kept)) if kept else None


class CorruptFirstBatch(StreamFilter):
    """Sends the first event batch with a stored block one token short: the router refuses the
    stream with INVALID_ARGUMENT, as it would a worker's malformed event."""

    def __init__(self) -> None:
        super().__init__()
        self.corrupted = False

    def passes(self, stream: int, req: "pb.worker.PublishRequest") -> Optional["pb.worker.PublishRequest"]:
        with self.lock:
            if req.WhichOneof("message") != "events" or self.corrupted:
                return req
            self.corrupted = True
        bad = pb.worker.PublishRequest()
        bad.CopyFrom(req)
        del bad.events.events[0].stored.blocks[0].token_ids[-1]
        return bad


class BlackHoleSecondStream(StreamFilter):
    """Black-holes the second Publish stream: its hello reaches the router, nothing after it does.

    It records the event ids each stream carried to the router, and those it swallowed.
    """

    def __init__(self) -> None:
        super().__init__()
        self._sent: List[List[int]] = []
        self._swallowed: List[int] = []

    def ids(self, stream: int = 0, swallowed: bool = False) -> List[int]:
        """Returns the event ids stream n (from 1) carried to the router, or those swallowed."""
        with self.lock:
            return list(self._swallowed if swallowed else self._sent[stream - 1])

    def opened(self, stream: int) -> None:
        self._sent.append([])

    def passes(self, stream: int, req: "pb.worker.PublishRequest") -> Optional["pb.worker.PublishRequest"]:
        kind = req.WhichOneof("message")
        ids = [ev.event_id for ev in req.events.events] if kind == "events" else []
        with self.lock:
            if stream == 2 and kind != "hello":
                self._swallowed.extend(ids)
                return None
            self._sent[stream - 1].extend(ids)
        return req


class CountCalls:
    """Counts the calls of one RouterService method a Router sends, with the time of each, to see
    its retries, and keeps their requests (a copy of each, as sent); ``sync()`` and ``aio()`` give
    it as a grpc and a grpc.aio interceptor."""

    def __init__(self, method: str = "Route") -> None:
        self._lock = threading.Lock()
        self.method = "/" + method
        self.times: List[float] = []
        self.requests: List[object] = []

    @property
    def calls(self) -> int:
        with self._lock:
            return len(self.times)

    # test_client.py's name for it
    routes = calls

    def _seen(self, client_call_details, request) -> None:  # noqa: ANN001
        method = client_call_details.method  # bytes in grpc.aio
        if (method.decode() if isinstance(method, bytes) else method).endswith(self.method):
            sent = type(request)()
            sent.CopyFrom(request)
            with self._lock:
                self.times.append(time.monotonic())
                self.requests.append(sent)

    def sync(self) -> grpc.UnaryUnaryClientInterceptor:
        counter = self

        class Sync(grpc.UnaryUnaryClientInterceptor):
            def intercept_unary_unary(self, continuation, client_call_details, request):  # noqa: ANN001
                counter._seen(client_call_details, request)
                return continuation(client_call_details, request)

        return Sync()

    def aio(self) -> grpc.aio.UnaryUnaryClientInterceptor:
        counter = self

        class Aio(grpc.aio.UnaryUnaryClientInterceptor):
            async def intercept_unary_unary(self, continuation, client_call_details, request):  # noqa: ANN001
                counter._seen(client_call_details, request)
                return await continuation(client_call_details, request)

        return Aio()


class SharedStateSetup:
    """A test (mixed into a TestCase) with a private redis-server and one `kvrouter serve` sharing
    its state through it."""

    flags: Tuple[str, ...] = ()
    reseed_window = "1s"

    def setUp(self) -> None:
        self.redis = Redis()
        self.addCleanup(self.redis.stop)  # type: ignore[attr-defined]
        self.server = Server("--redis-addr", self.redis.addr, "--redis-reseed-window", self.reseed_window, *self.flags)
        self.addCleanup(self.server.stop)  # type: ignore[attr-defined]

    def state(self) -> "pb.admin.GetStateResponse":
        return self.server.admin.GetState(pb.admin.GetStateRequest(), timeout=5)

    def redis_paused(self) -> Callable[[], bool]:
        """Pauses Redis (resumed when the test ends); returns the condition to wait for: the replica
        says its shared state is unreachable."""
        self.redis.pause()
        self.addCleanup(self.redis.resume)  # type: ignore[attr-defined]  # before stop (cleanups run last first)
        return lambda: self.server.health("kvrouter.v1.SharedState") == 2
