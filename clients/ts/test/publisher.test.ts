import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import path from "node:path";
import { Code, ConnectError, createClient, type Interceptor } from "@connectrpc/connect";
import { create, isMessage, type Message, type MessageInitShape } from "@bufbuild/protobuf";
import {
  DEFAULT_FLUSH_INTERVAL_MS,
  DEFAULT_MAX_BATCH_EVENTS,
  DEFAULT_MAX_DUMP_BLOCKS,
  DEFAULT_MAX_UNACKED,
  KvEventSchema,
  openTransport,
  Publisher,
  Router,
  errorInfo,
  PublisherClosedError,
  PublisherFullError,
  PublishRequestSchema,
  loadBlockHasher,
  PublishResponseSchema,
  StorageTier,
  WorkerRole,
  WorkerService,
  WorkerSupersededError,
  type KvEventInit,
  type WorkerHelloInit,
} from "../src/index.js";
import { chain, freePort, Proxy, recordBlocks, REPO_DIR, sleep, startRouter, startRouterOn, waitFor, type RouterProcess } from "./helpers.js";

const BS = 4;
const hello = (workerId: bigint, model: string): WorkerHelloInit => ({
  workerId, model, role: WorkerRole.AGGREGATED, blockSize: BS, totalKvBlocks: 4096n, endpoint: `10.0.${workerId / 250n}.${workerId % 250n}:8000`, kvEventsEnabled: true, freshStart: true,
});
/** One stored event of blocks [first, first+n) of worker base's chain, continuing the chain. */
const stored = (base: bigint, first: number, n: number): KvEventInit => ({
  storageTier: StorageTier.DEVICE,
  data: { case: "stored", value: { ...(first > 0 ? { parentHash: base + BigInt(first) } : {}), blocks: chain(base, first, n, BS) } },
});
const removed = (hashes: bigint[]): KvEventInit => ({ storageTier: StorageTier.DEVICE, data: { case: "removed", value: { blockHashes: hashes } } });

test("resume after the stream is cut: every event applied exactly once", async () => {
  const server = await startRouter();
  const proxy = await Proxy.start(server.addr);
  const pub = new Publisher({ addresses: [proxy.addr], hello: hello(11n, "resume"), minBackoffMs: 20, maxBackoffMs: 100, flushIntervalMs: 1 });
  const status = async () => (await server.workers("resume"))[0]!;
  try {
    await pub.ready;
    // Events 0-9: one block each, acked.
    for (let i = 0; i < 10; i++) {
      await pub.publish([stored(11_000n, i, 1)]);
    }
    await pub.flush();
    assert.equal(pub.unacked, 0);
    assert.equal((await status()).lastEventId, 9n);

    // Events 10-19 are sent but never reach the router; then the connection is cut.
    proxy.dropToServer = true;
    for (let i = 10; i < 20; i++) {
      await pub.publish([stored(11_000n, i, 1)]);
    }
    await sleep(200); // sent, into the void
    assert.equal(pub.unacked, 10);
    assert.equal((await status()).lastEventId, 9n, "the router did not see events 10-19");
    proxy.cut();
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    assert.equal(pub.stats.registrations, 2);
    let w = await status();
    assert.equal(w.lastEventId, 19n);
    assert.equal(w.cachedBlocks?.device, 20n);

    // Events 20-24 (removals) reach the router, but their acks do not; then the connection is cut.
    proxy.dropToClient = true;
    for (let i = 0; i < 5; i++) {
      await pub.publish([removed([11_000n + BigInt(20 - i)])]);
    }
    await waitFor("the router to apply events 20-24", async () => (await status()).lastEventId === 24n);
    assert.equal(pub.unacked, 5, "the acks were lost");
    const batchesBefore = pub.stats.batches;
    proxy.cut();
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    assert.equal(pub.stats.registrations, 3);
    assert.equal(pub.stats.batches, batchesBefore, "events the router held (Registered.last_event_id) were not sent again");
    w = await status();
    assert.equal(w.lastEventId, 24n);
    assert.equal(w.cachedBlocks?.device, 15n);
    assert.equal(w.awaitingResync, false);
    assert.equal(pub.stats.resyncRequests, 0, "no gap: nothing lost, nothing repeated");
    assert.equal(pub.stats.lastAcked, 24n);
    await pub.close();
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await proxy.close();
    await server.stop();
  }
});

/**
 * An interceptor that loses one event on the wire: it removes the event with the given id from the
 * Publish request that carries it (the whole message when nothing else is left in it), once.
 */
function loseEvent(eventId: bigint): { interceptor: Interceptor; lost: () => number } {
  let lost = 0;
  const interceptor: Interceptor = (next) => async (req) => {
    if (!req.stream || req.method.name !== "Publish") {
      return next(req);
    }
    const source = req.message;
    async function* filtered(): AsyncIterable<Message> {
      for await (const m of source) {
        if (lost === 0 && isMessage(m, PublishRequestSchema) && m.message.case === "events") {
          const events = m.message.value.events.filter((e) => e.eventId !== eventId);
          if (events.length < m.message.value.events.length) {
            lost++;
            if (events.length > 0) {
              yield create(PublishRequestSchema, { message: { case: "events", value: { events } } });
            }
            continue;
          }
        }
        yield m;
      }
    }
    return next({ ...req, message: filtered() });
  };
  return { interceptor, lost: () => lost };
}

for (const hashTokens of [false, true]) {
test(`an event lost on the wire makes the router ask for a resync; the dump restores the blocks (hashTokens ${hashTokens})`, async () => {
  const server = await startRouter();
  // The worker's cache, kept as stored events of two blocks each.
  const cache: KvEventInit[] = [];
  let dumpCalls = 0;
  const lose = loseEvent(2n);
  const resyncs: unknown[] = [];
  const pub = new Publisher({
    addresses: [server.addr],
    hello: hello(21n, "resync"),
    maxBatchBlocks: 4, // the dump of 10 blocks goes in 3 parts
    dump: () => {
      dumpCalls++;
      return cache;
    },
    interceptors: [lose.interceptor],
    hashTokens,
    log: (message, fields) => {
      if (message.includes("asked for a dump")) {
        resyncs.push(fields);
      }
    },
  });
  const status = async () => (await server.workers("resync"))[0]!;
  try {
    for (let i = 0; i < 4; i += 2) {
      cache.push(stored(21_000n, i, 2));
    }
    assert.deepEqual(await pub.publish(cache), [0n, 1n]);
    await pub.flush();
    assert.equal((await status()).cachedBlocks?.device, 4n);
    assert.equal(lose.lost(), 0);

    // Event 2 never reaches the router: it sees 3 after 1, drops the worker's blocks and asks for a dump.
    const more = [stored(21_000n, 4, 2), stored(21_000n, 6, 2), stored(21_000n, 8, 2)];
    cache.push(...more);
    assert.deepEqual(await pub.publish(more), [2n, 3n, 4n]);
    await waitFor("the dump to be sent", () => pub.stats.dumps === 1);
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    assert.equal(lose.lost(), 1, "the interceptor removed event 2 from the wire");
    const w = await waitFor("the dump to apply", async () => {
      const s = await status();
      return !s.awaitingResync && s.lastEventId === 4n ? s : undefined;
    });
    assert.ok(w);
    assert.equal(w.cachedBlocks?.device, 10n);
    assert.equal(dumpCalls, 1);
    assert.ok(pub.stats.resyncRequests >= 1, `resyncRequests ${pub.stats.resyncRequests}`);
    assert.equal(pub.stats.dumps, 1);
    assert.equal(pub.stats.dumpParts, 3);
    assert.deepEqual(resyncs[0], { reason: "gap: expected event 2, got 3", expectedEventId: 2n });
    assert.match(server.log(), /event id gap/);

    // Publishing goes on after the dump.
    assert.deepEqual(await pub.publish([stored(21_000n, 10, 1)]), [5n]);
    await pub.flush();
    const after = await status();
    assert.equal(after.cachedBlocks?.device, 11n);
    assert.equal(after.lastEventId, 5n);
    assert.equal(after.awaitingResync, false);
    // The router's blocks are the worker's: a prompt of the 11 blocks' tokens overlaps all of them.
    const router = new Router({ address: server.addr });
    try {
      const r = await router.route({ model: "resync", tokenIds: Array.from({ length: 11 * BS }, (_, i) => i + 1), queryOnly: true });
      assert.equal(r.response.decode?.workerId, 21n);
      assert.equal(r.response.diagnostics?.decode?.overlapBlocks?.device, 11n);
    } finally {
      router.close();
    }
    await pub.close();
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});
}

test("failover: with the first address dead, the publisher streams to the next one", async () => {
  const server = await startRouter();
  const dead = `127.0.0.1:${await freePort()}`; // nobody listens there
  const failures: Record<string, unknown>[] = [];
  const pub = new Publisher({
    addresses: [dead, server.addr],
    hello: hello(26n, "failover"),
    minBackoffMs: 10,
    maxBackoffMs: 100,
    log: (message, fields) => {
      if (message.includes("publish stream failed")) {
        failures.push(fields ?? {});
      }
    },
  });
  try {
    const evs = Array.from({ length: 6 }, (_, i) => stored(26_000n, 2 * i, 2));
    assert.deepEqual(await pub.publish(evs), [0n, 1n, 2n, 3n, 4n, 5n]);
    await pub.flush({ signal: AbortSignal.timeout(10_000) });
    const [w] = await server.workers("failover");
    assert.equal(w?.cachedBlocks?.device, 12n, "the live router holds every block");
    assert.equal(w?.lastEventId, 5n);
    assert.ok(failures.length >= 1, "the stream to the dead address failed and was logged");
    assert.equal(failures[0]!.address, dead);
    assert.equal(failures[0]!.code, "Unavailable");
    assert.equal(pub.stats.registrations, 1, "only the live router registered the worker");
    assert.equal(pub.stats.dumps, 0);
    await pub.close();
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});

/** Records Registered.last_event_id (undefined: none) of every Publish stream's registration. */
function recordRegistrations(): { interceptor: Interceptor; registered: (bigint | undefined)[] } {
  const registered: (bigint | undefined)[] = [];
  const interceptor: Interceptor = (next) => async (req) => {
    const res = await next(req);
    if (!res.stream) {
      return res;
    }
    const source = res.message;
    async function* observed(): AsyncIterable<Message> {
      for await (const m of source) {
        if (isMessage(m, PublishResponseSchema) && m.message.case === "registered") {
          registered.push(m.message.value.lastEventId);
        }
        yield m;
      }
    }
    return { ...res, message: observed() };
  };
  return { interceptor, registered };
}

test("a router restarted empty on the same address gets a dump, then the next events", async () => {
  const first = await startRouter();
  const port = Number(first.addr.split(":")[1]);
  let second: Awaited<ReturnType<typeof startRouter>> | undefined;
  const cache: KvEventInit[] = [];
  let dumpCalls = 0;
  const rec = recordRegistrations();
  const lostLines: unknown[] = [];
  const pub = new Publisher({
    addresses: [first.addr],
    hello: hello(27n, "restart"),
    minBackoffMs: 10,
    maxBackoffMs: 100,
    dump: () => {
      dumpCalls++;
      return cache;
    },
    interceptors: [rec.interceptor],
    log: (message, fields) => {
      if (message.includes("holds none of the events it acked") || message.includes("holds fewer events than it acked")) {
        lostLines.push(fields);
      }
    },
  });
  try {
    const evs = [stored(27_000n, 0, 2), stored(27_000n, 2, 2), stored(27_000n, 4, 2)];
    cache.push(...evs);
    assert.deepEqual(await pub.publish(evs), [0n, 1n, 2n]);
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    assert.equal((await first.workers("restart"))[0]?.cachedBlocks?.device, 6n);
    assert.equal(pub.stats.lastAcked, 2n);

    // The router dies with its (in-memory) state; a new, empty one serves the same address.
    await first.stop();
    second = await startRouterOn(port);
    const s = second;
    await waitFor("the publisher to register with the new router and send a dump", () => pub.stats.dumps >= 1, 10_000);
    assert.ok(pub.stats.registrations >= 2, `registrations ${pub.stats.registrations}`);
    const reg = rec.registered.at(-1);
    assert.ok(reg === undefined || reg < 2n, `the new router's Registered.last_event_id ${reg} is below the acked 2`);
    assert.equal(lostLines.length, 1, "the publisher noticed that the router lost acked events");
    assert.equal(pub.stats.resyncRequests, 0, "the publisher sent the dump without being asked");
    assert.equal(dumpCalls, 1);
    await waitFor("the dump to apply", async () => (await s.workers("restart"))[0]?.cachedBlocks?.device === 6n);

    // Publishing goes on, numbered after the dump.
    const more = stored(27_000n, 6, 1);
    cache.push(more);
    assert.deepEqual(await pub.publish([more]), [3n]);
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    const w = await waitFor("the new router to hold every block", async () => {
      const st = (await s.workers("restart"))[0];
      return st?.lastEventId === 3n ? st : undefined;
    });
    assert.ok(w);
    assert.equal(w.cachedBlocks?.device, 7n);
    assert.equal(w.lastEventId, 3n);
    assert.equal(w.awaitingResync, false);
    assert.equal(w.connected, true);
    assert.ok(pub.stats.dumps >= 1);
    assert.equal(pub.stats.lastAcked, 3n);
    await pub.close();
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await first.stop();
    await second?.stop();
  }
});

test("a second publisher with the same worker_id supersedes the first, which stops", async () => {
  const server = await startRouter();
  const a = new Publisher({ addresses: [server.addr], hello: hello(31n, "dup"), minBackoffMs: 10 });
  let b: Publisher | undefined;
  try {
    await a.ready;
    await a.publish([stored(31_000n, 0, 1)]);
    await a.flush();
    b = new Publisher({ addresses: [server.addr], hello: hello(31n, "dup") });
    await b.ready;
    await b.publish([stored(31_000n, 0, 2)]);
    await b.flush();
    // A learns it was superseded at the latest when it sends again.
    await a.publish([stored(31_000n, 2, 1)]).catch(() => undefined);
    await waitFor("A to stop", () => a.error);
    assert.ok(a.error instanceof WorkerSupersededError, `got ${String(a.error)}`);
    assert.equal(ConnectError.from(a.error.cause).code, Code.FailedPrecondition);
    assert.match(a.error.message, /worker superseded/);
    await assert.rejects(a.publish([stored(31_000n, 3, 1)]), WorkerSupersededError);
    await assert.rejects(a.close(), WorkerSupersededError);
    await sleep(100);
    assert.equal(a.stats.registrations, 1, "A did not reconnect");
    assert.equal(b.error, undefined);
    const [w] = await server.workers("dup");
    assert.equal(w?.cachedBlocks?.device, 2n, "only B's blocks");
    assert.equal(w?.connected, true);
    await b.close();
  } finally {
    await a.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await b?.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});

test("events the router would refuse fail before sending, with the router's message", async () => {
  const server = await startRouter();
  const pub = new Publisher({ addresses: [server.addr], hello: hello(41n, "valid") });
  try {
    await pub.ready;
    const bad: KvEventInit = { storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks: [{ blockHash: 1n, tokenIds: [1, 2, 3, 4] }, { blockHash: 2n, tokenIds: [5, 6, 7] }] } } };
    const client = await pub.publish([bad]).then(() => assert.fail("publish should fail"), (e: unknown) => ConnectError.from(e));
    assert.equal(client.code, Code.InvalidArgument);
    assert.equal(client.rawMessage, "events.events[0].stored.blocks[1].token_ids: must hold exactly block_size 4 tokens (got 3)");
    assert.equal(pub.unacked, 0, "nothing was queued");

    // The router answers the same batch with the same message.
    const t = openTransport(server.addr);
    const raw = createClient(WorkerService, t.transport);
    const fromServer = await (async () => {
      try {
        async function* requests() {
          yield create(PublishRequestSchema, { message: { case: "hello", value: { ...hello(42n, "valid"), freshStart: true } } });
          yield create(PublishRequestSchema, { message: { case: "events", value: { events: [{ ...bad, eventId: 0n }] } } });
          await sleep(2_000); // keep the stream open until the router ends it
        }
        for await (const _ of raw.publish(requests(), { timeoutMs: 5_000 })) {
          void _;
        }
      } catch (e) {
        return ConnectError.from(e);
      }
      return assert.fail("the router should refuse the batch");
    })();
    t.close();
    assert.equal(fromServer.code, Code.InvalidArgument);
    assert.equal(fromServer.rawMessage, client.rawMessage);

    await assert.rejects(pub.publish([{ storageTier: StorageTier.UNSPECIFIED, data: { case: "cleared", value: {} } }]), /storage_tier: must be DEVICE, HOST, DISK or EXTERNAL/);
    await assert.rejects(pub.publish([{ storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks: [{ blockHash: 1n }] } } }]), /neither is set/);
    assert.throws(() => new Publisher({ addresses: [server.addr], hello: { ...hello(0n, "valid") } }), /hello.worker_id: must not be 0/);
    assert.throws(() => new Publisher({ addresses: [server.addr], hello: { ...hello(43n, "valid"), blockSize: 0 } }), /hello.block_size: must be > 0/);
    // The router's own words (server/publishmap.go): a hello without an endpoint, or with both.
    assert.throws(() => new Publisher({ addresses: [server.addr], hello: { ...hello(45n, "valid"), endpoint: "" } }),
      /hello.endpoint: must be set to the address frontends reach the worker at \(or set hello.no_endpoint for a fleet whose frontends find workers by worker_id\)/);
    assert.throws(() => new Publisher({ addresses: [server.addr], hello: { ...hello(45n, "valid"), noEndpoint: true } }),
      /hello.no_endpoint: must not be set with hello.endpoint/);
    assert.throws(() => new Publisher({ addresses: [server.addr], hello: hello(44n, "valid"), minBackoffMs: 0 }), /minBackoffMs must be a number >= 1 \(got 0\)/);
    assert.throws(() => new Publisher({ addresses: [server.addr], hello: hello(44n, "valid"), maxBatchEvents: Number.NaN }), /maxBatchEvents must be a number >= 1/);

    // The publisher is still usable.
    await pub.publish([stored(41_000n, 0, 1)]);
    await pub.flush();
    assert.equal((await server.workers("valid"))[0]?.cachedBlocks?.device, 1n);
    await pub.close();
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});

test("a full unacked window waits for acks, or rejects with a clear error", async () => {
  const server = await startRouter();
  const proxy = await Proxy.start(server.addr);
  const waiting = new Publisher({ addresses: [proxy.addr], hello: hello(51n, "full"), maxUnacked: 3 });
  const rejecting = new Publisher({ addresses: [server.addr], hello: hello(52n, "full"), maxUnacked: 3, whenFull: "reject" });
  try {
    await waiting.ready;
    await rejecting.ready;
    proxy.dropToClient = true; // acks do not arrive
    await waiting.publish([stored(51_000n, 0, 1), stored(51_000n, 1, 1), stored(51_000n, 2, 1)]);
    let done = false;
    const fourth = waiting.publish([stored(51_000n, 3, 1)]).then((ids) => {
      done = true;
      return ids;
    });
    // Later calls queue behind it: one gives up (its signal aborts), the next keeps its turn.
    const givesUp = waiting.publish([stored(51_000n, 3, 1)], { signal: AbortSignal.timeout(50) }).then(() => undefined, (e: unknown) => e);
    const sixth = waiting.publish([stored(51_000n, 4, 1)]);
    await sleep(100);
    assert.equal(done, false, "the fourth event waits for room");
    assert.equal((await givesUp as Error | undefined)?.name, "TimeoutError", "the call that gave up rejected with its signal's reason");
    proxy.cut(); // reconnect: Registered acks what the router holds
    assert.deepEqual(await fourth, [3n]);
    assert.deepEqual(await sixth, [4n], "the call after the one that gave up still came after the fourth");
    await waiting.flush({ signal: AbortSignal.timeout(5_000) });

    // Rejecting: fill the window faster than acks can come.
    const r = await rejecting.publish([stored(52_000n, 0, 1), stored(52_000n, 1, 1), stored(52_000n, 2, 1)]).then(() =>
      rejecting.publish([stored(52_000n, 3, 1)]).then(() => undefined, (e: unknown) => e),
    );
    assert.ok(r instanceof PublisherFullError, `got ${String(r)}`);
    assert.match(r.message, /3 events await the router's ack/);
    await rejecting.flush();
    await rejecting.publish([stored(52_000n, 3, 1)]);
    await rejecting.close();
    await waiting.close();
    assert.equal((await server.workers("full")).map((w) => w.cachedBlocks?.device).sort().join(","), "4,5");
  } finally {
    await waiting.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await rejecting.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await proxy.close();
    await server.stop();
  }
});

test("messages over the router's max_batch_blocks are split, and load reports arrive", async () => {
  const server = await startRouter("--max-batch-blocks", "8");
  const pub = new Publisher({ addresses: [server.addr], hello: hello(61n, "limits"), flushIntervalMs: 50, minBackoffMs: 5 });
  try {
    await pub.ready;
    const evs = Array.from({ length: 40 }, (_, i) => stored(61_000n, i, 1));
    await pub.publish(evs);
    pub.reportLoad({ kvUsedBlocks: 40n, waitingRequests: 3n });
    await pub.flush({ signal: AbortSignal.timeout(10_000) });
    const w = await waitFor("the load report", async () => {
      const s = (await server.workers("limits"))[0];
      return s?.load?.waitingRequests === 3n ? s : undefined;
    });
    assert.ok(w);
    assert.equal(w.cachedBlocks?.device, 40n);
    assert.equal(w.lastEventId, 39n);
    assert.equal(w.load?.kvUsedBlocks, 40n);
    assert.ok(pub.stats.registrations > 1, "the publisher reconnected with smaller batches");
    await pub.close();
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});

test("a publisher without fresh_start continues the rank's numbering; the superseded one learns without sending", async () => {
  const server = await startRouter();
  const first = new Publisher({ addresses: [server.addr], hello: hello(71n, "cont") });
  let second: Publisher | undefined;
  try {
    await first.publish([stored(71_000n, 0, 1), stored(71_000n, 1, 1), stored(71_000n, 2, 1)]);
    await first.flush();
    // A restarted process that did not lose its cache registers without fresh_start.
    second = new Publisher({ addresses: [server.addr], hello: { ...hello(71n, "cont"), freshStart: false } });
    await second.ready;
    await waitFor("the first publisher to learn it was superseded", () => first.error instanceof WorkerSupersededError, 3_000);
    assert.deepEqual(await second.publish([stored(71_000n, 3, 1)]), [3n]);
    await second.flush();
    const [w] = await server.workers("cont");
    assert.equal(w?.lastEventId, 3n);
    assert.equal(w?.cachedBlocks?.device, 4n);
    assert.equal(second.stats.resyncRequests, 0);
    await second.close();
  } finally {
    await first.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await second?.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});

test("hashTokens sends tokens_hash, and the router's prompt hashes match them (salted too)", async () => {
  const server = await startRouter();
  const rec = recordBlocks();
  const bs = 16;
  const pub = new Publisher({
    addresses: [server.addr],
    hello: { ...hello(81n, "hashed"), blockSize: bs },
    hashTokens: true,
    interceptors: [rec.interceptor],
  });
  const router = new Router({ address: server.addr });
  const n = 40;
  // Two chains of n blocks with distinct tokens: one plain, one of a LoRA adapter and a cache namespace.
  const tokens = (base: number): number[] => Array.from({ length: n * bs }, (_, i) => base + i * 7919);
  const plain = tokens(1);
  const salted = tokens(3_000_000_000); // above 2^31: uint32s, not int32s
  const chainOf = (toks: number[], hashBase: bigint, extra: { loraName?: string; cacheNamespace?: string }): KvEventInit[] => {
    const evs: KvEventInit[] = [];
    for (let first = 0; first < n; first += 8) {
      evs.push({
        storageTier: StorageTier.DEVICE,
        data: {
          case: "stored",
          value: {
            ...extra,
            ...(first > 0 ? { parentHash: hashBase + BigInt(first - 1) } : {}),
            blocks: Array.from({ length: 8 }, (_, k) => ({ blockHash: hashBase + BigInt(first + k), tokenIds: toks.slice((first + k) * bs, (first + k + 1) * bs) })),
          },
        },
      });
    }
    return evs;
  };
  try {
    const plainEvents = chainOf(plain, 81_000n, {});
    const saltedEvents = chainOf(salted, 82_000n, { loraName: "adapter-ü", cacheNamespace: "tenant-9" });
    await pub.publish(plainEvents);
    await pub.publish(saltedEvents);
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    assert.equal((await server.workers("hashed"))[0]?.cachedBlocks?.device, BigInt(2 * n));
    // What went out: hashes, no tokens; the caller's events are unchanged.
    assert.equal(rec.blocks.length, 2 * n);
    assert.ok(rec.blocks.every((b) => b.tokensHash !== undefined && b.tokenIds.length === 0), "every block went out as tokens_hash only");
    const firstBlock = plainEvents[0]!.data!.value as { blocks: { tokenIds: number[]; tokensHash?: bigint }[] };
    assert.equal(firstBlock.blocks[0]!.tokenIds.length, bs);
    assert.equal(firstBlock.blocks[0]!.tokensHash, undefined);

    const overlap = async (tokenIds: number[], extra: { loraName?: string; cacheNamespace?: string } = {}) => {
      const r = await router.route({ model: "hashed", tokenIds, queryOnly: true, ...extra });
      assert.equal(r.response.decode?.workerId, 81n);
      return r.response.diagnostics?.decode?.overlapBlocks?.device;
    };
    assert.equal(await overlap(plain), BigInt(n), "the plain prompt overlaps every plain block");
    assert.equal(await overlap([...plain, 5, 6, 7]), BigInt(n), "a tail shorter than a block does not count");
    assert.equal(await overlap(salted, { loraName: "adapter-ü", cacheNamespace: "tenant-9" }), BigInt(n), "the salted prompt overlaps every salted block");
    assert.equal(await overlap(salted), 0n, "without the salt, nothing matches");
    assert.equal(await overlap(salted, { loraName: "adapter-ü" }), 0n, "with half the salt, nothing matches");
    await pub.close();
  } finally {
    router.close();
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});

test("hashTokens with many cache namespaces: each one's blocks match its prompts", async () => {
  const server = await startRouter();
  const pub = new Publisher({ addresses: [server.addr], hello: hello(96n, "tenants"), hashTokens: true });
  const router = new Router({ address: server.addr });
  // Block k of namespace ns holds tokens 100k+1..100k+4; every namespace its own salt.
  const block = (ns: number, k: number): KvEventInit => ({
    storageTier: StorageTier.DEVICE,
    data: { case: "stored", value: { cacheNamespace: `tenant-${ns}`, blocks: [{ blockHash: BigInt(ns * 1000 + k + 1), tokenIds: [1, 2, 3, 4].map((t) => 100 * k + t) }] } },
  });
  try {
    for (let ns = 0; ns < 63; ns++) {
      await pub.publish([block(ns, 0)]); // a new salt each time: 64 loaded with 1337
    }
    // Salts it has and a new one in one call: over 64, the publisher's hasher starts afresh with them.
    await pub.publish([block(0, 1), block(62, 1), block(63, 0)]);
    await pub.publish([block(64, 0), block(1, 1)]);
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    assert.equal((await server.workers("tenants"))[0]?.cachedBlocks?.device, 68n);
    for (const [ns, k] of [[0, 1], [62, 1], [63, 0], [64, 0], [1, 1], [35, 0]] as const) {
      const r = await router.route({ model: "tenants", tokenIds: [1, 2, 3, 4].map((t) => 100 * k + t), cacheNamespace: `tenant-${ns}`, queryOnly: true });
      assert.equal(r.response.diagnostics?.decode?.overlapBlocks?.device, 1n, `tenant-${ns} block ${k}`);
    }
    await pub.close();
  } finally {
    router.close();
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});

test("concurrent publish calls queue in call order; the events given are not modified", async () => {
  const server = await startRouter();
  const pub = new Publisher({ addresses: [server.addr], hello: hello(91n, "order"), hashTokens: true });
  try {
    await pub.ready;
    // The first call must load a hasher for a new salt; the second needs nothing. Yet 0 comes first.
    const first: KvEventInit = { storageTier: StorageTier.DEVICE, data: { case: "stored", value: { loraName: "new-adapter", blocks: chain(91_000n, 0, 1, BS) } } };
    const asMessage = create(KvEventSchema, stored(92_000n, 0, 1));
    const [a, b, c] = await Promise.all([pub.publish([first]), pub.publish([asMessage]), pub.publish([asMessage])]);
    assert.deepEqual([a, b, c], [[0n], [1n], [2n]]);
    assert.equal(asMessage.eventId, 0n, "the caller's message keeps its event id");
    assert.equal(asMessage.data.case === "stored" && asMessage.data.value.blocks[0]!.tokenIds.length, BS, "and its tokens");
    // With the hasher and salt loaded and room in the window, an event is queued before publish returns.
    const before = pub.unacked;
    const queued = pub.publish([stored(92_000n, 1, 1)]);
    queued.catch(() => undefined); // awaited below; no unhandled rejection if an assertion fails first
    assert.equal(pub.unacked, before + 1, "queued at once");
    assert.deepEqual(await queued, [3n]);
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    const [w] = await server.workers("order");
    assert.equal(w?.lastEventId, 3n);
    assert.equal(w?.cachedBlocks?.device, 3n);
    await pub.close();
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});

test("numbers protobuf cannot encode fail before sending, instead of failing every stream", async () => {
  const server = await startRouter();
  const pub = new Publisher({ addresses: [server.addr], hello: hello(93n, "numbers") });
  try {
    await pub.ready;
    const withBlock = (b: { blockHash: bigint; tokenIds?: number[]; tokensHash?: bigint }): KvEventInit => ({ storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks: [b] } } });
    const cases: [KvEventInit, RegExp][] = [
      [withBlock({ blockHash: 1n, tokenIds: [1, 2, -3, 4] }), /^events\.events\[0\]\.stored\.blocks\[0\]\.token_ids\[2\]: must be a uint32 \(got -3\)$/],
      [withBlock({ blockHash: 1n, tokenIds: [1, 2, 3, 2 ** 32] }), /token_ids\[3\]: must be a uint32/],
      [withBlock({ blockHash: 1n, tokenIds: [1, 2, 3, 0.5] }), /token_ids\[3\]: must be a uint32/],
      [withBlock({ blockHash: -1n, tokenIds: [1, 2, 3, 4] }), /block_hash: must be a uint64/],
      [withBlock({ blockHash: 1n, tokensHash: 1n << 64n }), /tokens_hash: must be a uint64/],
      [{ storageTier: StorageTier.DEVICE, data: { case: "removed", value: { blockHashes: [1n, -2n] } } }, /removed\.block_hashes\[1\]: must be a uint64/],
    ];
    for (const [ev, want] of cases) {
      const err = await pub.publish([ev]).then(() => assert.fail("publish should fail"), (e: unknown) => ConnectError.from(e));
      assert.equal(err.code, Code.InvalidArgument);
      assert.match(err.rawMessage, want);
    }
    assert.throws(() => pub.reportLoad({ kvUsedBlocks: -1n }), /load: .*invalid uint64/);
    assert.throws(() => new Publisher({ addresses: [server.addr], hello: { ...hello(94n, "numbers"), totalKvBlocks: -5n } }), /hello: .*invalid uint64/);
    assert.equal(pub.unacked, 0);
    await pub.publish([stored(93_000n, 0, 1)]);
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    assert.equal(pub.stats.registrations, 1, "the stream never failed");
    await pub.close();
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});

test("errorInfo decodes the router's ErrorInfo: reason, domain and metadata", async () => {
  const server = await startRouter("--max-batch-blocks", "2");
  const t = openTransport(server.addr);
  try {
    const raw = createClient(WorkerService, t.transport);
    async function* requests() {
      yield create(PublishRequestSchema, { message: { case: "hello", value: { ...hello(95n, "info"), freshStart: true } } });
      yield create(PublishRequestSchema, { message: { case: "events", value: { events: [{ ...stored(95_000n, 0, 3), eventId: 0n }] } } });
      await sleep(2_000);
    }
    const err = await (async () => {
      try {
        for await (const _ of raw.publish(requests(), { timeoutMs: 5_000 })) {
          void _;
        }
      } catch (e) {
        return ConnectError.from(e);
      }
      return assert.fail("the router should refuse the batch");
    })();
    assert.equal(err.code, Code.ResourceExhausted);
    assert.deepEqual(errorInfo(err), {
      reason: "PUBLISH_BATCH_TOO_LARGE",
      domain: "kvrouter.v1",
      metadata: { field: "events.events", limit: "max_batch_blocks", max: "2", got: "3" },
    });
    assert.equal(errorInfo(new Error("plain")), undefined);
  } finally {
    t.close();
    await server.stop();
  }
});

/** Sends a hello and then msg on a raw Publish stream, and returns the error the router ends it with. */
async function refusal(addr: string, workerId: bigint, model: string, msg: MessageInitShape<typeof PublishRequestSchema>): Promise<ConnectError> {
  const t = openTransport(addr);
  try {
    const raw = createClient(WorkerService, t.transport);
    async function* requests() {
      yield create(PublishRequestSchema, { message: { case: "hello", value: { ...hello(workerId, model), freshStart: true } } });
      yield create(PublishRequestSchema, msg);
      await sleep(2_000); // keep the stream open until the router ends it
    }
    try {
      for await (const _ of raw.publish(requests(), { timeoutMs: 5_000 })) {
        void _;
      }
    } catch (e) {
      return ConnectError.from(e);
    }
    return assert.fail("the router should refuse the message");
  } finally {
    t.close();
  }
}

test("mm_hashes beside a tokens_hash, or more than 64, are refused before sending, as the router refuses them", async () => {
  const server = await startRouter();
  const pub = new Publisher({ addresses: [server.addr], hello: hello(97n, "mm-valid") });
  try {
    const bh = await loadBlockHasher();
    const cases: [KvEventInit, string][] = [
      [
        { storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks: [{ blockHash: 1n, tokenIds: [1, 2, 3, 4] }, { blockHash: 2n, tokensHash: bh.localMultimodal([5, 6, 7, 8], [9n]), mmHashes: [9n] }] } } },
        "events.events[0].stored.blocks[1].mm_hashes: must be empty with tokens_hash, which already holds them",
      ],
      [
        { storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks: [{ blockHash: 1n, tokenIds: [1, 2, 3, 4], mmHashes: Array.from({ length: 65 }, (_, i) => BigInt(i)) }] } } },
        "events.events[0].stored.blocks[0].mm_hashes: must hold at most 64 hashes (got 65)",
      ],
    ];
    for (const [ev, want] of cases) {
      const client = await pub.publish([ev]).then(() => assert.fail("publish should fail"), (e: unknown) => ConnectError.from(e));
      assert.equal(client.code, Code.InvalidArgument);
      assert.equal(client.rawMessage, want);
      const fromServer = await refusal(server.addr, 98n, "mm-valid", { message: { case: "events", value: { events: [{ ...create(KvEventSchema, ev), eventId: 0n }] } } });
      assert.equal(fromServer.code, Code.InvalidArgument);
      assert.equal(fromServer.rawMessage, want, "the router says the same");
    }
    await assert.rejects(
      pub.publish([{ storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks: [{ blockHash: 1n, tokenIds: [1, 2, 3, 4], mmHashes: [-1n] }] } } }]),
      /stored\.blocks\[0\]\.mm_hashes\[0\]: must be a uint64 \(got -1\)/,
    );
    assert.equal(pub.unacked, 0);
    // 64 is the limit.
    await pub.publish([{ storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks: [{ blockHash: 1n, tokenIds: [1, 2, 3, 4], mmHashes: Array.from({ length: 64 }, (_, i) => BigInt(i)) }] } } }]);
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    assert.equal((await server.workers("mm-valid")).find((w) => w.worker?.workerId === 97n)?.cachedBlocks?.device, 1n);
    await pub.close();
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});

/** Says whether the router lists worker id among the model's workers. */
const listed = async (server: RouterProcess, model: string, id: bigint): Promise<boolean> => (await server.workers(model)).some((w) => w.worker?.workerId === id);

/** Expects a Route for the model to fail with NOT_FOUND: no worker serves it. */
async function assertNoWorker(server: RouterProcess, model: string): Promise<void> {
  const router = new Router({ address: server.addr });
  try {
    const err = await router.route({ model, tokenIds: [1, 2, 3, 4], queryOnly: true }).then(() => assert.fail("the route should fail"), (e: unknown) => ConnectError.from(e));
    assert.equal(err.code, Code.NotFound, `route: ${err.message}`);
  } finally {
    router.close();
  }
}

test("leave removes the worker at once, blocks and all, and closes the publisher", async () => {
  const server = await startRouter();
  const pub = new Publisher({ addresses: [server.addr], hello: hello(111n, "leaving") });
  try {
    await pub.publish([stored(111_000n, 0, 3)]);
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    assert.equal((await server.workers("leaving"))[0]?.cachedBlocks?.device, 3n);
    await pub.leave("engine down", { signal: AbortSignal.timeout(5_000) });
    assert.equal(await listed(server, "leaving", 111n), false, "the router no longer lists the worker");
    await assertNoWorker(server, "leaving");
    // The server's stderr may reach this process after the stream's end does.
    await waitFor("the router to log the leave", () => /"msg":"worker left: removed with its blocks","worker":"111\/0".*"reason":"engine down"/.test(server.log()));
    await assert.rejects(pub.publish([stored(111_000n, 3, 1)]), PublisherClosedError);
    await assert.rejects(pub.leave("again"), PublisherClosedError);
    await pub.close(); // harmless after a leave
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});

test("leave drops unacked events and reconnects to send it", async () => {
  const first = await startRouter();
  const port = Number(first.addr.split(":")[1]);
  let second: RouterProcess | undefined;
  const pub = new Publisher({ addresses: [first.addr], hello: hello(112n, "leaving"), minBackoffMs: 10, maxBackoffMs: 100 });
  try {
    await pub.publish([stored(112_000n, 0, 3)]);
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    await first.stop(); // embedded mode: the next router on the port knows nothing of the worker
    await pub.publish([stored(112_000n, 3, 2)]);
    assert.equal(pub.unacked, 1);
    let settled = false;
    const leaving = pub.leave("engine down", { signal: AbortSignal.timeout(10_000) }).finally(() => (settled = true));
    leaving.catch(() => undefined); // awaited below
    assert.equal(pub.unacked, 0, "the unacked events were dropped");
    await sleep(300);
    assert.equal(settled, false, "leave() waits for a router to confirm it");
    second = await startRouterOn(port);
    await leaving;
    assert.equal(pub.stats.registrations, 2, "the leave went on a new stream");
    assert.equal(await listed(second, "leaving", 112n), false);
    await assertNoWorker(second, "leaving");
    const s = second;
    await waitFor("the new router to log the leave", () => /"msg":"worker left: removed with its blocks","worker":"112\/0"/.test(s.log()));
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await first.stop();
    await second?.stop();
  }
});

test("a leave abandoned by its signal closes the publisher", async () => {
  const dead = `127.0.0.1:${await freePort()}`; // nobody listens there: nothing is confirmed
  const pub = new Publisher({ addresses: [dead], hello: hello(113n, "leaving"), minBackoffMs: 10, maxBackoffMs: 50 });
  await pub.publish([stored(113_000n, 0, 1)]);
  const err = await pub.leave("engine down", { signal: AbortSignal.timeout(300) }).then(() => assert.fail("leave should fail"), (e: unknown) => e as Error);
  assert.equal(err.name, "TimeoutError", "it rejects with the signal's reason");
  assert.equal(pub.unacked, 0);
  assert.match(String(pub.error), /closed before the router confirmed the leave/);
  await assert.rejects(pub.publish([stored(113_000n, 1, 1)]), /closed before the router confirmed the leave/);
});

test("a leave reason over 256 bytes is refused before sending, as the router refuses it", async () => {
  const server = await startRouter();
  const pub = new Publisher({ addresses: [server.addr], hello: hello(114n, "leaving") });
  try {
    const reason = "é".repeat(128) + "x"; // 129 characters, 257 bytes: the limit is in bytes
    const want = "leave.reason: must be at most 256 bytes (got 257)";
    await pub.publish([stored(114_000n, 0, 1)]);
    const client = await pub.leave(reason).then(() => assert.fail("leave should fail"), (e: unknown) => ConnectError.from(e));
    assert.equal(client.code, Code.InvalidArgument);
    assert.equal(client.rawMessage, want);
    assert.equal(pub.error, undefined, "a refused leave changes nothing");
    await pub.publish([stored(114_000n, 1, 1)]);
    await pub.flush({ signal: AbortSignal.timeout(5_000) });
    assert.equal((await server.workers("leaving")).find((w) => w.worker?.workerId === 114n)?.cachedBlocks?.device, 2n);
    const fromServer = await refusal(server.addr, 115n, "leaving", { message: { case: "leave", value: { reason } } });
    assert.equal(fromServer.code, Code.InvalidArgument);
    assert.equal(fromServer.rawMessage, want, "the router says the same");
    assert.equal(await listed(server, "leaving", 115n), true, "a refused leave removes nothing");
    await pub.leave(reason.slice(0, -1), { signal: AbortSignal.timeout(5_000) }); // 256 bytes: at the limit
    assert.equal(await listed(server, "leaving", 114n), false);
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
    await server.stop();
  }
});

test("a route right after `await publisher.flush()` sees every block published before it, 50 times in a row", async () => {
  // publish() only queues (the batch goes out within flushIntervalMs); flush() resolves once the router
  // acked, that is applied, every event published before it. So a Route sent after it sees them all.
  const server = await startRouter();
  const pub = new Publisher({ addresses: [server.addr], hello: hello(121n, "flushed") });
  const router = new Router({ address: server.addr });
  try {
    for (let round = 0; round < 50; round++) {
      // A prompt of its own each round (its first token differs), so only this round's blocks match it.
      const base = round * 1000;
      const blocks = Array.from({ length: 6 }, (_, i) => ({
        blockHash: BigInt(121_000_000 + base + i),
        tokenIds: Array.from({ length: BS }, (_, j) => base + i * BS + j + 1),
      }));
      await pub.publish([{ storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks } } }]);
      await pub.flush();
      const route = await router.route({ model: "flushed", tokenIds: [...blocks.flatMap((b) => b.tokenIds), base + 999] });
      try {
        assert.equal(route.response.decode?.workerId, 121n);
        assert.equal(route.response.diagnostics?.decode?.overlapBlocks?.device, 6n, `round ${round}: the route after flush() overlaps every block`);
      } finally {
        await route.free();
      }
    }
    assert.equal(pub.unacked, 0);
  } finally {
    router.close();
    await pub.close({ signal: AbortSignal.timeout(5_000) }).catch(() => undefined);
    await server.stop();
  }
});

test("the publisher's defaults are the Go client's (256 events a batch, 2 ms, 65,536 unacked, 16,384 blocks a dump part)", async () => {
  const go = readFileSync(path.join(REPO_DIR, "clients/go/kvclient/publisher.go"), "utf8");
  const goDefault = (field: string): string => {
    const m = go.match(new RegExp(`opts\\.${field} = ([^\\n]+)`));
    assert.ok(m, `clients/go/kvclient/publisher.go sets no default for ${field}`);
    return m[1]!.trim();
  };
  const goInt = (expr: string): number => {
    const e = expr.replaceAll("_", "");
    const shift = e.match(/^(\d+) << (\d+)$/);
    if (shift) {
      return Number(shift[1]) * 2 ** Number(shift[2]);
    }
    assert.match(e, /^\d+$/);
    return Number(e);
  };
  assert.equal(DEFAULT_MAX_BATCH_EVENTS, goInt(goDefault("MaxBatchEvents")));
  assert.equal(DEFAULT_MAX_UNACKED, goInt(goDefault("MaxUnacked")));
  assert.equal(DEFAULT_MAX_DUMP_BLOCKS, goInt(goDefault("MaxDumpBlocks")));
  const flush = goDefault("FlushInterval").match(/^(\d+) \* time\.Millisecond$/);
  assert.ok(flush, `FlushInterval default: ${goDefault("FlushInterval")}`);
  assert.equal(DEFAULT_FLUSH_INTERVAL_MS, Number(flush[1]));
  assert.deepEqual([DEFAULT_MAX_BATCH_EVENTS, DEFAULT_FLUSH_INTERVAL_MS, DEFAULT_MAX_UNACKED, DEFAULT_MAX_DUMP_BLOCKS], [256, 2, 65_536, 16_384]);

  // And a publisher without options uses them: 600 events queued at once go out in 256 + 256 + 88.
  const server = await startRouter();
  const pub = new Publisher({ addresses: [server.addr], hello: hello(122n, "defaults") });
  try {
    await pub.ready;
    await pub.publish(Array.from({ length: 600 }, (_, i) => stored(122_000n, i, 1)));
    await pub.flush();
    assert.equal(pub.stats.batches, 3);
    assert.equal((await server.workers("defaults"))[0]?.cachedBlocks?.device, 600n);
  } finally {
    await pub.close({ signal: AbortSignal.timeout(5_000) }).catch(() => undefined);
    await server.stop();
  }
});
