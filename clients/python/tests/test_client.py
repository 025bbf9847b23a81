"""Tests of kvrouter_client against real `kvrouter serve` processes (embedded mode)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import unittest
from unittest import mock
from typing import Dict, List, Tuple

import grpc

from kvrouter_client import (
    Booking,
    Publisher,
    PublisherClosedError,
    PublisherError,
    Router,
    UnackedWindowFullError,
    ValidationError,
    WorkerSupersededError,
    blockhash,
    error_reason,
    events,
    hash_prompt,
    pb,
    retry_delay,
)
from common import BS, LATE, BlackHoleSecondStream, CorruptFirstBatch, CountCalls, DropEvent, SharedStateSetup, block, hello
from kvserver import CLIENT_ROOT, Server, free_port, wait_until

# The publisher logs every reconnect; KVROUTER_TEST_LOG=INFO shows it.
logging.basicConfig(level=os.environ.get("KVROUTER_TEST_LOG", "CRITICAL"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class ServerTest(unittest.TestCase):
    """A test with its own kvrouter process on a free port."""

    flags: Tuple[str, ...] = ()

    def setUp(self) -> None:
        self.server = Server(*self.flags)
        self.addCleanup(self.server.stop)

    def publisher(self, *args, **kwargs) -> Publisher:
        """Returns a publisher that is closed (without waiting long) when the test ends."""
        p = Publisher(*args, **kwargs)

        def close() -> None:
            try:
                p.close(timeout=2)
            except Exception:  # noqa: BLE001 - the test checked what it wanted already
                pass

        self.addCleanup(close)
        return p


class ExamplesTest(ServerTest):
    def run_example(self, name: str, *args: str) -> str:
        # From the source tree, as a checkout runs them; test_installed.py runs them installed.
        out = subprocess.run(
            [sys.executable, os.path.join(CLIENT_ROOT, "examples", name), "--addr", self.server.addr, *args],
            capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=CLIENT_ROOT),
        )
        self.assertEqual(out.returncode, 0, f"{name} failed:\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def test_worker_publishes_frontend_routes_to_it_and_frees(self) -> None:
        out = self.run_example("worker.py", "--worker-id", "3", "--endpoint", "10.0.0.3:8000")
        self.assertIn("worker 3: published 8 blocks", out)
        w = self.server.worker_status(3)
        self.assertIsNotNone(w)
        self.assertEqual(w.cached_blocks.device, 8)
        self.assertEqual(w.load.kv_used_blocks, 8)
        # A second worker with a shorter prefix of the same prompt must lose the route.
        with self.publisher(hello(4), self.server.addr) as p:
            p.publish(events.stored([(900 + i, list(range(i * BS + 1, (i + 1) * BS + 1))) for i in range(2)]))
            p.flush(5)
        out = self.run_example("frontend.py", "--tokens", "34", "--request-id", "req-e2e")
        self.assertIn("request req-e2e: worker 3 rank 0 at 10.0.0.3:8000 (ROUTE_MODE_AGGREGATED, 8 cached blocks)", out)
        self.assertIn("request req-e2e: freed", out)
        for w in self.server.workers():
            self.assertEqual(w.load.active_requests, 0, f"worker {w.worker.worker_id} still has a booking")
            self.assertEqual(w.load.active_blocks, 0)
        self.assertEqual(self.server.admin.GetState(pb.admin.GetStateRequest()).bookings, 0)


class PublisherResumeTest(ServerTest):
    def interrupt_and_wait(self, p: Publisher) -> None:
        """Breaks the publisher's stream and waits until it registered again."""
        before = p.stats.streams
        p.interrupt()
        self.assertTrue(wait_until(lambda: p.stats.streams > before), "the publisher did not reconnect")

    def test_every_event_applied_once_across_interrupted_streams(self) -> None:
        dumps: List[int] = []
        p = self.publisher(hello(5), self.server.addr, dump=lambda: dumps.append(1) or [], max_batch_events=16)
        n = 1500
        for i in range(n):
            p.publish(events.stored([block(i)]))
            if i % 100 == 50:
                self.interrupt_and_wait(p)  # the stream fails with events sent and not yet acked
        p.flush(20)
        self.assertGreaterEqual(p.stats.streams, 10)
        self.assertEqual(p.last_acked, n - 1)
        w = self.server.worker_status(5)
        self.assertEqual(w.last_event_id, n - 1)
        self.assertEqual(w.cached_blocks.device, n)
        self.assertFalse(w.awaiting_resync)
        self.assertEqual(dumps, [], "a resync means an event was lost or repeated out of order")
        log = self.server.log_text()
        self.assertNotIn("gap", log)
        # Evict every other block; the removals must apply once too.
        for i in range(0, n, 2):
            p.publish(events.removed([block(i)[0]]))
            if i % 300 == 0:
                self.interrupt_and_wait(p)
        p.close(20)
        w = self.server.worker_status(5)
        self.assertEqual(w.last_event_id, n + n // 2 - 1)
        self.assertEqual(w.cached_blocks.device, n // 2)
        self.assertEqual(dumps, [])

    def test_reconnect_replays_what_a_dead_stream_lost(self) -> None:
        # Events sent on a stream whose connection black-holes them: the router registered the
        # stream and never read them. After the reconnect Registered says the router holds none of
        # them, so all are replayed, with no resync.
        hole = BlackHoleSecondStream()
        channel = grpc.intercept_channel(grpc.insecure_channel(self.server.addr), hole.sync())
        self.addCleanup(channel.close)
        dumps: List[int] = []
        p = self.publisher(hello(6), channel, dump=lambda: dumps.append(1) or [])
        p.publish(events.stored([block(0)]))
        p.flush(5)
        self.interrupt_and_wait(p)  # the second stream: registered, then nothing reaches the router
        self.assertEqual(hole.streams, 2)
        for i in range(1, 40):
            p.publish(events.stored([block(i)]))
        self.assertTrue(wait_until(lambda: hole.ids(swallowed=True) == list(range(1, 40))), f"sent into the black hole: {hole.ids(swallowed=True)}")
        self.assertEqual(p.unacked, 39)
        self.assertEqual(self.server.worker_status(6).last_event_id, 0)
        self.interrupt_and_wait(p)  # the third stream replays them
        p.flush(10)
        self.assertEqual(hole.ids(stream=3), list(range(1, 40)))
        w = self.server.worker_status(6)
        self.assertEqual(w.last_event_id, 39)
        self.assertEqual(w.cached_blocks.device, 40)
        self.assertFalse(w.awaiting_resync)
        self.assertEqual(p.stats.streams, 3)
        self.assertEqual(hole.streams, 3)
        self.assertEqual(p.stats.resync_requests, 0)
        self.assertEqual(p.stats.dumps, 0)
        self.assertEqual(dumps, [])

    def test_first_registration_without_fresh_start_continues_the_numbering(self) -> None:
        with Publisher(hello(16), self.server.addr) as p:
            p.publish([events.stored([block(i)]) for i in range(5)])
        with Publisher(hello(16, fresh_start=False), self.server.addr) as p:
            # Before the first registration the ids are provisional: Registered renumbers them.
            p.publish([events.stored([block(i)]) for i in range(5, 8)])
            p.flush(5)
            self.assertEqual(p.last_acked, 7)
        w = self.server.worker_status(16)
        self.assertEqual(w.last_event_id, 7)
        self.assertEqual(w.cached_blocks.device, 8)

    def test_a_restarted_router_that_lost_everything_gets_a_dump(self) -> None:
        # Embedded mode keeps its state in memory: a restart on the same port forgets the worker.
        cache = [block(i) for i in range(10)]
        dumps: List[int] = []

        def dump() -> List["pb.worker.KvEvent"]:
            dumps.append(len(cache))
            return [events.stored(cache)]

        p = self.publisher(hello(15), self.server.addr, dump=dump, backoff_initial=0.02, backoff_max=0.2)
        p.publish([events.stored([b]) for b in cache])
        p.flush(5)
        port = self.server.port
        self.server.stop()
        self.server = Server(port=port)
        self.addCleanup(self.server.stop)
        self.assertTrue(wait_until(lambda: dumps != [], timeout=10), "no dump after the restart")
        cache.append(block(10))
        p.publish(events.stored([block(10)]))
        p.flush(5)
        w = self.server.worker_status(15)
        self.assertEqual(w.cached_blocks.device, 11)
        self.assertEqual(w.last_event_id, 10)
        self.assertFalse(w.awaiting_resync)

    def test_fails_over_to_the_next_address(self) -> None:
        dead = f"127.0.0.1:{free_port()}"
        p = self.publisher(hello(8), [dead, self.server.addr], backoff_initial=0.01)
        p.publish([events.stored([block(i)]) for i in range(10)])
        p.flush(10)
        self.assertGreaterEqual(p.stats.failures, 1)
        self.assertEqual(self.server.worker_status(8).cached_blocks.device, 10)

    def test_close_flushes_and_waits_for_the_last_ack(self) -> None:
        p = Publisher(hello(9), self.server.addr, max_batch_events=8)
        for i in range(500):
            p.publish(events.stored([block(i)]))
        p.close(10)
        self.assertEqual(p.last_acked, 499)
        self.assertEqual(p.unacked, 0)
        w = self.server.worker_status(9)
        self.assertEqual(w.last_event_id, 499)
        self.assertFalse(w.connected)
        with self.assertRaises(PublisherClosedError):
            p.publish(events.stored([block(0)]))

    def test_a_failing_stream_thread_stops_the_publisher(self) -> None:
        # An unexpected error in the publisher's thread (a bug) must not leave flush() waiting forever.
        p = Publisher(hello(17), self.server.addr, start=False)

        def boom() -> None:
            raise RuntimeError("boom")

        p._run_streams = boom  # type: ignore[method-assign]
        p.publish(events.stored([block(0)]))
        p.start()
        with self.assertRaises(PublisherError) as cm:
            p.flush(5)
        self.assertIn("RuntimeError('boom')", str(cm.exception))
        self.assertIsInstance(cm.exception.cause, RuntimeError)
        with self.assertRaises(PublisherError):
            p.close(1)

    def test_unacked_window_bounds_memory(self) -> None:
        dead = f"127.0.0.1:{free_port()}"  # nothing listens: nothing is ever acked
        p = Publisher(hello(10), dead, max_unacked=10, backoff_initial=0.01, backoff_max=0.05)
        for i in range(10):
            p.publish(events.stored([block(i)]))
        with self.assertRaises(UnackedWindowFullError):
            p.publish(events.stored([block(10)]), block=False)
        t0 = time.monotonic()
        with self.assertRaises(UnackedWindowFullError) as cm:
            p.publish(events.stored([block(10)]), timeout=0.2)
        self.assertGreaterEqual(time.monotonic() - t0, 0.19)
        self.assertIn("max_unacked 10", str(cm.exception))
        with self.assertRaises(TimeoutError):
            p.close(timeout=0.3)

    def test_leaving_the_block_by_an_exception_does_not_wait_for_a_dead_router(self) -> None:
        # close() waits up to 30 s for acks; an exception leaving the block must not: nothing can
        # ack while no stream registers, so it ends the stream at once and the exception goes on.
        dead = f"127.0.0.1:{free_port()}"
        t0 = time.monotonic()
        with self.assertRaises(RuntimeError):
            with Publisher(hello(18), dead, backoff_initial=0.01, backoff_max=0.05) as p:
                p.publish([events.stored([block(i)]) for i in range(5)])
                raise RuntimeError("the engine failed")
        self.assertLess(time.monotonic() - t0, 5, "leaving the block waited for acks a dead router cannot send")
        self.assertEqual(p.unacked, 5, "the events were dropped unacked, not sent")
        with self.assertRaises(PublisherClosedError):
            p.publish(events.stored([block(5)]))
        # Without an exception the block still waits for the acks (at most close()'s timeout).
        with Publisher(hello(19), self.server.addr) as q:
            q.publish([events.stored([block(i)]) for i in range(5)])
        self.assertEqual(self.server.worker_status(19).last_event_id, 4)

    def test_leaving_the_block_by_an_exception_delivers_to_a_live_router(self) -> None:
        with self.assertRaises(RuntimeError):
            # A longer bound than the default 2 s, for a loaded machine: the wait ends with the acks.
            with Publisher(hello(21), self.server.addr, max_batch_events=8, error_close_timeout=20) as p:
                p.publish([events.stored([block(i)]) for i in range(200)])
                raise RuntimeError("the engine failed")
        self.assertEqual(p.unacked, 0, "the router was there to ack what was queued")
        w = self.server.worker_status(21)
        self.assertEqual(w.last_event_id, 199)
        self.assertEqual(w.cached_blocks.device, 200)

    def test_invalid_argument_stops_the_publisher(self) -> None:
        # What the router refuses as malformed is refused again on any stream: no reconnect.
        corrupt = CorruptFirstBatch()
        channel = grpc.intercept_channel(grpc.insecure_channel(self.server.addr), corrupt.sync())
        self.addCleanup(channel.close)
        p = self.publisher(hello(22), channel)
        p.publish(events.stored([block(0)]))
        self.assertTrue(wait_until(lambda: p.error is not None), "the publisher did not stop")
        self.assertIsInstance(p.error, PublisherError)
        self.assertEqual(p.error.cause.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("must hold exactly block_size 4 tokens (got 3)", str(p.error))
        self.assertEqual((corrupt.streams, p.stats.streams, p.stats.failures), (1, 1, 0))
        with self.assertRaises(PublisherError):
            p.flush(1)


class LimitsTest(ServerTest):
    flags = ("--max-batch-blocks", "8")

    def test_too_large_messages_are_split(self) -> None:
        p = self.publisher(hello(11), self.server.addr, max_batch_events=64, flush_interval=0.05)
        p.publish([events.stored([block(i)]) for i in range(100)])
        p.flush(10)
        self.assertIsNone(p.error)
        w = self.server.worker_status(11)
        self.assertEqual(w.last_event_id, 99)
        self.assertEqual(w.cached_blocks.device, 100)


class ResyncTest(ServerTest):
    def test_gap_is_answered_with_a_dump_in_parts(self) -> None:
        cache: List[Tuple[int, List[int]]] = []
        lock = threading.Lock()
        calls: List[int] = []

        def dump() -> List["pb.worker.KvEvent"]:
            with lock:
                calls.append(len(cache))
                return [events.stored([b]) for b in cache]

        drop = DropEvent(3)
        channel = grpc.intercept_channel(grpc.insecure_channel(self.server.addr), drop.sync())
        p = self.publisher(hello(12), channel, dump=dump, max_batch_events=2, max_dump_blocks=3)
        for i in range(10):
            with lock:
                cache.append(block(i))
            p.publish(events.stored([block(i)]))
        p.flush(10)
        self.assertTrue(drop.dropped)
        self.assertTrue(wait_until(lambda: calls != []))
        self.assertGreaterEqual(p.stats.resync_requests, 1)
        self.assertGreaterEqual(p.stats.dump_parts, 2, "a dump of 10 blocks in parts of 3 blocks")
        # Events after the dump continue its numbering.
        for i in range(10, 15):
            with lock:
                cache.append(block(i))
            p.publish(events.stored([block(i)]))
        p.flush(10)
        w = self.server.worker_status(12)
        self.assertFalse(w.awaiting_resync)
        self.assertEqual(w.cached_blocks.device, 15)
        self.assertEqual(w.last_event_id, 14)
        self.assertIn('"msg":"event id gap; dropped the worker\'s blocks and asked for a dump"', self.server.log_text())
        self.assertIn('"expected":3,"got":4', self.server.log_text())

    def test_resync_without_dump_function_stops_the_publisher(self) -> None:
        channel = grpc.intercept_channel(grpc.insecure_channel(self.server.addr), DropEvent(0).sync())
        p = self.publisher(hello(13), channel)
        p.publish([events.stored([block(i)]) for i in range(3)])
        self.assertTrue(wait_until(lambda: p.error is not None))
        self.assertIn("no dump function", str(p.error))


class HashTokensTest(ServerTest):
    N = 8  # blocks of the prompt 1..32

    def setUp(self) -> None:
        super().setUp()
        self.router = Router(self.server.addr)
        self.addCleanup(self.router.close)
        # Worker 31 holds the prompt's first 3 blocks by token ids: it wins unless worker 30's
        # hashed blocks match the router's own hashing of the prompt.
        with self.publisher(hello(31), self.server.addr) as p:
            p.publish(events.stored([block(i) for i in range(3)]))

    def overlap(self, **kwargs) -> Tuple[int, int]:
        """Routes the prompt (query only); returns the chosen worker and its device overlap."""
        b = self.router.route([t for i in range(self.N) for t in block(i)[1]] + [999], "demo", query_only=True, **kwargs)
        return b.decode.worker_id, b.response.diagnostics.decode.overlap_blocks.device

    def test_hashed_blocks_match_the_routers_hashing(self) -> None:
        p = self.publisher(hello(30), self.server.addr, hash_tokens=True)
        chain = [block(i) for i in range(self.N)]
        # Validation comes first, on the token ids; a refused call changes nothing.
        bad = [events.stored(chain[:1]), events.stored([(1, [1, 2, 3])])]
        with self.assertRaises(ValidationError) as cm:
            p.publish(bad)
        self.assertEqual(str(cm.exception), "events.events[1].stored.blocks[0].token_ids: must hold exactly block_size 4 tokens (got 3)")
        self.assertEqual(list(bad[0].stored.blocks[0].token_ids), chain[0][1])
        self.assertFalse(bad[0].stored.blocks[0].HasField("tokens_hash"))
        # One chain in two events, and the same prompt for a LoRA adapter and a tenant.
        evs = [
            events.stored(chain[:4]),
            events.stored(chain[4:], parent_hash=chain[3][0]),
            events.stored([(20_000 + i, toks) for i, (_, toks) in enumerate(chain)], lora_name="adapter-x", cache_namespace="tenant-1"),
        ]
        p.publish(evs)
        p.flush(5)
        salted = blockhash.salt("adapter-x", "tenant-1")
        for ev, s, blocks in ((evs[0], blockhash.SEED, chain[:4]), (evs[1], blockhash.SEED, chain[4:]), (evs[2], salted, chain)):
            self.assertEqual([b.tokens_hash for b in ev.stored.blocks], [blockhash.local(toks, s) for _, toks in blocks])
            self.assertTrue(all(len(b.token_ids) == 0 for b in ev.stored.blocks), "hashed blocks are sent without their token ids")
        self.assertEqual(self.server.worker_status(30).cached_blocks.device, 2 * self.N)
        self.assertEqual(self.overlap(), (30, self.N))
        self.assertEqual(self.overlap(lora_name="adapter-x", cache_namespace="tenant-1"), (30, self.N))
        # Another salt matches nothing: neither worker holds the prompt for adapter-x alone.
        self.assertEqual(self.overlap(lora_name="adapter-x")[1], 0)

    def test_multimodal_blocks_match_only_routes_with_the_same_inputs(self) -> None:
        # The prompt's blocks 2..4 hold an image (tokens 10..19 of the 32), a hash named by its
        # identifier. Worker 32 sends them as token ids and mm_hashes, worker 33 as tokens_hash.
        image = blockhash.multimodal_hash("cat.png")
        objects = [(image, 10, 20)]
        prompt = [t for i in range(self.N) for t in block(i)[1]]
        chain = [(40_000 + i, block(i)[1], [image] if 2 <= i <= 4 else []) for i in range(self.N)]
        with self.publisher(hello(32, model="mm"), self.server.addr) as p:
            p.publish(events.stored(chain))
        q = self.publisher(hello(33, model="mm"), self.server.addr, hash_tokens=True)
        ev = events.stored([(50_000 + i, toks, mm) for i, (_, toks, mm) in enumerate(chain)])
        q.publish(ev)
        q.flush(5)
        want = blockhash.local_hashes(prompt, BS, blockhash.SEED, objects)
        self.assertEqual([b.tokens_hash for b in ev.stored.blocks], want)
        self.assertTrue(all(len(b.mm_hashes) == 0 for b in ev.stored.blocks), "mm_hashes are folded into tokens_hash")
        self.assertNotEqual(want[2:5], blockhash.local_hashes(prompt, BS)[2:5])

        def overlap(**kwargs) -> Dict[int, int]:
            out = {}
            for allowed in (32, 33):
                b = self.router.route(prompt + [999], "mm", query_only=True, hints=pb.router.RoutingHints(allowed_worker_ids=[allowed]), **kwargs)
                out[b.decode.worker_id] = b.response.diagnostics.decode.overlap_blocks.device
            return out

        self.assertEqual(overlap(multimodal_objects=objects), {32: self.N, 33: self.N})
        # Without the image, or with another one behind the same tokens, only the blocks before it match.
        self.assertEqual(overlap(), {32: 2, 33: 2})
        self.assertEqual(overlap(multimodal_objects=[(blockhash.multimodal_hash("dog.png"), 10, 20)]), {32: 2, 33: 2})

    def test_dumped_blocks_are_hashed_too(self) -> None:
        cache = [block(i) for i in range(self.N)]
        dumped: List["pb.worker.KvEvent"] = []

        def dump() -> List["pb.worker.KvEvent"]:
            dumped[:] = [events.stored(cache[:4]), events.stored(cache[4:], parent_hash=cache[3][0])]
            return list(dumped)

        drop = DropEvent(2)  # the router sees a gap and asks for a dump
        channel = grpc.intercept_channel(grpc.insecure_channel(self.server.addr), drop.sync())
        self.addCleanup(channel.close)
        p = self.publisher(hello(30), channel, dump=dump, hash_tokens=True, max_batch_events=1)
        p.publish([events.stored([b]) for b in cache])
        self.assertTrue(wait_until(lambda: p.stats.dumps == 1 and p.unacked == 0), "no dump after the gap")
        p.flush(5)
        self.assertTrue(all(b.HasField("tokens_hash") and len(b.token_ids) == 0 for ev in dumped for b in ev.stored.blocks))
        # The ack of the dump's last part can reach the publisher before the router's status shows
        # the dump applied on a busy machine: wait for the effect checked.
        self.assertTrue(wait_until(lambda: not self.server.worker_status(30).awaiting_resync), "the worker still awaits a resync")
        w = self.server.worker_status(30)
        self.assertEqual(w.cached_blocks.device, self.N)
        self.assertEqual(self.overlap(), (30, self.N))


class HashPromptTest(ServerTest):
    """One prompt with a LoRA adapter, a cache namespace and an image, routed as token ids and as
    the block hashes of hash_prompt() / route(..., hash_prompt=BS), as the Go client's TestHashPrompt."""

    flags = ("--max-prompt-tokens", "64")
    PROMPT = list(range(1, 19))  # four blocks of 4, and two tokens more
    IMAGE = blockhash.multimodal_hash("cat.png")
    ARGS = dict(lora_name="l", cache_namespace="tenant", multimodal_objects=[(IMAGE, 5, 9)])  # the image: blocks 1 and 2

    def setUp(self) -> None:
        super().setUp()
        self.calls = CountCalls()
        channel = grpc.intercept_channel(grpc.insecure_channel(self.server.addr), self.calls.sync())
        self.addCleanup(channel.close)
        self.router = Router(channel, max_prompt_tokens=64)
        self.addCleanup(self.router.close)
        # Worker 61 caches the prompt's blocks as its engine reports them: token ids, salted with the
        # adapter and the namespace, with the image's hash. Worker 60 caches the same tokens without
        # them: it would win if the hashes missed the salt or the image.
        toks = [self.PROMPT[i * BS : (i + 1) * BS] for i in range(4)]
        with self.publisher(hello(60, model="hp"), self.server.addr) as p:
            p.publish(events.stored([(800 + i, t) for i, t in enumerate(toks)]))
        with self.publisher(hello(61, model="hp"), self.server.addr) as p:
            p.publish(events.stored([(700 + i, t, [self.IMAGE] if i in (1, 2) else []) for i, t in enumerate(toks)], lora_name="l", cache_namespace="tenant"))

    def request(self, **change) -> "pb.router.RouteRequest":
        """Returns the prompt's token-id RouteRequest (query only), with fields changed."""
        args = dict(self.ARGS, **change)
        return pb.router.RouteRequest(
            request_id="r-hp", model="hp", query_only=True, token_ids=args.get("token_ids", self.PROMPT),
            lora_name=args["lora_name"], cache_namespace=args["cache_namespace"],
            multimodal_objects=[pb.router.MultimodalObject(mm_hash=h, start=a, end=b) for h, a, b in args["multimodal_objects"]],
        )

    def server_error(self, req: "pb.router.RouteRequest") -> grpc.RpcError:
        try:
            self.server.router.Route(req, timeout=5)
        except grpc.RpcError as err:
            self.assertEqual(err.code(), grpc.StatusCode.INVALID_ARGUMENT)
            return err
        self.fail(f"the router accepted {req}")

    @staticmethod
    def decision(b: Booking) -> Tuple[int, int, List[Tuple[int, str, int]]]:
        """The decode worker, its device overlap, and every candidate's (explain)."""
        d = b.response.diagnostics
        return b.decode.worker_id, d.decode.overlap_blocks.device, sorted((c.worker.worker_id, c.hop, c.overlap_blocks.device) for c in d.candidates)

    def test_hashes_route_as_the_token_ids(self) -> None:
        by_ids = self.router.route(self.PROMPT, "hp", query_only=True, explain=True, **self.ARGS)
        want = self.decision(by_ids)
        self.assertEqual(want[:2], (61, 4))
        self.assertEqual({w: o for w, _, o in want[2]}, {60: 0, 61: 4})
        hashed = self.router.route(self.PROMPT, "hp", query_only=True, explain=True, hash_prompt=BS, **self.ARGS)
        self.assertEqual(self.decision(hashed), want)
        d = hashed.response.diagnostics
        self.assertEqual((d.prompt_tokens, d.prompt_blocks, d.block_size), (18, 4, 4))
        # On the wire: the hashes, the block size and the length, nothing else of the prompt.
        sent = self.calls.requests[-1]
        keys = blockhash.local_hashes(self.PROMPT, BS, blockhash.salt("l", "tenant"), [(self.IMAGE, 5, 9)])
        self.assertEqual(list(sent.block_hashes), keys)
        self.assertEqual((sent.block_size, sent.prompt_tokens, len(sent.token_ids), sent.lora_name, sent.cache_namespace, len(sent.multimodal_objects)), (4, 18, 0, "", "", 0))
        # hash_prompt() on a RouteRequest, booked through route_request().
        req = self.request()
        req.query_only = False
        hash_prompt(req, BS)
        self.assertEqual(req, pb.router.RouteRequest(request_id="r-hp", model="hp", block_hashes=keys, block_size=4, prompt_tokens=18))
        with self.router.route_request(req) as b:
            self.assertEqual(b.decode.worker_id, 61)
            self.assertEqual(b.response.diagnostics.decode.overlap_blocks.device, 4)
            self.assertEqual(self.server.worker_status(61).load.active_requests, 1)
        self.assertEqual(self.server.worker_status(61).load.active_requests, 0)
        # The caller's own keys, for a prompt of one block more than the cached ones: 4 of 5 match.
        longer = self.PROMPT[:16] + [90, 91, 92, 93, 94]
        own = blockhash.local_hashes(longer, BS, blockhash.salt("l", "tenant"), [(self.IMAGE, 5, 9)])
        b = self.router.route_request(pb.router.RouteRequest(model="hp", query_only=True, block_hashes=own, block_size=4, prompt_tokens=21))
        self.assertEqual((b.decode.worker_id, b.response.diagnostics.decode.overlap_blocks.device, b.response.diagnostics.prompt_blocks), (61, 4, 5))

    def test_a_prompt_hashed_for_another_block_size_is_refused(self) -> None:
        for query_only in (True, False):
            with self.assertRaises(grpc.RpcError) as cm:
                self.router.route(self.PROMPT, "hp", query_only=query_only, hash_prompt=8, **self.ARGS)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertEqual(error_reason(cm.exception), "BLOCK_SIZE_MISMATCH")
            self.assertIn('block_size 8, but model "hp" has blocks of 4 tokens', cm.exception.details())
        self.assertEqual(self.calls.requests[-1].block_size, 8)
        self.assertEqual(self.server.admin.GetState(pb.admin.GetStateRequest(), timeout=5).bookings, 0)

    def test_refusals_are_the_routers(self) -> None:
        # What the router refuses in the token ids, hash_prompt() and route(..., hash_prompt=) refuse
        # with its words, changing nothing.
        img = self.IMAGE
        cases = [
            (dict(token_ids=[], multimodal_objects=[]), "token_ids: must not be empty"),
            (dict(multimodal_objects=[(img, 5, 19)]), "multimodal_objects[0].end: must be at most the number of token_ids 18 (got 19)"),
            (dict(multimodal_objects=[(img, 5, 5)]), "multimodal_objects[0].end: must be greater than start 5 (got 5)"),
            (dict(multimodal_objects=[(img, 5, 9), (1, 2, 6)]), "multimodal_objects[0]: tokens [5, 9) overlap those of multimodal_objects[1], [2, 6)"),
            (dict(multimodal_objects=[(i, i % 18, i % 18 + 1) for i in range(257)]), "multimodal_objects: must hold at most 256 inputs (got 257)"),
        ]
        for change, want in cases:
            with self.subTest(want):
                req = self.request(**change)
                before = pb.router.RouteRequest()
                before.CopyFrom(req)
                self.assertEqual(self.server_error(req).details(), want)
                with self.assertRaises(ValidationError) as cm:
                    hash_prompt(req, BS)
                self.assertEqual(str(cm.exception), want)
                self.assertEqual(req, before, "a refused hash_prompt() changed the request")
                args = dict(self.ARGS, **change)
                with self.assertRaises(ValidationError) as cm:
                    self.router.route(args.get("token_ids", self.PROMPT), "hp", "r-hp", query_only=True, hash_prompt=BS,
                                      lora_name=args["lora_name"], cache_namespace=args["cache_namespace"], multimodal_objects=args["multimodal_objects"])
                self.assertEqual(str(cm.exception), want)
        # More tokens than max_prompt_tokens: route() checks the token ids, as the router does; a
        # request hashed by hash_prompt() is checked by its prompt_tokens, as the router checks it.
        long = self.request(token_ids=list(range(1, 66)), multimodal_objects=[])
        want = self.server_error(long).details()
        self.assertEqual(want, "token_ids: has 65 tokens, more than the maximum of 64 (max_prompt_tokens)")
        with self.assertRaises(ValidationError) as cm:
            self.router.route(list(range(1, 66)), "hp", query_only=True, hash_prompt=BS, lora_name="l")
        self.assertEqual(str(cm.exception), want)
        hash_prompt(long, BS)
        with self.assertRaises(ValidationError) as cm:
            self.router.route_request(long)
        self.assertEqual(str(cm.exception), self.server_error(long).details())
        self.assertEqual(str(cm.exception), "prompt_tokens: is 65, more than the maximum of 64 (max_prompt_tokens)")
        for bad in (0, -1, 1 << 32):
            with self.assertRaises(ValidationError) as cm:
                hash_prompt(self.request(), bad)
            self.assertEqual(cm.exception.field, "block_size")
        self.assertEqual(str(cm.exception), "block_size: must be a uint32 (got 4294967296)")
        self.assertEqual(self.calls.calls, 0, "nothing refused was sent")

    def test_hashed_requests_are_checked_as_the_router_checks_them(self) -> None:
        ok = dict(request_id="r-h", model="hp", query_only=True, block_hashes=[1, 2, 3, 4], block_size=4, prompt_tokens=18)
        cases = [
            (dict(token_ids=[1]), "token_ids: must be empty with block_size and block_hashes (fold it into the hashes)"),
            (dict(lora_name="l"), "lora_name: must be empty with block_size and block_hashes (fold it into the hashes)"),
            (dict(cache_namespace="tenant"), "cache_namespace: must be empty with block_size and block_hashes (fold it into the hashes)"),
            (dict(multimodal_objects=[pb.router.MultimodalObject(mm_hash=1, start=0, end=1)]),
             "multimodal_objects: must be empty with block_size and block_hashes (fold it into the hashes)"),
            (dict(prompt_tokens=0), "prompt_tokens: must be at least 1 with block_hashes"),
            (dict(prompt_tokens=15), "prompt_tokens: must be in [16, 20): 4 block_hashes of block_size 4 and a partial block (got 15)"),
            (dict(prompt_tokens=20), "prompt_tokens: must be in [16, 20): 4 block_hashes of block_size 4 and a partial block (got 20)"),
            (dict(block_hashes=[], prompt_tokens=4), "prompt_tokens: must be in [0, 4): 0 block_hashes of block_size 4 and a partial block (got 4)"),
            (dict(block_hashes=[7] * 16, prompt_tokens=65), "prompt_tokens: is 65, more than the maximum of 64 (max_prompt_tokens)"),
            (dict(block_size=0, token_ids=[1, 2, 3]), "block_size: must be set with block_hashes (the block size they were hashed with)"),
            (dict(block_size=0, block_hashes=[], token_ids=[1, 2, 3]), "prompt_tokens: must be set only with block_size and block_hashes (token_ids count themselves)"),
        ]
        for change, want in cases:
            with self.subTest(want):
                req = pb.router.RouteRequest(**dict(ok, **change))
                self.assertEqual(self.server_error(req).details(), want)
                with self.assertRaises(ValidationError) as cm:
                    self.router.route_request(req)
                self.assertEqual(str(cm.exception), want)
        self.assertEqual(self.calls.calls, 0, "nothing refused was sent")
        # The boundaries are accepted (made-up hashes match nothing).
        for change in (dict(), dict(prompt_tokens=16), dict(prompt_tokens=19), dict(block_hashes=[], prompt_tokens=3)):
            b = self.router.route_request(pb.router.RouteRequest(**dict(ok, **change)))
            self.assertEqual(b.response.diagnostics.decode.overlap_blocks.device, 0)
        self.assertEqual(self.calls.calls, 4)


class SupersededTest(ServerTest):
    def test_a_second_publisher_for_the_same_worker_stops_the_first(self) -> None:
        a = self.publisher(hello(7), self.server.addr)
        a.publish(events.stored([block(0)]))
        a.flush(5)
        b = self.publisher(hello(7), self.server.addr)
        b.publish(events.stored([block(1)]))
        b.flush(5)
        self.assertTrue(wait_until(lambda: a.error is not None))
        self.assertIsInstance(a.error, WorkerSupersededError)
        self.assertEqual(error_reason(a.error.cause), "WORKER_SUPERSEDED")
        self.assertEqual(a.error.cause.code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assertEqual(a.stats.streams, 1, "a superseded publisher must not reconnect")
        with self.assertRaises(WorkerSupersededError):
            a.publish(events.stored([block(2)]))
        with self.assertRaises(WorkerSupersededError):
            a.close(2)
        b.publish(events.stored([block(2)]))
        b.flush(5)
        self.assertIsNone(b.error)
        self.assertTrue(self.server.worker_status(7).connected)


class LeaveTest(ServerTest):
    def published(self, worker_id: int, **kwargs) -> Publisher:
        """Returns a publisher of worker_id (model "leaving") whose 3 blocks the router holds."""
        p = self.publisher(hello(worker_id, model="leaving"), self.server.addr, **kwargs)
        p.publish([events.stored([block(i)]) for i in range(3)])
        p.flush(5)
        self.assertEqual(self.server.worker_status(worker_id).cached_blocks.device, 3)
        return p

    def assert_gone(self, worker_id: int) -> None:
        self.assertIsNone(self.server.worker_status(worker_id), "the router still lists the worker after its leave")
        with Router(self.server.addr) as router, self.assertRaises(grpc.RpcError) as cm:
            router.route(block(0)[1], "leaving", query_only=True)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND, "no worker serves the model any more")

    def test_leave_removes_the_worker_at_once_and_closes_the_publisher(self) -> None:
        p = self.published(50)
        p.leave("engine down", timeout=5)
        self.assert_gone(50)
        self.assertIn('"msg":"worker left: removed with its blocks"', self.server.log_text())
        self.assertIn('"reason":"engine down"', self.server.log_text())
        with self.assertRaises(PublisherClosedError):
            p.publish(events.stored([block(3)]))
        with self.assertRaises(PublisherClosedError):
            p.leave("again")
        p.close(1)  # harmless after a leave

    def test_leave_drops_unacked_events_and_reconnects_to_send_it(self) -> None:
        p = self.published(51, backoff_initial=0.02, backoff_max=0.2)
        port = self.server.port
        self.server.stop()  # embedded mode: the next router on the port knows nothing of the worker
        p.publish([events.stored([block(i)]) for i in range(3, 6)])
        self.assertTrue(wait_until(lambda: p.stats.failures >= 1), "the stream did not fail with its router gone")
        errors: List[BaseException] = []
        done = threading.Event()

        def leave() -> None:
            try:
                p.leave("engine down", timeout=10)
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)
            done.set()

        t = threading.Thread(target=leave)
        t.start()
        self.addCleanup(t.join, 10)
        self.assertTrue(wait_until(lambda: p.unacked == 0, timeout=2), "leave() kept the unacked events")
        self.assertFalse(done.wait(0.3), "leave() returned without a router to confirm it")
        self.server = Server(port=port)
        self.addCleanup(self.server.stop)
        self.assertTrue(done.wait(10), "leave() did not return after the router came back")
        self.assertEqual(errors, [])
        self.assertEqual(p.stats.streams, 2, "the leave went on a new stream")
        self.assertIn('"msg":"worker left: removed with its blocks"', self.server.log_text())
        self.assert_gone(51)

    def test_leave_without_a_router_times_out_and_closes(self) -> None:
        p = Publisher(hello(52), f"127.0.0.1:{free_port()}", backoff_initial=0.01, backoff_max=0.05)  # nothing listens
        p.publish(events.stored([block(0)]))
        t0 = time.monotonic()
        with self.assertRaises(TimeoutError) as cm:
            p.leave("engine down", timeout=0.3)
        self.assertLess(time.monotonic() - t0, 3)
        self.assertIn("did not confirm the leave", str(cm.exception))
        self.assertEqual(p.unacked, 0)
        with self.assertRaises(PublisherClosedError):
            p.publish(events.stored([block(1)]))


class ValidationTest(ServerTest):
    flags = ("--max-prompt-tokens", "8")

    def server_error(self, call) -> grpc.RpcError:  # noqa: ANN001
        try:
            call()
        except grpc.RpcError as err:
            self.assertEqual(err.code(), grpc.StatusCode.INVALID_ARGUMENT)
            return err
        self.fail("the router accepted what the client refuses")

    def test_route_checks_match_the_router(self) -> None:
        dead = Router(f"127.0.0.1:{free_port()}", max_prompt_tokens=8)  # nothing is sent
        live = self.server.router
        cases = [
            dict(token_ids=list(range(1, 10)), model="demo", request_id="r1"),
            dict(token_ids=[], model="demo", request_id="r2"),
            dict(token_ids=[1, 2], model="", request_id="r3"),
            dict(token_ids=[1, 2], model="demo", request_id="x" * 513),
        ]
        for c in cases:
            with self.assertRaises(ValidationError) as cm:
                dead.route(c["token_ids"], c["model"], c["request_id"])
            err = self.server_error(lambda: live.Route(pb.router.RouteRequest(**c), timeout=5))
            self.assertEqual(str(cm.exception), err.details())
        self.assertEqual(str(cm.exception), "request_id: must be at most 512 bytes (got 513)")
        # Multimodal inputs, as (mm_hash, start, end), against a prompt of 8 tokens.
        mm_cases = [
            ([(1, 2, 2)], "multimodal_objects[0].end: must be greater than start 2 (got 2)"),
            ([(1, 0, 2), (2, 6, 9)], "multimodal_objects[1].end: must be at most the number of token_ids 8 (got 9)"),
            ([(1, 0, 4), (2, 2, 6)], "multimodal_objects[1]: tokens [2, 6) overlap those of multimodal_objects[0], [0, 4)"),
            ([(1, 5, 7), (2, 0, 6)], "multimodal_objects[0]: tokens [5, 7) overlap those of multimodal_objects[1], [0, 6)"),
            ([(i, i % 8, i % 8 + 1) for i in range(257)], "multimodal_objects: must hold at most 256 inputs (got 257)"),
        ]
        for objects, want in mm_cases:
            with self.assertRaises(ValidationError) as cm:
                dead.route(list(range(1, 9)), "demo", "r-mm", multimodal_objects=objects)
            self.assertEqual(str(cm.exception), want)
            req = pb.router.RouteRequest(request_id="r-mm", model="demo", token_ids=list(range(1, 9)),
                                         multimodal_objects=[pb.router.MultimodalObject(mm_hash=h, start=a, end=b) for h, a, b in objects])
            err = self.server_error(lambda: live.Route(req, timeout=5))
            self.assertEqual(err.details(), want)
        dead.close()

    def test_leave_reason_is_checked_as_the_router_does(self) -> None:
        reason = "é" * 128 + "x"  # 129 characters, 257 bytes: the limit is in bytes
        want = "leave.reason: must be at most 256 bytes (got 257)"
        p = self.publisher(hello(15), self.server.addr)
        p.publish(events.stored([block(0)]))
        p.flush(5)
        with self.assertRaises(ValidationError) as cm:
            p.leave(reason)
        self.assertEqual(str(cm.exception), want)
        self.assertIsNone(p.error)
        p.publish(events.stored([block(1)]))  # a refused leave changes nothing: the publisher goes on
        p.flush(5)
        self.assertEqual(self.server.worker_status(15).cached_blocks.device, 2)
        # The router refuses the same leave with the same message.
        reqs = [pb.worker.PublishRequest(hello=hello(16)), pb.worker.PublishRequest(leave=pb.worker.WorkerLeave(reason=reason))]
        err = self.server_error(lambda: list(self.server.worker.Publish(iter(reqs), timeout=5)))
        self.assertEqual(err.details(), want)
        self.assertIsNotNone(self.server.worker_status(16), "a refused leave removes nothing")
        p.leave(reason[:-1], timeout=5)  # 256 bytes: at the limit
        self.assertIsNone(self.server.worker_status(15))

    def test_publish_checks_match_the_router(self) -> None:
        p = Publisher(hello(14), f"127.0.0.1:{free_port()}", start=False)  # nothing is sent
        bad = [
            (events.stored([(1, [1, 2, 3])]), "events.events[0].stored.blocks[0].token_ids: must hold exactly block_size 4 tokens (got 3)"),
            (pb.worker.KvEvent(stored=pb.worker.BlocksStored(blocks=[pb.worker.StoredBlock(block_hash=1, token_ids=[1, 2, 3, 4])])),
             "events.events[0].storage_tier: must be DEVICE, HOST, DISK or EXTERNAL (got STORAGE_TIER_UNSPECIFIED)"),
            (pb.worker.KvEvent(storage_tier=pb.types.STORAGE_TIER_DEVICE), "events.events[0]: must set one of stored, removed, cleared"),
            (events.stored([(1, [1, 2, 3, 4]), (2, blockhash.local_multimodal([5, 6, 7, 8], [9]), [9])]),
             "events.events[0].stored.blocks[1].mm_hashes: must be empty with tokens_hash, which already holds them"),
            (events.stored([(1, [1, 2, 3, 4], range(65))]), "events.events[0].stored.blocks[0].mm_hashes: must hold at most 64 hashes (got 65)"),
        ]
        for ev, want in bad:
            with self.assertRaises(ValidationError) as cm:
                p.publish(ev)
            self.assertEqual(str(cm.exception), want)
            # The router says the same about the same event.
            h = hello(14)
            reqs = [pb.worker.PublishRequest(hello=h), pb.worker.PublishRequest(events=pb.worker.EventBatch(events=[ev]))]
            err = self.server_error(lambda: list(self.server.worker.Publish(iter(reqs), timeout=5)))
            self.assertEqual(err.details(), want)
        self.assertEqual(p.unacked, 0)
        self.assertEqual(p.stats.batches, 0)
        with self.assertRaises(ValidationError) as cm:
            Publisher(hello(0), self.server.addr)
        self.assertEqual(str(cm.exception), "hello.worker_id: must not be 0")
        # A hello without an endpoint, or with one and no_endpoint: refused as the router refuses it.
        no_endpoint, both = hello(15), hello(15)
        no_endpoint.endpoint = ""
        both.no_endpoint = True
        for h in (no_endpoint, both):
            with self.assertRaises(ValidationError) as cm:
                Publisher(h, self.server.addr, start=False)
            err = self.server_error(lambda: list(self.server.worker.Publish(iter([pb.worker.PublishRequest(hello=h)]), timeout=5)))
            self.assertEqual(str(cm.exception), err.details())
        p.close(1)


class BookingTest(ServerTest):
    def setUp(self) -> None:
        super().setUp()
        p = self.publisher(hello(20), self.server.addr)
        p.publish(events.stored([block(0)]))
        p.flush(5)
        self.router = Router(self.server.addr)
        self.addCleanup(self.router.close)

    def active(self) -> int:
        return self.server.worker_status(20).load.active_requests

    def test_free_and_prefill_complete_are_idempotent(self) -> None:
        b = self.router.route(block(0)[1] + [99], "demo")
        self.assertEqual(b.decode.worker_id, 20)
        self.assertEqual(self.active(), 1)
        b.prefill_complete()
        b.prefill_complete()
        b.free()
        self.assertEqual(self.active(), 0)
        b.free()
        b.prefill_complete()
        self.assertTrue(b.freed)
        # A booking freed elsewhere (or expired): NOT_FOUND counts as done.
        c = self.router.route([1, 2, 3], "demo", "req-c")
        self.server.router.Free(pb.router.FreeRequest(request_id="req-c"))
        c.free()
        self.assertTrue(c.freed)

    def test_context_manager_frees_on_exception(self) -> None:
        with self.assertRaises(RuntimeError):
            with self.router.route([1, 2, 3, 4, 5], "demo") as b:
                self.assertEqual(self.active(), 1)
                raise RuntimeError("the request failed")
        self.assertTrue(b.freed)
        self.assertEqual(self.active(), 0)
        with self.router.route([1, 2, 3, 4, 5], "demo") as b2:
            pass
        self.assertTrue(b2.freed)
        self.assertEqual(self.active(), 0)
        with self.assertRaises(grpc.RpcError) as cm:
            self.server.router.Free(pb.router.FreeRequest(request_id=b2.request_id))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)


class KeepaliveTest(ServerTest):
    def test_channels_the_clients_open_get_the_keepalive(self) -> None:
        # kvclient.Keepalive: a ping after 15 s without traffic, also with no call in flight, and the
        # connection failed when no answer comes within 10 s.
        want = {"grpc.keepalive_time_ms": 15_000, "grpc.keepalive_timeout_ms": 10_000, "grpc.keepalive_permit_without_calls": 1}
        with mock.patch("grpc.insecure_channel", wraps=grpc.insecure_channel) as opened:
            router = Router(self.server.addr)
            self.addCleanup(router.close)
            p = self.publisher(hello(23), self.server.addr)
        mine = [c for c in opened.call_args_list if c.args[0] == self.server.addr]  # not other tests' threads
        self.assertEqual(len(mine), 2)
        for c in mine:
            options = dict(c.kwargs["options"])
            self.assertEqual({k: options.get(k) for k in want}, want)
        # The channels work with them: the worker registers, a route finds it and is freed.
        p.publish(events.stored([block(0)]))
        p.flush(5)
        with router.route(block(0)[1] + [99], "demo") as b:
            self.assertEqual(b.decode.worker_id, 23)
        self.assertEqual(self.server.worker_status(23).load.active_requests, 0)
        # A channel given is the caller's: nothing is opened.
        with mock.patch("grpc.insecure_channel", wraps=grpc.insecure_channel) as opened:
            Router(self.server.channel)
        self.assertNotIn(self.server.addr, [c.args[0] for c in opened.call_args_list])


class SharedStateTest(SharedStateSetup, unittest.TestCase):
    def register(self, worker_id: int) -> None:
        """Registers an aggregated worker that can prefill 8 tokens at once, and waits for it."""
        h = hello(worker_id)
        h.max_num_batched_tokens = 8
        p = Publisher(h, self.server.addr)

        def close() -> None:
            try:
                p.close(timeout=2)
            except Exception:  # noqa: BLE001 - the test checked what it wanted already
                pass

        self.addCleanup(close)
        p.publish(events.stored([block(0)]))
        p.flush(5)

    def pause_redis(self) -> None:
        """Pauses Redis and waits until the replica says its shared state is unreachable."""
        self.assertTrue(wait_until(self.redis_paused(), timeout=10),
                        "the replica did not notice that Redis stopped answering")


class UnavailableEndTest(SharedStateTest):
    """Free and MarkPrefillComplete that the router cannot accept yet (UNAVAILABLE) are retried."""

    # A worker whose prefill tokens exceed its max_num_batched_tokens is overloaded: a Route then
    # waits in the router's queue until its deadline, having booked nothing.
    flags = ("--router-queue-threshold", "1")

    def setUp(self) -> None:
        super().setUp()
        self.assertTrue(wait_until(lambda: self.state().shared_state_complete, timeout=10), "the replica's shared state never became complete")
        self.register(40)
        self.router = Router(self.server.addr)
        self.addCleanup(self.router.close)

    def active(self) -> int:
        return self.server.worker_status(40).load.active_requests

    def test_free_the_router_cannot_accept_yet_is_retried_in_the_background(self) -> None:
        held = self.router.route(list(range(1, 21)), "demo")  # booked on this replica
        self.assertEqual(self.active(), 1)
        self.pause_redis()
        # A request this replica does not hold may be held, unpublished, by another replica: with
        # Redis unreachable it cannot tell, and says so. free() retries until its timeout, raises the
        # last error, and hands the Free to the background.
        gone = self.router.existing("routed-elsewhere")
        t0 = time.monotonic()
        with self.assertRaises(grpc.RpcError) as cm:
            gone.free(timeout=0.5)
        # At least one retry, after the router's 250 ms RetryInfo, jittered to no less than half;
        # free() hands over to the background once the next wait would pass its timeout.
        self.assertGreaterEqual(time.monotonic() - t0, 0.1, "free() gave up at once instead of retrying")
        # The last try may run out of the call's time before the router answers it.
        self.assertIn(cm.exception.code(), LATE)
        # What the router answers, given the time to: UNAVAILABLE, LOG_UNAVAILABLE, retry after 250 ms.
        with self.assertRaises(grpc.RpcError) as cm:
            self.server.router.Free(pb.router.FreeRequest(request_id="routed-elsewhere"), timeout=5)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(error_reason(cm.exception), "LOG_UNAVAILABLE")
        self.assertEqual(retry_delay(cm.exception), 0.25)
        self.assertTrue(gone.freed, "the background retry owns the Free now")
        self.assertEqual(self.router.pending_ends, 1)
        gone.free(timeout=0.5)  # nothing more to do: no second retry of the same Free
        self.assertEqual(self.router.pending_ends, 1)
        # MarkPrefillComplete goes the same way.
        with self.assertRaises(grpc.RpcError) as cm:
            self.router.existing("prefilled-elsewhere").prefill_complete(timeout=0.3)
        self.assertIn(cm.exception.code(), LATE)
        self.assertEqual(self.router.pending_ends, 2)
        # A booking this replica holds is freed at once, locally, while Redis is unreachable: the
        # first call is accepted, nothing goes to the background.
        held.free(timeout=5)
        self.assertEqual(self.router.pending_ends, 2)
        self.assertEqual(self.active(), 0)
        # A booking is made on this replica after the Free was sent (as another replica's booking
        # becomes visible once it is published): the retried Free finds it and frees it.
        late = self.router.existing("routed-later")
        with self.assertRaises(grpc.RpcError):
            late.free(timeout=0.3)
        self.assertEqual(self.router.pending_ends, 3)
        self.server.router.Route(pb.router.RouteRequest(request_id="routed-later", model="demo", token_ids=[1, 2, 3]), timeout=5)
        self.assertEqual(self.active(), 1)
        self.assertTrue(wait_until(lambda: self.router.pending_ends == 2 and self.active() == 0, timeout=5),
                        f"the retried Free did not free the booking made after it: {self.router.pending_ends} pending, {self.active()} active")
        # Closing a Router gives up what it retries.
        other = Router(self.server.addr)
        with self.assertRaises(grpc.RpcError):
            other.existing("closed-while-retried").free(timeout=0.3)
        self.assertEqual(other.pending_ends, 1)
        self.assertEqual(other.close(), 1)
        self.assertEqual(other.pending_ends, 0)
        # Without background retries the Free is only raised, and a later call tries again.
        once = Router(self.server.addr, end_retry_for=0)
        self.addCleanup(once.close)
        b = once.existing("not-retried")
        with self.assertRaises(grpc.RpcError):
            b.free(timeout=0.3)
        self.assertEqual(once.pending_ends, 0)
        self.assertFalse(b.freed)
        # Once Redis answers again, the replica can tell that nobody holds the others (NOT_FOUND).
        self.redis.resume()
        self.assertTrue(wait_until(lambda: self.router.pending_ends == 0, timeout=10), f"{self.router.pending_ends} ends still pending after Redis came back")
        self.assertEqual(self.state().bookings, 0)

    def test_a_route_that_failed_in_flight_is_freed_with_retries(self) -> None:
        self.router.route(list(range(1, 21)), "demo")  # 20 prefill tokens: the worker is overloaded
        self.pause_redis()
        # The Route waits in the router's queue until its deadline: the router may have booked it for
        # all the client knows, so the client frees it, and the replica cannot tell (UNAVAILABLE).
        with self.assertRaises(grpc.RpcError) as cm:
            self.router.route(list(range(1, 21)), "demo", "cut-short", timeout=0.3)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertEqual(self.router.pending_ends, 1)
        time.sleep(0.6)  # several tries, each UNAVAILABLE
        self.assertEqual(self.router.pending_ends, 1)
        self.redis.resume()
        self.assertTrue(wait_until(lambda: self.router.pending_ends == 0, timeout=10), "the Free of the failed Route was not retried until the router answered")
        self.assertEqual(self.state().bookings, 1)  # the first route's only


class RouteRetryTest(SharedStateTest):
    # On an empty Redis the replica's state may be incomplete for the reseed window: a replica
    # holding the lost state may still reseed the log. Meanwhile a Route for a model without workers
    # is UNAVAILABLE (LOG_UNAVAILABLE), not NOT_FOUND. The window is long enough for the whole test.
    reseed_window = "8s"

    def test_route_is_retried_while_the_shared_state_may_be_incomplete(self) -> None:
        self.assertFalse(self.state().shared_state_complete)
        with self.assertRaises(grpc.RpcError) as cm:
            self.server.router.Route(pb.router.RouteRequest(request_id="r0", model="demo", token_ids=[1, 2, 3]), timeout=5)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(error_reason(cm.exception), "LOG_UNAVAILABLE")
        counter = CountCalls()
        channel = grpc.intercept_channel(grpc.insecure_channel(self.server.addr), counter.sync())
        self.addCleanup(channel.close)
        router = Router(channel)
        got: List[object] = []
        t = threading.Thread(target=lambda: got.append(self._route(router)))
        t.start()
        self.addCleanup(t.join, 10)
        self.assertTrue(wait_until(lambda: counter.routes >= 2, timeout=5), "the Route was not sent again")
        self.register(41)  # the worker the Route waited for
        t.join(10)
        self.assertEqual(len(got), 1)
        self.assertIsInstance(got[0], Booking, f"route() = {got[0]!r}")
        self.assertEqual(got[0].decode.worker_id, 41)  # type: ignore[attr-defined]
        self.assertFalse(self.state().shared_state_complete, "the reseed window ended before the Route was answered: the test tested nothing")

    @staticmethod
    def _route(router: Router) -> object:
        try:
            return router.route([1, 2, 3, 4, 5], "demo", timeout=6)
        except grpc.RpcError as err:
            return err


if __name__ == "__main__":
    unittest.main()
