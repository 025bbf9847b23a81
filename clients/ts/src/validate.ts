import type { KvEvent } from "./gen/kvrouter/v1/worker_pb.js";
import { StorageTier } from "./gen/kvrouter/v1/types_pb.js";
import type { RouteRequest } from "./gen/kvrouter/v1/router_pb.js";
import { invalidArgument } from "./errors.js";
import type { ConnectError } from "@connectrpc/connect";

/** The longest request_id the router accepts, in UTF-8 bytes. */
export const MAX_REQUEST_ID_BYTES = 512;

/** The router's default max_prompt_tokens (1,048,576). */
export const DEFAULT_MAX_PROMPT_TOKENS = 1 << 20;

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

/**
 * Checks a RouteRequest as the router does before routing: a request_id unless query_only, a model, and
 * between one and maxPromptTokens tokens. Returns the error the router would answer, with its message,
 * or undefined when the router would accept the request's shape.
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
  const n = req.tokenIds.length;
  if (n === 0) {
    return invalidArgument("token_ids", "must not be empty");
  }
  if (n > maxPromptTokens) {
    return invalidArgument("token_ids", `has ${n} tokens, more than the maximum of ${maxPromptTokens} (max_prompt_tokens)`);
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
 * one of token_ids and tokens_hash, with exactly blockSize tokens. Numbers that protobuf cannot encode
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
