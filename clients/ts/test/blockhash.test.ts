import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import path from "node:path";
import { create } from "@bufbuild/protobuf";
import { BLOCK_HASH_SEED, ConnectError, hashPrompt, loadBlockHasher, Publisher, Router, RouteRequestSchema, StorageTier, WorkerRole, xxh3 } from "../src/index.js";
import { recordBlocks, REPO_DIR, startRouter } from "./helpers.js";

/** The router's golden vectors (kvstate/blockhash/testdata/hash_vectors.json); uint64s are decimal strings. */
interface Vectors {
  raw: { name: string; input_hex: string; seed: string; xxh3_64: string }[];
  cases: {
    name: string;
    block_size: number;
    lora_name: string;
    cache_namespace: string;
    tokens: number[];
    salt: string;
    local_hashes: string[];
    sequence_hashes: string[];
  }[];
  multimodal_ids: { identifier: string; mm_hash: string }[];
  multimodal_cases: {
    name: string;
    block_size: number;
    lora_name: string;
    cache_namespace: string;
    tokens: number[];
    /** In the order a caller sends them, not always sorted. */
    objects: { hash: string; start: number; end: number }[];
    salt: string;
    /** Per block, the sorted hashes it carries. */
    block_mm_hashes: string[][];
    local_hashes: string[];
    sequence_hashes: string[];
  }[];
}

const vectors = JSON.parse(readFileSync(path.join(REPO_DIR, "kvstate/blockhash/testdata/hash_vectors.json"), "utf8")) as Vectors;
const big = (xs: string[]): bigint[] => xs.map((x) => BigInt(x));

test("XXH3 matches every raw golden vector, seeds above 2^32 included", async () => {
  assert.ok(vectors.raw.length >= 30, `only ${vectors.raw.length} raw vectors`);
  assert.ok(vectors.raw.some((v) => BigInt(v.seed) > 0xffff_ffffn), "a seed above 2^32 is covered");
  for (const v of vectors.raw) {
    const got = await xxh3(Buffer.from(v.input_hex, "hex"), BigInt(v.seed));
    assert.equal(got, BigInt(v.xxh3_64), v.name);
  }
});

test("salt, local, locals, chain and sequence match every golden case", async () => {
  assert.ok(vectors.cases.length >= 20, `only ${vectors.cases.length} cases`);
  const bh = await loadBlockHasher();
  let blocks = 0;
  for (const c of vectors.cases) {
    const salt = bh.salt(c.lora_name, c.cache_namespace);
    assert.equal(salt, BigInt(c.salt), `${c.name}: salt`);
    await bh.load(salt);
    const locals = bh.locals(c.tokens, c.block_size, salt);
    assert.deepEqual(locals, big(c.local_hashes), `${c.name}: locals`);
    assert.deepEqual(bh.locals(Uint32Array.from(c.tokens), c.block_size, salt), locals, `${c.name}: locals of a Uint32Array`);
    for (const [i, l] of locals.entries()) {
      assert.equal(bh.local(c.tokens.slice(i * c.block_size, (i + 1) * c.block_size), salt), l, `${c.name}: local ${i}`);
    }
    const seq = bh.sequence(locals);
    assert.deepEqual(seq, big(c.sequence_hashes), `${c.name}: sequence`);
    for (let i = 1; i < seq.length; i++) {
      assert.equal(bh.chain(seq[i - 1]!, locals[i]!), seq[i], `${c.name}: chain ${i}`);
    }
    blocks += locals.length;
  }
  assert.ok(blocks > 300, `only ${blocks} blocks checked`);
});

test("a fresh BlockHasher hashes with 1337 at once and refuses salts it did not load", async () => {
  const c = vectors.cases.find((x) => x.name === "1800-b64-lora-a-ns-tenant-1")!;
  const fresh = await loadBlockHasher();
  assert.equal(fresh.salt(), BLOCK_HASH_SEED);
  assert.equal(fresh.salt("", ""), 1337n);
  assert.equal(fresh.hasSalt(1337n), true);
  const salt = fresh.salt(c.lora_name, c.cache_namespace);
  assert.throws(() => fresh.local(c.tokens.slice(0, 64), salt), /not loaded: await blockHasher.load/);
  const loaded = await loadBlockHasher(salt);
  assert.equal(loaded.local(c.tokens.slice(0, 64), salt), BigInt(c.local_hashes[0]!));

  const one = vectors.cases.find((x) => x.name === "one-block-16-b16")!;
  assert.equal(fresh.local(one.tokens), BigInt(one.local_hashes[0]!), "the default salt is 1337");
  assert.throws(() => fresh.local([1, -1]), RangeError);
  assert.throws(() => fresh.local([1, 2 ** 32]), RangeError);
  assert.throws(() => fresh.local([1.5]), RangeError);
  assert.throws(() => fresh.chain(-1n, 1n), RangeError);
  assert.throws(() => fresh.chain(1n, 1n << 64n), RangeError);
  assert.deepEqual(fresh.locals(one.tokens, 0), []);
  assert.deepEqual(fresh.sequence([]), []);
});

test("multimodalHash matches every multimodal identifier vector", async () => {
  assert.ok(vectors.multimodal_ids.length >= 10, `only ${vectors.multimodal_ids.length} identifiers`);
  const bh = await loadBlockHasher();
  for (const v of vectors.multimodal_ids) {
    assert.equal(bh.multimodalHash(v.identifier), BigInt(v.mm_hash), JSON.stringify(v.identifier));
  }
});

const objectsOf = (c: Vectors["multimodal_cases"][number]) => c.objects.map((o) => ({ mmHash: BigInt(o.hash), start: o.start, end: o.end }));

test("locals with multimodal objects, localMultimodal and sequence match every multimodal case", async () => {
  assert.ok(vectors.multimodal_cases.length >= 10, `only ${vectors.multimodal_cases.length} cases`);
  const bh = await loadBlockHasher();
  let carrying = 0;
  for (const c of vectors.multimodal_cases) {
    const salt = bh.salt(c.lora_name, c.cache_namespace);
    assert.equal(salt, BigInt(c.salt), `${c.name}: salt`);
    await bh.load(salt);
    const want = big(c.local_hashes);
    const objects = objectsOf(c); // in the order the file lists them
    assert.deepEqual(bh.locals(c.tokens, c.block_size, salt, objects), want, `${c.name}: locals`);
    assert.deepEqual(bh.locals(Uint32Array.from(c.tokens), c.block_size, salt, [...objects].reverse()), want, `${c.name}: locals of a Uint32Array, objects reversed`);
    assert.deepEqual(bh.sequence(want), big(c.sequence_hashes), `${c.name}: sequence`);
    assert.equal(c.block_mm_hashes.length, want.length, `${c.name}: blocks`);
    for (const [i, mm] of c.block_mm_hashes.entries()) {
      const block = c.tokens.slice(i * c.block_size, (i + 1) * c.block_size);
      const hashes = big(mm);
      assert.equal(bh.localMultimodal(block, hashes, salt), want[i], `${c.name}: localMultimodal ${i}`);
      assert.equal(bh.localMultimodal(block, [...hashes].reverse(), salt), want[i], `${c.name}: localMultimodal ${i}, hashes reversed`);
      if (hashes.length === 0) {
        assert.equal(bh.local(block, salt), want[i], `${c.name}: block ${i} carries nothing`);
      }
      carrying += hashes.length > 0 ? 1 : 0;
    }
  }
  assert.ok(carrying >= 15, `only ${carrying} blocks carry multimodal hashes`);
  assert.throws(() => bh.localMultimodal([1, 2, 3, 4], [1n << 64n]), RangeError);
  assert.throws(() => bh.locals([1, 2, 3, 4], 4, BLOCK_HASH_SEED, [{ mmHash: -1n, start: 0, end: 4 }]), RangeError);
  assert.throws(() => bh.locals([1, 2, 3, 4], 4, BLOCK_HASH_SEED, [{ mmHash: 1n, start: -1, end: 4 }]), RangeError);
  assert.throws(() => bh.locals([1, 2, 3, 4], 4, BLOCK_HASH_SEED, [{ mmHash: 1n, start: 0, end: 2 ** 32 }]), RangeError);
  assert.equal(bh.localMultimodal([1, 2, 3, 4], []), bh.local([1, 2, 3, 4]));
  const ten = Array.from({ length: 10 }, (_, i) => i);
  assert.deepEqual(bh.locals(ten, 4, BLOCK_HASH_SEED, [{ mmHash: 7n, start: 8, end: 10 }, { mmHash: 7n, start: 3, end: 3 }]), bh.locals(ten, 4), "an object in the tail, or empty, changes nothing");
});

test("hashPrompt keys every golden case's prompt as the vectors, and refuses what the router refuses", async () => {
  let hashed = 0;
  const all = [...vectors.cases.map((c) => ({ ...c, objects: [] as Vectors["multimodal_cases"][number]["objects"] })), ...vectors.multimodal_cases];
  for (const c of all) {
    const init = () => ({
      model: "m", tokenIds: c.tokens, loraName: c.lora_name, cacheNamespace: c.cache_namespace,
      multimodalObjects: c.objects.map((o) => ({ mmHash: BigInt(o.hash), start: o.start, end: o.end })),
    });
    const req = create(RouteRequestSchema, init());
    const empty = c.objects.findIndex((o) => o.end <= o.start);
    const refusal = c.block_size === 0 ? "block_size: must be at least 1 (got 0)"
      : c.tokens.length === 0 ? "token_ids: must not be empty"
      : empty >= 0 ? `multimodal_objects[${empty}].end: must be greater than start ${c.objects[empty]!.start} (got ${c.objects[empty]!.end})`
      : undefined;
    if (refusal !== undefined) {
      const err = await hashPrompt(req, c.block_size).then(() => assert.fail(`${c.name}: hashed`), (e: unknown) => ConnectError.from(e));
      assert.equal(err.rawMessage, refusal, c.name);
      assert.deepEqual(req, create(RouteRequestSchema, init()), `${c.name}: unchanged`);
      continue;
    }
    await hashPrompt(req, c.block_size);
    assert.deepEqual(req, create(RouteRequestSchema, { model: "m", blockHashes: big(c.local_hashes), blockSize: c.block_size, promptTokens: c.tokens.length }), c.name);
    hashed++;
  }
  assert.ok(hashed >= 25, `only ${hashed} cases hashed`);
});

test("hashTokens folds mm_hashes into the vectors' local hashes, and the router matches them", async () => {
  const server = await startRouter();
  const router = new Router({ address: server.addr });
  try {
    for (const [k, c] of vectors.multimodal_cases.entries()) {
      // One worker per case, each its own model: block sizes differ between cases.
      const model = `mm-${c.name}`;
      const rec = recordBlocks();
      const hello = { workerId: BigInt(100 + k), model, role: WorkerRole.AGGREGATED, blockSize: c.block_size, totalKvBlocks: 1000n, endpoint: `10.0.2.${k}:8000`, kvEventsEnabled: true, freshStart: true };
      const pub = new Publisher({ addresses: [server.addr], hello, hashTokens: true, interceptors: [rec.interceptor] });
      try {
        const n = c.local_hashes.length;
        const blocks = Array.from({ length: n }, (_, i) => ({
          blockHash: BigInt(1000 * k + i + 1),
          tokenIds: c.tokens.slice(i * c.block_size, (i + 1) * c.block_size),
          mmHashes: big(c.block_mm_hashes[i]!).reverse(), // in any order
        }));
        await pub.publish([{ storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks, loraName: c.lora_name, cacheNamespace: c.cache_namespace } } }]);
        await pub.flush({ signal: AbortSignal.timeout(5_000) });
        assert.deepEqual(rec.blocks.map((b) => b.tokensHash), big(c.local_hashes), `${c.name}: the tokens_hash sent`);
        assert.ok(rec.blocks.every((b) => b.tokenIds.length === 0 && b.mmHashes.length === 0), `${c.name}: sent without token ids and mm_hashes`);
        assert.equal(blocks[0]!.tokenIds.length, c.block_size, `${c.name}: the caller's blocks are unchanged`);
        // The router's own hashing of the prompt with its objects finds every block. (It refuses an empty
        // object, which no block holds: it is left out.)
        const multimodalObjects = objectsOf(c).filter((o) => o.end > o.start);
        const r = await router.route({ model, tokenIds: c.tokens, loraName: c.lora_name, cacheNamespace: c.cache_namespace, multimodalObjects, queryOnly: true });
        assert.equal(r.response.diagnostics?.decode?.overlapBlocks?.device, BigInt(n), `${c.name}: overlap`);
        await pub.close();
      } finally {
        await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
      }
    }
  } finally {
    router.close();
    await server.stop();
  }
});
