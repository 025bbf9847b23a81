"""Router: the frontend's side of kvrouter (Route, MarkPrefillComplete, Free)."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from types import TracebackType
from typing import List, Optional, Sequence, Set, Tuple, Type

import grpc

from kvrouter_client import pb
from kvrouter_client._routecore import BookingBase, End, RouterBase, drive, end_request

__all__ = ["Router", "Booking"]


class Booking(BookingBase):
    __doc__ = BookingBase.__doc__

    def __init__(self, router: "Router", request_id: str, response: "pb.router.RouteResponse") -> None:
        super().__init__(router, request_id, response)
        self._lock = threading.Lock()

    def prefill_complete(self, timeout: Optional[float] = None) -> None:
        """Tells the router the request's first token arrived; harmless to repeat.

        UNAVAILABLE (the router cannot accept it yet) is retried until ``timeout`` (the router's
        ``timeout`` by default) ends; then the call goes on in the background and the last error is
        raised. After free(), or once it succeeded or went to the background, it does nothing.
        """
        self._end(False, timeout)

    def free(self, timeout: Optional[float] = None) -> None:
        """Releases the booking; only the first successful call reaches the router.

        UNAVAILABLE (the router cannot accept it yet) is retried until ``timeout`` (the router's
        ``timeout`` by default) ends; then the Free goes on in the background, until the router
        accepts it or ``end_retry_for`` after the route, and the last error is raised: the booking
        is freed once the router accepts it, and later calls do nothing.
        """
        self._end(True, timeout)

    def _end(self, free: bool, timeout: Optional[float]) -> None:
        with self._lock:
            if self._needs(free):
                self._ended(free, *self._router._end(self.request_id, free, timeout or self._router.timeout, self._at))

    def __enter__(self) -> "Booking":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        try:
            self.free()
        except grpc.RpcError:
            if exc is None:
                raise  # otherwise the caller's own exception is the one to see


class Router(RouterBase):
    __doc__ = (RouterBase.__doc__ or "") + """
    ``Router(target, max_prompt_tokens=1_048_576, timeout=10.0, *, end_retry_for=300.0,
    max_pending_ends=100_000, channel_options=DEFAULT_CHANNEL_OPTIONS)``; used as a context
    manager, it is closed when the block ends.
    """

    def _open_channel(self, address: str, options: Sequence[Tuple[str, object]]) -> grpc.Channel:
        return grpc.insecure_channel(address, options=options)

    def _retrier(self, call_timeout: float, max_pending: int) -> "_EndRetrier":
        return _EndRetrier(self._stub, call_timeout, max_pending)

    def _booking(self, request_id: str, response: "pb.router.RouteResponse") -> Booking:
        return Booking(self, request_id, response)

    def route_request(self, req: "pb.router.RouteRequest", timeout: Optional[float] = None) -> Booking:
        """Routes a ready RouteRequest (filled with a random request_id when it has none): a prompt
        of token ids, or one keyed by hash_prompt() or by the caller (block_hashes, block_size and
        prompt_tokens), each checked as the router checks it."""
        steps = self._prepare(req, timeout)
        return Booking(self, req.request_id, drive(steps, self._stub.Route, req))

    def close(self) -> int:
        """Stops the background retries, closes the channel if the Router opened it, and returns how
        many ends were still being retried (given up: their bookings expire on the router)."""
        given_up = self._ends.close()
        if self._own_channel:
            self.channel.close()
        return given_up

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _end(self, request_id: str, free: bool, timeout: float, since: float) -> Tuple[Optional[grpc.RpcError], bool]:
        method, req = end_request(request_id, free)
        return drive(self.end_steps(request_id, free, timeout, since), getattr(self._stub, method), req)  # type: ignore[no-any-return]

    def _free_detached(self, request_id: str) -> None:
        """Frees a request whose Route failed after the router may have booked it, without keeping
        the caller, whose call failed already: in the background, retried as any Free (NOT_FOUND,
        nothing was booked, is fine). Without background retries it is sent once."""
        if not self._ends.add(request_id, True, time.monotonic() + self.end_retry_for, 0.0):
            try:
                self._stub.Free(pb.router.FreeRequest(request_id=request_id), timeout=self.timeout)
            except grpc.RpcError:
                pass


class _EndRetrier:
    """Retries ends in the background: one daemon thread sends each when it is due, as a gRPC future,
    so that many calls can wait for the router at once without a thread each; the future's callback
    schedules the next try. The thread starts with the first end."""

    def __init__(self, stub: "pb.router_grpc.RouterServiceStub", call_timeout: float, max_pending: int) -> None:
        self._stub = stub
        self._call_timeout = call_timeout
        self._max_pending = max_pending
        self._cv = threading.Condition()
        self._due: List[Tuple[float, int, End]] = []  # a heap by due time
        self._seq = itertools.count()  # orders ends due at the same time
        self._inflight: Set[grpc.Future] = set()
        self._pending = 0
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    @property
    def pending(self) -> int:
        with self._cv:
            return self._pending

    def add(self, request_id: str, free: bool, until: float, delay: float) -> bool:
        """Schedules an end in ``delay`` seconds; False when it cannot be taken (closed, disabled,
        past its time already, or max_pending ends are pending)."""
        now = time.monotonic()
        with self._cv:
            if self._closed or now + delay >= until or self._pending >= self._max_pending:
                return False
            self._pending += 1
            heapq.heappush(self._due, (now + delay, next(self._seq), End(request_id, free, until)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvrouter-end-retries", daemon=True)
                self._thread.start()
            self._cv.notify()
        return True

    def close(self) -> int:
        """Stops every retry and returns how many ends were pending."""
        with self._cv:
            if self._closed:
                return 0
            self._closed = True
            given_up, self._pending = self._pending, 0
            self._due.clear()
            inflight, self._inflight = list(self._inflight), set()
            self._cv.notify_all()
        for f in inflight:
            f.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        return given_up

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._due or self._due[0][0] > time.monotonic()):
                    self._cv.wait(self._due[0][0] - time.monotonic() if self._due else None)
                if self._closed:
                    return
                _, _, end = heapq.heappop(self._due)
            self._send(end)

    def _send(self, end: End) -> None:
        left = end.until - time.monotonic()
        if left <= 0:
            self._finish()
            return
        method, req = end_request(end.request_id, end.free)
        try:
            fut = getattr(self._stub, method).future(req, timeout=min(self._call_timeout, left))
        except Exception:  # noqa: BLE001 - a closed channel: nothing more can be sent
            self._finish()
            return
        with self._cv:
            if self._closed:
                fut.cancel()
                return
            self._inflight.add(fut)
        fut.add_done_callback(lambda f: self._answered(end, f))

    def _answered(self, end: End, fut: grpc.Future) -> None:
        """Runs on a gRPC thread when a call of ``end`` finished: done, or scheduled again."""
        with self._cv:
            self._inflight.discard(fut)
            if self._closed:
                return
        try:
            fut.result()
            delay = end.next_try(None)
        except grpc.RpcError as err:
            delay = end.next_try(err)
        except Exception:  # noqa: BLE001 - cancelled: the Router is closing
            delay = None
        if delay is None:
            self._finish()
            return
        with self._cv:
            if self._closed:
                return
            heapq.heappush(self._due, (time.monotonic() + delay, next(self._seq), end))
            self._cv.notify()

    def _finish(self) -> None:
        with self._cv:
            if not self._closed:
                self._pending -= 1
