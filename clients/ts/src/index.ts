/**
 * The TypeScript client of kvrouter: a Publisher for workers, a Router for frontends, the generated
 * stubs of the contract (proto/kvrouter/v1), and the router's own request checks.
 */
export { Publisher, MAX_BATCH_BLOCKS, DEFAULT_MAX_BATCH_EVENTS, DEFAULT_FLUSH_INTERVAL_MS, DEFAULT_MAX_UNACKED, DEFAULT_MAX_DUMP_BLOCKS } from "./publisher.js";
export type { PublisherOptions, PublisherStats, KvEventInit, WorkerHelloInit, LoadReportInit } from "./publisher.js";
export { Router, RouteHandle } from "./router.js";
export type { RouterOptions, RouteInit, RouteOptions, EndOptions } from "./router.js";
// The error class and codes every call rejects with (the router's status), and the interceptor type of
// the options: from @connectrpc/connect, re-exported so that callers match errors
// (err instanceof ConnectError && err.code === Code.NotFound) without depending on it themselves.
export { Code, ConnectError } from "@connectrpc/connect";
export type { Interceptor } from "@connectrpc/connect";
export { errorInfo, errorReason, retryDelayMs, invalidArgument, WorkerSupersededError, PublisherFullError, PublisherClosedError, ERROR_DOMAIN } from "./errors.js";
export {
  checkEvent,
  checkRouteRequest,
  checkRequestId,
  checkLeaveReason,
  DEFAULT_MAX_PROMPT_TOKENS,
  MAX_REQUEST_ID_BYTES,
  MAX_MULTIMODAL_OBJECTS,
  MAX_BLOCK_MM_HASHES,
  MAX_LEAVE_REASON_BYTES,
} from "./validate.js";
export { openTransport, baseUrl } from "./transport.js";
export type { OwnedTransport, TransportOptions } from "./transport.js";
export type { ErrorInfo } from "./errors.js";
export { BlockHasher, loadBlockHasher, hashPrompt, xxh3, BLOCK_HASH_SEED, MULTIMODAL_ID_SEED } from "./blockhash.js";
export type { Tokens, MultimodalObjectInit } from "./blockhash.js";
export * from "./gen/kvrouter/v1/types_pb.js";
export * from "./gen/kvrouter/v1/worker_pb.js";
export * from "./gen/kvrouter/v1/router_pb.js";
export * from "./gen/kvrouter/v1/admin_pb.js";
