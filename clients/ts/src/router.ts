import { create, isMessage, type MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient, type Client, type Interceptor } from "@connectrpc/connect";
import { randomUUID } from "node:crypto";
import { RouteRequestSchema, RouterService, type RouteResponse } from "./gen/kvrouter/v1/router_pb.js";
import { openTransport, type OwnedTransport } from "./transport.js";
import { checkRouteRequest, DEFAULT_MAX_PROMPT_TOKENS } from "./validate.js";

/** Options of a Router. */
export interface RouterOptions {
  /** The router's address, "host:port" (plaintext HTTP/2) or a URL. */
  address: string;
  /** The longest prompt to send, in tokens; longer ones fail before they are sent. Default: the router's default, 1,048,576. */
  maxPromptTokens?: number;
  /** The deadline of each call, in milliseconds. Default: 5,000. */
  timeoutMs?: number;
  /** Connect interceptors for every call, for example to add an authentication header. The first one is the outermost: it sees each call first. */
  interceptors?: Interceptor[];
}

/** What Router.route accepts: a RouteRequest, as an object literal. */
export type RouteInit = MessageInitShape<typeof RouteRequestSchema>;

/**
 * Router is the frontend's client: it routes requests and ends their bookings. Every booking must be
 * freed: use withRoute, or `await using` on the handle that route returns, or call free() yourself.
 */
export class Router {
  private readonly owned: OwnedTransport;
  private readonly client: Client<typeof RouterService>;
  private readonly maxPromptTokens: number;
  private readonly timeoutMs: number;

  constructor(opts: RouterOptions) {
    this.owned = openTransport(opts.address, { interceptors: opts.interceptors ?? [] });
    this.client = createClient(RouterService, this.owned.transport);
    this.maxPromptTokens = opts.maxPromptTokens ?? DEFAULT_MAX_PROMPT_TOKENS;
    this.timeoutMs = opts.timeoutMs ?? 5_000;
  }

  /**
   * Routes one request and books its load (unless query_only). A booking request without request_id
   * gets a random one. A request the router would refuse for its shape (no model, no tokens, more than
   * maxPromptTokens tokens, a request_id over 512 bytes) fails with INVALID_ARGUMENT and the router's
   * message before anything is sent. A call aborted in flight may have been booked: the router frees a
   * booking whose caller left.
   */
  async route(init: RouteInit, opts: { signal?: AbortSignal } = {}): Promise<RouteHandle> {
    // create returns a RouteRequest message as it is: copy it, so that a request id set here stays here.
    const req = isMessage(init, RouteRequestSchema) ? { ...init } : create(RouteRequestSchema, init);
    if (!req.queryOnly && req.requestId === "") {
      req.requestId = randomUUID();
    }
    const invalid = checkRouteRequest(req, this.maxPromptTokens);
    if (invalid) {
      throw invalid;
    }
    const res = await this.client.route(req, { signal: opts.signal, timeoutMs: this.timeoutMs });
    return new RouteHandle(this, req.requestId, res);
  }

  /**
   * Routes a request, runs fn with the decision, and frees the booking when fn returns or throws, or as
   * soon as opts.signal aborts (fn receives a signal that aborts then too). Returns what fn returns.
   */
  async withRoute<T>(init: RouteInit, fn: (route: RouteHandle, signal: AbortSignal) => Promise<T> | T, opts: { signal?: AbortSignal } = {}): Promise<T> {
    opts.signal?.throwIfAborted();
    const handle = await this.route(init, opts);
    const inner = new AbortController();
    const onAbort = (): void => {
      inner.abort(opts.signal?.reason);
      void handle.free().catch(() => undefined); // retried by the finally below
    };
    opts.signal?.addEventListener("abort", onAbort, { once: true });
    try {
      if (opts.signal?.aborted) {
        onAbort();
      }
      return await fn(handle, inner.signal);
    } finally {
      opts.signal?.removeEventListener("abort", onAbort);
      await handle.free();
    }
  }

  /** Closes the connection; handles made by this router can no longer reach it. */
  close(): void {
    this.owned.close();
  }

  /** @internal */
  async call(kind: "free" | "prefill", requestId: string): Promise<void> {
    if (kind === "free") {
      await this.client.free({ requestId }, { timeoutMs: this.timeoutMs });
    } else {
      await this.client.markPrefillComplete({ requestId }, { timeoutMs: this.timeoutMs });
    }
  }
}

/**
 * RouteHandle is one routing decision and its booking. prefillComplete() and free() may be called any
 * number of times, concurrently too: each reaches the router until it succeeds once, and NOT_FOUND
 * (the booking expired or was freed) counts as done. After free(), prefillComplete() does nothing.
 */
export class RouteHandle implements AsyncDisposable {
  /** The request id the request was routed (and booked) with. */
  readonly requestId: string;
  /** The router's decision: mode, prefill and decode targets, annotations, diagnostics. */
  readonly response: RouteResponse;
  private freeing: Promise<void> | undefined;
  private prefilling: Promise<void> | undefined;
  private freed = false;

  /** @internal */
  constructor(private readonly router: Router, requestId: string, response: RouteResponse) {
    this.requestId = requestId;
    this.response = response;
    if (!response.booked) {
      this.freed = true; // query_only: nothing to free
      this.freeing = Promise.resolve();
    }
  }

  /** Says whether the booking was freed (or never made). */
  get isFreed(): boolean {
    return this.freed;
  }

  /** Records that the first token arrived, so the prompt stops counting as prefill load. Idempotent. */
  prefillComplete(): Promise<void> {
    if (this.freed || this.freeing) {
      return Promise.resolve();
    }
    this.prefilling ??= this.once("prefill").catch((err: unknown) => {
      this.prefilling = undefined;
      throw err;
    });
    return this.prefilling;
  }

  /** Releases everything the request booked. Idempotent. */
  free(): Promise<void> {
    this.freeing ??= this.once("free").then(
      () => {
        this.freed = true;
      },
      (err: unknown) => {
        this.freeing = undefined; // a later call tries again
        throw err;
      },
    );
    return this.freeing;
  }

  /** Frees the booking, so that `await using handle = await router.route(...)` frees it at scope end. */
  [Symbol.asyncDispose](): Promise<void> {
    return this.free();
  }

  private async once(kind: "free" | "prefill"): Promise<void> {
    try {
      await this.router.call(kind, this.requestId);
    } catch (err) {
      if (ConnectError.from(err).code === Code.NotFound) {
        return; // expired, or freed already: done
      }
      throw err;
    }
  }
}
