import { create, isMessage, type MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient, type Client, type Interceptor } from "@connectrpc/connect";
import { randomUUID } from "node:crypto";
import { hashPrompt } from "./blockhash.js";
import { errorReason, retryDelayMs } from "./errors.js";
import { RouteRequestSchema, RouteResponseSchema, RouterService, type RouteResponse } from "./gen/kvrouter/v1/router_pb.js";
import { openTransport, type OwnedTransport } from "./transport.js";
import { checkRouteRequest, DEFAULT_MAX_PROMPT_TOKENS } from "./validate.js";

/** Options of a Router. */
export interface RouterOptions {
  /** The router's address, "host:port" (plaintext HTTP/2) or a URL. */
  address: string;
  /** The longest prompt to send, in tokens; longer ones fail before they are sent. Default: the router's default, 1,048,576. */
  maxPromptTokens?: number;
  /** How long a call may take, in milliseconds, its retries included. Default: 5,000. */
  timeoutMs?: number;
  /** Connect interceptors for every call, for example to add an authentication header. The first one is the outermost: it sees each call first. */
  interceptors?: Interceptor[];
  /**
   * How long, in milliseconds from the route, a free() or prefillComplete() that the router could not
   * accept within its timeout (UNAVAILABLE: its shared state is being re-established, or the replica
   * that holds the booking has not published it) is retried in the background: the booking would
   * otherwise load its workers until the router expires it. Default: 300,000 (the router's
   * booking_expiry default); 0 or less: no retry in the background.
   */
  endRetryForMs?: number;
  /** At most this many ends are retried in the background at once; past it an end is given up (its booking expires on the router). Default: 100,000. */
  maxPendingEnds?: number;
}

/** Options of one free() or prefillComplete() call. */
export interface EndOptions {
  /** How long the call is retried in the foreground, in milliseconds, before it goes on in the background. Default: the Router's timeoutMs. */
  timeoutMs?: number;
}

/** What Router.route accepts: a RouteRequest, as an object literal. */
export type RouteInit = MessageInitShape<typeof RouteRequestSchema>;

/** Options of one route() call. */
export interface RouteOptions {
  /** Aborts the call, its retries included. */
  signal?: AbortSignal;
  /** How long the call may take, in milliseconds, its retries included. Default: the Router's timeoutMs. */
  timeoutMs?: number;
  /**
   * The model's block size: the request's prompt is checked as token ids, then keyed with hashPrompt
   * (its block hashes, salted with its LoRA name and cache namespace, its multimodal inputs folded in)
   * and sent as those, instead of its token ids. The router routes it as it would the token ids; with
   * another block size than the model's it answers FAILED_PRECONDITION, reason BLOCK_SIZE_MISMATCH.
   * Default: the request is sent as it is.
   */
  hashPrompt?: number;
}

type EndKind = "free" | "prefill";

/** An end that failed: its last error, and whether the background retries took it over. */
interface EndFailure {
  error: unknown;
  handedOff: boolean;
}

/**
 * Router is the frontend's client: it routes requests and ends their bookings. Every booking must be
 * freed: use withRoute, or `await using` on the handle that route returns, or call free() yourself.
 * Close it to stop the ends it retries in the background. It keeps the Node.js process alive only while
 * a call is in flight (its idle connection and its background retries' timers do not), so a program
 * that forgets close() still exits.
 */
export class Router {
  private readonly owned: OwnedTransport;
  private readonly client: Client<typeof RouterService>;
  private readonly maxPromptTokens: number;
  private readonly timeoutMs: number;
  private readonly endRetryForMs: number;
  private readonly maxPendingEnds: number;
  /** Aborts the background retries and their calls in flight at close(). */
  private readonly closing = new AbortController();
  private pending = 0;

  constructor(opts: RouterOptions) {
    this.owned = openTransport(opts.address, { interceptors: opts.interceptors ?? [] });
    this.client = createClient(RouterService, this.owned.transport);
    this.maxPromptTokens = opts.maxPromptTokens ?? DEFAULT_MAX_PROMPT_TOKENS;
    this.timeoutMs = opts.timeoutMs ?? 5_000;
    this.endRetryForMs = opts.endRetryForMs ?? 300_000;
    this.maxPendingEnds = opts.maxPendingEnds ?? 100_000;
  }

  /**
   * Routes one request and books its load (unless query_only). A booking request without request_id
   * gets a random one. A request the router would refuse for its shape (no model, no tokens, more than
   * maxPromptTokens tokens, a request_id over 512 bytes; for a hashed prompt, a field its hashes hold or
   * a promptTokens that does not fit them) fails with INVALID_ARGUMENT and the router's message before
   * anything is sent. With opts.hashPrompt (the model's block size) the prompt is sent as its block
   * hashes (see hashPrompt and RouteOptions.hashPrompt); the caller's request is not changed. While the router answers UNAVAILABLE with reason LOG_UNAVAILABLE
   * (it is loading its shared state, or the state may be incomplete; it booked nothing) the call is
   * sent again after the delay it suggests, until opts.timeoutMs (the Router's timeoutMs by default)
   * ends or opts.signal aborts. A call aborted in flight may have been booked: the router frees a
   * booking whose caller left.
   */
  async route(init: RouteInit, opts: RouteOptions = {}): Promise<RouteHandle> {
    // create returns a RouteRequest message as it is: copy it, so that a request id set here (and the
    // hashes of hashPrompt, which replaces the copy's arrays) stay here.
    const req = isMessage(init, RouteRequestSchema) ? { ...init } : create(RouteRequestSchema, init);
    if (!req.queryOnly && req.requestId === "") {
      req.requestId = randomUUID();
    }
    const invalid = checkRouteRequest(req, this.maxPromptTokens);
    if (invalid) {
      throw invalid;
    }
    if (opts.hashPrompt !== undefined) {
      await hashPrompt(req, opts.hashPrompt); // checked as token ids above, as the router would
    }
    const deadline = performance.now() + (opts.timeoutMs ?? this.timeoutMs);
    for (let attempt = 0; ; attempt++) {
      try {
        const res = await this.client.route(req, { signal: opts.signal, timeoutMs: msLeft(deadline) });
        return new RouteHandle(this, req.requestId, res);
      } catch (err) {
        if (!logUnavailable(err)) {
          throw err;
        }
        const delay = retryAfterMs(err, attempt);
        if (performance.now() + delay >= deadline || !(await sleep(delay, opts.signal))) {
          throw err;
        }
      }
    }
  }

  /**
   * Returns the handle of a request routed elsewhere (by another Router or process: the request id is
   * all it takes), for this Router to end: its prefillComplete() and free() behave as those of a handle
   * that route returned, with background retries counted from now.
   */
  existing(requestId: string): RouteHandle {
    return new RouteHandle(this, requestId, create(RouteResponseSchema, { booked: true }));
  }

  /**
   * Routes a request, runs fn with the decision, and frees the booking when fn returns or throws, or as
   * soon as opts.signal aborts (fn receives a signal that aborts then too). Returns what fn returns.
   * opts.hashPrompt is route()'s.
   */
  async withRoute<T>(init: RouteInit, fn: (route: RouteHandle, signal: AbortSignal) => Promise<T> | T, opts: Pick<RouteOptions, "signal" | "hashPrompt"> = {}): Promise<T> {
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

  /** How many free() and prefillComplete() calls are being retried in the background. */
  get pendingEnds(): number {
    return this.pending;
  }

  /**
   * Stops the background retries and closes the connection; handles made by this router can no longer
   * reach it. Returns how many ends were still being retried (given up: their bookings expire on the
   * router).
   */
  close(): number {
    if (this.closing.signal.aborted) {
      return 0;
    }
    const givenUp = this.pending;
    this.pending = 0;
    this.closing.abort();
    this.owned.close();
    return givenUp;
  }

  /**
   * Sends a Free (or a MarkPrefillComplete) for requestId, and sends it again while the router cannot
   * accept it yet (UNAVAILABLE: it may not see the booking, which another replica holds and has not
   * published, or its shared state is being re-established), after the delay it suggests, until
   * timeoutMs ends; then hands it to the background retries, until endRetryForMs after since (a
   * performance.now()). NOT_FOUND (the booking expired, or ended through another caller) counts as
   * done. Resolves undefined when done, else with the last error and whether the background took it.
   * @internal
   */
  async end(kind: EndKind, requestId: string, since: number, timeoutMs = this.timeoutMs): Promise<EndFailure | undefined> {
    const deadline = performance.now() + timeoutMs;
    for (let attempt = 0; ; attempt++) {
      try {
        await this.call(kind, requestId, msLeft(deadline));
        return undefined;
      } catch (err) {
        const code = ConnectError.from(err).code;
        if (code === Code.NotFound) {
          return undefined;
        }
        if (!RETRYABLE_END.has(code)) {
          return { error: err, handedOff: false };
        }
        const delay = retryAfterMs(err, attempt);
        if (performance.now() + delay >= deadline) {
          return { error: err, handedOff: this.retryInBackground(kind, requestId, since + this.endRetryForMs, delay) };
        }
        await sleep(delay);
      }
    }
  }

  /** Starts retrying an end in the background after delay ms; false when it cannot be taken (closed, past its time, or maxPendingEnds wait already). */
  private retryInBackground(kind: EndKind, requestId: string, until: number, delay: number): boolean {
    if (this.closing.signal.aborted || performance.now() + delay >= until || this.pending >= this.maxPendingEnds) {
      return false;
    }
    this.pending++;
    void this.retryEnd(kind, requestId, until, delay).finally(() => {
      if (!this.closing.signal.aborted) {
        this.pending--; // close() zeroed the count of those it gave up
      }
    });
    return true;
  }

  /** Calls an end the router could not accept until it is accepted, NOT_FOUND, until, or close(). */
  private async retryEnd(kind: EndKind, requestId: string, until: number, delay: number): Promise<void> {
    const signal = this.closing.signal;
    for (let attempt = 1; ; attempt++) {
      // The timer does not keep the process alive: a process may exit with ends pending, as it may with
      // any booking it did not free.
      if (!(await sleep(delay, signal, false))) {
        return;
      }
      const left = until - performance.now();
      if (left <= 0) {
        return;
      }
      try {
        await this.call(kind, requestId, Math.min(this.timeoutMs, msLeft(until)), signal);
        return;
      } catch (err) {
        if (!RETRYABLE_END.has(ConnectError.from(err).code)) {
          return; // NOT_FOUND (nobody holds it), closed (CANCELED), or an error a retry would not change
        }
        delay = retryAfterMs(err, attempt);
        if (performance.now() + delay >= until) {
          return;
        }
      }
    }
  }

  private async call(kind: EndKind, requestId: string, timeoutMs: number, signal?: AbortSignal): Promise<void> {
    if (kind === "free") {
      await this.client.free({ requestId }, { timeoutMs, signal });
    } else {
      await this.client.markPrefillComplete({ requestId }, { timeoutMs, signal });
    }
  }
}

/** The codes of an end worth another try: the router could not tell where the booking is yet, or could not be reached in time. */
const RETRYABLE_END: ReadonlySet<Code> = new Set([Code.Unavailable, Code.DeadlineExceeded, Code.ResourceExhausted]);

/**
 * Returns the whole milliseconds until deadline (a performance.now()), at least 1: a call's timeoutMs
 * becomes its grpc-timeout header, which takes integers only (a fraction is refused with HTTP 400).
 */
function msLeft(deadline: number): number {
  return Math.max(Math.floor(deadline - performance.now()), 1);
}

/** Says whether err is the router's LOG_UNAVAILABLE: its shared state cannot answer yet, and the call changed nothing. */
function logUnavailable(err: unknown): boolean {
  return ConnectError.from(err).code === Code.Unavailable && errorReason(err) === "LOG_UNAVAILABLE";
}

/**
 * Returns how long to wait, in milliseconds, before attempt+1: what the router's RetryInfo suggests, or
 * 100 ms doubling per attempt, at most 2 s; with jitter, so that clients that failed together do not
 * retry together.
 */
function retryAfterMs(err: unknown, attempt: number): number {
  let d = 100 * 2 ** Math.min(attempt, 5);
  const suggested = retryDelayMs(err);
  if (suggested !== undefined) {
    d = Math.max(suggested, d / 2);
  }
  d = Math.min(d, 2_000);
  return d / 2 + Math.random() * (d / 2);
}

/** Waits ms; resolves false at once when signal aborts first. ref: whether the timer keeps the process alive. */
function sleep(ms: number, signal?: AbortSignal, ref = true): Promise<boolean> {
  return new Promise((resolve) => {
    if (signal?.aborted) {
      resolve(false);
      return;
    }
    const onAbort = (): void => {
      clearTimeout(timer);
      resolve(false);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve(true);
    }, ms);
    if (!ref) {
      timer.unref();
    }
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/**
 * RouteHandle is one routing decision and its booking. prefillComplete() and free() may be called any
 * number of times, concurrently too: each reaches the router until it succeeds once, and NOT_FOUND
 * (the booking expired or was freed) counts as done. After free(), prefillComplete() does nothing.
 * While the router cannot accept one yet (UNAVAILABLE: the replica asked cannot see the booking, which
 * another replica holds and has not published, or its shared state is being re-established) it is sent
 * again until its timeout ends, then retried in the background (see RouterOptions.endRetryForMs) and
 * the call rejects with the last error.
 */
export class RouteHandle implements AsyncDisposable {
  /** The request id the request was routed (and booked) with. */
  readonly requestId: string;
  /** The router's decision: mode, prefill and decode targets, annotations, diagnostics. */
  readonly response: RouteResponse;
  private freeing: Promise<void> | undefined;
  private prefilling: Promise<void> | undefined;
  private freed = false;
  /** When it was routed (performance.now()): background retries of its ends stop endRetryForMs after. */
  private readonly at = performance.now();

  /** @internal */
  constructor(private readonly router: Router, requestId: string, response: RouteResponse) {
    this.requestId = requestId;
    this.response = response;
    if (!response.booked) {
      this.freed = true; // query_only: nothing to free
      this.freeing = Promise.resolve();
    }
  }

  /** Says whether free() has nothing more to do: the booking was freed, never made, or its Free was handed to the background retries (which free it once the router accepts). */
  get isFreed(): boolean {
    return this.freed;
  }

  /** Records that the first token arrived, so the prompt stops counting as prefill load. Idempotent. */
  prefillComplete(opts: EndOptions = {}): Promise<void> {
    if (this.freed || this.freeing) {
      return Promise.resolve();
    }
    this.prefilling ??= this.router.end("prefill", this.requestId, this.at, opts.timeoutMs).then((failure) => {
      if (failure !== undefined) {
        // Handed to the background: nothing more to do here. Otherwise a later call tries again.
        this.prefilling = failure.handedOff ? Promise.resolve() : undefined;
        throw failure.error;
      }
    });
    return this.prefilling;
  }

  /** Releases everything the request booked. Idempotent. */
  free(opts: EndOptions = {}): Promise<void> {
    this.freeing ??= this.router.end("free", this.requestId, this.at, opts.timeoutMs).then((failure) => {
      if (failure === undefined) {
        this.freed = true;
        return;
      }
      if (failure.handedOff) {
        this.freed = true; // the background retry owns it now
        this.freeing = Promise.resolve();
      } else {
        this.freeing = undefined; // a later call tries again
      }
      throw failure.error;
    });
    return this.freeing;
  }

  /** Frees the booking, so that `await using handle = await router.route(...)` frees it at scope end. */
  [Symbol.asyncDispose](): Promise<void> {
    return this.free();
  }
}
