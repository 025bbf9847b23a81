"""Router: the frontend's side of kvrouter (Route, MarkPrefillComplete, Free)."""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
import uuid
from types import TracebackType
from typing import Iterable, List, Optional, Sequence, Set, Tuple, Type, Union

import grpc

from kvrouter_client import pb
from kvrouter_client.errors import error_reason, retry_delay, status_code
from kvrouter_client.validation import check_route_request

__all__ = ["Router", "Booking"]


class Booking:
    """Booking is one routed request: where to send it, and the load the router booked for it.

    ``prefill_complete()`` and ``free()`` may be called any number of times: each reaches the router
    until it succeeds once, and NOT_FOUND (the booking expired or was freed) counts as done. While the
    router cannot accept one yet (UNAVAILABLE: the replica asked cannot see the booking, which another
    replica holds and has not published, or its shared state is being re-established), it is sent
    again until its timeout ends, then retried in the background (see ``Router``) and its error is
    raised. Used as a context manager, the booking is freed when the block ends, also when it raises.
    """

    def __init__(self, router: "Router", request_id: str, response: "pb.router.RouteResponse") -> None:
        self._router = router
        self.request_id = request_id
        self.response = response
        self._lock = threading.Lock()
        self._freed = not response.booked  # a query_only decision books nothing
        self._prefill_done = self._freed
        # Background retries of this booking's ends stop end_retry_for after the route: by then the
        # router has expired the booking itself.
        self._at = time.monotonic()

    @property
    def mode(self) -> int:
        """The route mode (a pb.router.RouteMode value)."""
        return self.response.mode

    @property
    def decode(self) -> "pb.types.WorkerTarget":
        """The decode target (the only target in AGGREGATED and BYPASS modes)."""
        return self.response.decode

    @property
    def prefill(self) -> Optional["pb.types.WorkerTarget"]:
        """The prefill target in DISAGGREGATED mode, else None."""
        return self.response.prefill if self.response.HasField("prefill") else None

    @property
    def freed(self) -> bool:
        """Whether free() has nothing more to do: the booking was freed, never booked, or its Free
        was handed to the router's background retries (which free it once the router accepts)."""
        with self._lock:
            return self._freed

    def prefill_complete(self, timeout: Optional[float] = None) -> None:
        """Tells the router the request's first token arrived; harmless to repeat.

        UNAVAILABLE (the router cannot accept it yet) is retried until ``timeout`` (the router's
        ``timeout`` by default) ends; then the call goes on in the background and the last error is
        raised. After free(), or once it succeeded or went to the background, it does nothing.
        """
        with self._lock:
            if self._prefill_done or self._freed:
                return
            err, handed_off = self._router._end(self.request_id, False, timeout or self._router.timeout, self._at)
            if err is None or handed_off:
                self._prefill_done = True
            if err is not None:
                raise err

    def free(self, timeout: Optional[float] = None) -> None:
        """Releases the booking; only the first successful call reaches the router.

        UNAVAILABLE (the router cannot accept it yet) is retried until ``timeout`` (the router's
        ``timeout`` by default) ends; then the Free goes on in the background, until the router
        accepts it or ``end_retry_for`` after the route, and the last error is raised: the booking
        is freed once the router accepts it, and later calls do nothing.
        """
        with self._lock:
            if self._freed:
                return
            err, handed_off = self._router._end(self.request_id, True, timeout or self._router.timeout, self._at)
            if err is None or handed_off:
                self._freed = True  # freed, or the background retry owns it now
            if err is not None:
                raise err

    def __enter__(self) -> "Booking":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        try:
            self.free()
        except grpc.RpcError:
            if exc is None:
                raise  # otherwise the caller's own exception is the one to see

    def __repr__(self) -> str:
        d = self.response.decode
        return f"Booking(request_id={self.request_id!r}, decode={d.worker_id}/{d.dp_rank}@{d.endpoint}, freed={self.freed})"


class Router:
    """Router routes requests through kvrouter's RouterService.

    ``target`` is an address ("host:port") or an open grpc.Channel. ``max_prompt_tokens`` is the
    router's max_prompt_tokens: longer prompts are refused here, with the router's message, before
    anything is sent (None skips that check). ``timeout`` is how long, in seconds, a call may take,
    its retries included.

    A Free or MarkPrefillComplete the router could not accept within its call's timeout is retried in
    the background, from a daemon thread, until the router accepts it (or answers NOT_FOUND: nobody
    holds the booking), or ``end_retry_for`` seconds after the route passed (the router's
    booking_expiry, 300 s, after which it expired the booking itself; 0 or less: no background
    retry), or the Router is closed. Without it, a booking the caller freed during a fault would load
    its workers until it expires. At most ``max_pending_ends`` are retried at once; past that an end
    is given up, and its booking expires on the router. ``pending_ends`` counts them.
    """

    def __init__(
        self,
        target: Union[str, grpc.Channel],
        max_prompt_tokens: Optional[int] = 1_048_576,
        timeout: float = 10.0,
        *,
        end_retry_for: float = 300.0,
        max_pending_ends: int = 100_000,
    ) -> None:
        self._own_channel = isinstance(target, str)
        self.channel: grpc.Channel = grpc.insecure_channel(target) if isinstance(target, str) else target
        self._stub = pb.router_grpc.RouterServiceStub(self.channel)
        self.max_prompt_tokens = max_prompt_tokens
        self.timeout = timeout
        self.end_retry_for = end_retry_for
        self._ends = _EndRetrier(self._stub, timeout, max_pending_ends)

    def route(
        self,
        token_ids: Sequence[int],
        model: str,
        request_id: Optional[str] = None,
        *,
        lora_name: str = "",
        cache_namespace: str = "",
        multimodal_objects: Iterable[Tuple[int, int, int]] = (),
        annotations: Iterable[str] = (),
        session_id: str = "",
        explain: bool = False,
        hints: Optional["pb.router.RoutingHints"] = None,
        config_override: Optional["pb.router.RouterConfigOverride"] = None,
        query_only: bool = False,
        timeout: Optional[float] = None,
    ) -> Booking:
        """Routes one request and returns its Booking; a request without an id gets a random one.

        ``multimodal_objects`` are the prompt's multimodal inputs (images, audio) as ``(mm_hash,
        start, end)`` tuples, as kvrouter_client.blockhash takes them: the input's hash
        (blockhash.multimodal_hash of the identifier the engine keys its cache with) and the
        positions ``[start, end)`` in ``token_ids`` of its placeholder tokens. The router hashes the
        blocks holding them with their hashes, so that the same placeholder tokens of two different
        images never match.

        It raises ValidationError (before sending) for what the router would refuse as malformed,
        and grpc.RpcError for the router's own errors. While the router answers UNAVAILABLE with
        reason LOG_UNAVAILABLE (it is loading its shared state, or the state may be incomplete; it
        booked nothing) the call is sent again after the delay it suggests, until ``timeout`` ends.
        A call that fails after the router may have booked it (a deadline, a cancel) is freed here,
        so it leaves no booking behind.
        """
        if request_id is None and not query_only:
            request_id = uuid.uuid4().hex
        req = pb.router.RouteRequest(
            request_id=request_id or "",
            model=model,
            token_ids=list(token_ids),
            lora_name=lora_name,
            cache_namespace=cache_namespace,
            multimodal_objects=[pb.router.MultimodalObject(mm_hash=h, start=start, end=end) for h, start, end in multimodal_objects],
            annotations=list(annotations),
            session_id=session_id,
            explain=explain,
            query_only=query_only,
        )
        if hints is not None:
            req.hints.CopyFrom(hints)
        if config_override is not None:
            req.config_override.CopyFrom(config_override)
        return self.route_request(req, timeout=timeout)

    def route_request(self, req: "pb.router.RouteRequest", timeout: Optional[float] = None) -> Booking:
        """Routes a ready RouteRequest (filled with a random request_id when it has none)."""
        if req.request_id == "" and not req.query_only:
            req.request_id = uuid.uuid4().hex
        check_route_request(req, self.max_prompt_tokens)
        deadline = time.monotonic() + (timeout or self.timeout)
        for attempt in itertools.count():
            try:
                resp = self._stub.Route(req, timeout=max(deadline - time.monotonic(), 0.001))
                return Booking(self, req.request_id, resp)
            except grpc.RpcError as err:
                code = status_code(err)
                if code == grpc.StatusCode.UNAVAILABLE and error_reason(err) == "LOG_UNAVAILABLE":
                    delay = _retry_after(err, attempt)
                    if time.monotonic() + delay < deadline:
                        time.sleep(delay)
                        continue
                elif not req.query_only and code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
                    self._free_detached(req.request_id)
                raise
        raise AssertionError("unreachable")

    def existing(self, request_id: str) -> Booking:
        """Returns the Booking of a request routed elsewhere (by another Router or process: its id is
        all it takes), for this Router to end: its prefill_complete() and free() behave as those of a
        Booking that route() returned, with background retries counted from now."""
        return Booking(self, request_id, pb.router.RouteResponse(booked=True))

    @property
    def pending_ends(self) -> int:
        """How many Free and MarkPrefillComplete calls are being retried in the background."""
        return self._ends.pending

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
        """Sends a Free (or a MarkPrefillComplete) for request_id, and sends it again while the
        router cannot accept it yet, after the delay it suggests, until ``timeout`` ends; then hands
        it to the background retries (until end_retry_for after ``since``, a time.monotonic()).

        NOT_FOUND (the booking expired, or ended through another caller) counts as done. Returns
        (None, False) when it is done, else the last error and whether the background took it.
        """
        call = self._stub.Free if free else self._stub.MarkPrefillComplete
        req = pb.router.FreeRequest(request_id=request_id) if free else pb.router.MarkPrefillCompleteRequest(request_id=request_id)
        deadline = time.monotonic() + timeout
        for attempt in itertools.count():
            try:
                call(req, timeout=max(deadline - time.monotonic(), 0.001))
                return None, False
            except grpc.RpcError as err:
                if status_code(err) == grpc.StatusCode.NOT_FOUND:
                    return None, False
                if status_code(err) not in _RETRYABLE_END:
                    return err, False
                delay = _retry_after(err, attempt)
                if time.monotonic() + delay >= deadline:
                    return err, self._ends.add(request_id, free, since + self.end_retry_for, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _free_detached(self, request_id: str) -> None:
        """Frees a request whose Route failed after the router may have booked it, without keeping
        the caller, whose call failed already: in the background, retried as any Free (NOT_FOUND,
        nothing was booked, is fine). Without background retries it is sent once."""
        if not self._ends.add(request_id, True, time.monotonic() + self.end_retry_for, 0.0):
            try:
                self._stub.Free(pb.router.FreeRequest(request_id=request_id), timeout=self.timeout)
            except grpc.RpcError:
                pass


# The codes of an end worth another try: the router could not tell where the booking is yet, or
# could not be reached in time.
_RETRYABLE_END = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)


def _retry_after(err: grpc.RpcError, attempt: int) -> float:
    """Returns how long to wait, in seconds, before attempt+1: what the router's RetryInfo suggests,
    or 100 ms doubling per attempt, at most 2 s; with jitter, so that clients that failed together
    do not retry together."""
    d = 0.1 * (1 << min(attempt, 5))
    suggested = retry_delay(err)
    if suggested is not None:
        d = max(suggested, d / 2)
    d = min(d, 2.0)
    return random.uniform(d / 2, d)


class _End:
    """One Free or MarkPrefillComplete retried in the background."""

    __slots__ = ("request_id", "free", "until", "attempt")

    def __init__(self, request_id: str, free: bool, until: float) -> None:
        self.request_id = request_id
        self.free = free
        self.until = until  # time.monotonic() after which it is given up
        self.attempt = 1  # the foreground made the first


class _EndRetrier:
    """Retries ends in the background: one daemon thread sends each when it is due, as a gRPC future,
    so that many calls can wait for the router at once without a thread each; the future's callback
    schedules the next try. The thread starts with the first end."""

    def __init__(self, stub: "pb.router_grpc.RouterServiceStub", call_timeout: float, max_pending: int) -> None:
        self._stub = stub
        self._call_timeout = call_timeout
        self._max_pending = max_pending
        self._cv = threading.Condition()
        self._due: List[Tuple[float, int, _End]] = []  # a heap by due time
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
            heapq.heappush(self._due, (now + delay, next(self._seq), _End(request_id, free, until)))
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

    def _send(self, end: _End) -> None:
        left = end.until - time.monotonic()
        if left <= 0:
            self._finish()
            return
        call = self._stub.Free if end.free else self._stub.MarkPrefillComplete
        req = pb.router.FreeRequest(request_id=end.request_id) if end.free else pb.router.MarkPrefillCompleteRequest(request_id=end.request_id)
        try:
            fut = call.future(req, timeout=min(self._call_timeout, left))
        except Exception:  # noqa: BLE001 - a closed channel: nothing more can be sent
            self._finish()
            return
        with self._cv:
            if self._closed:
                fut.cancel()
                return
            self._inflight.add(fut)
        fut.add_done_callback(lambda f: self._answered(end, f))

    def _answered(self, end: _End, fut: grpc.Future) -> None:
        """Runs on a gRPC thread when a call of ``end`` finished: done, or scheduled again."""
        with self._cv:
            self._inflight.discard(fut)
            if self._closed:
                return
        try:
            fut.result()
            self._finish()  # accepted
            return
        except grpc.RpcError as err:
            if status_code(err) not in _RETRYABLE_END:
                self._finish()  # NOT_FOUND (nobody holds it) or an error a retry would not change
                return
            delay = _retry_after(err, end.attempt)
        except Exception:  # noqa: BLE001 - cancelled: the Router is closing
            self._finish()
            return
        end.attempt += 1
        due = time.monotonic() + delay
        with self._cv:
            if self._closed:
                return
            if due >= end.until:
                self._pending -= 1  # given up: the router expires the booking by then
                return
            heapq.heappush(self._due, (due, next(self._seq), end))
            self._cv.notify()

    def _finish(self) -> None:
        with self._cv:
            if not self._closed:
                self._pending -= 1
