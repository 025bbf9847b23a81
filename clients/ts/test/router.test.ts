import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { Code, ConnectError, createClient, type Interceptor } from "@connectrpc/connect";
import { create } from "@bufbuild/protobuf";
import { openTransport, Publisher, Router, RouteRequestSchema, RouterService, StorageTier, WorkerRole } from "../src/index.js";
import { chain, startRouter, type RouterProcess } from "./helpers.js";

let server: RouterProcess;
let publisher: Publisher;
let router: Router;
const MODEL = "m";

before(async () => {
  server = await startRouter("--max-prompt-tokens", "64");
  publisher = new Publisher({
    addresses: [server.addr],
    hello: { workerId: 5n, model: MODEL, role: WorkerRole.AGGREGATED, blockSize: 4, totalKvBlocks: 1000n, endpoint: "10.0.0.5:8000", kvEventsEnabled: true, freshStart: true },
  });
  await publisher.publish([{ storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks: chain(500n, 0, 4, 4) } } }]);
  await publisher.flush();
  router = new Router({ address: server.addr, maxPromptTokens: 64 });
});

after(async () => {
  router.close();
  await publisher.close();
  await server.stop();
});

const prompt = Array.from({ length: 20 }, (_, i) => i + 1);
const activeRequests = async (): Promise<bigint | undefined> => (await server.workers(MODEL))[0]?.load?.activeRequests;

test("free and prefillComplete are idempotent", async () => {
  const h = await router.route({ model: MODEL, tokenIds: prompt });
  assert.equal(h.response.decode?.workerId, 5n);
  assert.ok(h.requestId !== "", "a random request id was assigned");
  assert.equal(await activeRequests(), 1n);
  await Promise.all([h.prefillComplete(), h.prefillComplete()]);
  await Promise.all([h.free(), h.free(), h.free()]);
  await h.free();
  await h.prefillComplete(); // after free: nothing to do
  assert.equal(h.isFreed, true);
  assert.equal(await activeRequests(), 0n);
});

test("a booking freed elsewhere (NOT_FOUND) counts as freed", async () => {
  const h = await router.route({ model: MODEL, tokenIds: prompt, requestId: "freed-elsewhere" });
  const t = openTransport(server.addr);
  await createClient(RouterService, t.transport).free({ requestId: "freed-elsewhere" });
  t.close();
  await h.free();
  assert.equal(h.isFreed, true);
});

test("withRoute frees when the work returns or throws", async () => {
  const v = await router.withRoute({ model: MODEL, tokenIds: prompt }, async (h) => {
    assert.equal(await activeRequests(), 1n);
    return h.response.decode?.endpoint;
  });
  assert.equal(v, "10.0.0.5:8000");
  assert.equal(await activeRequests(), 0n);

  let handle: { isFreed: boolean } | undefined;
  await assert.rejects(
    router.withRoute({ model: MODEL, tokenIds: prompt }, async (h) => {
      handle = h;
      assert.equal(await activeRequests(), 1n);
      throw new Error("engine failed");
    }),
    /engine failed/,
  );
  assert.equal(handle?.isFreed, true);
  assert.equal(await activeRequests(), 0n);
});

test("withRoute frees as soon as the AbortSignal fires", async () => {
  const ac = new AbortController();
  let freedWhileRunning: bigint | undefined;
  await assert.rejects(
    router.withRoute(
      { model: MODEL, tokenIds: prompt },
      async (h, signal) => {
        assert.equal(await activeRequests(), 1n);
        ac.abort(new Error("client went away"));
        assert.equal(signal.aborted, true);
        // The booking is freed while the work is still running.
        for (let i = 0; i < 100 && !h.isFreed; i++) {
          await new Promise((r) => setTimeout(r, 10));
        }
        freedWhileRunning = await activeRequests();
        signal.throwIfAborted();
      },
      { signal: ac.signal },
    ),
    /client went away/,
  );
  assert.equal(freedWhileRunning, 0n);
  assert.equal(await activeRequests(), 0n);
});

test("asyncDispose frees the booking", async () => {
  {
    await using h = await router.route({ model: MODEL, tokenIds: prompt });
    assert.equal(h.isFreed, false);
    assert.equal(await activeRequests(), 1n);
  }
  assert.equal(await activeRequests(), 0n);
});

test("requests the router would refuse fail before sending, with the router's message", async () => {
  const long = Array.from({ length: 65 }, (_, i) => i);
  const t = openTransport(server.addr);
  const raw = createClient(RouterService, t.transport);
  try {
    const cases = [
      { model: MODEL, tokenIds: long, requestId: "r-long" },
      { model: MODEL, tokenIds: [], requestId: "r-empty" },
      { model: "", tokenIds: prompt, requestId: "r-nomodel" },
      { model: MODEL, tokenIds: prompt, requestId: "x".repeat(513) },
      // Multimodal inputs against the prompt's 20 tokens.
      { model: MODEL, tokenIds: prompt, requestId: "r-mm", multimodalObjects: [{ mmHash: 1n, start: 2, end: 2 }] },
      { model: MODEL, tokenIds: prompt, requestId: "r-mm", multimodalObjects: [{ mmHash: 1n, start: 0, end: 4 }, { mmHash: 2n, start: 18, end: 21 }] },
      { model: MODEL, tokenIds: prompt, requestId: "r-mm", multimodalObjects: [{ mmHash: 1n, start: 0, end: 4 }, { mmHash: 2n, start: 3, end: 6 }] },
      { model: MODEL, tokenIds: prompt, requestId: "r-mm", multimodalObjects: [{ mmHash: 1n, start: 5, end: 7 }, { mmHash: 2n, start: 0, end: 6 }] },
      { model: MODEL, tokenIds: prompt, requestId: "r-mm", multimodalObjects: Array.from({ length: 257 }, (_, i) => ({ mmHash: BigInt(i), start: i % 20, end: (i % 20) + 1 })) },
    ];
    const wantMultimodal = [
      "multimodal_objects[0].end: must be greater than start 2 (got 2)",
      "multimodal_objects[1].end: must be at most the number of token_ids 20 (got 21)",
      "multimodal_objects[1]: tokens [3, 6) overlap those of multimodal_objects[0], [0, 4)",
      "multimodal_objects[0]: tokens [5, 7) overlap those of multimodal_objects[1], [0, 6)",
      "multimodal_objects: must hold at most 256 inputs (got 257)",
    ];
    const messages: string[] = [];
    for (const c of cases) {
      const client = await router.route(c).then(
        () => assert.fail("route should have failed"),
        (e: unknown) => ConnectError.from(e),
      );
      const fromServer = await raw.route(c).then(
        () => assert.fail("the server should have refused"),
        (e: unknown) => ConnectError.from(e),
      );
      assert.equal(client.code, Code.InvalidArgument);
      assert.equal(client.rawMessage, fromServer.rawMessage, "the client's message is the server's");
      assert.equal(fromServer.code, Code.InvalidArgument);
      messages.push(client.rawMessage);
    }
    assert.deepEqual(messages.slice(-wantMultimodal.length), wantMultimodal);
    assert.match((await router.route(cases[0]!).catch((e: unknown) => ConnectError.from(e))).toString(), /has 65 tokens, more than the maximum of 64/);
  } finally {
    t.close();
  }
  assert.equal(await activeRequests(), 0n);
});

test("interceptors see every call, with the headers they add", async () => {
  const seen: string[] = [];
  const auth: Interceptor = (next) => async (req) => {
    req.header.set("authorization", "Bearer test-token");
    return next(req);
  };
  const record: Interceptor = (next) => async (req) => {
    seen.push(`${req.method.name} ${req.header.get("authorization") ?? "-"}`);
    return next(req);
  };
  const r = new Router({ address: server.addr, interceptors: [auth, record] });
  try {
    await r.withRoute({ model: MODEL, tokenIds: prompt }, async (h) => {
      await h.prefillComplete();
    });
  } finally {
    r.close();
  }
  assert.deepEqual(seen, ["Route Bearer test-token", "MarkPrefillComplete Bearer test-token", "Free Bearer test-token"]);
  assert.equal(await activeRequests(), 0n);
});

test("a RouteRequest message can be routed twice: each call gets its own request id", async () => {
  const req = create(RouteRequestSchema, { model: MODEL, tokenIds: prompt });
  await using a = await router.route(req);
  await using b = await router.route(req);
  assert.notEqual(a.requestId, b.requestId);
  assert.equal(req.requestId, "", "the caller's message is not changed");
  assert.equal(await activeRequests(), 2n);
});
