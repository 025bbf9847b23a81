import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { Code, ConnectError, createClient, type Client, type Interceptor } from "@connectrpc/connect";
import { clone, create, isMessage } from "@bufbuild/protobuf";
import {
  errorReason,
  hashPrompt,
  loadBlockHasher,
  openTransport,
  Publisher,
  Router,
  RouteRequestSchema,
  RouterService,
  StorageTier,
  WorkerRole,
  type BlockHasher,
  type OwnedTransport,
  type RouteHandle,
  type RouteInit,
  type RouteRequest,
} from "../src/index.js";
import { startRouter, type RouterProcess } from "./helpers.js";

// One prompt with a LoRA adapter, a cache namespace and an image, routed as token ids and as the block
// hashes of hashPrompt / route(req, { hashPrompt }), as the Go client's TestHashPrompt.
const BS = 4;
const MODEL = "hp";
const MAX_PROMPT_TOKENS = 64;
const PROMPT = Array.from({ length: 18 }, (_, i) => i + 1); // four blocks of 4, and two tokens more

let server: RouterProcess;
let publishers: Publisher[] = [];
let router: Router;
let raw: Client<typeof RouterService>;
let rawTransport: OwnedTransport;
let bh: BlockHasher;
let salt: bigint;
let image: bigint;
/** Every RouteRequest the router sent, as it went out. */
const sent: RouteRequest[] = [];

type MM = { mmHash: bigint; start: number; end: number };
/** The prompt's token-id request (query only), with its image in tokens [5, 9): blocks 1 and 2. */
const query = (tokenIds: number[] = PROMPT, multimodalObjects: MM[] = [{ mmHash: image, start: 5, end: 9 }]): RouteInit => ({
  requestId: "r-hp", model: MODEL, queryOnly: true, tokenIds, loraName: "l", cacheNamespace: "tenant", multimodalObjects,
});

before(async () => {
  server = await startRouter("--max-prompt-tokens", String(MAX_PROMPT_TOKENS));
  bh = await loadBlockHasher();
  salt = bh.salt("l", "tenant");
  await bh.load(salt);
  image = bh.multimodalHash("cat.png");
  const hello = (workerId: bigint) => ({ workerId, model: MODEL, role: WorkerRole.AGGREGATED, blockSize: BS, totalKvBlocks: 1000n, endpoint: `10.0.0.${workerId}:8000`, kvEventsEnabled: true, freshStart: true });
  const toks = Array.from({ length: 4 }, (_, i) => PROMPT.slice(i * BS, (i + 1) * BS));
  // Worker 61 caches the prompt's blocks as its engine reports them: token ids, salted with the adapter
  // and the namespace, with the image's hash. Worker 60 caches the same tokens without them: it would win
  // if the hashes missed the salt or the image.
  const plain = new Publisher({ addresses: [server.addr], hello: hello(60n) });
  const salted = new Publisher({ addresses: [server.addr], hello: hello(61n) });
  publishers = [plain, salted];
  await plain.publish([{ storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks: toks.map((tokenIds, i) => ({ blockHash: 800n + BigInt(i), tokenIds })) } } }]);
  await salted.publish([{
    storageTier: StorageTier.DEVICE,
    data: { case: "stored", value: { loraName: "l", cacheNamespace: "tenant", blocks: toks.map((tokenIds, i) => ({ blockHash: 700n + BigInt(i), tokenIds, mmHashes: i === 1 || i === 2 ? [image] : [] })) } },
  }]);
  await Promise.all(publishers.map((p) => p.flush()));
  const record: Interceptor = (next) => async (req) => {
    if (!req.stream && isMessage(req.message, RouteRequestSchema)) {
      sent.push(clone(RouteRequestSchema, req.message));
    }
    return next(req);
  };
  router = new Router({ address: server.addr, maxPromptTokens: MAX_PROMPT_TOKENS, interceptors: [record] });
  rawTransport = openTransport(server.addr);
  raw = createClient(RouterService, rawTransport.transport);
});

after(async () => {
  router.close();
  rawTransport.close();
  await Promise.all(publishers.map((p) => p.close()));
  await server.stop();
});

/** The decode worker, its device overlap, and every candidate's (explain). */
function decision(h: RouteHandle): { worker?: bigint; overlap?: bigint; candidates: string[] } {
  const d = h.response.diagnostics;
  const candidates = (d?.candidates ?? []).map((c) => `${c.worker?.workerId}/${c.hop}/${c.overlapBlocks?.device}`).sort();
  return { worker: h.response.decode?.workerId, overlap: d?.decode?.overlapBlocks?.device, candidates };
}

const activeRequests = async (workerId: bigint): Promise<bigint | undefined> =>
  (await server.workers(MODEL)).find((w) => w.worker?.workerId === workerId)?.load?.activeRequests;

/** The router's answer to a request sent as it is: its INVALID_ARGUMENT. */
async function serverError(req: RouteInit): Promise<ConnectError> {
  const err = await raw.route(req).then(
    () => assert.fail(`the router accepted ${JSON.stringify(req, (_, v: unknown) => (typeof v === "bigint" ? String(v) : v))}`),
    (e: unknown) => ConnectError.from(e),
  );
  assert.equal(err.code, Code.InvalidArgument);
  return err;
}

/** What a promise rejects with, as a ConnectError. */
const refusal = (p: Promise<unknown>): Promise<ConnectError> => p.then(() => assert.fail("it should have been refused"), (e: unknown) => ConnectError.from(e));

test("a prompt routed as its block hashes goes to the same worker with the same overlap as its token ids", async () => {
  const want = decision(await router.route({ ...query(), explain: true }));
  assert.equal(want.worker, 61n);
  assert.equal(want.overlap, 4n);
  assert.equal(want.candidates.length, 2, want.candidates.join(", "));
  assert.ok(want.candidates.some((c) => c.startsWith("60/") && c.endsWith("/0")) && want.candidates.some((c) => c.startsWith("61/") && c.endsWith("/4")), want.candidates.join(", "));

  const init = { ...query(), explain: true };
  const hashed = await router.route(init, { hashPrompt: BS });
  assert.deepEqual(decision(hashed), want);
  const d = hashed.response.diagnostics;
  assert.deepEqual([d?.promptTokens, d?.promptBlocks, d?.blockSize], [18n, 4n, 4]);
  // On the wire: the hashes, the block size and the length, nothing else of the prompt.
  const keys = bh.locals(PROMPT, BS, salt, [{ mmHash: image, start: 5, end: 9 }]);
  const wire = sent.at(-1)!;
  assert.deepEqual(wire.blockHashes, keys);
  assert.deepEqual([wire.blockSize, wire.promptTokens, wire.tokenIds, wire.loraName, wire.cacheNamespace, wire.multimodalObjects], [4, 18, [], "", "", []]);
  // The caller's request is not changed.
  assert.deepEqual([init.tokenIds, init.loraName, init.blockHashes, init.blockSize], [PROMPT, "l", undefined, undefined]);

  // hashPrompt on a message, booked through withRoute.
  const msg = create(RouteRequestSchema, query());
  msg.queryOnly = false;
  msg.requestId = "";
  await hashPrompt(msg, BS);
  assert.deepEqual(msg, create(RouteRequestSchema, { model: MODEL, blockHashes: keys, blockSize: BS, promptTokens: 18 }));
  await router.withRoute(msg, async (h) => {
    assert.deepEqual([h.response.decode?.workerId, h.response.diagnostics?.decode?.overlapBlocks?.device], [61n, 4n]);
    assert.equal(await activeRequests(61n), 1n);
  });
  assert.equal(await activeRequests(61n), 0n);
  // And on an object literal, with the caller's own hasher.
  const literal = query();
  await hashPrompt(literal, BS, bh);
  assert.deepEqual([literal.blockHashes, literal.blockSize, literal.promptTokens, literal.tokenIds, literal.loraName, literal.cacheNamespace, literal.multimodalObjects], [keys, BS, 18, [], "", "", []]);

  // The caller's own keys, for a prompt of one block more than the cached ones: 4 of 5 match.
  const own = bh.locals([...PROMPT.slice(0, 16), 90, 91, 92, 93, 94], BS, salt, [{ mmHash: image, start: 5, end: 9 }]);
  const r = await router.route({ model: MODEL, queryOnly: true, blockHashes: own, blockSize: BS, promptTokens: 21 });
  assert.deepEqual([r.response.decode?.workerId, r.response.diagnostics?.decode?.overlapBlocks?.device, r.response.diagnostics?.promptBlocks], [61n, 4n, 5n]);
});

test("a prompt hashed for another block size is refused with FAILED_PRECONDITION", async () => {
  for (const queryOnly of [true, false]) {
    const err = await refusal(router.route({ ...query(), queryOnly }, { hashPrompt: 8 }));
    assert.equal(err.code, Code.FailedPrecondition);
    assert.equal(errorReason(err), "BLOCK_SIZE_MISMATCH");
    assert.match(err.rawMessage, /block_size 8, but model "hp" has blocks of 4 tokens/);
    assert.equal(sent.at(-1)?.blockSize, 8);
  }
  assert.equal(await activeRequests(61n), 0n);
  assert.equal(await activeRequests(60n), 0n);
});

test("hashPrompt and route's hashPrompt refuse what the router refuses in the token ids, with its message", async () => {
  const before = sent.length;
  const cases: [RouteInit, string][] = [
    [query([], []), "token_ids: must not be empty"],
    [query(PROMPT, [{ mmHash: image, start: 5, end: 19 }]), "multimodal_objects[0].end: must be at most the number of token_ids 18 (got 19)"],
    [query(PROMPT, [{ mmHash: image, start: 5, end: 5 }]), "multimodal_objects[0].end: must be greater than start 5 (got 5)"],
    [query(PROMPT, [{ mmHash: image, start: 5, end: 9 }, { mmHash: 1n, start: 2, end: 6 }]), "multimodal_objects[0]: tokens [5, 9) overlap those of multimodal_objects[1], [2, 6)"],
    [query(PROMPT, Array.from({ length: 257 }, (_, i) => ({ mmHash: BigInt(i), start: i % 18, end: (i % 18) + 1 }))), "multimodal_objects: must hold at most 256 inputs (got 257)"],
  ];
  for (const [req, want] of cases) {
    assert.equal((await serverError(req)).rawMessage, want);
    const copy = structuredClone(req);
    const err = await refusal(hashPrompt(req, BS));
    assert.equal(err.code, Code.InvalidArgument);
    assert.equal(err.rawMessage, want);
    assert.deepEqual(req, copy, "a refused hashPrompt changed the request");
    const msg = create(RouteRequestSchema, req);
    const msgCopy = create(RouteRequestSchema, req);
    assert.equal((await refusal(hashPrompt(msg, BS))).rawMessage, want);
    assert.deepEqual(msg, msgCopy, "a refused hashPrompt changed the message");
    assert.equal((await refusal(router.route(req, { hashPrompt: BS }))).rawMessage, want);
  }
  // More tokens than maxPromptTokens: route checks the token ids, as the router does; a request hashed
  // by hashPrompt is checked by its promptTokens, as the router checks it.
  const long = query(Array.from({ length: 65 }, (_, i) => i + 1), []);
  const want = (await serverError(long)).rawMessage;
  assert.equal(want, "token_ids: has 65 tokens, more than the maximum of 64 (max_prompt_tokens)");
  assert.equal((await refusal(router.route(long, { hashPrompt: BS }))).rawMessage, want);
  await hashPrompt(long, BS);
  const hashedWant = (await serverError(long)).rawMessage;
  assert.equal(hashedWant, "prompt_tokens: is 65, more than the maximum of 64 (max_prompt_tokens)");
  assert.equal((await refusal(router.route(long))).rawMessage, hashedWant);
  // Block sizes that are not one.
  for (const [size, message] of [
    [0, "block_size: must be at least 1 (got 0)"],
    [-1, "block_size: must be at least 1 (got -1)"],
    [1.5, "block_size: must be a uint32 (got 1.5)"],
    [2 ** 32, "block_size: must be a uint32 (got 4294967296)"],
  ] as const) {
    const err = await refusal(hashPrompt(query(), size));
    assert.deepEqual([err.code, err.rawMessage], [Code.InvalidArgument, message]);
    assert.equal((await refusal(router.route(query(), { hashPrompt: size }))).rawMessage, message);
  }
  assert.equal(sent.length, before, "nothing refused was sent");
});

test("hashed requests the router would refuse fail before sending, with the router's message", async () => {
  const ok = { requestId: "r-h", model: MODEL, queryOnly: true, blockHashes: [1n, 2n, 3n, 4n], blockSize: BS, promptTokens: 18 };
  const cases: [RouteInit, string][] = [
    [{ ...ok, tokenIds: [1] }, "token_ids: must be empty with block_size and block_hashes (fold it into the hashes)"],
    [{ ...ok, loraName: "l" }, "lora_name: must be empty with block_size and block_hashes (fold it into the hashes)"],
    [{ ...ok, cacheNamespace: "tenant" }, "cache_namespace: must be empty with block_size and block_hashes (fold it into the hashes)"],
    [{ ...ok, multimodalObjects: [{ mmHash: 1n, start: 0, end: 1 }] }, "multimodal_objects: must be empty with block_size and block_hashes (fold it into the hashes)"],
    [{ ...ok, promptTokens: 0 }, "prompt_tokens: must be at least 1 with block_hashes"],
    [{ ...ok, promptTokens: 15 }, "prompt_tokens: must be in [16, 20): 4 block_hashes of block_size 4 and a partial block (got 15)"],
    [{ ...ok, promptTokens: 20 }, "prompt_tokens: must be in [16, 20): 4 block_hashes of block_size 4 and a partial block (got 20)"],
    [{ ...ok, blockHashes: [], promptTokens: 4 }, "prompt_tokens: must be in [0, 4): 0 block_hashes of block_size 4 and a partial block (got 4)"],
    [{ ...ok, blockHashes: Array.from({ length: 16 }, () => 7n), promptTokens: 65 }, "prompt_tokens: is 65, more than the maximum of 64 (max_prompt_tokens)"],
    [{ ...ok, blockSize: 0, tokenIds: [1, 2, 3] }, "block_size: must be set with block_hashes (the block size they were hashed with)"],
    [{ ...ok, blockSize: 0, blockHashes: [], tokenIds: [1, 2, 3] }, "prompt_tokens: must be set only with block_size and block_hashes (token_ids count themselves)"],
  ];
  const before = sent.length;
  for (const [req, want] of cases) {
    assert.equal((await serverError(req)).rawMessage, want);
    const err = await refusal(router.route(req));
    assert.deepEqual([err.code, err.rawMessage], [Code.InvalidArgument, want]);
  }
  assert.equal(sent.length, before, "nothing refused was sent");
  // The boundaries are accepted (made-up hashes match nothing).
  for (const change of [{}, { promptTokens: 16 }, { promptTokens: 19 }, { blockHashes: [], promptTokens: 3 }]) {
    const r = await router.route({ ...ok, ...change });
    assert.equal(r.response.diagnostics?.decode?.overlapBlocks?.device, 0n);
  }
  assert.equal(sent.length, before + 4);
});
