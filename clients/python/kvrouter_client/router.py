"""Router: the frontend's side of kvrouter (Route, MarkPrefillComplete, Free)."""

from __future__ import annotations

import threading
import uuid
from types import TracebackType
from typing import Iterable, Optional, Sequence, Type, Union

import grpc

from kvrouter_client import pb
from kvrouter_client.errors import status_code
from kvrouter_client.validation import check_route_request

__all__ = ["Router", "Booking"]


class Booking:
    """Booking is one routed request: where to send it, and the load the router booked for it.

    ``prefill_complete()`` and ``free()`` may be called any number of times: each reaches the router
    until it succeeds once, and NOT_FOUND (the booking expired or was freed) counts as done. Used as a
    context manager, the booking is freed when the block ends, also when it raises.
    """

    def __init__(self, router: "Router", request_id: str, response: "pb.router.RouteResponse") -> None:
        self._router = router
        self.request_id = request_id
        self.response = response
        self._lock = threading.Lock()
        self._freed = not response.booked  # a query_only decision books nothing
        self._prefill_done = self._freed

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
        """Whether the booking was freed (or never booked)."""
        with self._lock:
            return self._freed

    def prefill_complete(self, timeout: Optional[float] = None) -> None:
        """Tells the router the request's first token arrived; harmless to repeat."""
        with self._lock:
            if self._prefill_done or self._freed:
                return
            try:
                self._router._stub.MarkPrefillComplete(pb.router.MarkPrefillCompleteRequest(request_id=self.request_id), timeout=timeout or self._router.timeout)
            except grpc.RpcError as err:
                if status_code(err) != grpc.StatusCode.NOT_FOUND:
                    raise
            self._prefill_done = True

    def free(self, timeout: Optional[float] = None) -> None:
        """Releases the booking; only the first successful call reaches the router."""
        with self._lock:
            if self._freed:
                return
            try:
                self._router._stub.Free(pb.router.FreeRequest(request_id=self.request_id), timeout=timeout or self._router.timeout)
            except grpc.RpcError as err:
                if status_code(err) != grpc.StatusCode.NOT_FOUND:
                    raise
            self._freed = True

    def _quiet_free(self) -> None:
        try:
            self.free()
        except grpc.RpcError:
            pass

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
    anything is sent (None skips that check). ``timeout`` is the deadline of each call, in seconds.
    """

    def __init__(self, target: Union[str, grpc.Channel], max_prompt_tokens: Optional[int] = 1_048_576, timeout: float = 10.0) -> None:
        self._own_channel = isinstance(target, str)
        self.channel: grpc.Channel = grpc.insecure_channel(target) if isinstance(target, str) else target
        self._stub = pb.router_grpc.RouterServiceStub(self.channel)
        self.max_prompt_tokens = max_prompt_tokens
        self.timeout = timeout

    def route(
        self,
        token_ids: Sequence[int],
        model: str,
        request_id: Optional[str] = None,
        *,
        lora_name: str = "",
        cache_namespace: str = "",
        annotations: Iterable[str] = (),
        session_id: str = "",
        explain: bool = False,
        hints: Optional["pb.router.RoutingHints"] = None,
        config_override: Optional["pb.router.RouterConfigOverride"] = None,
        query_only: bool = False,
        timeout: Optional[float] = None,
    ) -> Booking:
        """Routes one request and returns its Booking; a request without an id gets a random one.

        It raises ValidationError (before sending) for what the router would refuse as malformed,
        and grpc.RpcError for the router's own errors. A call that fails after the router may have
        booked it (a deadline, a cancel) is freed here, so it leaves no booking behind.
        """
        if request_id is None and not query_only:
            request_id = uuid.uuid4().hex
        req = pb.router.RouteRequest(
            request_id=request_id or "",
            model=model,
            token_ids=list(token_ids),
            lora_name=lora_name,
            cache_namespace=cache_namespace,
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
        try:
            resp = self._stub.Route(req, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            if not req.query_only and status_code(err) in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
                Booking(self, req.request_id, pb.router.RouteResponse(booked=True))._quiet_free()
            raise
        return Booking(self, req.request_id, resp)

    def close(self) -> None:
        """Closes the channel if the Router opened it."""
        if self._own_channel:
            self.channel.close()

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
