"""Tests of kvrouter_client.aio against real `kvrouter serve` processes: embedded mode, one replica
on a private Redis, and two replicas sharing one.

Each reaction of the threaded clients' tests (test_client.py) is checked here for the asyncio ones.
The event loop must keep running while a test waits for the router, so waits are ``await until(...)``
and the blocking helpers (starting a server) run in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import unittest
from typing import Awaitable, List, Optional, Tuple, TypeVar
from unittest import mock

import grpc
import grpc.aio

from common import BS, LATE, BlackHoleSecondStream, CorruptFirstBatch, CountCalls, DropEvent, SharedStateSetup, block, hello, until
from kvrouter_client import (
    PublisherClosedError,
    PublisherError,
    UnackedWindowFullError,
    ValidationError,
    WorkerSupersededError,
    aio,
    error_reason,
    events,
    pb,
    retry_delay,
)
from kvserver import Redis, Server, free_port

logging.basicConfig(level=os.environ.get("KVROUTER_TEST_LOG", "CRITICAL"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


T = TypeVar("T")


async def awaited(aw: Awaitable[T]) -> T:
    """A coroutine of an awaitable (Router.route's RouteCall), for asyncio.create_task."""
    return await aw


class AioTest(unittest.IsolatedAsyncioTestCase):
    """A test with its own kvrouter process on a free port, and the clients it makes closed after it."""

    flags: Tuple[str, ...] = ()

    def setUp(self) -> None:
        self.server = Server(*self.flags)
        self.addCleanup(lambda: self.server.stop())

    def publisher(self, *args, **kwargs) -> aio.Publisher:
        """Returns a publisher that is closed (without waiting long) when the test ends."""
        p = aio.Publisher(*args, **kwargs)

        async def close() -> None:
            try:
                await p.close(timeout=2)
            except Exception:  # noqa: BLE001 - the test checked what it wanted already
                pass

        self.addAsyncCleanup(close)
        return p

    def router(self, target, **kwargs) -> aio.Router:  # noqa: ANN001
        r = aio.Router(target, **kwargs)
        self.addAsyncCleanup(r.close)
        return r

    def channel(self, addr: str, *interceptors) -> grpc.aio.Channel:  # noqa: ANN002
        ch = grpc.aio.insecure_channel(addr, interceptors=list(interceptors))
        self.addAsyncCleanup(ch.close)
        return ch

    async def restart(self) -> None:
        """Restarts the server on its port with nothing of its state (embedded mode)."""
        port = self.server.port
        self.server.stop()
        self.server = await asyncio.to_thread(Server, port=port)

    async def registered_again(self, p: aio.Publisher) -> None:
        """Breaks the publisher's stream and waits until it registered again."""
        before = p.stats.streams
        p.interrupt()
        self.assertTrue(await until(lambda: p.stats.streams > before), "the publisher did not reconnect")


class PublisherTest(AioTest):
    async def test_every_event_applied_once_across_interrupted_streams(self) -> None:
        dumps: List[int] = []
        p = self.publisher(hello(5), self.server.addr, dump=lambda: dumps.append(1) or [], max_batch_events=16)
        n = 1500
        for i in range(n):
            await p.publish(events.stored([block(i)]))
            if i % 100 == 50:
                await self.registered_again(p)  # the stream fails with events sent and not yet acked
        await p.flush(20)
        self.assertGreaterEqual(p.stats.streams, 10)
        self.assertEqual(p.last_acked, n - 1)
        w = self.server.worker_status(5)
        self.assertEqual((w.last_event_id, w.cached_blocks.device, w.awaiting_resync), (n - 1, n, False))
        for i in range(0, n, 2):
            await p.publish(events.removed([block(i)[0]]))
            if i % 300 == 0:
                await self.registered_again(p)
        await p.close(20)
        w = self.server.worker_status(5)
        self.assertEqual((w.last_event_id, w.cached_blocks.device), (n + n // 2 - 1, n // 2))
        self.assertEqual(dumps, [], "a resync means an event was lost or repeated out of order")
        self.assertNotIn("gap", self.server.log_text())

    async def test_reconnect_replays_what_a_dead_stream_lost(self) -> None:
        # The second stream registers and then reaches the router with nothing: Registered on the
        # third says the router holds none of its events, and they are all replayed, with no dump.
        hole = BlackHoleSecondStream()
        dumps: List[int] = []
        p = self.publisher(hello(6), self.channel(self.server.addr, hole.aio()), dump=lambda: dumps.append(1) or [])
        await p.publish(events.stored([block(0)]))
        await p.flush(5)
        await self.registered_again(p)
        self.assertEqual(hole.streams, 2)
        for i in range(1, 40):
            await p.publish(events.stored([block(i)]))
        self.assertTrue(await until(lambda: hole.ids(swallowed=True) == list(range(1, 40))), f"sent into the black hole: {hole.ids(swallowed=True)}")
        self.assertEqual(p.unacked, 39)
        self.assertEqual(self.server.worker_status(6).last_event_id, 0)
        await self.registered_again(p)
        await p.flush(10)
        self.assertEqual(hole.ids(stream=3), list(range(1, 40)))
        w = self.server.worker_status(6)
        self.assertEqual((w.last_event_id, w.cached_blocks.device, w.awaiting_resync), (39, 40, False))
        self.assertEqual((p.stats.streams, p.stats.resync_requests, p.stats.dumps, dumps), (3, 0, 0, []))

    async def test_first_registration_without_fresh_start_continues_the_numbering(self) -> None:
        async with aio.Publisher(hello(16), self.server.addr) as p:
            await p.publish([events.stored([block(i)]) for i in range(5)])
        async with aio.Publisher(hello(16, fresh_start=False), self.server.addr) as p:
            await p.publish([events.stored([block(i)]) for i in range(5, 8)])
            await p.flush(5)
            self.assertEqual(p.last_acked, 7)
        w = self.server.worker_status(16)
        self.assertEqual((w.last_event_id, w.cached_blocks.device), (7, 8))

    async def test_a_restarted_router_that_lost_everything_gets_a_dump(self) -> None:
        cache = [block(i) for i in range(10)]
        dumps: List[int] = []

        async def dump() -> List["pb.worker.KvEvent"]:  # a coroutine function works as well
            dumps.append(len(cache))
            return [events.stored(cache)]

        p = self.publisher(hello(15), self.server.addr, dump=dump, backoff_initial=0.02, backoff_max=0.2)
        await p.publish([events.stored([b]) for b in cache])
        await p.flush(5)
        await self.restart()
        self.assertTrue(await until(lambda: dumps != []), "no dump after the restart")
        cache.append(block(10))
        await p.publish(events.stored([block(10)]))
        await p.flush(5)
        w = self.server.worker_status(15)
        self.assertEqual((w.cached_blocks.device, w.last_event_id, w.awaiting_resync), (11, 10, False))

    async def test_fails_over_to_the_next_address_with_backoff(self) -> None:
        dead = f"127.0.0.1:{free_port()}"
        p = self.publisher(hello(8), [dead, dead, self.server.addr], backoff_initial=0.05, backoff_max=0.2)
        t0 = time.monotonic()
        await p.publish([events.stored([block(i)]) for i in range(10)])
        await p.flush(10)
        # Two failures, each followed by a backoff of 0.5-1.5 times 50 ms, then 100 ms.
        self.assertGreaterEqual(time.monotonic() - t0, 0.025 + 0.05)
        self.assertEqual((p.stats.failures, p.stats.streams), (2, 1))
        self.assertEqual(self.server.worker_status(8).cached_blocks.device, 10)

    async def test_close_flushes_and_waits_for_the_last_ack(self) -> None:
        p = aio.Publisher(hello(9), self.server.addr, max_batch_events=8)
        for i in range(500):
            await p.publish(events.stored([block(i)]))
        await p.close(10)
        self.assertEqual((p.last_acked, p.unacked), (499, 0))
        w = self.server.worker_status(9)
        self.assertEqual((w.last_event_id, w.connected), (499, False))
        with self.assertRaises(PublisherClosedError):
            await p.publish(events.stored([block(0)]))

    async def test_unacked_window_bounds_memory(self) -> None:
        dead = f"127.0.0.1:{free_port()}"  # nothing listens: nothing is ever acked
        p = aio.Publisher(hello(10), dead, max_unacked=10, backoff_initial=0.01, backoff_max=0.05)
        for i in range(10):
            await p.publish(events.stored([block(i)]))
        with self.assertRaises(UnackedWindowFullError):
            await p.publish(events.stored([block(10)]), block=False)
        t0 = time.monotonic()
        with self.assertRaises(UnackedWindowFullError) as cm:
            await p.publish(events.stored([block(10)]), timeout=0.2)
        self.assertGreaterEqual(time.monotonic() - t0, 0.19)
        self.assertIn("max_unacked 10", str(cm.exception))
        with self.assertRaises(TimeoutError):
            await p.close(timeout=0.3)

    async def test_leaving_the_block_by_an_exception_does_not_wait_for_a_dead_router(self) -> None:
        dead = f"127.0.0.1:{free_port()}"
        t0 = time.monotonic()
        with self.assertRaises(RuntimeError):
            async with aio.Publisher(hello(18), dead) as p:
                await p.publish([events.stored([block(i)]) for i in range(5)])
                raise RuntimeError("the engine failed")
        self.assertLess(time.monotonic() - t0, 5, "leaving the block waited for acks a dead router cannot send (close() waits 30 s)")
        self.assertEqual(p.unacked, 5)
        with self.assertRaises(PublisherClosedError):
            await p.publish(events.stored([block(5)]))
        # With the router there, what was queued is delivered before the stream ends.
        with self.assertRaises(RuntimeError):
            # A longer bound than the default 2 s, for a loaded machine: the wait ends with the acks.
            async with aio.Publisher(hello(19), self.server.addr, max_batch_events=8, error_close_timeout=20) as q:
                await q.publish([events.stored([block(i)]) for i in range(200)])
                raise RuntimeError("the engine failed")
        self.assertEqual(q.unacked, 0)
        self.assertEqual(self.server.worker_status(19).last_event_id, 199)

    async def test_leave_removes_the_worker_at_once(self) -> None:
        p = self.publisher(hello(50, model="leaving"), self.server.addr)
        await p.publish([events.stored([block(i)]) for i in range(3)])
        await p.flush(5)
        await p.leave("engine down", timeout=5)
        self.assertIsNone(self.server.worker_status(50))
        self.assertIn('"reason":"engine down"', self.server.log_text())
        with self.assertRaises(PublisherClosedError):
            await p.publish(events.stored([block(3)]))

    async def test_load_reports_reach_the_router_and_are_sent_again_after_a_reconnect(self) -> None:
        p = self.publisher(hello(24), self.server.addr, dump=lambda: [events.stored([block(0)])], backoff_initial=0.02, backoff_max=0.2)
        await p.publish(events.stored([block(0)]))
        p.report_load(kv_used_blocks=7, waiting_requests=2)

        def used() -> Optional[int]:
            w = self.server.worker_status(24)
            return None if w is None else w.load.kv_used_blocks

        self.assertTrue(await until(lambda: used() == 7), f"the router shows {used()} used blocks")
        await self.restart()  # the new router knows nothing of the load
        self.assertTrue(await until(lambda: used() == 7), "the last load report was not sent again on the new stream")

    async def test_made_outside_an_event_loop_it_says_so(self) -> None:
        def make() -> None:
            aio.Publisher(hello(25), self.server.addr)

        with self.assertRaises(RuntimeError) as cm:
            await asyncio.to_thread(make)
        self.assertIn("running event loop", str(cm.exception))


class LimitsTest(AioTest):
    flags = ("--max-batch-blocks", "8")

    async def test_too_large_messages_are_split(self) -> None:
        p = self.publisher(hello(11), self.server.addr, max_batch_events=64, flush_interval=0.05)
        await p.publish([events.stored([block(i)]) for i in range(100)])
        await p.flush(10)
        self.assertIsNone(p.error)
        self.assertLessEqual(p._core.batch, 8, "RESOURCE_EXHAUSTED did not halve the batches")
        w = self.server.worker_status(11)
        self.assertEqual((w.last_event_id, w.cached_blocks.device), (99, 100))


class RefusalTest(AioTest):
    async def test_gap_is_answered_with_a_dump_in_parts(self) -> None:
        cache: List[Tuple[int, List[int]]] = []
        calls: List[int] = []

        def dump() -> List["pb.worker.KvEvent"]:
            calls.append(len(cache))
            return [events.stored([b]) for b in cache]

        drop = DropEvent(3)
        p = self.publisher(hello(12), self.channel(self.server.addr, drop.aio()), dump=dump, max_batch_events=2, max_dump_blocks=3)
        for i in range(10):
            cache.append(block(i))
            await p.publish(events.stored([block(i)]))
        await p.flush(10)
        self.assertTrue(drop.dropped)
        self.assertTrue(await until(lambda: calls != []))
        self.assertGreaterEqual(p.stats.resync_requests, 1)
        self.assertGreaterEqual(p.stats.dump_parts, 4, "a dump of 10 blocks in parts of 3 blocks")
        for i in range(10, 15):
            cache.append(block(i))
            await p.publish(events.stored([block(i)]))
        await p.flush(10)
        self.assertTrue(await until(lambda: not self.server.worker_status(12).awaiting_resync), "the worker still awaits a resync")
        w = self.server.worker_status(12)
        self.assertEqual((w.cached_blocks.device, w.last_event_id), (15, 14))
        self.assertIn('"expected":3,"got":4', self.server.log_text())

    async def test_resync_without_dump_function_stops_the_publisher(self) -> None:
        p = self.publisher(hello(13), self.channel(self.server.addr, DropEvent(0).aio()))
        await p.publish([events.stored([block(i)]) for i in range(3)])
        self.assertTrue(await until(lambda: p.error is not None))
        self.assertIn("no dump function", str(p.error))

    async def test_a_second_publisher_for_the_same_worker_stops_the_first(self) -> None:
        a = self.publisher(hello(7), self.server.addr)
        await a.publish(events.stored([block(0)]))
        await a.flush(5)
        b = self.publisher(hello(7), self.server.addr)
        await b.publish(events.stored([block(1)]))
        await b.flush(5)
        self.assertTrue(await until(lambda: a.error is not None))
        self.assertIsInstance(a.error, WorkerSupersededError)
        self.assertEqual(error_reason(a.error.cause), "WORKER_SUPERSEDED")
        self.assertEqual(a.stats.streams, 1, "a superseded publisher must not reconnect")
        with self.assertRaises(WorkerSupersededError):
            await a.publish(events.stored([block(2)]))
        with self.assertRaises(WorkerSupersededError):
            await a.close(2)
        await b.publish(events.stored([block(2)]))
        await b.flush(5)
        self.assertTrue(self.server.worker_status(7).connected)

    async def test_invalid_argument_stops_the_publisher(self) -> None:
        corrupt = CorruptFirstBatch()
        p = self.publisher(hello(22), self.channel(self.server.addr, corrupt.aio()))
        await p.publish(events.stored([block(0)]))
        self.assertTrue(await until(lambda: p.error is not None), "the publisher did not stop")
        self.assertEqual(p.error.cause.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("must hold exactly block_size 4 tokens (got 3)", str(p.error))
        self.assertEqual((corrupt.streams, p.stats.streams, p.stats.failures), (1, 1, 0))
        with self.assertRaises(PublisherError):
            await p.flush(1)

    async def test_checks_before_sending_are_the_threaded_clients(self) -> None:
        p = aio.Publisher(hello(14), f"127.0.0.1:{free_port()}", start=False)
        with self.assertRaises(ValidationError) as cm:
            await p.publish(events.stored([(1, [1, 2, 3])]))
        self.assertEqual(str(cm.exception), "events.events[0].stored.blocks[0].token_ids: must hold exactly block_size 4 tokens (got 3)")
        self.assertEqual(p.unacked, 0)
        await p.close(1)
        with self.assertRaises(ValidationError) as cm:
            aio.Publisher(hello(0), self.server.addr)
        self.assertEqual(str(cm.exception), "hello.worker_id: must not be 0")
        router = self.router(f"127.0.0.1:{free_port()}", max_prompt_tokens=8)  # nothing is sent
        with self.assertRaises(ValidationError) as cm:
            router.route(list(range(1, 10)), "demo")
        self.assertEqual(str(cm.exception), "token_ids: has 9 tokens, more than the maximum of 8 (max_prompt_tokens)")
        with self.assertRaises(ValidationError) as cm:
            await router.route([1, 2], "demo", "x" * 513)
        self.assertEqual(str(cm.exception), "request_id: must be at most 512 bytes (got 513)")


class RouterTest(AioTest):
    async def asyncSetUp(self) -> None:
        p = self.publisher(hello(20), self.server.addr)
        await p.publish(events.stored([block(0)]))
        await p.flush(5)
        self.counter = CountCalls("Free")
        self.r = self.router(self.channel(self.server.addr, self.counter.aio()))

    def active(self) -> int:
        return self.server.worker_status(20).load.active_requests

    async def test_a_booking_is_freed_exactly_once(self) -> None:
        b = await self.r.route(block(0)[1] + [99], "demo")
        self.assertEqual((b.decode.worker_id, b.decode.endpoint, self.active()), (20, "10.0.0.20:8000", 1))
        await b.prefill_complete()
        await b.prefill_complete()
        await asyncio.gather(b.free(), b.free(), b.free())  # at once, from three tasks
        await b.free()
        await b.prefill_complete()
        self.assertTrue(b.freed)
        self.assertEqual(self.active(), 0)
        self.assertEqual(self.counter.calls, 1, "one Free reached the router")
        # A booking freed elsewhere (or expired): NOT_FOUND counts as done.
        c = await self.r.route([1, 2, 3], "demo", "req-c")
        self.server.router.Free(pb.router.FreeRequest(request_id="req-c"))
        await c.free()
        self.assertTrue(c.freed)
        # Ending a booking routed by someone else.
        self.server.router.Route(pb.router.RouteRequest(request_id="req-d", model="demo", token_ids=[1, 2, 3]))
        self.assertEqual(self.active(), 1)
        await self.r.existing("req-d").free()
        self.assertEqual(self.active(), 0)

    async def test_the_context_manager_frees_on_exit_on_exception_and_on_cancel(self) -> None:
        with self.assertRaises(RuntimeError):
            async with self.r.route([1, 2, 3, 4, 5], "demo") as b:
                self.assertEqual(self.active(), 1)
                raise RuntimeError("the request failed")
        self.assertTrue(b.freed)
        async with self.r.route([1, 2, 3, 4, 5], "demo") as b2:
            pass
        self.assertTrue(b2.freed)
        self.assertEqual(self.active(), 0)
        # A request task cancelled while it serves frees its booking too.
        entered = asyncio.Event()

        async def serve() -> None:
            async with self.r.route([1, 2, 3, 4, 5], "demo"):
                entered.set()
                await asyncio.sleep(60)

        task = asyncio.create_task(serve())
        await asyncio.wait_for(entered.wait(), 10)
        self.assertEqual(self.active(), 1)
        task.cancel()
        with self.assertRaises(asyncio.CancelledError):
            await task
        self.assertTrue(await until(lambda: self.active() == 0), "the cancelled request's booking was not freed")
        self.assertEqual(self.server.admin.GetState(pb.admin.GetStateRequest()).bookings, 0)

    async def test_a_hashed_prompt_is_routed_as_its_token_ids(self) -> None:
        prompt = block(0)[1] + [99]  # worker 20's block and a tail
        outcome = lambda b: (b.decode.worker_id, b.response.diagnostics.decode.overlap_blocks.device)  # noqa: E731
        by_ids = await self.r.route(prompt, "demo", query_only=True)
        hashed = await self.r.route(prompt, "demo", query_only=True, hash_prompt=BS)
        self.assertEqual(outcome(hashed), outcome(by_ids))
        self.assertEqual(outcome(hashed), (20, 1))
        async with self.r.route(prompt, "demo", hash_prompt=BS) as b:
            self.assertEqual((b.decode.worker_id, self.active()), (20, 1))
        self.assertEqual(self.active(), 0)
        # Refused before anything is awaited, as the router refuses the token ids.
        with self.assertRaises(ValidationError) as cm:
            self.r.route(prompt, "demo", multimodal_objects=[(1, 2, 9)], hash_prompt=BS)
        self.assertEqual(str(cm.exception), "multimodal_objects[0].end: must be at most the number of token_ids 5 (got 9)")
        with self.assertRaises(grpc.RpcError) as cm:
            await self.r.route(prompt, "demo", hash_prompt=8)
        self.assertEqual((cm.exception.code(), error_reason(cm.exception)), (grpc.StatusCode.FAILED_PRECONDITION, "BLOCK_SIZE_MISMATCH"))
        self.assertEqual(self.active(), 0)

    async def test_a_route_is_awaited_once(self) -> None:
        call = self.r.route([1, 2, 3], "demo", query_only=True)
        b = await call
        self.assertFalse(b.response.booked)
        self.assertTrue(b.freed, "a query books nothing")
        with self.assertRaises(RuntimeError):
            await call

    async def test_channels_the_clients_open_get_the_keepalive(self) -> None:
        want = {"grpc.keepalive_time_ms": 15_000, "grpc.keepalive_timeout_ms": 10_000, "grpc.keepalive_permit_without_calls": 1}
        with mock.patch("grpc.aio.insecure_channel", wraps=grpc.aio.insecure_channel) as opened:
            router = self.router(self.server.addr)
            self.publisher(hello(23), self.server.addr)
        mine = [c for c in opened.call_args_list if c.args[0] == self.server.addr]
        self.assertEqual(len(mine), 2)
        for c in mine:
            options = dict(c.kwargs["options"])
            self.assertEqual({k: options.get(k) for k in want}, want)
        async with router.route(block(0)[1] + [99], "demo") as b:
            self.assertIn(b.decode.worker_id, (20, 23))


class SharedStateTest(SharedStateSetup, unittest.IsolatedAsyncioTestCase):
    async def register(self, worker_id: int) -> None:
        """Registers an aggregated worker that can prefill 8 tokens at once, and waits for it."""
        h = hello(worker_id)
        h.max_num_batched_tokens = 8
        p = aio.Publisher(h, self.server.addr)
        self.addAsyncCleanup(p.close, 2)
        await p.publish(events.stored([block(0)]))
        await p.flush(5)

    async def pause_redis(self) -> None:
        """Pauses Redis and waits until the replica says its shared state is unreachable."""
        self.assertTrue(await until(self.redis_paused()),
                        "the replica did not notice that Redis stopped answering")


class UnavailableEndTest(SharedStateTest):
    flags = ("--router-queue-threshold", "1")

    async def asyncSetUp(self) -> None:
        self.assertTrue(await until(lambda: self.state().shared_state_complete), "the replica's shared state never became complete")
        await self.register(40)
        self.r = aio.Router(self.server.addr)
        self.addAsyncCleanup(self.r.close)

    def active(self) -> int:
        return self.server.worker_status(40).load.active_requests

    async def test_free_the_router_cannot_accept_yet_is_retried_in_the_background(self) -> None:
        held = await self.r.route(list(range(1, 21)), "demo")
        self.assertEqual(self.active(), 1)
        await self.pause_redis()
        gone = self.r.existing("routed-elsewhere")
        t0 = time.monotonic()
        with self.assertRaises(grpc.RpcError) as cm:
            await gone.free(timeout=0.5)
        self.assertGreaterEqual(time.monotonic() - t0, 0.1, "free() gave up at once instead of retrying")
        self.assertIn(cm.exception.code(), LATE)
        with self.assertRaises(grpc.RpcError) as cm:
            self.server.router.Free(pb.router.FreeRequest(request_id="routed-elsewhere"), timeout=5)
        self.assertEqual((cm.exception.code(), error_reason(cm.exception), retry_delay(cm.exception)), (grpc.StatusCode.UNAVAILABLE, "LOG_UNAVAILABLE", 0.25))
        self.assertTrue(gone.freed, "the background retry owns the Free now")
        self.assertEqual(self.r.pending_ends, 1)
        await gone.free(timeout=0.5)  # nothing more to do
        self.assertEqual(self.r.pending_ends, 1)
        with self.assertRaises(grpc.RpcError) as cm:
            await self.r.existing("prefilled-elsewhere").prefill_complete(timeout=0.3)
        self.assertIn(cm.exception.code(), LATE)
        self.assertEqual(self.r.pending_ends, 2)
        await held.free(timeout=5)  # held by this replica: freed at once
        self.assertEqual((self.r.pending_ends, self.active()), (2, 0))
        # A booking made on this replica after its Free was sent is freed by the retried Free.
        late = self.r.existing("routed-later")
        with self.assertRaises(grpc.RpcError):
            await late.free(timeout=0.3)
        self.assertEqual(self.r.pending_ends, 3)
        self.server.router.Route(pb.router.RouteRequest(request_id="routed-later", model="demo", token_ids=[1, 2, 3]), timeout=5)
        self.assertEqual(self.active(), 1)
        self.assertTrue(await until(lambda: self.r.pending_ends == 2 and self.active() == 0),
                        f"the retried Free did not free the booking made after it: {self.r.pending_ends} pending, {self.active()} active")
        # Closing a Router gives up what it retries.
        other = aio.Router(self.server.addr)
        with self.assertRaises(grpc.RpcError):
            await other.existing("closed-while-retried").free(timeout=0.3)
        self.assertEqual(other.pending_ends, 1)
        self.assertEqual(await other.close(), 1)
        self.assertEqual(other.pending_ends, 0)
        # Without background retries the Free is only raised, and a later call tries again.
        once = aio.Router(self.server.addr, end_retry_for=0)
        self.addAsyncCleanup(once.close)
        b = once.existing("not-retried")
        with self.assertRaises(grpc.RpcError):
            await b.free(timeout=0.3)
        self.assertEqual((once.pending_ends, b.freed), (0, False))
        self.redis.resume()
        self.assertTrue(await until(lambda: self.r.pending_ends == 0), f"{self.r.pending_ends} ends still pending after Redis came back")
        self.assertEqual(self.state().bookings, 0)

    async def test_a_route_that_failed_or_was_cancelled_in_flight_is_freed_with_retries(self) -> None:
        await self.r.route(list(range(1, 21)), "demo")  # 20 prefill tokens: the worker is overloaded
        await self.pause_redis()
        # The Route waits in the router's queue until its deadline: the client frees it, and the
        # replica cannot tell whether anyone holds it (UNAVAILABLE): the Free goes on retrying.
        with self.assertRaises(grpc.RpcError) as cm:
            await self.r.route(list(range(1, 21)), "demo", "cut-short", timeout=0.3)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertEqual(self.r.pending_ends, 1)
        # A caller cancelled while its Route waits in the queue: freed the same way.
        counter = CountCalls("Route")
        router = aio.Router(grpc.aio.insecure_channel(self.server.addr, interceptors=[counter.aio()]))
        self.addAsyncCleanup(router.channel.close)
        self.addAsyncCleanup(router.close)
        task = asyncio.create_task(awaited(router.route(list(range(1, 21)), "demo", "cancelled", timeout=30)))
        self.assertTrue(await until(lambda: counter.calls == 1), "the Route was not sent")
        task.cancel()
        with self.assertRaises(asyncio.CancelledError):
            await task
        self.assertEqual(router.pending_ends, 1)
        self.redis.resume()
        self.assertTrue(await until(lambda: self.r.pending_ends == 0 and router.pending_ends == 0),
                        "the Frees of the failed Routes were not retried until the router answered")
        self.assertEqual(self.state().bookings, 1)  # the first route's only


class RouteRetryTest(SharedStateTest):
    reseed_window = "8s"

    async def test_route_is_retried_while_the_shared_state_may_be_incomplete(self) -> None:
        self.assertFalse(self.state().shared_state_complete)
        with self.assertRaises(grpc.RpcError) as cm:
            self.server.router.Route(pb.router.RouteRequest(request_id="r0", model="demo", token_ids=[1, 2, 3]), timeout=5)
        self.assertEqual((cm.exception.code(), error_reason(cm.exception)), (grpc.StatusCode.UNAVAILABLE, "LOG_UNAVAILABLE"))
        counter = CountCalls("Route")
        router = aio.Router(grpc.aio.insecure_channel(self.server.addr, interceptors=[counter.aio()]))
        self.addAsyncCleanup(router.channel.close)
        self.addAsyncCleanup(router.close)
        task = asyncio.create_task(awaited(router.route([1, 2, 3, 4, 5], "demo", timeout=6)))
        self.assertTrue(await until(lambda: counter.calls >= 2), "the Route was not sent again")
        await self.register(41)
        b = await asyncio.wait_for(task, 10)
        self.assertEqual(b.decode.worker_id, 41)
        self.assertFalse(self.state().shared_state_complete, "the reseed window ended before the Route was answered: the test tested nothing")
        await b.free()


class TwoReplicasTest(unittest.IsolatedAsyncioTestCase):
    """Two `kvrouter serve` replicas sharing one private Redis."""

    def setUp(self) -> None:
        self.redis = Redis()
        self.addCleanup(self.redis.stop)
        flags = ("--redis-addr", self.redis.addr, "--redis-reseed-window", "1s")
        self.a = Server(*flags, "--replica-id", "a")
        self.addCleanup(self.a.stop)
        self.b = Server(*flags, "--replica-id", "b")
        self.addCleanup(self.b.stop)

    async def asyncSetUp(self) -> None:
        for s in (self.a, self.b):
            self.assertTrue(await until(lambda: s.admin.GetState(pb.admin.GetStateRequest(), timeout=5).shared_state_complete),
                            "a replica's shared state never became complete")

    async def test_the_publisher_resumes_on_the_other_replica_when_its_replica_is_killed(self) -> None:
        dumps: List[int] = []
        p = aio.Publisher(hello(60), [self.a.addr, self.b.addr], dump=lambda: dumps.append(1) or [], max_batch_events=16, backoff_initial=0.02)
        self.addAsyncCleanup(p.close, 2)
        for i in range(300):
            await p.publish(events.stored([block(i)]))
        await p.flush(10)
        self.assertTrue(self.a.worker_status(60).connected, "the stream is on replica a")
        self.a.stop()  # SIGKILL: the stream breaks with events in flight
        for i in range(300, 600):
            await p.publish(events.stored([block(i)]))
        await p.flush(20)
        self.assertGreaterEqual(p.stats.failures, 1)
        self.assertEqual(p.stats.streams, 2)
        w = self.b.worker_status(60)
        self.assertEqual((w.last_event_id, w.cached_blocks.device, w.awaiting_resync, w.connected), (599, 600, False, True))
        self.assertEqual((p.stats.dumps, dumps), (0, []), "the resume needed a dump: an event was lost or repeated")
        async with aio.Router(self.b.addr) as router:
            async with router.route(block(599)[1] + [1], "demo") as booking:
                self.assertEqual((booking.decode.worker_id, booking.response.diagnostics.decode.overlap_blocks.device), (60, 1))

    async def test_a_booking_is_freed_on_the_other_replica_once_it_can_tell(self) -> None:
        p = aio.Publisher(hello(61), self.b.addr)
        self.addAsyncCleanup(p.close, 2)
        await p.publish(events.stored([block(0)]))
        await p.flush(5)

        def bookings(s: Server) -> int:
            return s.admin.GetState(pb.admin.GetStateRequest(), timeout=5).bookings

        router_a = aio.Router(self.a.addr)
        self.addAsyncCleanup(router_a.close)
        counter = CountCalls("Free")
        router_b = aio.Router(grpc.aio.insecure_channel(self.b.addr, interceptors=[counter.aio()]), timeout=20)
        self.addAsyncCleanup(router_b.channel.close)
        self.addAsyncCleanup(router_b.close)
        self.assertTrue(await until(lambda: self.a.worker_status(61) is not None), "replica a does not see the worker")
        booking = await router_a.route(block(0)[1] + [1], "demo")
        self.assertEqual(booking.decode.worker_id, 61)
        # Replica b ends the booking replica a made.
        await router_b.existing(booking.request_id).free()
        self.assertTrue(await until(lambda: bookings(self.a) == 0 and bookings(self.b) == 0), "the booking was not freed everywhere")
        # With replica a paused, b cannot tell whether a holds a booking it has not published yet:
        # it answers UNAVAILABLE, and the Free is sent again after the delay it suggests, until a is
        # back and b can say that nobody holds it.
        self.a.proc.send_signal(signal.SIGSTOP)
        self.addCleanup(self.a.proc.send_signal, signal.SIGCONT)
        with self.assertRaises(grpc.RpcError) as cm:
            self.b.router.Free(pb.router.FreeRequest(request_id="held-by-a?"), timeout=10)
        self.assertEqual((cm.exception.code(), error_reason(cm.exception)), (grpc.StatusCode.UNAVAILABLE, "LOG_UNAVAILABLE"))
        suggested: Optional[float] = retry_delay(cm.exception)
        self.assertIsNotNone(suggested)
        before = counter.calls
        free = asyncio.create_task(router_b.existing("held-by-a?").free())
        self.assertTrue(await until(lambda: counter.calls >= before + 2, timeout=15), "the Free was not sent again")
        self.a.proc.send_signal(signal.SIGCONT)
        await asyncio.wait_for(free, 20)
        times = counter.times[before:]
        self.assertTrue(all(t1 - t0 >= suggested / 2 - 0.01 for t0, t1 in zip(times, times[1:])),
                        f"a retry came sooner than half the router's RetryInfo delay ({suggested} s): {times}")
        self.assertEqual(router_b.pending_ends, 0)


if __name__ == "__main__":
    unittest.main()
