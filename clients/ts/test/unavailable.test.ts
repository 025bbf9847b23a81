// Ends and routes that a router sharing its state through Redis cannot answer yet (UNAVAILABLE with
// reason LOG_UNAVAILABLE) are retried: a private redis-server and a real `kvrouter serve --redis-addr`.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Code, ConnectError, createClient, type Interceptor } from "@connectrpc/connect";
import { errorReason, openTransport, Publisher, retryDelayMs, Router, RouterService, StorageTier, WorkerRole } from "../src/index.js";
import { chain, startRedis, startRouter, waitFor, type RedisProcess, type RouterProcess } from "./helpers.js";

const MODEL = "m";
const prompt = Array.from({ length: 20 }, (_, i) => i + 1);

/** A private Redis and one router on it; cleanup stops both, whatever state the test left them in. */
async function sharedState(reseedWindow: string): Promise<{ redis: RedisProcess; server: RouterProcess; cleanup: (() => Promise<void> | void)[] }> {
  const redis = await startRedis();
  const cleanup: (() => Promise<void> | void)[] = [() => redis.stop(), () => redis.resume()];
  try {
    const server = await startRouter("--redis-addr", redis.addr, "--redis-reseed-window", reseedWindow);
    cleanup.push(() => server.stop());
    return { redis, server, cleanup };
  } catch (err) {
    await redis.stop();
    throw err;
  }
}

async function runCleanup(cleanup: (() => Promise<void> | void)[]): Promise<void> {
  for (const c of cleanup.reverse()) {
    await c();
  }
}

/** Registers worker id for MODEL with one stored block, and waits for the router's ack. */
async function register(server: RouterProcess, id: bigint, cleanup: (() => Promise<void> | void)[]): Promise<void> {
  const p = new Publisher({
    addresses: [server.addr],
    hello: { workerId: id, model: MODEL, role: WorkerRole.AGGREGATED, blockSize: 4, totalKvBlocks: 1000n, endpoint: `10.0.1.${id}:8000`, kvEventsEnabled: true, freshStart: true },
  });
  cleanup.push(() => p.close().catch(() => undefined));
  await p.publish([{ storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks: chain(500n, 0, 1, 4) } } }]);
  await p.flush();
}

const code = (err: unknown): Code => ConnectError.from(err).code;

/** The error of a call the router could not accept yet: its answer, or the call's time running out first. */
const late = (err: unknown): boolean => code(err) === Code.Unavailable || code(err) === Code.DeadlineExceeded;

test("free and prefillComplete the router cannot accept yet are retried in the background", async () => {
  const { redis, server, cleanup } = await sharedState("1s");
  try {
    await waitFor("the replica's shared state to be complete", async () => (await server.admin.getState({})).sharedStateComplete, 10_000);
    await register(server, 40n, cleanup);
    const router = new Router({ address: server.addr });
    cleanup.push(() => void router.close());
    const t = openTransport(server.addr);
    cleanup.push(() => t.close());
    const raw = createClient(RouterService, t.transport);
    const active = async (): Promise<bigint | undefined> => (await server.workers(MODEL))[0]?.load?.activeRequests;

    const held = await router.route({ model: MODEL, tokenIds: prompt }); // booked on this replica
    assert.equal(await active(), 1n);
    redis.pause();
    await waitFor("the replica to say it cannot tell who holds a request it does not hold", () =>
      raw.free({ requestId: "probe" }, { timeoutMs: 300 }).then(() => false, (err: unknown) => code(err) === Code.Unavailable), 10_000);

    // A request this replica does not hold may be held, unpublished, by another replica: with Redis
    // unreachable it cannot tell, and says so. free() retries until its timeout, rejects with the last
    // error, and hands the Free to the background.
    const gone = router.existing("routed-elsewhere");
    const t0 = performance.now();
    const err = await gone.free({ timeoutMs: 500 }).then(() => assert.fail("free should have failed"), (e: unknown) => e);
    // At least one retry, after the router's 250 ms RetryInfo, jittered to no less than half: free()
    // hands over to the background once the next wait would pass its timeout.
    assert.ok(performance.now() - t0 >= 100, "free() gave up at once instead of retrying");
    // The last try may run out of the call's time before the router answers it.
    assert.ok(late(err), `free() rejected with ${code(err)}, want UNAVAILABLE or DEADLINE_EXCEEDED`);
    // What the router answers, given the time to: UNAVAILABLE, LOG_UNAVAILABLE, retry after 250 ms.
    const answer = await raw.free({ requestId: "routed-elsewhere" }, { timeoutMs: 5_000 }).then(() => assert.fail("the router freed it"), (e: unknown) => e);
    assert.equal(code(answer), Code.Unavailable);
    assert.equal(errorReason(answer), "LOG_UNAVAILABLE");
    assert.equal(retryDelayMs(answer), 250);
    assert.equal(gone.isFreed, true, "the background retry owns the Free now");
    assert.equal(router.pendingEnds, 1);
    await gone.free(); // nothing more to do: no second retry of the same Free
    assert.equal(router.pendingEnds, 1);
    // MarkPrefillComplete goes the same way.
    await assert.rejects(router.existing("prefilled-elsewhere").prefillComplete({ timeoutMs: 300 }), late);
    assert.equal(router.pendingEnds, 2);
    // A booking this replica holds is freed at once, locally, while Redis is unreachable: the first
    // call is accepted, nothing goes to the background.
    await held.free({ timeoutMs: 5_000 });
    assert.equal(router.pendingEnds, 2);
    assert.equal(await active(), 0n);
    // A booking is made on this replica after the Free was sent (as another replica's booking becomes
    // visible once it is published): the retried Free finds it and frees it.
    await assert.rejects(router.existing("routed-later").free({ timeoutMs: 300 }));
    assert.equal(router.pendingEnds, 3);
    await raw.route({ requestId: "routed-later", model: MODEL, tokenIds: [1, 2, 3] }, { timeoutMs: 5_000 });
    assert.equal(await active(), 1n);
    await waitFor("the retried Free to free the booking made after it", async () => router.pendingEnds === 2 && (await active()) === 0n);
    // Closing a Router gives up what it retries.
    const other = new Router({ address: server.addr });
    await assert.rejects(other.existing("closed-while-retried").free({ timeoutMs: 300 }));
    assert.equal(other.pendingEnds, 1);
    assert.equal(other.close(), 1);
    assert.equal(other.pendingEnds, 0);
    // Without background retries the Free only rejects, and a later call tries again.
    const once = new Router({ address: server.addr, endRetryForMs: 0 });
    cleanup.push(() => void once.close());
    const b = once.existing("not-retried");
    await assert.rejects(b.free({ timeoutMs: 300 }));
    assert.equal(once.pendingEnds, 0);
    assert.equal(b.isFreed, false);
    // Once Redis answers again, the replica can tell that nobody holds the others (NOT_FOUND).
    redis.resume();
    await waitFor("every pending end to finish after Redis came back", () => router.pendingEnds === 0, 10_000);
    assert.equal((await server.admin.getState({})).bookings, 0n);
  } finally {
    await runCleanup(cleanup);
  }
});

test("route is retried while the shared state may be incomplete", async () => {
  // On an empty Redis the replica's state may be incomplete for the reseed window: a replica holding
  // the lost state may still reseed the log. Meanwhile a Route for a model without workers is
  // UNAVAILABLE (LOG_UNAVAILABLE), not NOT_FOUND. The window is long enough for the whole test.
  const { server, cleanup } = await sharedState("8s");
  try {
    assert.equal((await server.admin.getState({})).sharedStateComplete, false);
    const t = openTransport(server.addr);
    cleanup.push(() => t.close());
    const err = await createClient(RouterService, t.transport).route({ requestId: "r0", model: MODEL, tokenIds: [1, 2, 3] }).then(
      () => assert.fail("the router routed a model without workers"),
      (e: unknown) => e,
    );
    assert.equal(code(err), Code.Unavailable);
    assert.equal(errorReason(err), "LOG_UNAVAILABLE");
    let routes = 0;
    const count: Interceptor = (next) => async (req) => {
      if (req.method.name === "Route") {
        routes++;
      }
      return next(req);
    };
    const router = new Router({ address: server.addr, interceptors: [count] });
    cleanup.push(() => void router.close());
    const routed = router.route({ model: MODEL, tokenIds: [1, 2, 3, 4, 5] }, { timeoutMs: 6_000 });
    routed.catch(() => undefined); // awaited below; a rejection before then is not unhandled
    await waitFor("the Route to be sent again", () => routes >= 2);
    await register(server, 41n, cleanup); // the worker the Route waited for
    const h = await routed;
    assert.equal(h.response.decode?.workerId, 41n);
    assert.equal((await server.admin.getState({})).sharedStateComplete, false, "the reseed window ended before the Route was answered: the test tested nothing");
    await h.free();
  } finally {
    await runCleanup(cleanup);
  }
});
