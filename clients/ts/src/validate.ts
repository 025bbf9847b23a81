import type { KvEvent } from "./gen/kvrouter/v1/worker_pb.js";
import { StorageTier } from "./gen/kvrouter/v1/types_pb.js";
import type { RouteRequest } from "./gen/kvrouter/v1/router_pb.js";
import { invalidArgument } from "./errors.js";
import type { ConnectError } from "@connectrpc/connect";

/** The longest request_id the router accepts, in UTF-8 bytes. */
export const MAX_REQUEST_ID_BYTES = 512;

/** The router's default max_prompt_tokens (1,048,576). */
export const DEFAULT_MAX_PROMPT_TOKENS = 1 << 20;

/** The most multimodal inputs of one RouteRequest (server/router.go): each costs the hashing of the blocks it touches. */
export const MAX_MULTIMODAL_OBJECTS = 256;

/** The most mm_hashes of one stored block (server/router.go). */
export const MAX_BLOCK_MM_HASHES = 64;

/** The longest WorkerLeave reason the router accepts, in UTF-8 bytes: it goes to the router's log. */
export const MAX_LEAVE_REASON_BYTES = 256;

/** Checks a request id as the router does; returns the router's error, or undefined when valid. */
export function checkRequestId(id: string): ConnectError | undefined {
  if (id === "") {
    return invalidArgument("request_id", "must not be empty");
  }
  const n = Buffer.byteLength(id, "utf8");
  if (n > MAX_REQUEST_ID_BYTES) {
    return invalidArgument("request_id", `must be at most ${MAX_REQUEST_ID_BYTES} bytes (got ${n})`);
  }
  return undefined;
}

/** Checks a WorkerLeave reason as the router does (at most 256 UTF-8 bytes); returns the router's error, or undefined when valid. */
export function checkLeaveReason(reason: string): ConnectError | undefined {
  const n = Buffer.byteLength(reason, "utf8");
  if (n > MAX_LEAVE_REASON_BYTES) {
    return invalidArgument("leave.reason", `must be at most ${MAX_LEAVE_REASON_BYTES} bytes (got ${n})`);
  }
  return undefined;
}

/**
 * Checks a RouteRequest as the router does before routing: a request_id unless query_only, a model,
 * and its prompt (server/router.go, prompt). A prompt of token ids: between one and maxPromptTokens
 * tokens, no block_hashes nor prompt_tokens, and multimodal inputs that are at most 256, each within
 * the prompt (end > start, end <= the number of tokens), none overlapping another. A hashed prompt
 * (blockSize set, see hashPrompt): no token_ids, lora_name, cache_namespace nor multimodal_objects
 * (its hashes hold them), and a promptTokens between one and maxPromptTokens that fits its
 * blockHashes. Returns the error the router would answer, with its message, or undefined when the
 * router would accept the request's shape.
 */
export function checkRouteRequest(req: RouteRequest, maxPromptTokens: number): ConnectError | undefined {
  if (!req.queryOnly || req.requestId !== "") {
    const err = checkRequestId(req.requestId);
    if (err) {
      return err;
    }
  }
  if (req.model === "") {
    return invalidArgument("model", "must not be empty");
  }
  if (req.blockSize !== 0) {
    return checkHashedPrompt(req, maxPromptTokens);
  }
  if (req.blockHashes.length > 0) {
    return invalidArgument("block_size", "must be set with block_hashes (the block size they were hashed with)");
  }
  if (req.promptTokens !== 0) {
    return invalidArgument("prompt_tokens", "must be set only with block_size and block_hashes (token_ids count themselves)");
  }
  const n = req.tokenIds.length;
  if (n === 0) {
    return invalidArgument("token_ids", "must not be empty");
  }
  if (n > maxPromptTokens) {
    return invalidArgument("token_ids", `has ${n} tokens, more than the maximum of ${maxPromptTokens} (max_prompt_tokens)`);
  }
  return checkMultimodalObjects(req, n);
}

/** Checks a hashed prompt (blockSize set) as the router does (server/router.go, prompt). */
function checkHashedPrompt(req: RouteRequest, maxPromptTokens: number): ConnectError | undefined {
  const fields: [string, boolean][] = [
    ["token_ids", req.tokenIds.length > 0],
    ["lora_name", req.loraName !== ""],
    ["cache_namespace", req.cacheNamespace !== ""],
    ["multimodal_objects", req.multimodalObjects.length > 0],
  ];
  for (const [name, set] of fields) {
    if (set) {
      return invalidArgument(name, "must be empty with block_size and block_hashes (fold it into the hashes)");
    }
  }
  const tokens = req.promptTokens;
  if (tokens === 0) {
    return invalidArgument("prompt_tokens", "must be at least 1 with block_hashes");
  }
  if (tokens > maxPromptTokens) {
    return invalidArgument("prompt_tokens", `is ${tokens}, more than the maximum of ${maxPromptTokens} (max_prompt_tokens)`);
  }
  // In bigints, as the router's uint64s: the products may pass 2^53.
  const size = BigInt(req.blockSize);
  const blocks = BigInt(req.blockHashes.length);
  if (BigInt(tokens) < blocks * size || BigInt(tokens) >= (blocks + 1n) * size) {
    return invalidArgument("prompt_tokens", `must be in [${blocks * size}, ${(blocks + 1n) * size}): ${blocks} block_hashes of block_size ${size} and a partial block (got ${tokens})`);
  }
  return undefined;
}

/**
 * Checks a RouteRequest's multimodal_objects against its n tokens, as the router does (server/router.go).
 * @internal
 */
export function checkMultimodalObjects(req: RouteRequest, n: number): ConnectError | undefined {
  const objs = req.multimodalObjects;
  if (objs.length > MAX_MULTIMODAL_OBJECTS) {
    return invalidArgument("multimodal_objects", `must hold at most ${MAX_MULTIMODAL_OBJECTS} inputs (got ${objs.length})`);
  }
  for (const [i, o] of objs.entries()) {
    if (o.end <= o.start) {
      return invalidArgument(`multimodal_objects[${i}].end`, `must be greater than start ${o.start} (got ${o.end})`);
    }
    if (o.end > n) {
      return invalidArgument(`multimodal_objects[${i}].end`, `must be at most the number of token_ids ${n} (got ${o.end})`);
    }
  }
  // The router sorts them by their first token and names the first that overlaps the one before it.
  const order = objs.map((_, i) => i).sort((a, b) => objs[a]!.start - objs[b]!.start);
  for (let k = 1; k < order.length; k++) {
    const p = order[k - 1]!;
    const i = order[k]!;
    const a = objs[p]!;
    const b = objs[i]!;
    if (a.end > b.start) {
      return invalidArgument(`multimodal_objects[${i}]`, `tokens [${b.start}, ${b.end}) overlap those of multimodal_objects[${p}], [${a.start}, ${a.end})`);
    }
  }
  return undefined;
}

const MAX_U64 = (1n << 64n) - 1n;

/** Says whether v encodes as a uint64 (a bigint, or a safe integer number, in range). */
function isU64(v: unknown): boolean {
  return typeof v === "bigint" ? v >= 0n && v <= MAX_U64 : Number.isSafeInteger(v) && (v as number) >= 0;
}

/** Returns the index of the first token that is not a uint32, or -1. */
function badToken(tokens: readonly number[]): number {
  for (let i = 0; i < tokens.length; i++) {
    const t = tokens[i]!;
    if (t >>> 0 !== t) {
      return i;
    }
  }
  return -1;
}

const TIER_NAMES: Record<number, string> = {
  [StorageTier.UNSPECIFIED]: "STORAGE_TIER_UNSPECIFIED",
};

/**
 * Checks one KV event as the router checks the events of a batch (field is its path, for example
 * "events.events[3]"): its dp_rank is the stream's, its tier is set, and a stored block sets exactly
 * one of token_ids and tokens_hash, with exactly blockSize tokens, and at most 64 mm_hashes, none beside
 * a tokens_hash (which holds them already). Numbers that protobuf cannot encode
 * (a token that is not a uint32, a hash that is not a uint64) fail here too, as the router could never
 * receive them. Returns the router's error, with its message, or undefined when the router would
 * accept the event.
 */
export function checkEvent(field: string, ev: KvEvent, dpRank: number, blockSize: number): ConnectError | undefined {
  if (ev.dpRank !== dpRank) {
    return invalidArgument(`${field}.dp_rank`, `must equal the stream's registered dp_rank ${dpRank} (got ${ev.dpRank})`);
  }
  if (ev.storageTier < StorageTier.DEVICE || ev.storageTier > StorageTier.EXTERNAL) {
    const name = TIER_NAMES[ev.storageTier] ?? String(ev.storageTier);
    return invalidArgument(`${field}.storage_tier`, `must be DEVICE, HOST, DISK or EXTERNAL (got ${name})`);
  }
  switch (ev.data.case) {
    case "stored": {
      const st = ev.data.value;
      const blocks = st.blocks;
      if (blocks.length === 0) {
        return invalidArgument(`${field}.stored.blocks`, "must not be empty");
      }
      if (st.parentHash !== undefined && !isU64(st.parentHash)) {
        return invalidArgument(`${field}.stored.parent_hash`, `must be a uint64 (got ${String(st.parentHash)})`);
      }
      for (let j = 0; j < blocks.length; j++) {
        const b = blocks[j]!;
        const bf = `${field}.stored.blocks[${j}]`;
        if (!isU64(b.blockHash)) {
          return invalidArgument(`${bf}.block_hash`, `must be a uint64 (got ${String(b.blockHash)})`);
        }
        if (b.tokensHash !== undefined && b.tokenIds.length > 0) {
          return invalidArgument(bf, "must set exactly one of token_ids and tokens_hash (both are set)");
        }
        if (b.tokensHash !== undefined && b.mmHashes.length > 0) {
          return invalidArgument(`${bf}.mm_hashes`, "must be empty with tokens_hash, which already holds them");
        }
        if (b.tokensHash !== undefined) {
          if (!isU64(b.tokensHash)) {
            return invalidArgument(`${bf}.tokens_hash`, `must be a uint64 (got ${String(b.tokensHash)})`);
          }
          continue;
        }
        if (b.tokenIds.length === 0) {
          return invalidArgument(bf, "must set exactly one of token_ids and tokens_hash (neither is set)");
        }
        if (b.tokenIds.length !== blockSize) {
          return invalidArgument(`${bf}.token_ids`, `must hold exactly block_size ${blockSize} tokens (got ${b.tokenIds.length})`);
        }
        const k = badToken(b.tokenIds);
        if (k >= 0) {
          return invalidArgument(`${bf}.token_ids[${k}]`, `must be a uint32 (got ${String(b.tokenIds[k])})`);
        }
        if (b.mmHashes.length > MAX_BLOCK_MM_HASHES) {
          return invalidArgument(`${bf}.mm_hashes`, `must hold at most ${MAX_BLOCK_MM_HASHES} hashes (got ${b.mmHashes.length})`);
        }
        for (const [m, h] of b.mmHashes.entries()) {
          if (!isU64(h)) {
            return invalidArgument(`${bf}.mm_hashes[${m}]`, `must be a uint64 (got ${String(h)})`);
          }
        }
      }
      return undefined;
    }
    case "removed":
      if (ev.data.value.blockHashes.length === 0) {
        return invalidArgument(`${field}.removed.block_hashes`, "must not be empty");
      }
      for (const [k, h] of ev.data.value.blockHashes.entries()) {
        if (!isU64(h)) {
          return invalidArgument(`${field}.removed.block_hashes[${k}]`, `must be a uint64 (got ${String(h)})`);
        }
      }
      return undefined;
    case "cleared":
      return undefined;
    default:
      return invalidArgument(field, "must set one of stored, removed, cleared");
  }
}

/** Counts the blocks an event costs against the router's max_batch_blocks (stored blocks plus removed hashes). */
export function eventBlocks(ev: KvEvent): number {
  switch (ev.data.case) {
    case "stored":
      return ev.data.value.blocks.length;
    case "removed":
      return ev.data.value.blockHashes.length;
    default:
      return 0;
  }
}
