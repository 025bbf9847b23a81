"""The state and the decisions of a Publisher, shared by the threaded one (kvrouter_client.Publisher)
and the asyncio one (kvrouter_client.aio.Publisher).

PublisherCore does no I/O and never waits: its owner calls it with its lock held (the threaded
publisher) or from its event loop (the asyncio one), performs the calls and the waits it asks for,
and wakes its waiters after every change. Its ``*_steps`` generators are the waiting loops of
publish(), flush(), leave() and of leaving a ``with`` block by an exception: each yields how long
to wait (None: until something changes) and returns the outcome, so that both publishers wait on
the same conditions, each with its own primitive (``drive_threaded``, and ``drive_async`` in
kvrouter_client.aio).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Generator, Iterable, List, Optional, Sequence, Tuple, TypeVar, Union

import grpc

from kvrouter_client import pb
from kvrouter_client._channels import DEFAULT_CHANNEL_OPTIONS, split_targets
from kvrouter_client.errors import (
    PublisherClosedError,
    PublisherError,
    UnackedWindowFullError,
    WorkerSupersededError,
    error_reason,
    status_code,
)
from kvrouter_client.validation import MAX_BATCH_BLOCKS, check_events, check_hello, check_leave_reason, event_blocks

_log = logging.getLogger("kvrouter_client.publisher")

DumpFunction = Callable[[], Iterable["pb.worker.KvEvent"]]
"""A dump function returns the worker's whole cache as stored events (event ids are ignored)."""

# Codes after which a reconnect cannot help: what was sent will be refused again.
_FATAL_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}

# What next_send() asks the stream to do.
WAIT = "wait"  # nothing to send: wait (the value: at most how long, None: until a change)
SEND = "send"  # send the value, a PublishRequest
DUMP = "dump"  # send a dump (run_dump's parts)
LEAVE = "leave"  # send the value (the WorkerLeave's PublishRequest), then half-close
END = "end"  # half-close: everything was acked and the publisher is closing

# What stream_ended() decides.
STOP = "stop"  # the publisher is done, or failed: no more streams
AGAIN = "again"  # open the next stream at once, on the same target
NEXT = "next"  # open the next stream on the next target, after a backoff

T = TypeVar("T")
Steps = Generator[Optional[float], None, T]
"""A waiting loop: yields how long to wait (None: until a change) and returns its outcome."""


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


class Fatal(Exception):
    """An error raised inside a stream that must stop the publisher."""

    def __init__(self, err: PublisherError) -> None:
        super().__init__(str(err))
        self.err = err


class PublisherCore:
    """The events waiting for their ack, their numbering, and what the stream sends and does next."""

    def __init__(
        self,
        hello: "pb.worker.WorkerHello",
        dump: Optional[Callable[[], Any]],
        *,
        max_batch_events: int,
        max_batch_blocks: int,
        flush_interval: float,
        max_unacked: int,
        max_dump_blocks: int,
        backoff_initial: float,
        backoff_max: float,
        hash_tokens: bool,
        error_close_timeout: float,
    ) -> None:
        check_hello(hello)
        if min(max_batch_events, max_batch_blocks, max_unacked, max_dump_blocks) < 1:
            raise ValueError("max_batch_events, max_batch_blocks, max_unacked and max_dump_blocks must be >= 1")
        if flush_interval < 0 or backoff_initial <= 0 or backoff_max < backoff_initial:
            raise ValueError("flush_interval must be >= 0, backoff_initial > 0 and backoff_max >= backoff_initial")
        if error_close_timeout < 0:
            raise ValueError("error_close_timeout must be >= 0")
        self.hash: Optional[Callable[[Sequence["pb.worker.KvEvent"]], None]] = None
        if hash_tokens:
            from kvrouter_client.blockhash import _stored_hasher

            self.hash = _stored_hasher(hello.block_size)
        self.hello = pb.worker.WorkerHello()
        self.hello.CopyFrom(hello)
        self.dump = dump
        self.max_batch_blocks = max_batch_blocks
        self.flush_interval = flush_interval
        self.max_unacked = max_unacked
        self.max_dump_blocks = max_dump_blocks
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.error_close_timeout = error_close_timeout

        self.next_id = 0
        self.pending: List["pb.worker.KvEvent"] = []  # unacked, ids ascending
        self.sent = 0  # pending[:sent] went out on the current stream
        self.acked = -1  # last acked id, -1 before the first ack
        self.load: Optional["pb.worker.LoadReport"] = None  # to send
        self.last_load: Optional["pb.worker.LoadReport"] = None  # sent again after a reconnect
        self.resync = False  # a dump is to be sent
        self.dumping = False
        self.closing = False
        self.leave: Optional["pb.worker.WorkerLeave"] = None  # set by leave(): sent in place of anything else
        self.left = False  # the router removed the worker rank after the leave
        self.aborted = False  # the owner ends the stream now
        self.err: Optional[PublisherError] = None
        self.batch = max_batch_events  # events per message; halved by RESOURCE_EXHAUSTED
        self.down = False  # a stream failed and none registered since
        self.first = True  # no stream registered yet
        self.target = 0  # index of the target of the next stream
        self.stats = PublisherStats()
        self._delay = backoff_initial  # the next backoff
        self._batch_deadline: Optional[float] = None

    # ----- the caller's side -----

    def check_open(self) -> None:
        """Raises the publisher's error once it stopped, and PublisherClosedError once it closes."""
        if self.err is not None:
            raise self.err
        if self.closing:
            raise PublisherClosedError("kvrouter_client: the publisher is closed")

    def prepare(self, events: Union["pb.worker.KvEvent", Sequence["pb.worker.KvEvent"]]) -> List["pb.worker.KvEvent"]:
        """Checks events as the router would and hashes their tokens (with hash_tokens); needs no lock."""
        evs = [events] if isinstance(events, pb.worker.KvEvent) else list(events)
        if not evs:
            raise ValueError("publish needs at least one event")
        check_events(evs, self.hello.block_size)
        if self.hash is not None:
            self.hash(evs)
        return evs

    def publish_steps(self, evs: List["pb.worker.KvEvent"], block: bool, timeout: Optional[float]) -> Steps[int]:
        """Queues evs once the unacked window has room for them; returns the last event's id."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.check_open()
            if not self.dumping and len(self.pending) + len(evs) <= max(self.max_unacked, len(evs)):
                for ev in evs:
                    ev.event_id = self.next_id
                    ev.dp_rank = self.hello.dp_rank
                    self.next_id += 1
                    self.pending.append(ev)
                return self.next_id - 1
            remaining = None if deadline is None else deadline - time.monotonic()
            if not block or (remaining is not None and remaining <= 0):
                raise UnackedWindowFullError(
                    f"kvrouter_client: {len(self.pending)} events wait for the router's ack (max_unacked {self.max_unacked})"
                    + (" and a dump is running" if self.dumping else "")
                    + f"; cannot queue {len(evs)} more"
                )
            yield remaining

    def report_load(self, kv_used_blocks: int, waiting_requests: int) -> None:
        r = pb.worker.LoadReport(dp_rank=self.hello.dp_rank, kv_used_blocks=kv_used_blocks, waiting_requests=waiting_requests)
        self.check_open()
        self.load = r
        self.last_load = r

    def flush_steps(self, deadline: Optional[float]) -> Steps[None]:
        """Waits until every event published was acked; raises TimeoutError at the deadline, and the
        publisher's error once it stopped."""
        while True:
            if self.err is not None:
                raise self.err
            if not self.pending:
                return
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"kvrouter_client: {len(self.pending)} events still wait for the router's ack")
            yield remaining

    def begin_leave(self, reason: str) -> None:
        check_leave_reason(reason)
        self.check_open()
        self.closing = True
        self.leave = pb.worker.WorkerLeave(reason=reason)
        self.pending.clear()
        self.sent = 0

    def leave_steps(self, deadline: Optional[float]) -> Steps[Optional[BaseException]]:
        """Waits until the router confirmed the leave; returns what the leave ends with (None: done)."""
        while not self.left and self.err is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return TimeoutError("kvrouter_client: the router did not confirm the leave in time")
            yield remaining
        return self.err

    def close_steps(self, deadline: Optional[float], running: bool) -> Steps[Optional[BaseException]]:
        """close(): sends what is queued and, when the stream runs, waits for the last acks; returns
        what close() raises once the stream ended (TimeoutError, the publisher's error), if anything."""
        self.closing = True
        if not running:
            return None
        try:
            yield from self.flush_steps(deadline)
        except Exception as e:  # noqa: BLE001 - raised by close() after the cleanup
            return e
        return None

    def backoff_steps(self, delay: float, targets: int) -> Steps[bool]:
        """Waits delay seconds before the next stream, which goes to the next of the targets;
        returns True when the owner aborted meanwhile."""
        deadline = time.monotonic() + delay
        while not self.aborted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.target = (self.target + 1) % targets
                return False
            yield remaining
        return True

    def error_exit_steps(self, deadline: float, running: bool) -> Steps[bool]:
        """Closes after the caller's block raised: waits for the last acks until the deadline (the
        owner's error_close_timeout from now), and only while they can come (no stream failed since
        the last registered); returns whether events are left unacked, which the owner then drops by
        ending the stream at once."""
        self.closing = True
        if not running:
            return False
        while self.pending and self.err is None and not self.down and not self.aborted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            yield remaining
        return bool(self.pending)

    def done(self) -> bool:
        """Whether the stream has nothing more to do."""
        return self.aborted or self.left or (self.closing and not self.pending and self.leave is None)

    def fail(self, err: PublisherError) -> None:
        if self.err is None:
            self.err = err
        _log.error("kvrouter publisher stopped: %s", err)

    # ----- the stream's side -----

    def stream_hello(self) -> "pb.worker.PublishRequest":
        """The first message of the next stream: the hello, with fresh_start on the first stream only."""
        hello = pb.worker.WorkerHello()
        hello.CopyFrom(self.hello)
        hello.fresh_start = self.first and self.hello.fresh_start
        return pb.worker.PublishRequest(hello=hello)

    def registered(self, m: "pb.worker.PublishResponse", fresh_start: bool) -> None:
        """Takes the router's answer to the hello: rewinds to the first event the router lacks, or
        asks for a dump when only one can restore what it lost. Raises Fatal for another answer."""
        kind = m.WhichOneof("message")
        if kind != "registered":
            raise Fatal(PublisherError(f"kvrouter_client: the router answered the hello with {kind}, not registered"))
        reg = m.registered
        self.sent = 0
        self.resync = False
        self.load = self.last_load
        self._batch_deadline = None
        if not reg.HasField("last_event_id"):
            self.resync = self.acked >= 0 and not fresh_start
        elif self.first and not fresh_start:
            # A worker resuming a rank: its events (none sent yet) follow the router's last one.
            last = reg.last_event_id
            self.next_id = last + 1
            for ev in self.pending:
                ev.event_id = self.next_id
                self.next_id += 1
            self.acked = last
        elif reg.last_event_id < self.acked:
            self.resync = True  # the router lost events it had acked
        else:
            self.drop_through(reg.last_event_id)
        self.first = False
        self.down = False
        self._delay = self.backoff_initial
        self.stats.streams += 1

    def drop_through(self, event_id: int) -> None:
        n = 0
        while n < len(self.pending) and self.pending[n].event_id <= event_id:
            n += 1
        if n:
            del self.pending[:n]
        self.sent = max(self.sent - n, 0)
        self.acked = max(self.acked, event_id)

    def received(self, m: "pb.worker.PublishResponse") -> None:
        """Takes a message of the router after the registration: an ack or a resync request."""
        kind = m.WhichOneof("message")
        if kind == "ack":
            self.drop_through(m.ack.event_id)
        elif kind == "resync":
            _log.info("the router asked for a dump: %s", m.resync.reason)
            self.stats.resync_requests += 1
            self.resync = True

    def next_send(self, now: float) -> Tuple[str, Any]:
        """Says what the stream sends next (WAIT, SEND, DUMP, LEAVE or END, with its value); after
        leave(), nothing but the leave and the half-close."""
        if self.leave is not None:
            return LEAVE, pb.worker.PublishRequest(leave=self.leave)
        if self.resync:
            self.resync = False
            return DUMP, None
        unsent = len(self.pending) - self.sent
        if unsent > 0:
            if self._batch_deadline is None:
                self._batch_deadline = now + self.flush_interval
            if unsent < self.batch and not self.closing and now < self._batch_deadline:
                return WAIT, self._batch_deadline - now
            self._batch_deadline = None
            events: List["pb.worker.KvEvent"] = []
            blocks = 0
            for ev in self.pending[self.sent : self.sent + self.batch]:
                b = event_blocks(ev)
                if events and blocks + b > self.max_batch_blocks:
                    break
                events.append(ev)
                blocks += b
            self.sent += len(events)
            self.stats.batches += 1
            return SEND, pb.worker.PublishRequest(events=pb.worker.EventBatch(events=events))
        if self.load is not None:
            msg = pb.worker.PublishRequest(load=self.load)
            self.load = None
            return SEND, msg
        if self.closing and not self.pending:
            return END, None
        return WAIT, None

    def begin_dump(self) -> int:
        """Pauses publishing for a dump; returns the last event id the dump covers."""
        if self.dump is None:
            raise Fatal(PublisherError("kvrouter_client: the router asked for a dump of the worker's cache (ResyncRequest) and the Publisher has no dump function"))
        self.dumping = True
        if self.next_id == 0:
            self.next_id = 1  # through_event_id 0 then stands for "nothing before"
        return self.next_id - 1

    def call_dump(self) -> Any:
        """Calls the dump function; what it raises stops the publisher (Fatal)."""
        assert self.dump is not None
        try:
            return self.dump()
        except Exception as e:  # noqa: BLE001
            raise self.dump_failed(e) from e

    def dump_failed(self, e: BaseException) -> Fatal:
        return Fatal(PublisherError(f"kvrouter_client: the dump function failed: {e!r}", e))

    def dump_parts(self, result: Iterable["pb.worker.KvEvent"], through: int) -> List["pb.worker.PublishRequest"]:
        """Checks and hashes the dump function's events, and splits them into KvDump messages of at
        most max_dump_blocks blocks. Raises Fatal for events the router would refuse."""
        try:
            events = list(result)
        except Exception as e:  # noqa: BLE001 - a generator that failed
            raise self.dump_failed(e) from e
        for ev in events:
            ev.dp_rank = self.hello.dp_rank
        try:
            check_events(events, self.hello.block_size, field="dump.events")
        except Exception as e:  # noqa: BLE001
            raise Fatal(PublisherError(f"kvrouter_client: the dump function returned an event the router would refuse: {e}", e)) from e
        for i, ev in enumerate(events):
            if ev.WhichOneof("data") != "stored":
                raise Fatal(PublisherError(f"kvrouter_client: dump.events[{i}]: must be a stored event (a dump lists the blocks the worker holds)"))
        if self.hash is not None:
            self.hash(events)
        parts = []
        start = 0
        while True:
            end, blocks = start, 0
            while end < len(events) and (end == start or blocks + event_blocks(events[end]) <= self.max_dump_blocks):
                blocks += event_blocks(events[end])
                end += 1
            parts.append(pb.worker.PublishRequest(dump=pb.worker.KvDump(through_event_id=through, events=events[start:end], more_follows=end < len(events))))
            start = end
            if start >= len(events):
                return parts

    def dump_sent(self, through: int) -> None:
        self.stats.dumps += 1
        self.drop_through(through)  # in the dump; the router acks it once applied

    def stream_closed(self, leave_sent: bool) -> Optional[PublisherError]:
        """Takes the router's end of the stream with OK; returns it as an error unless it was asked for."""
        if leave_sent:
            # The router ends the stream with OK once it removed the rank: it read the leave, since
            # nothing follows the leave but the half-close.
            self.left = True
            return None
        if self.closing and not self.pending and self.leave is None:
            return None
        return PublisherError("kvrouter_client: the router ended the stream")

    def stream_ended(self, err: Optional[BaseException]) -> Tuple[str, float]:
        """Decides what follows a stream that ended with err (None: cleanly): STOP, AGAIN, or NEXT
        after the returned delay, in seconds (exponential backoff with jitter)."""
        if self.done():
            return STOP, 0.0
        if isinstance(err, Fatal):
            self.fail(err.err)
            return STOP, 0.0
        code = status_code(err) if err is not None else None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and self.batch > 1:
            self.batch //= 2
            _log.warning("the router refused a message as too large; sending %d events per message: %s", self.batch, describe(err))
            return AGAIN, 0.0
        if code in _FATAL_CODES:
            self.fail(fatal_error(err))
            return STOP, 0.0
        self.stats.failures += 1
        self.down = True
        _log.warning("kvrouter publish stream failed; reconnecting: %s", describe(err))
        delay = self._delay * random.uniform(0.5, 1.5)
        self._delay = min(self._delay * 2, self.backoff_max)
        return NEXT, delay


def renews_channel(err: Optional[BaseException]) -> bool:
    """Whether a channel the publisher opened itself is replaced after a stream failed with err.

    A channel whose server went away may keep failing calls with its last connection error for a
    while (seen with grpcio 1.51): after UNAVAILABLE the next attempt dials afresh.
    """
    return err is not None and status_code(err) == grpc.StatusCode.UNAVAILABLE


def describe(err: Optional[BaseException]) -> str:
    if err is None:
        return "the stream ended"
    code = status_code(err)
    if code is not None:
        details = getattr(err, "details", None)
        return f"{code.name}: {details() if callable(details) else err}"
    return str(err)


def fatal_error(err: Optional[BaseException]) -> PublisherError:
    if err is not None and error_reason(err) == "WORKER_SUPERSEDED":
        return WorkerSupersededError(f"kvrouter_client: another stream registered this worker rank (two processes with one worker_id?): {describe(err)}", err)
    if err is not None and status_code(err) == grpc.StatusCode.FAILED_PRECONDITION:
        return PublisherError(f"kvrouter_client: the router refused the stream: {describe(err)}", err)
    return PublisherError(f"kvrouter_client: the router refused what this worker sent: {describe(err)}", err)


def drive_threaded(steps: Steps[T], cond: threading.Condition) -> T:
    """Runs a waiting loop on a held threading.Condition, and wakes the other waiters after it."""
    try:
        while True:
            cond.wait(next(steps))
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    finally:
        cond.notify_all()


class PublisherBase:
    """The constructor, options and read-only views that both publishers share.

    A subclass says which channels it takes (``_channel_type``, named ``_channel_type_name``) and
    how it opens one (``_open_channel``), and provides ``_locked()`` (a context manager guarding the
    core), ``_wake()`` (wakes every waiter; called with the lock held), ``_cut(call)`` (ends a
    stream as a network failure would), ``_setup()`` and ``start()``.
    """

    _channel_type: Any = None
    _channel_type_name = ""

    def __init__(
        self,
        hello: "pb.worker.WorkerHello",
        targets: Any,
        dump: Optional[Callable[[], Any]] = None,
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
        error_close_timeout: float = 2.0,
        start: bool = True,
    ) -> None:
        self._core = PublisherCore(
            hello,
            dump,
            max_batch_events=max_batch_events,
            max_batch_blocks=max_batch_blocks,
            flush_interval=flush_interval,
            max_unacked=max_unacked,
            max_dump_blocks=max_dump_blocks,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            hash_tokens=hash_tokens,
            error_close_timeout=error_close_timeout,
        )
        self._channel_options = list(channel_options)
        # The address of each channel the publisher opened, None for a channel it was given.
        self._addresses, self._channels = split_targets(targets, self._channel_type, self._channel_type_name, self._open_channel)
        self._call: Any = None  # the current stream's call
        self.stats = self._core.stats
        self._setup()
        if start:
            self.start()

    def _open_channel(self, address: str) -> Any:
        raise NotImplementedError

    def _setup(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def _locked(self) -> ContextManager[Any]:
        raise NotImplementedError

    def _wake(self) -> None:
        raise NotImplementedError

    def _cut(self, call: Any) -> None:
        raise NotImplementedError

    def _owned_channels(self) -> List[Any]:
        """The channels the publisher opened itself (closed with it)."""
        with self._locked():
            return [ch for ch, addr in zip(self._channels, self._addresses) if addr is not None]

    def _renew_channel(self, i: int, err: Optional[BaseException]) -> Any:
        """Replaces channel i after a failure that calls for it (renews_channel) when the publisher
        opened it itself; returns the channel replaced, for the caller to close, or None."""
        addr = self._addresses[i]
        if addr is None or not renews_channel(err):
            return None
        with self._locked():
            old, self._channels[i] = self._channels[i], self._open_channel(addr)
        return old

    def _stream_ended(self, i: int, err: Optional[BaseException]) -> Tuple[bool, Optional[float], Any]:
        """Takes the end of the stream on target i: returns whether the publisher stops, else the
        backoff before the next stream (None: at once, on the same target), and the channel that
        a fresh one replaced, for the caller to close (or None)."""
        with self._locked():
            action, delay = self._core.stream_ended(err)
            self._wake()
        if action == STOP:
            return True, None, None
        if action == AGAIN:
            return False, None, None
        return False, delay, self._renew_channel(i, err)

    def report_load(self, kv_used_blocks: int, waiting_requests: int) -> None:
        """Sends the worker's own load; the latest report is sent once, and again after a reconnect."""
        with self._locked():
            self._core.report_load(kv_used_blocks, waiting_requests)
            self._wake()

    @property
    def last_acked(self) -> Optional[int]:
        """The last event id the router acked, or None before the first ack."""
        with self._locked():
            return None if self._core.acked < 0 else self._core.acked

    @property
    def unacked(self) -> int:
        """The number of published events the router has not acked yet."""
        with self._locked():
            return len(self._core.pending)

    @property
    def error(self) -> Optional[PublisherError]:
        """Why the publisher stopped, or None while it runs."""
        with self._locked():
            return self._core.err

    def interrupt(self) -> None:
        """Ends the current stream as a network failure would; the publisher reconnects and resumes.

        It is meant for tests and for moving a worker to another router replica on purpose.
        """
        with self._locked():
            call = self._call
        if call is not None:
            self._cut(call)
