import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import path from "node:path";
import { BLOCK_HASH_SEED, loadBlockHasher, xxh3 } from "../src/index.js";
import { REPO_DIR } from "./helpers.js";

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
