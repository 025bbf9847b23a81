/**
 * The router's block hashing (kvstate/blockhash/blockhash.go), for workers that send tokens_hash instead
 * of token_ids and for anyone who wants the router's hashes of a prompt:
 *
 * - salt = 1337, plus XXH3(lora_name, seed 0) when a LoRA adapter is set, plus XXH3(cache_namespace,
 *   seed 1) when a cache namespace is set (UTF-8, additions wrap mod 2^64, empty strings are absent);
 * - local = XXH3 over the block's tokens as little-endian uint32s, seeded with the salt, followed, when the
 *   block holds multimodal inputs (images, audio), by their hashes sorted ascending as little-endian
 *   uint64s; a block holds every input whose token range [start, end) overlaps its own;
 * - multimodalHash(identifier) = the first 16 hex digits of an engine's 64-hex-digit digest of the input,
 *   or XXH3(identifier, seed 2) for any other identifier;
 * - chain(parent, local) = XXH3 over parent and local as little-endian uint64s, seed 1337;
 * - the sequence hash of block 0 is its local hash, of block i chain(sequence[i-1], local[i]).
 *
 * XXH3 is the 64-bit XXH3 of hash-wasm. Its hashers are WebAssembly instances created asynchronously,
 * one per seed, so loadBlockHasher() resolves a BlockHasher whose methods are synchronous.
 *
 * hashPrompt(req, blockSize) keys a RouteRequest's prompt with them, to send its block hashes instead of
 * its token ids (the Go client's kvclient.HashPrompt).
 */
import { create, isMessage, type MessageInitShape } from "@bufbuild/protobuf";
import { createXXHash3, type IHasher } from "hash-wasm";
import { invalidArgument } from "./errors.js";
import { RouteRequestSchema } from "./gen/kvrouter/v1/router_pb.js";
import { checkMultimodalObjects } from "./validate.js";

/** The XXH3 seed of local hashes without LoRA adapter or cache namespace, and of every chain. */
export const BLOCK_HASH_SEED = 1337n;

/**
 * The XXH3 seed multimodalHash hashes an identifier that is not an engine digest with (0 and 1 salt
 * LoRA names and cache namespaces).
 */
export const MULTIMODAL_ID_SEED = 2n;

const MAX_U64 = (1n << 64n) - 1n;
/** How many XXH3 hashers of seeds other than 0, 1 and 1337 stay cached between loads (least recently loaded go first). */
const MAX_CACHED_SEEDS = 256;
const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
const utf8 = new TextEncoder();
/** An engine's own identifier of a multimodal input: a digest of its content in 64 hex digits (vLLM's). */
const ENGINE_DIGEST = /^[0-9a-fA-F]{64}$/;

/** Hashers of the seeds every BlockHasher needs; never evicted. */
const pinned = new Map<bigint, Promise<IHasher>>();
/** Hashers of salts, most recently loaded last. */
const cached = new Map<bigint, Promise<IHasher>>();

function createHasher(seed: bigint): Promise<IHasher> {
  return createXXHash3(Number(seed & 0xffff_ffffn), Number(seed >> 32n));
}

/** Returns the (cached) XXH3 hasher of a seed. */
function hasherOf(seed: bigint): Promise<IHasher> {
  checkU64("seed", seed);
  let p = pinned.get(seed);
  if (p) {
    return p;
  }
  if (seed === 0n || seed === 1n || seed === MULTIMODAL_ID_SEED || seed === BLOCK_HASH_SEED) {
    p = createHasher(seed);
    p.catch(() => pinned.delete(seed)); // a failed load is retried next time
    pinned.set(seed, p);
  } else {
    p = cached.get(seed);
    if (p) {
      cached.delete(seed); // re-inserted below: most recently used
    } else {
      p = createHasher(seed);
      p.catch(() => cached.delete(seed)); // a failed load is retried next time
    }
    cached.set(seed, p);
    while (cached.size > MAX_CACHED_SEEDS) {
      cached.delete(cached.keys().next().value!);
    }
  }
  return p;
}

function checkU64(what: string, v: bigint): void {
  if (typeof v !== "bigint" || v < 0n || v > MAX_U64) {
    throw new RangeError(`kvrouter: ${what} must be a uint64 bigint (got ${String(v)})`);
  }
}

function digest(h: IHasher, data: Uint8Array): bigint {
  const d = h.init().update(data).digest("binary"); // the canonical (big-endian) form
  return new DataView(d.buffer, d.byteOffset, 8).getBigUint64(0, false);
}

/** Tokens as a block hashes them. */
export type Tokens = readonly number[] | Uint32Array;

/**
 * One multimodal input of a prompt, as BlockHasher.locals takes it: the hash that names its content
 * (multimodalHash) and the positions [start, end) of the prompt tokens its placeholder tokens fill. It is
 * the shape of RouteRequest.multimodal_objects, so a RouteRequest's multimodalObjects (messages or
 * object literals) can be passed as they are; an absent field is 0, as in the message.
 */
export interface MultimodalObjectInit {
  readonly mmHash?: bigint;
  readonly start?: number;
  readonly end?: number;
}

const compareU64 = (a: bigint, b: bigint): number => (a < b ? -1 : a > b ? 1 : 0);

/**
 * Returns, by block index (of n blocks of blockSize tokens), the hashes of the objects whose tokens the
 * block holds: block i holds tokens [i*blockSize, (i+1)*blockSize), and an object [start, end) is held by
 * every block its tokens overlap (none when start >= end). Throws a RangeError for an object whose
 * numbers protobuf could not encode.
 */
function carriedHashes(objects: readonly MultimodalObjectInit[], blockSize: number, n: number): Map<number, bigint[]> {
  const out = new Map<number, bigint[]>();
  for (const [k, o] of objects.entries()) {
    const h = o.mmHash ?? 0n;
    checkU64(`multimodal object ${k}'s mmHash`, h);
    const start = o.start ?? 0;
    const end = o.end ?? 0;
    if (start >>> 0 !== start || end >>> 0 !== end) {
      throw new RangeError(`kvrouter: multimodal object ${k}: start and end must be uint32 token positions (got ${start}, ${end})`);
    }
    const last = Math.min(Math.floor((end - 1) / blockSize), n - 1);
    for (let i = Math.floor(start / blockSize); start < end && i <= last; i++) {
      let hs = out.get(i);
      if (!hs) {
        hs = [];
        out.set(i, hs);
      }
      hs.push(h);
    }
  }
  return out;
}

/**
 * BlockHasher computes the router's block hashes synchronously. Get one with loadBlockHasher(); it
 * hashes with salt 1337 (no LoRA adapter, no cache namespace) at once, and with any other salt after
 * load(salt) (or loadBlockHasher(salt)) resolved. It is cheap: make one per task if you like.
 */
export class BlockHasher {
  private readonly seeded = new Map<bigint, IHasher>();
  private readonly salts = new Map<string, bigint>(); // salt() of recent (loraName, cacheNamespace) pairs
  private scratch = new Uint32Array(64);
  private mmScratch = new Uint8Array(4 * 64 + 8 * 4); // a block's token bytes and its multimodal hashes
  private readonly pair = new DataView(new ArrayBuffer(16));

  /** @internal Use loadBlockHasher. */
  constructor(
    private readonly seed0: IHasher,
    private readonly seed1: IHasher,
    private readonly seed2: IHasher,
    private readonly chainHasher: IHasher,
  ) {
    this.seeded.set(BLOCK_HASH_SEED, chainHasher);
  }

  /**
   * Loads the XXH3 hashers of these salts, so that local() and locals() accept them. Resolves to this
   * hasher.
   */
  async load(...salts: bigint[]): Promise<this> {
    const todo = [...new Set(salts)].filter((s) => !this.seeded.has(s));
    const hs = await Promise.all(todo.map(hasherOf));
    todo.forEach((s, i) => this.seeded.set(s, hs[i]!));
    return this;
  }

  /** Says whether local() and locals() accept this salt now. */
  hasSalt(salt: bigint): boolean {
    return this.seeded.has(salt);
  }

  /** How many salts local() and locals() accept (1337 included). */
  get saltsLoaded(): number {
    return this.seeded.size;
  }

  /**
   * The salt (the seed of local hashes) of a request or stored block: 1337, plus XXH3(loraName, seed 0)
   * if loraName is not empty, plus XXH3(cacheNamespace, seed 1) if cacheNamespace is not empty, mod 2^64.
   */
  salt(loraName = "", cacheNamespace = ""): bigint {
    if (loraName === "" && cacheNamespace === "") {
      return BLOCK_HASH_SEED;
    }
    const key = `${loraName}\u0000${cacheNamespace}`;
    const known = this.salts.get(key);
    if (known !== undefined) {
      return known;
    }
    let s = BLOCK_HASH_SEED;
    if (loraName !== "") {
      s += digest(this.seed0, utf8.encode(loraName));
    }
    if (cacheNamespace !== "") {
      s += digest(this.seed1, utf8.encode(cacheNamespace));
    }
    s = BigInt.asUintN(64, s);
    if (this.salts.size >= 1024) {
      this.salts.clear();
    }
    this.salts.set(key, s);
    return s;
  }

  /**
   * The hash that names a multimodal input in block hashes (MultimodalObject.mm_hash and
   * StoredBlock.mm_hashes), from the identifier the engine keys its prefix cache with. vLLM's own
   * identifier of an item is a 64-hex-digit digest of its content; its first 16 digits, read as an
   * integer, are the hash (as Dynamo reads them). Any other identifier, such as one the frontend chose
   * and passed to the engine (vLLM's multi_modal_uuids), is hashed with XXH3 (UTF-8, seed 2), so that
   * the frontend and the worker agree on it without sharing anything but the string.
   */
  multimodalHash(identifier: string): bigint {
    if (ENGINE_DIGEST.test(identifier)) {
      return BigInt(`0x${identifier.slice(0, 16)}`);
    }
    return digest(this.seed2, utf8.encode(identifier));
  }

  /**
   * The local hash of one block's tokens (all of them, whatever their number): XXH3 over the tokens as
   * little-endian uint32s, seeded with salt (default 1337). Throws a RangeError for a token that is not
   * a uint32, and an Error for a salt that was not loaded.
   */
  local(tokens: Tokens, salt: bigint = BLOCK_HASH_SEED): bigint {
    return digest(this.hasher(salt), this.bytes(tokens, 0, tokens.length));
  }

  /**
   * The local hash of one block that holds multimodal inputs: XXH3 over its tokens as little-endian
   * uint32s followed by the inputs' hashes as little-endian uint64s, seeded with salt (default 1337).
   * mmHashes are the hashes of the inputs whose tokens lie in the block, once per input (the same image
   * twice counts twice), in any order: they are sorted here (a copy), as the router sorts a stored
   * block's mm_hashes, so that a block's key does not depend on the order its inputs were listed in.
   * Without any it equals local(). Throws a RangeError for a token that is not a uint32 or a hash that
   * is not a uint64.
   */
  localMultimodal(tokens: Tokens, mmHashes: readonly bigint[], salt: bigint = BLOCK_HASH_SEED): bigint {
    const h = this.hasher(salt);
    const block = this.bytes(tokens, 0, tokens.length);
    if (mmHashes.length === 0) {
      return digest(h, block);
    }
    for (const m of mmHashes) {
      checkU64("mm_hash", m);
    }
    return digest(h, this.withHashes(block, [...mmHashes].sort(compareU64)));
  }

  /**
   * The local hash of every complete block of tokens, in order: a tail shorter than blockSize is not
   * hashed, and a blockSize of 0 hashes nothing. objects are the prompt's multimodal inputs (a
   * RouteRequest's multimodalObjects), in any order, overlapping or not: a block whose tokens overlap an
   * input's [start, end) is hashed with the input's hash (localMultimodal), as the router hashes a
   * RouteRequest with multimodal_objects; an empty input (start >= end) is held by no block.
   */
  locals(tokens: Tokens, blockSize: number, salt: bigint = BLOCK_HASH_SEED, objects: readonly MultimodalObjectInit[] = []): bigint[] {
    const h = this.hasher(salt);
    if (!Number.isInteger(blockSize) || blockSize <= 0) {
      return [];
    }
    const n = tokens.length - (tokens.length % blockSize);
    const carried = objects.length > 0 ? carriedHashes(objects, blockSize, n / blockSize) : undefined;
    const all = this.bytes(tokens, 0, n);
    const out: bigint[] = [];
    for (let start = 0; start < n; start += blockSize) {
      const block = all.subarray(4 * start, 4 * (start + blockSize));
      const mm = carried?.get(start / blockSize);
      out.push(digest(h, mm ? this.withHashes(block, mm.sort(compareU64)) : block));
    }
    return out;
  }

  /**
   * The sequence hash of a block from its parent's sequence hash and its own local hash: XXH3 over the
   * two as little-endian uint64s, seed 1337.
   */
  chain(parent: bigint, local: bigint): bigint {
    checkU64("parent", parent);
    checkU64("local", local);
    this.pair.setBigUint64(0, parent, true);
    this.pair.setBigUint64(8, local, true);
    return digest(this.chainHasher, new Uint8Array(this.pair.buffer));
  }

  /**
   * The sequence hash of each block from the local hashes of a prompt's blocks: the first block's is its
   * local hash, each next one chains to the previous one. Two prompts share the sequence hash of block i
   * only if they share blocks 0..i.
   */
  sequence(locals: readonly bigint[]): bigint[] {
    const out: bigint[] = [];
    for (const [i, l] of locals.entries()) {
      if (i === 0) {
        checkU64("local", l);
        out.push(l);
      } else {
        out.push(this.chain(out[i - 1]!, l));
      }
    }
    return out;
  }

  private hasher(salt: bigint): IHasher {
    const h = this.seeded.get(salt);
    if (!h) {
      checkU64("salt", salt);
      throw new Error(`kvrouter: the XXH3 hasher of salt ${salt} is not loaded: await blockHasher.load(salt) first`);
    }
    return h;
  }

  /** A block's token bytes followed by its (checked, sorted) multimodal hashes as little-endian uint64s. */
  private withHashes(block: Uint8Array, sorted: readonly bigint[]): Uint8Array {
    const n = block.length + 8 * sorted.length;
    if (this.mmScratch.length < n) {
      this.mmScratch = new Uint8Array(Math.max(n, 2 * this.mmScratch.length));
    }
    const buf = this.mmScratch;
    buf.set(block, 0);
    const dv = new DataView(buf.buffer, block.length, 8 * sorted.length);
    for (const [i, m] of sorted.entries()) {
      dv.setBigUint64(8 * i, m, true);
    }
    return buf.subarray(0, n);
  }

  /** tokens[from, to) as little-endian uint32 bytes, checked to be uint32s. */
  private bytes(tokens: Tokens, from: number, to: number): Uint8Array {
    if (tokens instanceof Uint32Array && LITTLE_ENDIAN) {
      const t = tokens.subarray(from, to);
      return new Uint8Array(t.buffer, t.byteOffset, t.byteLength);
    }
    const n = to - from;
    if (this.scratch.length < n) {
      this.scratch = new Uint32Array(Math.max(n, 2 * this.scratch.length));
    }
    const s = this.scratch;
    for (let i = 0; i < n; i++) {
      const v = tokens[from + i]!;
      if (v >>> 0 !== v) {
        throw new RangeError(`kvrouter: token ${from + i} must be a uint32 (got ${v})`);
      }
      s[i] = v;
    }
    if (!LITTLE_ENDIAN) {
      const dv = new DataView(s.buffer, 0, 4 * n);
      for (let i = 0; i < n; i++) {
        dv.setUint32(4 * i, s[i]!, true);
      }
    }
    return new Uint8Array(s.buffer, 0, 4 * n);
  }
}

/**
 * Returns the 64-bit XXH3 of data with a uint64 seed, as the router's hashing computes it (raw access,
 * for tests and tools; hash blocks with a BlockHasher).
 */
export async function xxh3(data: Uint8Array, seed: bigint): Promise<bigint> {
  return digest(await hasherOf(seed), data);
}

/**
 * Loads the XXH3 hashers of seeds 0, 1, 2 and 1337, and of the given salts, and resolves a BlockHasher
 * that hashes with them synchronously. Hashers are cached per seed (those of up to 256 other salts
 * stay cached for later loads), so loading again is cheap.
 */
export async function loadBlockHasher(...salts: bigint[]): Promise<BlockHasher> {
  const [s0, s1, s2, s1337] = await Promise.all([hasherOf(0n), hasherOf(1n), hasherOf(MULTIMODAL_ID_SEED), hasherOf(BLOCK_HASH_SEED)]);
  const bh = new BlockHasher(s0, s1, s2, s1337);
  if (salts.length > 0) {
    await bh.load(...salts);
  }
  return bh;
}

/** The BlockHasher of hashPrompt (seeds 0, 1, 2 and 1337), loaded on first use; salts are loaded per call. */
let promptHasher: Promise<BlockHasher> | undefined;

function sharedHasher(): Promise<BlockHasher> {
  if (!promptHasher) {
    const p = loadBlockHasher();
    p.catch(() => {
      if (promptHasher === p) {
        promptHasher = undefined; // a failed load is retried next time
      }
    });
    promptHasher = p;
  }
  return promptHasher;
}

/**
 * Keys a RouteRequest's prompt as the router would for blocks of blockSize tokens (the model's block
 * size, as its workers registered it; AdminService/ListWorkers shows it), and makes the request send the
 * keys instead of the prompt, in place, as the Go client's kvclient.HashPrompt does: it sets blockHashes
 * (the local hash of each complete block, salted with loraName and cacheNamespace, with the
 * multimodalObjects folded in: BlockHasher.locals), blockSize and promptTokens, and empties tokenIds,
 * loraName, cacheNamespace and multimodalObjects, which the hashes then hold. req is a RouteRequest
 * message or an object literal of one (what Router.route takes); its arrays are replaced, not changed.
 *
 * The router routes such a request exactly as it would the token ids, without decoding or hashing them
 * (docs/hashing.md, "Keying the prompt yourself"); with another block size than the model's it answers
 * FAILED_PRECONDITION, reason BLOCK_SIZE_MISMATCH. A prompt the router would refuse as token ids (none,
 * more than 256 multimodal inputs, one with end <= start or past the prompt, two that overlap) rejects
 * with the router's INVALID_ARGUMENT and message, and so does a blockSize below 1 or not a uint32; req is
 * then left as it was. A token that is not a uint32 rejects with a RangeError. The XXH3 hashers of
 * the request's salt are loaded (and cached) here; hasher, when given, is used instead of the shared one.
 * Router.route(req, { hashPrompt: blockSize }) does this to its copy of the request.
 */
export async function hashPrompt(req: MessageInitShape<typeof RouteRequestSchema>, blockSize: number, hasher?: BlockHasher): Promise<void> {
  if (blockSize < 1) {
    throw invalidArgument("block_size", `must be at least 1 (got ${blockSize})`);
  }
  if (!Number.isInteger(blockSize) || blockSize > 0xffff_ffff) {
    throw invalidArgument("block_size", `must be a uint32 (got ${blockSize})`);
  }
  const msg = isMessage(req, RouteRequestSchema) ? req : create(RouteRequestSchema, req);
  const n = msg.tokenIds.length;
  if (n === 0) {
    throw invalidArgument("token_ids", "must not be empty");
  }
  const invalid = checkMultimodalObjects(msg, n);
  if (invalid) {
    throw invalid;
  }
  const base = hasher ?? (await sharedHasher());
  const salt = base.salt(msg.loraName, msg.cacheNamespace);
  // A BlockHasher keeps every salt it loads: a salt the hasher lacks is loaded into one for this call
  // only (the hashers of recent salts stay cached), so that many tenants do not grow the shared one.
  const bh = base.hasSalt(salt) ? base : await loadBlockHasher(salt);
  const locals = bh.locals(msg.tokenIds, blockSize, salt, msg.multimodalObjects);
  // Nothing is changed before this point: a refusal leaves the request as it was.
  req.blockHashes = locals;
  req.blockSize = blockSize;
  req.promptTokens = n;
  req.tokenIds = [];
  req.loraName = "";
  req.cacheNamespace = "";
  req.multimodalObjects = [];
}
