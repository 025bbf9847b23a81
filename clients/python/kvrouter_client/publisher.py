"""Publisher: one worker rank's Publish stream, which never loses or repeats an event across reconnects."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import grpc

from kvrouter_client import pb
from kvrouter_client.errors import (
    PublisherClosedError,
    PublisherError,
    UnackedWindowFullError,
    WorkerSupersededError,
    error_reason,
    status_code,
)
from kvrouter_client.validation import MAX_BATCH_BLOCKS, check_events, check_hello, check_leave_reason, event_blocks

__all__ = ["Publisher", "PublisherStats", "DumpFunction", "DEFAULT_CHANNEL_OPTIONS"]

DumpFunction = Callable[[], Iterable["pb.worker.KvEvent"]]
"""A dump function returns the worker's whole cache as stored events (event ids are ignored)."""

_log = logging.getLogger("kvrouter_client.publisher")

# Codes after which a reconnect cannot help: what was sent will be refused again.
_FATAL_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}


# gRPC's own reconnect backoff starts at 1 s and grows to 120 s; the publisher's backoff is meant to
# decide, so the channels it opens retry a connection sooner. Keepalive pings (every 15 s, also on a
# quiet stream; the router allows one every 10 s) fail a stream whose router vanished without closing
# the connection (a crashed host, a partition) within about 25 s, instead of leaving it waiting for
# acks until TCP gives up, many minutes later.
DEFAULT_CHANNEL_OPTIONS: Tuple[Tuple[str, object], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 5000),
    ("grpc.keepalive_time_ms", 15_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
)


@dataclass
class PublisherStats:
    """PublisherStats counts what a publisher did, for logs and tests."""

    streams: int = 0
    """Publish streams the router registered."""
    failures: int = 0
    """Streams that failed and were retried."""
    resync_requests: int = 0
    """ResyncRequest messages received."""
    dumps: int = 0
    """Dumps sent (each possibly in several parts)."""
    dump_parts: int = 0
    """KvDump messages sent."""
    batches: int = 0
    """EventBatch messages sent, replays included."""


class _Fatal(Exception):
    """An error raised inside a stream that must stop the publisher."""

    def __init__(self, err: PublisherError) -> None:
        super().__init__(str(err))
        self.err = err


class Publisher:
    """Publisher streams one worker rank's KV-cache events and load to kvrouter.

    It opens a Publish stream to the first of ``targets`` (addresses "host:port" or open
    grpc.Channel objects), registers with ``hello``, numbers the events given to publish() from 0
    (or, without fresh_start, after the router's last event of the rank), and sends them in batches
    of at most ``max_batch_events`` events and ``max_batch_blocks`` blocks, waiting at most
    ``flush_interval`` seconds for a batch to fill. Every event is kept until the router acks it;
    at most ``max_unacked`` are kept, and publish() blocks (or raises UnackedWindowFullError) past
    that. After a failed stream it reconnects to the next target with exponential backoff and
    jitter (``backoff_initial`` to ``backoff_max`` seconds), registers without fresh_start, drops
    what the router's Registered.last_event_id says it holds and replays the rest, so that every
    event is applied exactly once.

    A ResyncRequest (the router saw a gap in the event ids) is answered with a KvDump of what
    ``dump`` returns, sent in parts of at most ``max_dump_blocks`` blocks; publish() waits while the
    dump function runs, so the dump reflects every event published before it. A newer stream for the
    same worker rank stops the publisher with WorkerSupersededError; a message the router refuses
    stops it with PublisherError (a message refused as too large first makes batches smaller).

    With ``hash_tokens``, each stored block given with its token ids (published or dumped) is sent
    with its ``tokens_hash`` instead, computed here as the router would (kvrouter_client.blockhash,
    which needs Debian's python3-xxhash), its ``mm_hashes`` folded in: 8 bytes a block on the wire,
    and no hashing on the router.

    The publisher is safe to use from several threads, but the dump function must not call
    publish() (it runs while publishing is paused). Channels it opens itself for address targets use
    ``channel_options``: by default DEFAULT_CHANNEL_OPTIONS, a short gRPC reconnect backoff and
    keepalive pings (options given replace them all); channels given as targets keep their own. Use
    it as a context manager, or call close(), which sends what is queued, waits for the last ack and
    ends the stream; or leave(), for a worker that stopped serving, which has the router remove the
    worker rank at once instead of a grace period after the stream ended.
    """

    def __init__(
        self,
        hello: "pb.worker.WorkerHello",
        targets: Union[str, grpc.Channel, Sequence[Union[str, grpc.Channel]]],
        dump: Optional[DumpFunction] = None,
        *,
        max_batch_events: int = 256,
        max_batch_blocks: int = MAX_BATCH_BLOCKS,
        flush_interval: float = 0.002,
        max_unacked: int = 65_536,
        max_dump_blocks: int = MAX_BATCH_BLOCKS,
        backoff_initial: float = 0.05,
        backoff_max: float = 5.0,
        channel_options: Sequence[Tuple[str, object]] = DEFAULT_CHANNEL_OPTIONS,
        hash_tokens: bool = False,
        start: bool = True,
    ) -> None:
        check_hello(hello)
        targets = [targets] if isinstance(targets, (str, grpc.Channel)) else list(targets)
        if len(targets) == 0:
            raise ValueError("Publisher needs at least one target")
        for t in targets:
            if not isinstance(t, (str, grpc.Channel)):
                raise TypeError(f"Publisher targets are addresses (str) or grpc.Channel objects, not {type(t).__name__}")
        if min(max_batch_events, max_batch_blocks, max_unacked, max_dump_blocks) < 1:
            raise ValueError("max_batch_events, max_batch_blocks, max_unacked and max_dump_blocks must be >= 1")
        if flush_interval < 0 or backoff_initial <= 0 or backoff_max < backoff_initial:
            raise ValueError("flush_interval must be >= 0, backoff_initial > 0 and backoff_max >= backoff_initial")
        self._hash: Optional[Callable[[Sequence["pb.worker.KvEvent"]], None]] = None
        if hash_tokens:
            # Imported here: only hash_tokens needs xxhash (python3-xxhash); a missing one fails now.
            from kvrouter_client.blockhash import _stored_hasher

            self._hash = _stored_hasher(hello.block_size)
        self._hello = pb.worker.WorkerHello()
        self._hello.CopyFrom(hello)
        self._channel_options = list(channel_options)
        self._addresses: List[Optional[str]] = []  # the address of each channel the publisher opened
        self._channels: List[grpc.Channel] = []
        for t in targets:
            if isinstance(t, str):
                self._addresses.append(t)
                self._channels.append(grpc.insecure_channel(t, options=self._channel_options))
            else:
                self._addresses.append(None)
                self._channels.append(t)
        self._dump = dump
        self._max_batch_blocks = max_batch_blocks
        self._flush_interval = flush_interval
        self._max_unacked = max_unacked
        self._max_dump_blocks = max_dump_blocks
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max

        self._cond = threading.Condition()
        self._next_id = 0
        self._pending: List["pb.worker.KvEvent"] = []  # unacked, ids ascending
        self._sent = 0  # pending[:sent] went out on the current stream
        self._acked = -1  # last acked id, -1 before the first ack
        self._load: Optional["pb.worker.LoadReport"] = None  # to send
        self._last_load: Optional["pb.worker.LoadReport"] = None  # sent again after a reconnect
        self._resync = False
        self._dumping = False
        self._closing = False
        self._leave: Optional["pb.worker.WorkerLeave"] = None  # set by leave(): sent in place of anything else
        self._left = False  # the router removed the worker rank after the leave
        self._aborted = False
        self._err: Optional[PublisherError] = None
        self._batch = max_batch_events
        self._call: Optional[grpc.Call] = None
        self.stats = PublisherStats()
        self._thread = threading.Thread(target=self._run, name=f"kvrouter-publisher-{hello.worker_id}/{hello.dp_rank}", daemon=True)
        self._started = False
        if start:
            self.start()

    # ----- public API -----

    def start(self) -> None:
        """Starts the background stream (done by the constructor unless ``start=False``)."""
        with self._cond:
            if self._started:
                return
            self._started = True
        self._thread.start()

    def publish(self, events: Union["pb.worker.KvEvent", Sequence["pb.worker.KvEvent"]], *, block: bool = True, timeout: Optional[float] = None) -> int:
        """Queues events for the router and returns the event id given to the last one.

        Without fresh_start in the hello, ids given before the first registration are provisional:
        the router's Registered.last_event_id renumbers the queued events to follow it.

        The publisher takes the events over: it sets their event_id and dp_rank, and they must not
        be changed afterwards. Events the router would refuse (a stored block whose token count is
        not the hello's block_size, a missing storage tier, ...) raise ValidationError, with the
        router's message, and nothing of the call is queued. With ``hash_tokens``, stored blocks get
        their tokens_hash in place of their token ids here. While ``max_unacked`` events wait for
        their ack, or a dump runs, it blocks (at most ``timeout`` seconds, when given) and then raises
        UnackedWindowFullError; with ``block=False`` it raises at once. It raises the publisher's
        error once it stopped, and PublisherClosedError after close().
        """
        evs = [events] if isinstance(events, pb.worker.KvEvent) else list(events)
        if not evs:
            raise ValueError("publish needs at least one event")
        check_events(evs, self._hello.block_size)
        if self._hash is not None:
            self._hash(evs)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._err is not None:
                    raise self._err
                if self._closing:
                    raise PublisherClosedError("kvrouter_client: the publisher is closed")
                if not self._dumping and len(self._pending) + len(evs) <= max(self._max_unacked, len(evs)):
                    for ev in evs:
                        ev.event_id = self._next_id
                        ev.dp_rank = self._hello.dp_rank
                        self._next_id += 1
                        self._pending.append(ev)
                    self._cond.notify_all()
                    return self._next_id - 1
                remaining = None if deadline is None else deadline - time.monotonic()
                if not block or (remaining is not None and remaining <= 0):
                    raise UnackedWindowFullError(
                        f"kvrouter_client: {len(self._pending)} events wait for the router's ack (max_unacked {self._max_unacked})"
                        + (" and a dump is running" if self._dumping else "")
                        + f"; cannot queue {len(evs)} more"
                    )
                self._cond.wait(remaining)

    def report_load(self, kv_used_blocks: int, waiting_requests: int) -> None:
        """Sends the worker's own load; the latest report is sent once, and again after a reconnect."""
        r = pb.worker.LoadReport(dp_rank=self._hello.dp_rank, kv_used_blocks=kv_used_blocks, waiting_requests=waiting_requests)
        with self._cond:
            if self._err is not None:
                raise self._err
            if self._closing:
                raise PublisherClosedError("kvrouter_client: the publisher is closed")
            self._load = r
            self._last_load = r
            self._cond.notify_all()

    @property
    def last_acked(self) -> Optional[int]:
        """The last event id the router acked, or None before the first ack."""
        with self._cond:
            return None if self._acked < 0 else self._acked

    @property
    def unacked(self) -> int:
        """The number of published events the router has not acked yet."""
        with self._cond:
            return len(self._pending)

    @property
    def error(self) -> Optional[PublisherError]:
        """Why the publisher stopped, or None while it runs."""
        with self._cond:
            return self._err

    def flush(self, timeout: Optional[float] = None) -> None:
        """Waits until the router acked every event published so far.

        It raises the publisher's error if it stopped, and TimeoutError after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._flush_locked(deadline)

    def interrupt(self) -> None:
        """Ends the current stream as a network failure would; the publisher reconnects and resumes.

        It is meant for tests and for moving a worker to another router replica on purpose.
        """
        with self._cond:
            call = self._call
        if call is not None:
            call.cancel()

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Sends what is queued, waits for the router's last ack, and ends the stream.

        When the acks do not come within ``timeout`` seconds, the stream is cancelled and
        TimeoutError is raised (the unacked events are lost). It raises the publisher's error if it
        stopped on one. Channels the publisher opened itself are closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        err: Optional[BaseException] = None
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            if self._started:
                try:
                    self._flush_locked(deadline)
                except BaseException as e:  # noqa: BLE001 - re-raised below, after cleanup
                    err = e
        self._shutdown(deadline, err)

    def leave(self, reason: str = "", timeout: Optional[float] = 30.0) -> None:
        """Has the router remove the worker rank now, with its blocks, and closes the publisher.

        For a worker that stopped serving (its engine is down) and must get no more requests: after
        close() the router keeps the rank, and routes to it, for a grace period in case it reconnects.
        ``reason`` says why, for the router's log (at most 256 bytes). Events not acked yet are
        dropped, since the worker's blocks go with it. The leave is the last message of the stream
        (on a new one if the stream fails first, with the reconnects' backoff); the router
        confirms the removal by ending the stream with OK, and leave() returns then. Without that
        confirmation within ``timeout`` seconds it raises TimeoutError, and the router removes the
        rank a grace period after the stream ended, as after close(). The publisher is closed either
        way, and channels it opened itself too.

        A reason over 256 bytes raises ValidationError, with the router's message, and changes
        nothing. It raises the publisher's error if it stopped on one (before or during the leave),
        and PublisherClosedError after close() or a first leave(). It starts the stream if the
        publisher was made with ``start=False``.
        """
        check_leave_reason(reason)
        deadline = None if timeout is None else time.monotonic() + timeout
        err: Optional[BaseException] = None
        with self._cond:
            if self._err is not None:
                raise self._err
            if self._closing:
                raise PublisherClosedError("kvrouter_client: the publisher is closed")
            self._closing = True
            self._leave = pb.worker.WorkerLeave(reason=reason)
            self._pending.clear()
            self._sent = 0
            self._cond.notify_all()
        self.start()
        with self._cond:
            while not self._left and self._err is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    err = TimeoutError("kvrouter_client: the router did not confirm the leave in time")
                    break
                self._cond.wait(remaining)
            if self._err is not None:
                err = self._err
        self._shutdown(deadline, err)

    def _shutdown(self, deadline: Optional[float], err: Optional[BaseException]) -> None:
        """Ends the stream thread (at once when err is set, else once it ended the stream itself or
        at the deadline), closes the channels the publisher opened, and raises err, if any."""
        if self._started:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if err is None:
                self._thread.join(remaining)
                if self._thread.is_alive():
                    err = TimeoutError("kvrouter_client: the Publish stream did not end in time")
            with self._cond:
                self._aborted = True
                call = self._call
                self._cond.notify_all()
            if call is not None:
                call.cancel()
            self._thread.join(5.0)
        with self._cond:
            owned = [ch for ch, addr in zip(self._channels, self._addresses) if addr is not None]
        for ch in owned:
            ch.close()
        if err is not None:
            raise err

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, exc_type: object, exc: Optional[BaseException], tb: object) -> None:
        try:
            self.close()
        except BaseException:
            if exc is None:
                raise

    # ----- internals -----

    def _flush_locked(self, deadline: Optional[float]) -> None:
        while self._pending and self._err is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"kvrouter_client: {len(self._pending)} events still wait for the router's ack")
            self._cond.wait(remaining)
        if self._err is not None:
            raise self._err

    def _fail(self, err: PublisherError) -> None:
        with self._cond:
            if self._err is None:
                self._err = err
            self._cond.notify_all()
        _log.error("kvrouter publisher stopped: %s", err)

    def _done(self) -> bool:
        with self._cond:
            return self._aborted or self._left or (self._closing and not self._pending and self._leave is None)

    def _run(self) -> None:
        try:
            self._run_streams()
        except BaseException as e:  # noqa: BLE001 - a bug must not leave publish() and flush() waiting forever
            self._fail(PublisherError(f"kvrouter_client: the publisher's stream thread failed: {e!r}", e))

    def _run_streams(self) -> None:
        first = True
        delay = self._backoff_initial
        i = 0
        while True:
            registered, err = self._stream(self._channels[i], first)
            if registered:
                first = False
                delay = self._backoff_initial
            if self._done():
                return
            if isinstance(err, _Fatal):
                self._fail(err.err)
                return
            code = status_code(err) if err is not None else None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                with self._cond:
                    if self._batch > 1:
                        self._batch //= 2
                        _log.warning("the router refused a message as too large; sending %d events per message: %s", self._batch, _details(err))
                        continue
            if code in _FATAL_CODES:
                self._fail(_fatal_error(err))
                return
            self.stats.failures += 1
            _log.warning("kvrouter publish stream failed; reconnecting: %s", _details(err))
            addr = self._addresses[i]
            if code == grpc.StatusCode.UNAVAILABLE and addr is not None:
                # A channel whose server went away may keep failing calls with its last connection
                # error for a while (seen with grpcio 1.51): a channel the publisher opened itself is
                # replaced, so the next attempt dials afresh.
                with self._cond:
                    old, self._channels[i] = self._channels[i], grpc.insecure_channel(addr, options=self._channel_options)
                old.close()
            with self._cond:
                if self._cond.wait_for(lambda: self._aborted, timeout=delay * random.uniform(0.5, 1.5)):
                    return
            delay = min(delay * 2, self._backoff_max)
            i = (i + 1) % len(self._channels)

    def _stream(self, channel: grpc.Channel, first: bool) -> Tuple[bool, Optional[BaseException]]:
        """Runs one Publish stream; returns whether it registered, and why it ended (None: cleanly)."""
        q: "queue.Queue[Optional[pb.worker.PublishRequest]]" = queue.Queue()
        done = threading.Event()

        def requests() -> Iterator["pb.worker.PublishRequest"]:
            while True:
                try:
                    item = q.get(timeout=0.05)
                except queue.Empty:
                    if done.is_set():
                        return
                    continue
                if item is None or done.is_set():
                    return
                yield item

        hello = pb.worker.WorkerHello()
        hello.CopyFrom(self._hello)
        hello.fresh_start = first and self._hello.fresh_start
        q.put(pb.worker.PublishRequest(hello=hello))
        stub = pb.worker_grpc.WorkerServiceStub(channel)
        call = stub.Publish(requests())
        with self._cond:
            if self._aborted:
                call.cancel()
            self._call = call
        registered = False
        sender: Optional[threading.Thread] = None
        sender_err: List[BaseException] = []
        leave_sent = threading.Event()
        try:
            it = iter(call)
            m = next(it)
            if m.WhichOneof("message") != "registered":
                raise _Fatal(PublisherError(f"kvrouter_client: the router answered the hello with {m.WhichOneof('message')}, not registered"))
            need_dump = self._resume(m.registered, first, hello.fresh_start)
            registered = True
            self.stats.streams += 1

            def send() -> None:
                try:
                    self._send_loop(q, done, need_dump, leave_sent)
                except BaseException as e:  # noqa: BLE001 - handed to the stream's owner
                    sender_err.append(e)
                    call.cancel()

            sender = threading.Thread(target=send, name="kvrouter-publisher-send", daemon=True)
            sender.start()
            for m in it:
                kind = m.WhichOneof("message")
                if kind == "ack":
                    with self._cond:
                        self._drop_through_locked(m.ack.event_id)
                elif kind == "resync":
                    _log.info("the router asked for a dump: %s", m.resync.reason)
                    self.stats.resync_requests += 1
                    with self._cond:
                        self._resync = True
                        self._cond.notify_all()
            if sender_err:
                raise sender_err[0]
            with self._cond:
                if leave_sent.is_set():
                    # The router ends the stream with OK once it removed the rank: it read the leave,
                    # since nothing follows the leave but the half-close.
                    self._left = True
                    self._cond.notify_all()
                    return registered, None
                clean = self._closing and not self._pending and self._leave is None
            return registered, None if clean else PublisherError("kvrouter_client: the router ended the stream")
        except StopIteration:
            return registered, PublisherError("kvrouter_client: the stream ended before the router registered the worker")
        except grpc.RpcError as e:
            if sender_err:
                return registered, sender_err[0]
            return registered, e
        except _Fatal as e:
            return registered, e
        finally:
            done.set()
            with self._cond:
                self._call = None
                self._cond.notify_all()
            call.cancel()
            if sender is not None:
                sender.join()

    def _resume(self, reg: "pb.worker.Registered", first: bool, fresh_start: bool) -> bool:
        """Rewinds to the first event the router lacks; returns whether only a dump can restore it."""
        with self._cond:
            self._sent = 0
            self._resync = False
            self._load = self._last_load
            if not reg.HasField("last_event_id"):
                return self._acked >= 0 and not fresh_start
            last = reg.last_event_id
            if first and not fresh_start:
                # A worker resuming a rank: its events (none sent yet) follow the router's last one.
                self._next_id = last + 1
                for ev in self._pending:
                    ev.event_id = self._next_id
                    self._next_id += 1
                self._acked = last
                self._cond.notify_all()
                return False
            if last < self._acked:
                return True  # the router lost events it had acked
            self._drop_through_locked(last)
            return False

    def _drop_through_locked(self, event_id: int) -> None:
        n = 0
        while n < len(self._pending) and self._pending[n].event_id <= event_id:
            n += 1
        if n:
            del self._pending[:n]
        self._sent = max(self._sent - n, 0)
        self._acked = max(self._acked, event_id)
        self._cond.notify_all()

    def _send_loop(self, q: "queue.Queue[Optional[pb.worker.PublishRequest]]", done: threading.Event, need_dump: bool, leave_sent: threading.Event) -> None:
        """Feeds the stream: dumps when asked, event batches, load reports, and the final half-close;
        after leave(), nothing but the leave and the half-close."""
        batch_deadline: Optional[float] = None
        while not done.is_set():
            with self._cond:
                leave = self._leave
            if leave is not None:
                q.put(pb.worker.PublishRequest(leave=leave))
                leave_sent.set()
                q.put(None)  # the leave is the stream's last message
                return
            if need_dump:
                self._send_dump(q)
                need_dump = False
                continue
            msg: Optional["pb.worker.PublishRequest"] = None
            with self._cond:
                while not done.is_set():
                    if self._leave is not None:
                        break
                    if self._resync:
                        self._resync = False
                        need_dump = True
                        break
                    unsent = len(self._pending) - self._sent
                    if unsent > 0:
                        now = time.monotonic()
                        if batch_deadline is None:
                            batch_deadline = now + self._flush_interval
                        if unsent < self._batch and not self._closing and now < batch_deadline:
                            self._cond.wait(batch_deadline - now)
                            continue
                        batch_deadline = None
                        events, blocks = [], 0
                        for ev in self._pending[self._sent : self._sent + self._batch]:
                            b = event_blocks(ev)
                            if events and blocks + b > self._max_batch_blocks:
                                break
                            events.append(ev)
                            blocks += b
                        self._sent += len(events)
                        msg = pb.worker.PublishRequest(events=pb.worker.EventBatch(events=events))
                        self.stats.batches += 1
                        break
                    if self._load is not None:
                        msg = pb.worker.PublishRequest(load=self._load)
                        self._load = None
                        break
                    if self._closing and not self._pending:
                        q.put(None)  # half-close: the router ends the stream cleanly
                        return
                    self._cond.wait()
            if msg is not None:
                q.put(msg)

    def _send_dump(self, q: "queue.Queue[Optional[pb.worker.PublishRequest]]") -> None:
        """Sends the dump function's events as a KvDump, in parts, with publishing paused."""
        if self._dump is None:
            raise _Fatal(PublisherError("kvrouter_client: the router asked for a dump of the worker's cache (ResyncRequest) and the Publisher has no dump function"))
        with self._cond:
            self._dumping = True
            if self._next_id == 0:
                self._next_id = 1  # through_event_id 0 then stands for "nothing before"
            through = self._next_id - 1
        try:
            try:
                events = list(self._dump())
            except Exception as e:  # noqa: BLE001
                raise _Fatal(PublisherError(f"kvrouter_client: the dump function failed: {e!r}", e)) from e
            for ev in events:
                ev.dp_rank = self._hello.dp_rank
            try:
                check_events(events, self._hello.block_size, field="dump.events")
            except Exception as e:  # noqa: BLE001
                raise _Fatal(PublisherError(f"kvrouter_client: the dump function returned an event the router would refuse: {e}", e)) from e
            for i, ev in enumerate(events):
                if ev.WhichOneof("data") != "stored":
                    raise _Fatal(PublisherError(f"kvrouter_client: dump.events[{i}]: must be a stored event (a dump lists the blocks the worker holds)"))
            if self._hash is not None:
                self._hash(events)
            start = 0
            while True:
                end, blocks = start, 0
                while end < len(events) and (end == start or blocks + event_blocks(events[end]) <= self._max_dump_blocks):
                    blocks += event_blocks(events[end])
                    end += 1
                q.put(pb.worker.PublishRequest(dump=pb.worker.KvDump(through_event_id=through, events=events[start:end], more_follows=end < len(events))))
                self.stats.dump_parts += 1
                start = end
                if start >= len(events):
                    break
            self.stats.dumps += 1
            with self._cond:
                self._drop_through_locked(through)  # in the dump; the router acks it once applied
        finally:
            with self._cond:
                self._dumping = False
                self._cond.notify_all()


def _details(err: Optional[BaseException]) -> str:
    if err is None:
        return "the stream ended"
    code = status_code(err)
    if code is not None:
        details = getattr(err, "details", None)
        return f"{code.name}: {details() if callable(details) else err}"
    return str(err)


def _fatal_error(err: Optional[BaseException]) -> PublisherError:
    if err is not None and error_reason(err) == "WORKER_SUPERSEDED":
        return WorkerSupersededError(f"kvrouter_client: another stream registered this worker rank (two processes with one worker_id?): {_details(err)}", err)
    if status_code(err) == grpc.StatusCode.FAILED_PRECONDITION:
        return PublisherError(f"kvrouter_client: the router refused the stream: {_details(err)}", err)
    return PublisherError(f"kvrouter_client: the router refused what this worker sent: {_details(err)}", err)
