"""kvrouter_client.aio.Publisher: one worker rank's Publish stream on grpc.aio."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from typing import Any, ContextManager, List, Optional, Sequence, Union

import grpc
import grpc.aio

from kvrouter_client import pb
from kvrouter_client._pubcore import DUMP, LEAVE, SEND, WAIT, Fatal, PublisherBase
from kvrouter_client.aio._loop import Changed, drive_waits, running_loop
from kvrouter_client.errors import PublisherError

__all__ = ["Publisher"]


class Publisher(PublisherBase):
    """Publisher streams one worker rank's KV-cache events and load to kvrouter, on grpc.aio.

    ``Publisher(hello, targets, dump=None, *, max_batch_events=256, max_batch_blocks=16384,
    flush_interval=0.002, max_unacked=65536, max_dump_blocks=16384, backoff_initial=0.05,
    backoff_max=5.0, channel_options=DEFAULT_CHANNEL_OPTIONS, hash_tokens=False,
    error_close_timeout=2.0, start=True)``, made in a running event loop.

    It does what kvrouter_client.Publisher does, with the same options and the same reactions to the
    router (the code that decides them is shared): batches, the unacked window, acks, reconnects to
    the next target with backoff and the resume after Registered.last_event_id, dumps (for a
    ResyncRequest, and when the router lost events it acked), WORKER_SUPERSEDED and refusals that
    stop it, RESOURCE_EXHAUSTED that halves its batches. Targets are addresses or open
    grpc.aio.Channel objects. Its stream runs as a task of the loop instead of threads, and
    publish(), flush(), close() and leave() are coroutines; report_load() and interrupt() are plain
    methods. ``dump`` may be a plain function or a coroutine function; publish() waits while it
    runs. ``async with Publisher(...) as pub:`` closes it when the block ends (close(): the last
    acks, then the end of the stream); a block left by an exception waits for the last acks at most
    ``error_close_timeout`` seconds, and not at all once a stream failed and none registered since.
    """

    _channel_type = grpc.aio.Channel
    _channel_type_name = "grpc.aio.Channel"

    def __init__(self, hello: "pb.worker.WorkerHello", targets: Any, *args: Any, **kwargs: Any) -> None:
        running_loop("Publisher")
        super().__init__(hello, targets, *args, **kwargs)

    def _open_channel(self, address: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(address, options=self._channel_options)

    def _setup(self) -> None:
        self._changed = Changed()
        self._task: Optional["asyncio.Task[None]"] = None
        self._cut_call: Any = None  # the call cut by the publisher itself

    def _locked(self) -> ContextManager[object]:
        return contextlib.nullcontext()

    def _wake(self) -> None:
        self._changed.notify()

    def _cut(self, call: Any) -> None:
        self._cut_call = call
        call.cancel()

    # ----- public API -----

    def start(self) -> None:
        """Starts the stream's task (done by the constructor unless ``start=False``)."""
        if self._task is None:
            h = self._core.hello
            self._task = running_loop("Publisher").create_task(self._run(), name=f"kvrouter-publisher-{h.worker_id}/{h.dp_rank}")

    async def publish(self, events: Union["pb.worker.KvEvent", Sequence["pb.worker.KvEvent"]], *, block: bool = True, timeout: Optional[float] = None) -> int:
        """Queues events for the router and returns the event id given to the last one; as
        kvrouter_client.Publisher.publish(), waiting without blocking the loop."""
        evs = self._core.prepare(events)
        return await drive_waits(self._core.publish_steps(evs, block, timeout), self._changed)  # type: ignore[no-any-return]

    async def flush(self, timeout: Optional[float] = None) -> None:
        """Waits until the router acked every event published so far; raises the publisher's error
        if it stopped, and TimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        await drive_waits(self._core.flush_steps(deadline), self._changed)

    async def close(self, timeout: Optional[float] = 30.0) -> None:
        """Sends what is queued, waits for the router's last ack, and ends the stream; as
        kvrouter_client.Publisher.close()."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            err = await drive_waits(self._core.close_steps(deadline, self._task is not None), self._changed)
        except BaseException as e:  # noqa: BLE001 - re-raised below, after cleanup
            err = e
        await self._shutdown(deadline, err)

    async def leave(self, reason: str = "", timeout: Optional[float] = 30.0) -> None:
        """Has the router remove the worker rank now, with its blocks, and closes the publisher; as
        kvrouter_client.Publisher.leave()."""
        self._core.begin_leave(reason)
        self._wake()
        deadline = None if timeout is None else time.monotonic() + timeout
        self.start()
        err = await drive_waits(self._core.leave_steps(deadline), self._changed)
        await self._shutdown(deadline, err)

    async def __aenter__(self) -> "Publisher":
        return self

    async def __aexit__(self, exc_type: object, exc: Optional[BaseException], tb: object) -> None:
        if exc is None:
            await self.close()
            return
        # The block raised: its exception is the one to see, and the publisher must not hold it up
        # waiting for acks that cannot come.
        deadline = time.monotonic() + self._core.error_close_timeout
        try:
            drop = await drive_waits(self._core.error_exit_steps(deadline, self._task is not None), self._changed)
            await self._shutdown(deadline, None, abort=drop)
        except Exception:  # noqa: BLE001
            pass

    # ----- internals -----

    async def _shutdown(self, deadline: Optional[float], err: Optional[BaseException], abort: bool = False) -> None:
        """Ends the stream's task (at once when err or abort is set, else once it ended the stream
        itself or at the deadline), closes the channels the publisher opened, and raises err, if any."""
        task = self._task
        if task is not None:
            if err is None and not abort:
                await asyncio.wait({task}, timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0))
                if not task.done():
                    err = TimeoutError("kvrouter_client: the Publish stream did not end in time")
            self._core.aborted = True
            self._wake()
            if self._call is not None:
                self._cut(self._call)
            await asyncio.wait({task}, timeout=5.0)
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for ch in self._owned_channels():
            await ch.close()
        if err is not None:
            raise err

    async def _run(self) -> None:
        try:
            await self._run_streams()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - a bug must not leave publish() and flush() waiting forever
            self._core.fail(PublisherError(f"kvrouter_client: the publisher's stream task failed: {e!r}", e))
            self._wake()

    async def _run_streams(self) -> None:
        while True:
            stop, delay, replaced = self._stream_ended(self._core.target, await self._stream(self._channels[self._core.target]))
            if replaced is not None:
                await replaced.close()
            if stop:
                return
            if delay is not None and await drive_waits(self._core.backoff_steps(delay, len(self._channels)), self._changed):
                return

    async def _stream(self, channel: grpc.aio.Channel) -> Optional[BaseException]:
        """Runs one Publish stream; returns why it ended (None: cleanly)."""
        core = self._core
        hello = core.stream_hello()
        call = pb.worker_grpc.WorkerServiceStub(channel).Publish()
        self._call = call
        if core.aborted:
            self._cut(call)
        sender: Optional["asyncio.Task[None]"] = None
        sender_err: List[BaseException] = []
        leave_sent: List[bool] = []
        try:
            await call.write(hello)
            m = await call.read()
            if m is grpc.aio.EOF:
                return PublisherError("kvrouter_client: the stream ended before the router registered the worker")
            core.registered(m, hello.hello.fresh_start)
            self._wake()
            sender = asyncio.get_running_loop().create_task(self._send_loop(call, sender_err, leave_sent))
            while True:
                m = await call.read()
                if m is grpc.aio.EOF:
                    break
                core.received(m)
                self._wake()
            if sender_err:
                return sender_err[0]
            return core.stream_closed(bool(leave_sent))
        except grpc.RpcError as e:
            return sender_err[0] if sender_err else e
        except Fatal as e:
            return e
        except asyncio.CancelledError:
            if self._cut_call is not call:
                raise  # the task itself is cancelled
            # The publisher cut the call: interrupt(), a failed sender, or the end of the publisher.
            return sender_err[0] if sender_err else PublisherError("kvrouter_client: the stream was cut")
        finally:
            self._call = None
            if self._cut_call is call:
                self._cut_call = None
            call.cancel()
            if sender is not None:
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)
            self._wake()

    async def _send_loop(self, call: Any, sender_err: List[BaseException], leave_sent: List[bool]) -> None:
        """Feeds the stream: dumps when asked, event batches, load reports, and the final half-close."""
        core = self._core
        try:
            while True:
                kind, msg = core.next_send(time.monotonic())
                if kind == WAIT:
                    await self._changed.wait(msg)
                elif kind == DUMP:
                    await self._send_dump(call)
                elif kind == SEND:
                    await call.write(msg)
                else:  # LEAVE or END
                    if kind == LEAVE:
                        await call.write(msg)
                        leave_sent.append(True)
                    await call.done_writing()  # half-close: the router ends the stream cleanly
                    return
        except (grpc.RpcError, asyncio.InvalidStateError):
            return  # the stream failed or ended: the reader sees why
        except Exception as e:  # noqa: BLE001 - handed to the stream's owner
            sender_err.append(e)
            self._cut(call)

    async def _send_dump(self, call: Any) -> None:
        """Sends the dump function's events as a KvDump, in parts, with publishing paused."""
        core = self._core
        through = core.begin_dump()
        try:
            result = core.call_dump()
            if inspect.isawaitable(result):
                try:
                    result = await result
                except Exception as e:  # noqa: BLE001
                    raise core.dump_failed(e) from e
            for part in core.dump_parts(result, through):
                await call.write(part)
                core.stats.dump_parts += 1
            core.dump_sent(through)
        finally:
            core.dumping = False
            self._wake()
