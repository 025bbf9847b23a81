"""Publisher: one worker rank's Publish stream, which never loses or repeats an event across reconnects."""

from __future__ import annotations

import queue
import threading
import time
from typing import ContextManager, Iterator, List, Optional, Sequence, Union

import grpc

from kvrouter_client import pb
from kvrouter_client._channels import DEFAULT_CHANNEL_OPTIONS
from kvrouter_client._pubcore import (
    DUMP,
    END,
    LEAVE,
    WAIT,
    DumpFunction,
    Fatal,
    PublisherBase,
    PublisherStats,
    drive_threaded,
)
from kvrouter_client.errors import PublisherError

__all__ = ["Publisher", "PublisherStats", "DumpFunction", "DEFAULT_CHANNEL_OPTIONS"]

class Publisher(PublisherBase):
    """Publisher streams one worker rank's KV-cache events and load to kvrouter.

    ``Publisher(hello, targets, dump=None, *, max_batch_events=256, max_batch_blocks=16384,
    flush_interval=0.002, max_unacked=65536, max_dump_blocks=16384, backoff_initial=0.05,
    backoff_max=5.0, channel_options=DEFAULT_CHANNEL_OPTIONS, hash_tokens=False,
    error_close_timeout=2.0, start=True)``

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
    with its ``tokens_hash`` instead, computed here as the router would (kvrouter_client.blockhash),
    its ``mm_hashes`` folded in: 8 bytes a block on the wire, and no hashing on the router.

    The publisher is safe to use from several threads, but the dump function must not call
    publish() (it runs while publishing is paused). Channels it opens itself for address targets use
    ``channel_options``: by default DEFAULT_CHANNEL_OPTIONS, a short gRPC reconnect backoff and
    keepalive pings (options given replace them all); channels given as targets keep their own. Use
    it as a context manager, or call close(), which sends what is queued, waits for the last ack and
    ends the stream; or leave(), for a worker that stopped serving, which has the router remove the
    worker rank at once instead of a grace period after the stream ended. A ``with`` block left by
    an exception does not wait for a flush that cannot happen: it waits for the last acks at most
    ``error_close_timeout`` seconds, and not at all once a stream failed and none registered since
    (a dead or unreachable router), then ends the stream and drops what was not acked.
    """

    _channel_type = grpc.Channel
    _channel_type_name = "grpc.Channel"

    def _open_channel(self, address: str) -> grpc.Channel:
        return grpc.insecure_channel(address, options=self._channel_options)

    def _setup(self) -> None:
        self._cond = threading.Condition()
        h = self._core.hello
        self._thread = threading.Thread(target=self._run, name=f"kvrouter-publisher-{h.worker_id}/{h.dp_rank}", daemon=True)
        self._started = False

    def _locked(self) -> ContextManager[object]:
        return self._cond

    def _wake(self) -> None:
        self._cond.notify_all()

    def _cut(self, call: grpc.Call) -> None:
        call.cancel()

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
        evs = self._core.prepare(events)
        with self._cond:
            return drive_threaded(self._core.publish_steps(evs, block, timeout), self._cond)

    def flush(self, timeout: Optional[float] = None) -> None:
        """Waits until the router acked every event published so far.

        It raises the publisher's error if it stopped, and TimeoutError after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            drive_threaded(self._core.flush_steps(deadline), self._cond)

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Sends what is queued, waits for the router's last ack, and ends the stream.

        When the acks do not come within ``timeout`` seconds, the stream is cancelled and
        TimeoutError is raised (the unacked events are lost). It raises the publisher's error if it
        stopped on one. Channels the publisher opened itself are closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            with self._cond:
                err = drive_threaded(self._core.close_steps(deadline, self._started), self._cond)
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
        with self._cond:
            self._core.begin_leave(reason)
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        self.start()
        with self._cond:
            err = drive_threaded(self._core.leave_steps(deadline), self._cond)
        self._shutdown(deadline, err)

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, exc_type: object, exc: Optional[BaseException], tb: object) -> None:
        if exc is None:
            self.close()
            return
        # The block raised: its exception is the one to see, and the publisher must not hold it up
        # waiting for acks that cannot come.
        deadline = time.monotonic() + self._core.error_close_timeout
        try:
            with self._cond:
                drop = drive_threaded(self._core.error_exit_steps(deadline, self._started), self._cond)
            self._shutdown(deadline, None, abort=drop)
        except Exception:  # noqa: BLE001
            pass

    # ----- internals -----

    def _shutdown(self, deadline: Optional[float], err: Optional[BaseException], abort: bool = False) -> None:
        """Ends the stream thread (at once when err or abort is set, else once it ended the stream
        itself or at the deadline), closes the channels the publisher opened, and raises err, if any."""
        if self._started:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if err is None and not abort:
                self._thread.join(remaining)
                if self._thread.is_alive():
                    err = TimeoutError("kvrouter_client: the Publish stream did not end in time")
            with self._cond:
                self._core.aborted = True
                call = self._call
                self._cond.notify_all()
            if call is not None:
                call.cancel()
            self._thread.join(5.0)
        for ch in self._owned_channels():
            ch.close()
        if err is not None:
            raise err

    def _run(self) -> None:
        try:
            self._run_streams()
        except BaseException as e:  # noqa: BLE001 - a bug must not leave publish() and flush() waiting forever
            with self._cond:
                self._core.fail(PublisherError(f"kvrouter_client: the publisher's stream thread failed: {e!r}", e))
                self._cond.notify_all()

    def _run_streams(self) -> None:
        while True:
            stop, delay, replaced = self._stream_ended(self._core.target, self._stream(self._channels[self._core.target]))
            if replaced is not None:
                replaced.close()
            if stop:
                return
            if delay is not None:
                with self._cond:
                    if drive_threaded(self._core.backoff_steps(delay, len(self._channels)), self._cond):
                        return

    def _stream(self, channel: grpc.Channel) -> Optional[BaseException]:
        """Runs one Publish stream; returns why it ended (None: cleanly)."""
        core = self._core
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

        with self._cond:
            hello = core.stream_hello()
        q.put(hello)
        call = pb.worker_grpc.WorkerServiceStub(channel).Publish(requests())
        with self._cond:
            if core.aborted:
                call.cancel()
            self._call = call
        sender: Optional[threading.Thread] = None
        sender_err: List[BaseException] = []
        leave_sent = threading.Event()
        try:
            it = iter(call)
            m = next(it)
            with self._cond:
                core.registered(m, hello.hello.fresh_start)
                self._cond.notify_all()

            def send() -> None:
                try:
                    self._send_loop(q, done, leave_sent)
                except BaseException as e:  # noqa: BLE001 - handed to the stream's owner
                    sender_err.append(e)
                    call.cancel()

            sender = threading.Thread(target=send, name="kvrouter-publisher-send", daemon=True)
            sender.start()
            for m in it:
                with self._cond:
                    core.received(m)
                    self._cond.notify_all()
            if sender_err:
                return sender_err[0]
            with self._cond:
                return core.stream_closed(leave_sent.is_set())
        except StopIteration:
            return PublisherError("kvrouter_client: the stream ended before the router registered the worker")
        except grpc.RpcError as e:
            return sender_err[0] if sender_err else e
        except Fatal as e:
            return e
        finally:
            done.set()
            with self._cond:
                self._call = None
                self._cond.notify_all()
            call.cancel()
            if sender is not None:
                sender.join()

    def _send_loop(self, q: "queue.Queue[Optional[pb.worker.PublishRequest]]", done: threading.Event, leave_sent: threading.Event) -> None:
        """Feeds the stream: dumps when asked, event batches, load reports, and the final half-close."""
        core = self._core
        while not done.is_set():
            with self._cond:
                kind, msg = core.next_send(time.monotonic())
                while kind == WAIT:
                    if done.is_set():
                        return
                    self._cond.wait(msg)
                    kind, msg = core.next_send(time.monotonic())
            if kind == DUMP:
                self._send_dump(q)
                continue
            if kind == LEAVE:
                q.put(msg)
                leave_sent.set()
            if kind in (LEAVE, END):
                q.put(None)  # half-close: the router ends the stream cleanly
                return
            q.put(msg)

    def _send_dump(self, q: "queue.Queue[Optional[pb.worker.PublishRequest]]") -> None:
        """Sends the dump function's events as a KvDump, in parts, with publishing paused."""
        core = self._core
        with self._cond:
            through = core.begin_dump()
        try:
            for part in core.dump_parts(core.call_dump(), through):
                q.put(part)
                core.stats.dump_parts += 1
            with self._cond:
                core.dump_sent(through)
        finally:
            with self._cond:
                core.dumping = False
                self._cond.notify_all()
