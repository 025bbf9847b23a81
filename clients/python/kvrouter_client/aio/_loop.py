"""The asyncio primitives kvrouter_client.aio shares: a broadcast wake-up and the drivers of the
shared waiting and retry loops (kvrouter_client._pubcore, kvrouter_client._routecore)."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, List, Optional, Tuple, TypeVar

import grpc

from kvrouter_client._routecore import SLEEP

T = TypeVar("T")


def running_loop(what: str) -> asyncio.AbstractEventLoop:
    """Returns the running loop, or raises RuntimeError saying that ``what`` needs one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(f"kvrouter_client.aio.{what} must be made in a running event loop (inside a coroutine)") from None


class Changed:
    """Wakes every waiting coroutine at once when the state they wait on changed (the asyncio
    counterpart of threading.Condition.notify_all, without a lock: the loop runs one at a time)."""

    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: List["asyncio.Future[None]"] = []

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def wait(self, timeout: Optional[float]) -> None:
        """Returns after the next notify(), or after timeout seconds (None: no limit)."""
        loop = asyncio.get_running_loop()
        fut: "asyncio.Future[None]" = loop.create_future()
        self._waiters.append(fut)
        timer = None if timeout is None else loop.call_later(max(timeout, 0.0), _wake, fut)
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)


def _wake(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)


async def drive_waits(steps: Any, changed: Changed) -> Any:
    """Runs a waiting loop of kvrouter_client._pubcore, waking on ``changed``, and wakes the others."""
    try:
        while True:
            await changed.wait(next(steps))
    except StopIteration as stop:
        return stop.value
    finally:
        changed.notify()


async def _call(call: Callable[..., Awaitable[Any]], req: Any, timeout: float) -> Tuple[Any, Optional[grpc.RpcError]]:
    try:
        return await call(req, timeout=timeout), None
    except grpc.RpcError as err:
        return None, err


async def drive_calls(steps: Any, call: Callable[..., Awaitable[Any]], req: Any) -> Any:
    """Runs a retry loop of kvrouter_client._routecore with ``call`` and asyncio.sleep."""
    try:
        op = next(steps)
        while True:
            if op[0] == SLEEP:
                await asyncio.sleep(op[1])
                op = steps.send(None)
            else:
                op = steps.send(await _call(call, req, op[1]))
    except StopIteration as stop:
        return stop.value
