"""kvrouter_client.aio.Router: the frontend's side of kvrouter on grpc.aio."""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Any, Coroutine, Generator, Optional, Sequence, Set, Tuple, Type

import grpc
import grpc.aio

from kvrouter_client import pb
from kvrouter_client._routecore import BookingBase, End, RouterBase, Steps, end_request
from kvrouter_client.aio._loop import _call, drive_calls, running_loop

__all__ = ["Router", "Booking"]


class Booking(BookingBase):
    __doc__ = (BookingBase.__doc__ or "") + """
    Its free() and prefill_complete() are coroutines, and it is an async context manager. An end
    whose caller is cancelled while it is sent goes on in the background (see ``Router``), so a
    cancelled request still frees its booking.
    """

    def __init__(self, router: "Router", request_id: str, response: "pb.router.RouteResponse") -> None:
        super().__init__(router, request_id, response)
        self._lock: Optional[asyncio.Lock] = None  # made on first use, on the loop that uses it

    async def prefill_complete(self, timeout: Optional[float] = None) -> None:
        """Tells the router the request's first token arrived; harmless to repeat (see Booking)."""
        await self._end(False, timeout)

    async def free(self, timeout: Optional[float] = None) -> None:
        """Releases the booking; only the first successful call reaches the router (see Booking)."""
        await self._end(True, timeout)

    async def _end(self, free: bool, timeout: Optional[float]) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        router = self._router
        async with self._lock:
            if not self._needs(free):
                return
            try:
                outcome = await router._end(self.request_id, free, timeout or router.timeout, self._at)
            except asyncio.CancelledError:
                # The caller left; the booking must not stay behind: the background retries take it.
                if router._ends.add(self.request_id, free, self._at + router.end_retry_for, 0.0):
                    self._ended(free, None, True)
                raise
            self._ended(free, *outcome)

    async def __aenter__(self) -> "Booking":
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        try:
            await self.free()
        except grpc.RpcError:
            if exc is None:
                raise  # otherwise the caller's own exception is the one to see


class RouteCall:
    """What Router.route() returns: await it for the Booking, or use it as an async context manager
    (``async with router.route(...) as booking:``), which routes on entry and frees the booking when
    the block ends, also when it raises or is cancelled."""

    def __init__(self, router: "Router", req: "pb.router.RouteRequest", steps: Steps) -> None:
        self._router = router
        self._req = req
        self._steps: Optional[Steps] = steps
        self._booking: Optional[Booking] = None

    def __await__(self) -> Generator[Any, None, Booking]:
        return self._route().__await__()

    async def _route(self) -> Booking:
        steps, self._steps = self._steps, None
        if steps is None:
            raise RuntimeError("kvrouter_client.aio: a route() is awaited once")
        return await self._router._route(self._req, steps)

    async def __aenter__(self) -> Booking:
        self._booking = await self._route()
        return self._booking

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        assert self._booking is not None
        await self._booking.__aexit__(exc_type, exc, tb)


class Router(RouterBase):
    """Router routes requests through kvrouter's RouterService, on grpc.aio.

    ``Router(target, max_prompt_tokens=1_048_576, timeout=10.0, *, end_retry_for=300.0,
    max_pending_ends=100_000, channel_options=DEFAULT_CHANNEL_OPTIONS)``, made in a running event
    loop: ``target`` is an address or an open grpc.aio.Channel, and everything else is as in
    kvrouter_client.Router. ``route()`` returns a RouteCall: ``await router.route(...)`` is the
    Booking, and ``async with router.route(...) as booking:`` frees it when the block ends. A Route
    whose caller is cancelled while it is in flight may have been booked: it is freed in the
    background, as a Route that failed with a deadline is. The background retries of Free and
    MarkPrefillComplete run as tasks of the loop; ``await router.close()`` stops them.
    """

    def __init__(self, target: Any, *args: Any, **kwargs: Any) -> None:
        running_loop("Router")
        super().__init__(target, *args, **kwargs)

    def _open_channel(self, address: str, options: Sequence[Tuple[str, object]]) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(address, options=options)

    def _retrier(self, call_timeout: float, max_pending: int) -> "_EndRetrier":
        return _EndRetrier(self._stub, call_timeout, max_pending)

    def _booking(self, request_id: str, response: "pb.router.RouteResponse") -> Booking:
        return Booking(self, request_id, response)

    def route_request(self, req: "pb.router.RouteRequest", timeout: Optional[float] = None) -> RouteCall:
        """Routes a ready RouteRequest (filled with a random request_id when it has none), token
        ids or a prompt keyed by hash_prompt() or by the caller; it is checked, and raises
        ValidationError, before anything is awaited."""
        return RouteCall(self, req, self._prepare(req, timeout))

    async def _route(self, req: "pb.router.RouteRequest", steps: Steps) -> Booking:
        try:
            resp = await drive_calls(steps, self._stub.Route, req)
        except asyncio.CancelledError:
            if not req.query_only:
                self._free_detached(req.request_id)  # the router may have booked it already
            raise
        return Booking(self, req.request_id, resp)

    async def _end(self, request_id: str, free: bool, timeout: float, since: float) -> Tuple[Optional[grpc.RpcError], bool]:
        method, req = end_request(request_id, free)
        return await drive_calls(self.end_steps(request_id, free, timeout, since), getattr(self._stub, method), req)  # type: ignore[no-any-return]

    def _free_detached(self, request_id: str) -> None:
        """Frees a request whose Route failed after the router may have booked it, in the
        background, retried as any Free; without background retries it is sent once."""
        if not self._ends.add(request_id, True, time.monotonic() + self.end_retry_for, 0.0):
            self._ends.send_once(request_id, self.timeout)

    async def close(self) -> int:
        """Stops the background retries, closes the channel if the Router opened it, and returns how
        many ends were still being retried (given up: their bookings expire on the router)."""
        given_up = await self._ends.close()
        if self._own_channel:
            await self.channel.close()
        return given_up

    async def __aenter__(self) -> "Router":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _EndRetrier:
    """Retries ends in the background, one task each, on the Router's loop."""

    def __init__(self, stub: "pb.router_grpc.RouterServiceStub", call_timeout: float, max_pending: int) -> None:
        self._stub = stub
        self._call_timeout = call_timeout
        self._max_pending = max_pending
        self._retries: Set["asyncio.Task[None]"] = set()
        self._once: Set["asyncio.Task[None]"] = set()  # single Frees, not counted as pending
        self._pending = 0
        self._closed = False

    @property
    def pending(self) -> int:
        return self._pending

    def add(self, request_id: str, free: bool, until: float, delay: float) -> bool:
        """Schedules an end in ``delay`` seconds; False when it cannot be taken (closed, disabled,
        past its time already, or max_pending ends are pending)."""
        if self._closed or time.monotonic() + delay >= until or self.pending >= self._max_pending:
            return False
        self._pending += 1
        self._spawn(self._retries, self._retry(End(request_id, free, until), delay))
        return True

    def send_once(self, request_id: str, timeout: float) -> None:
        if not self._closed:
            self._spawn(self._once, _call(self._stub.Free, pb.router.FreeRequest(request_id=request_id), timeout))

    def _spawn(self, tasks: Set["asyncio.Task[None]"], coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _retry(self, end: End, delay: Optional[float]) -> None:
        method, req = end_request(end.request_id, end.free)
        call = getattr(self._stub, method)
        try:
            while delay is not None:
                await asyncio.sleep(delay)
                left = end.until - time.monotonic()
                if left <= 0:
                    return
                _, err = await _call(call, req, min(self._call_timeout, left))
                delay = end.next_try(err)
        except Exception:  # noqa: BLE001 - a closed channel: nothing more can be sent
            pass
        finally:
            if not self._closed:
                self._pending -= 1

    async def close(self) -> int:
        """Stops every retry and returns how many ends were pending."""
        if self._closed:
            return 0
        self._closed = True
        given_up, self._pending = self._pending, 0
        tasks = list(self._retries | self._once)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return given_up
