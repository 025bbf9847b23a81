"""What the threaded Router (kvrouter_client.Router) and the asyncio one (kvrouter_client.aio.Router)
share: the requests they build, their checks, when a call is sent again and after how long, and the
state of a Booking.

``hash_prompt`` keys a RouteRequest's prompt as the router would (Go: kvclient.HashPrompt).

The retry loops are generators (``route_steps``, ``RouterBase.end_steps``) that do no I/O: each
yields ``(CALL, timeout)`` to have its call sent, and is sent back ``(response, error)``, or yields
``(SLEEP, seconds)``; it returns the outcome. Each Router drives them with its own calls and sleeps.
"""

from __future__ import annotations

import itertools
import random
import time
import uuid
from typing import Any, Callable, Generator, Iterable, Optional, Sequence, Tuple

import grpc

from kvrouter_client import blockhash, pb
from kvrouter_client._channels import DEFAULT_CHANNEL_OPTIONS
from kvrouter_client.errors import ValidationError, error_reason, retry_delay, status_code
from kvrouter_client.validation import check_multimodal_objects, check_route_request

CALL = "call"
SLEEP = "sleep"

Steps = Generator[Tuple[str, float], Any, Any]

# The codes of an end worth another try: the router could not tell where the booking is yet, or
# could not be reached in time.
RETRYABLE_END = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)

# The codes of a Route that may have been booked although the caller got no answer.
_IN_FLIGHT = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)


def retry_after(err: BaseException, attempt: int) -> float:
    """Returns how long to wait, in seconds, before attempt+1: what the router's RetryInfo suggests,
    or 100 ms doubling per attempt, at most 2 s; with jitter, so that clients that failed together
    do not retry together."""
    d = 0.1 * (1 << min(attempt, 5))
    suggested = retry_delay(err)
    if suggested is not None:
        d = max(suggested, d / 2)
    d = min(d, 2.0)
    return random.uniform(d / 2, d)


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def route_steps(req: "pb.router.RouteRequest", deadline: float, free_detached: Callable[[str], None]) -> Steps:
    """Sends a Route until it is answered, again while the router answers UNAVAILABLE with reason
    LOG_UNAVAILABLE (nothing was booked) and the delay it suggests fits before the deadline; returns
    the RouteResponse, or raises the call's error. A call that failed after the router may have
    booked it (a deadline, a cancel) is handed to free_detached first."""
    for attempt in itertools.count():
        resp, err = yield CALL, _remaining(deadline)
        if err is None:
            return resp
        code = status_code(err)
        if code == grpc.StatusCode.UNAVAILABLE and error_reason(err) == "LOG_UNAVAILABLE":
            delay = retry_after(err, attempt)
            if time.monotonic() + delay < deadline:
                yield SLEEP, delay
                continue
        elif not req.query_only and code in _IN_FLIGHT:
            free_detached(req.request_id)
        raise err
    raise AssertionError("unreachable")


def end_request(request_id: str, free: bool) -> Tuple[str, Any]:
    """Returns the method of RouterService that ends a booking (Free or MarkPrefillComplete) and its request."""
    if free:
        return "Free", pb.router.FreeRequest(request_id=request_id)
    return "MarkPrefillComplete", pb.router.MarkPrefillCompleteRequest(request_id=request_id)


def route_request(
    token_ids: Sequence[int],
    model: str,
    request_id: Optional[str],
    *,
    lora_name: str,
    cache_namespace: str,
    multimodal_objects: Iterable[Tuple[int, int, int]],
    annotations: Iterable[str],
    session_id: str,
    explain: bool,
    hints: Optional["pb.router.RoutingHints"],
    config_override: Optional["pb.router.RouterConfigOverride"],
    query_only: bool,
) -> "pb.router.RouteRequest":
    """Builds the RouteRequest of Router.route()'s arguments."""
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
    return req


def hash_prompt(req: "pb.router.RouteRequest", block_size: int) -> None:
    """Keys a RouteRequest's prompt as the router would for blocks of ``block_size`` tokens (the
    model's block size, as its workers registered it; AdminService/ListWorkers shows it), and makes
    the request send the keys instead of the prompt, in place, as the Go client's
    kvclient.HashPrompt does: it sets ``block_hashes`` (the local hash of each complete block, salted
    with ``lora_name`` and ``cache_namespace``, with the ``multimodal_objects`` folded in:
    blockhash.local_hashes), ``block_size`` and ``prompt_tokens``, and clears ``token_ids``,
    ``lora_name``, ``cache_namespace`` and ``multimodal_objects``, which the hashes then hold.

    The router routes such a request exactly as it would the token ids, without decoding or hashing
    them (docs/hashing.md, "Keying the prompt yourself"); with another block size than the model's
    it answers FAILED_PRECONDITION, reason BLOCK_SIZE_MISMATCH. A prompt the router would refuse as
    token ids (none, more than 256 multimodal inputs, one with end <= start or past the prompt, two
    that overlap) raises ValidationError with the router's field and message, and so does a
    block_size below 1 or over 2**32-1; the request is then left as it was. ``Router.route(...,
    hash_prompt=block_size)`` does this to the request it builds.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int (got {block_size!r})")
    if block_size < 1:
        raise ValidationError("block_size", f"must be at least 1 (got {block_size})")
    if block_size > 0xFFFFFFFF:
        raise ValidationError("block_size", f"must be a uint32 (got {block_size})")
    tokens = req.token_ids[:]  # one copy out of the repeated field
    if not tokens:
        raise ValidationError("token_ids", "must not be empty")
    check_multimodal_objects(req.multimodal_objects, len(tokens))
    objects = [(o.mm_hash, o.start, o.end) for o in req.multimodal_objects]
    hashes = blockhash.local_hashes(tokens, block_size, blockhash.salt(req.lora_name, req.cache_namespace), objects)
    # Nothing is changed before this point: a refusal leaves the request as it was.
    del req.block_hashes[:]
    req.block_hashes.extend(hashes)
    req.block_size = block_size
    req.prompt_tokens = len(tokens)
    for field in ("token_ids", "lora_name", "cache_namespace", "multimodal_objects"):
        req.ClearField(field)


# RouterBase.route's argument of the same name hides the function there.
_hash_prompt = hash_prompt


class End:
    """One Free or MarkPrefillComplete retried in the background."""

    __slots__ = ("request_id", "free", "until", "attempt")

    def __init__(self, request_id: str, free: bool, until: float) -> None:
        self.request_id = request_id
        self.free = free
        self.until = until  # time.monotonic() after which it is given up
        self.attempt = 1  # the foreground made the first

    def next_try(self, err: Optional[BaseException]) -> Optional[float]:
        """Takes the outcome of a background try (err None: accepted); returns the delay before the
        next, or None when the end is over: accepted, NOT_FOUND (nobody holds the booking), an error
        a retry would not change, or past its time (the router expires the booking by then)."""
        if err is None or status_code(err) not in RETRYABLE_END:
            return None
        delay = retry_after(err, self.attempt)
        self.attempt += 1
        return None if time.monotonic() + delay >= self.until else delay


class BookingBase:
    """Booking is one routed request: where to send it, and the load the router booked for it.

    ``prefill_complete()`` and ``free()`` may be called any number of times: each reaches the router
    until it succeeds once, and NOT_FOUND (the booking expired or was freed) counts as done. While the
    router cannot accept one yet (UNAVAILABLE: the replica asked cannot see the booking, which another
    replica holds and has not published, or its shared state is being re-established), it is sent
    again until its timeout ends, then retried in the background (see ``Router``) and its error is
    raised. Used as a context manager, the booking is freed when the block ends, also when it raises.
    """

    def __init__(self, router: Any, request_id: str, response: "pb.router.RouteResponse") -> None:
        self._router = router
        self.request_id = request_id
        self.response = response
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
        return self._freed

    def _needs(self, free: bool) -> bool:
        """Whether an end (free, else prefill_complete) has anything to do."""
        return not self._freed if free else not (self._prefill_done or self._freed)

    def _ended(self, free: bool, err: Optional[BaseException], handed_off: bool) -> None:
        """Records what Router._end returned for an end, and raises its error."""
        if err is None or handed_off:
            # Done, or the background retry owns it now.
            if free:
                self._freed = True
            else:
                self._prefill_done = True
        if err is not None:
            raise err

    def __repr__(self) -> str:
        d = self.response.decode
        return f"Booking(request_id={self.request_id!r}, decode={d.worker_id}/{d.dp_rank}@{d.endpoint}, freed={self.freed})"


class RouterBase:
    """Router routes requests through kvrouter's RouterService.

    ``target`` is an address ("host:port") or an open grpc.Channel (a grpc.aio.Channel for
    kvrouter_client.aio.Router). ``max_prompt_tokens`` is the router's max_prompt_tokens: longer
    prompts are refused here, with the router's message, before anything is sent (None skips that
    check). ``timeout`` is how long, in seconds, a call may take, its retries included. A channel
    the Router opens for an address uses ``channel_options`` (DEFAULT_CHANNEL_OPTIONS: keepalive
    pings after 15 s of silence, failing the connection when none is answered within 10 s, and a
    short reconnect backoff); a channel given keeps its own.

    A Free or MarkPrefillComplete the router could not accept within its call's timeout is retried
    in the background (from a daemon thread; tasks of the loop in kvrouter_client.aio) until the
    router accepts it (or answers NOT_FOUND: nobody holds the booking), or ``end_retry_for`` seconds
    after the route passed (the router's booking_expiry, 300 s, after which it expired the booking
    itself; 0 or less: no background retry), or the Router is closed. Without it, a booking the
    caller freed during a fault would load its workers until it expires. At most
    ``max_pending_ends`` are retried at once; past that an end is given up, and its booking expires
    on the router. ``pending_ends`` counts them.
    """

    def __init__(
        self,
        target: Any,
        max_prompt_tokens: Optional[int] = 1_048_576,
        timeout: float = 10.0,
        *,
        end_retry_for: float = 300.0,
        max_pending_ends: int = 100_000,
        channel_options: Sequence[Tuple[str, object]] = DEFAULT_CHANNEL_OPTIONS,
    ) -> None:
        self._own_channel = isinstance(target, str)
        self.channel = self._open_channel(target, list(channel_options)) if isinstance(target, str) else target
        self._stub = pb.router_grpc.RouterServiceStub(self.channel)
        self.max_prompt_tokens = max_prompt_tokens
        self.timeout = timeout
        self.end_retry_for = end_retry_for
        self._ends = self._retrier(timeout, max_pending_ends)

    def _open_channel(self, address: str, options: Sequence[Tuple[str, object]]) -> Any:
        raise NotImplementedError

    def _retrier(self, call_timeout: float, max_pending: int) -> Any:
        raise NotImplementedError

    def route_request(self, req: "pb.router.RouteRequest", timeout: Optional[float] = None) -> Any:
        raise NotImplementedError

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
        hash_prompt: Optional[int] = None,
    ) -> Any:
        """Routes one request and returns its Booking (kvrouter_client.aio: an awaitable of it, which
        is also an async context manager); a request without an id gets a random one.

        ``multimodal_objects`` are the prompt's multimodal inputs (images, audio) as ``(mm_hash,
        start, end)`` tuples, as kvrouter_client.blockhash takes them: the input's hash
        (blockhash.multimodal_hash of the identifier the engine keys its cache with) and the
        positions ``[start, end)`` in ``token_ids`` of its placeholder tokens. The router hashes the
        blocks holding them with their hashes, so that the same placeholder tokens of two different
        images never match.

        ``hash_prompt=block_size`` (the model's block size) sends the prompt's block hashes instead
        of its token ids (kvrouter_client.hash_prompt): the request is checked as token ids first,
        then hashed here, and the router neither decodes nor hashes it, and routes it as it would the
        token ids; a block size that is not the model's is answered FAILED_PRECONDITION (reason
        BLOCK_SIZE_MISMATCH). A request already keyed (block_hashes, block_size and prompt_tokens
        set) goes through ``route_request()``.

        It raises ValidationError (before sending) for what the router would refuse as malformed,
        and grpc.RpcError for the router's own errors. While the router answers UNAVAILABLE with
        reason LOG_UNAVAILABLE (it is loading its shared state, or the state may be incomplete; it
        booked nothing) the call is sent again after the delay it suggests, until ``timeout`` ends.
        A call that fails after the router may have booked it (a deadline, a cancel) is freed here,
        so it leaves no booking behind.
        """
        if request_id is None and not query_only:
            request_id = uuid.uuid4().hex
        req = route_request(
            token_ids,
            model,
            request_id,
            lora_name=lora_name,
            cache_namespace=cache_namespace,
            multimodal_objects=multimodal_objects,
            annotations=annotations,
            session_id=session_id,
            explain=explain,
            hints=hints,
            config_override=config_override,
            query_only=query_only,
        )
        if hash_prompt is not None:
            # Refused as the router refuses the token ids, before they are replaced by their hashes.
            check_route_request(req, self.max_prompt_tokens)
            _hash_prompt(req, hash_prompt)
        return self.route_request(req, timeout=timeout)

    def _prepare(self, req: "pb.router.RouteRequest", timeout: Optional[float]) -> Steps:
        """Fills a request without request_id with a random one, checks it, and returns its steps."""
        if req.request_id == "" and not req.query_only:
            req.request_id = uuid.uuid4().hex
        check_route_request(req, self.max_prompt_tokens)
        return route_steps(req, time.monotonic() + (timeout or self.timeout), self._free_detached)

    def _free_detached(self, request_id: str) -> None:
        raise NotImplementedError

    def end_steps(self, request_id: str, free: bool, timeout: float, since: float) -> Steps:
        """Sends a Free (or a MarkPrefillComplete) for request_id, and sends it again while the
        router cannot accept it yet, after the delay it suggests, until ``timeout`` ends; then hands
        it to the background retries (until end_retry_for after ``since``, a time.monotonic()).

        NOT_FOUND (the booking expired, or ended through another caller) counts as done. Returns
        (None, False) when it is done, else the last error and whether the background took it.
        """
        deadline = time.monotonic() + timeout
        for attempt in itertools.count():
            _, err = yield CALL, _remaining(deadline)
            code = None if err is None else status_code(err)
            if err is None or code == grpc.StatusCode.NOT_FOUND:
                return None, False
            if code not in RETRYABLE_END:
                return err, False
            delay = retry_after(err, attempt)
            if time.monotonic() + delay >= deadline:
                return err, self._ends.add(request_id, free, since + self.end_retry_for, delay)
            yield SLEEP, delay
        raise AssertionError("unreachable")

    def existing(self, request_id: str) -> Any:
        """Returns the Booking of a request routed elsewhere (by another Router or process: its id is
        all it takes), for this Router to end: its prefill_complete() and free() behave as those of a
        Booking that route() returned, with background retries counted from now."""
        return self._booking(request_id, pb.router.RouteResponse(booked=True))

    def _booking(self, request_id: str, response: "pb.router.RouteResponse") -> Any:
        raise NotImplementedError

    @property
    def pending_ends(self) -> int:
        """How many Free and MarkPrefillComplete calls are being retried in the background."""
        return int(self._ends.pending)


def rpc_outcome(call: Callable[..., Any], req: Any, timeout: float) -> Tuple[Any, Optional[grpc.RpcError]]:
    """Sends one call; returns (its response, None) or (None, its error)."""
    try:
        return call(req, timeout=timeout), None
    except grpc.RpcError as err:
        return None, err


def drive(steps: Steps, call: Callable[..., Any], req: Any) -> Any:
    """Runs a retry loop with blocking calls and sleeps; returns its outcome."""
    try:
        op = next(steps)
        while True:
            if op[0] == SLEEP:
                time.sleep(op[1])
                op = steps.send(None)
            else:
                op = steps.send(rpc_outcome(call, req, op[1]))
    except StopIteration as stop:
        return stop.value

