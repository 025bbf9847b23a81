import { create, isMessage, toBinary, type DescMessage, type MessageInitShape, type MessageShape } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient, type Client, type Interceptor } from "@connectrpc/connect";
import {
  KvEventSchema,
  LoadReportSchema,
  WorkerHelloSchema,
  WorkerService,
  type KvEvent,
  type LoadReport,
  type PublishRequest,
  type PublishResponse,
  type Registered,
  type WorkerHello,
  type WorkerLeave,
  PublishRequestSchema,
  WorkerLeaveSchema,
} from "./gen/kvrouter/v1/worker_pb.js";
import { WorkerRole } from "./gen/kvrouter/v1/types_pb.js";
import { errorReason, invalidArgument, PublisherClosedError, PublisherFullError, WorkerSupersededError } from "./errors.js";
import { openDetachedTransport, type OwnedTransport } from "./transport.js";
import { loadBlockHasher, type BlockHasher } from "./blockhash.js";
import { checkEvent, checkLeaveReason, eventBlocks } from "./validate.js";

/** A KV event as an object literal; event_id is assigned by the Publisher and dp_rank defaults to the hello's. */
export type KvEventInit = MessageInitShape<typeof KvEventSchema>;
/** A worker hello as an object literal. */
export type WorkerHelloInit = MessageInitShape<typeof WorkerHelloSchema>;
/** A load report as an object literal; dp_rank defaults to the hello's. */
export type LoadReportInit = MessageInitShape<typeof LoadReportSchema>;

/** The router's max_batch_blocks: events, and blocks, per message. */
export const MAX_BATCH_BLOCKS = 16_384;
/** PublisherOptions.maxBatchEvents by default: the Go client's MaxBatchEvents. */
export const DEFAULT_MAX_BATCH_EVENTS = 256;
/** PublisherOptions.flushIntervalMs by default: the Go client's FlushInterval (2 ms). */
export const DEFAULT_FLUSH_INTERVAL_MS = 2;
/** PublisherOptions.maxUnacked by default: the Go client's MaxUnacked (65,536). */
export const DEFAULT_MAX_UNACKED = 65_536;
/** PublisherOptions.maxDumpBlocks by default: the Go client's MaxDumpBlocks, the router's max_batch_blocks. */
export const DEFAULT_MAX_DUMP_BLOCKS = MAX_BATCH_BLOCKS;

/** Options of a Publisher. */
export interface PublisherOptions {
  /**
   * Router addresses ("host:port" or URLs). The publisher streams to the first, and after a failed
   * stream reconnects to the next one (round robin), so several replicas or one balanced name both work.
   */
  addresses: string[];
  /** The worker's registration. A new worker process should set freshStart; it is sent on the first stream only. */
  hello: WorkerHelloInit;
  /**
   * Returns the worker's whole cache as stored events (their ids are ignored), for the router's
   * ResyncRequest. It must reflect every event published before it is called; publish() waits while
   * it runs. Without it a resync request stops the publisher with UNIMPLEMENTED.
   */
  dump?: (signal: AbortSignal) => Promise<KvEventInit[]> | KvEventInit[];
  /**
   * The most events per batch message (at most 16,384, the router's max_batch_blocks). Default 256, as
   * the Go client's MaxBatchEvents; halved, down to one, each time the router refuses a message as too
   * large.
   */
  maxBatchEvents?: number;
  /** The most blocks (stored blocks plus removed hashes) per batch message. Default 16,384, the router's max_batch_blocks. */
  maxBatchBlocks?: number;
  /**
   * The most blocks of one dump part (a KvDump with more_follows). Default 16,384, the router's
   * max_batch_blocks, as the Go client's MaxDumpBlocks; never more than maxBatchBlocks.
   */
  maxDumpBlocks?: number;
  /**
   * How long an event may wait for its batch to fill before the batch is sent, in milliseconds. Default
   * 2, as the Go client's FlushInterval. flush() and close() send at once.
   */
  flushIntervalMs?: number;
  /**
   * The most events kept until the router acks them (what a reconnect replays); publish() then waits or
   * rejects (whenFull). Default 65,536, as the Go client's MaxUnacked.
   */
  maxUnacked?: number;
  /** What publish() does when maxUnacked events await acks: "wait" for acks (default) or "reject" with PublisherFullError. */
  whenFull?: "wait" | "reject";
  /** The first reconnect delay in milliseconds; it doubles per failed attempt, with jitter. Default 50. */
  minBackoffMs?: number;
  /** The longest reconnect delay in milliseconds. Default 5,000. */
  maxBackoffMs?: number;
  /** Receives the publisher's log lines (reconnects, resyncs). Default: none. */
  log?: (message: string, fields?: Record<string, unknown>) => void;
  /**
   * Connect interceptors for the Publish streams (every address's transport), for example to add an
   * authentication header, or to log. The first one is the outermost: it sees each call first.
   */
  interceptors?: Interceptor[];
  /**
   * Sends each stored block's tokens_hash (8 bytes: its local hash, computed here exactly as the router
   * computes it, salted with the event's lora_name and cache_namespace, its mm_hashes folded in) instead
   * of its token_ids and mm_hashes, as the Go client's HashTokens does. Blocks that already set
   * tokens_hash are sent as they are. Default false.
   */
  hashTokens?: boolean;
}

/** Counters of what a publisher did, for logs and tests. */
export interface PublisherStats {
  /** Streams that registered. */
  registrations: number;
  /** Resync requests received from the router. */
  resyncRequests: number;
  /** Dumps sent (each possibly in several parts). */
  dumps: number;
  /** Dump parts sent. */
  dumpParts: number;
  /** Event batch messages sent (replays included). */
  batches: number;
  /** The highest event id the router acked, or -1n. */
  lastAcked: bigint;
}

/** One queued event. */
interface Entry {
  ev: KvEvent;
  blocks: number;
  at: number; // when it was published (ms), for the batch time bound
}

/** A queue of requests that the Publish call reads as its request stream. */
class RequestQueue implements AsyncIterable<PublishRequest> {
  private items: PublishRequest[] = [];
  private ended = false;
  private wake: (() => void) | undefined;

  push(msg: PublishRequest): void {
    if (this.ended) {
      return;
    }
    this.items.push(msg);
    this.wake?.();
  }

  end(): void {
    this.ended = true;
    this.wake?.();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<PublishRequest> {
    for (;;) {
      const item = this.items.shift();
      if (item) {
        yield item;
        continue;
      }
      if (this.ended) {
        return;
      }
      await new Promise<void>((resolve) => (this.wake = resolve));
      this.wake = undefined;
    }
  }
}

/** Wakes waiters on every change of the publisher's state. */
class Notifier {
  private waiters = new Set<() => void>();

  /** onChange runs at every notify, before the waiters wake. */
  constructor(private readonly onChange: () => void = () => undefined) {}

  notify(): void {
    this.onChange();
    const ws = [...this.waiters];
    this.waiters.clear();
    for (const w of ws) {
      w();
    }
  }

  /**
   * Resolves at the next notify, after timeoutMs, or when signal aborts. The timer does not keep the
   * process alive: the Publisher does, while it has work (see Publisher.syncHold).
   */
  wait(timeoutMs?: number, signal?: AbortSignal): Promise<void> {
    return new Promise<void>((resolve) => {
      let timer: NodeJS.Timeout | undefined;
      const done = (): void => {
        this.waiters.delete(done);
        if (timer) {
          clearTimeout(timer);
        }
        signal?.removeEventListener("abort", done);
        resolve();
      };
      this.waiters.add(done);
      if (timeoutMs !== undefined) {
        timer = setTimeout(done, Math.max(0, timeoutMs)).unref();
      }
      signal?.addEventListener("abort", done, { once: true });
    });
  }
}

/**
 * Returns why protobuf cannot encode a message (a number out of its field's range), or undefined. A
 * message that cannot be encoded would fail every stream it is sent on.
 */
function encodeError<Desc extends DescMessage>(schema: Desc, msg: MessageShape<Desc>): string | undefined {
  try {
    toBinary(schema, msg);
    return undefined;
  } catch (e) {
    return e instanceof Error ? e.message : String(e);
  }
}

/** Resolves when p settles; rejects with the signal's reason if it aborts first. */
function settledOrAborted(p: Promise<void>, signal?: AbortSignal): Promise<void> {
  if (!signal) {
    return p;
  }
  signal.throwIfAborted();
  return new Promise<void>((resolve, reject) => {
    const onAbort = (): void => reject(signal.reason);
    signal.addEventListener("abort", onAbort, { once: true });
    void p.finally(() => {
      signal.removeEventListener("abort", onAbort);
      resolve();
    });
  });
}

/** Waits ms, or until signal aborts. The timer does not keep the process alive (see Publisher.syncHold). */
const sleep = (ms: number, signal?: AbortSignal): Promise<void> =>
  new Promise((resolve) => {
    const t = setTimeout(done, ms).unref();
    function done(): void {
      clearTimeout(t);
      signal?.removeEventListener("abort", done);
      resolve();
    }
    signal?.addEventListener("abort", done, { once: true });
  });

/**
 * Publisher is one worker rank's Publish stream, kept up across failures. It registers with the hello,
 * numbers the events it is given from the rank's last id, sends them in batches (bounded in events,
 * blocks and time), and keeps every event until the router acks it. After a failed stream it reconnects
 * (the next address, exponential backoff with jitter), registers again without fresh_start and resumes
 * after Registered.last_event_id: acked events are not sent again, the others are. It answers a
 * ResyncRequest (and a router that lost acked events) with a KvDump of the dump function's events, in
 * parts. It stops for good on WORKER_SUPERSEDED (another stream registered the same worker rank), on
 * INVALID_ARGUMENT and other FAILED_PRECONDITION statuses, and on a single event too large to send.
 * close() ends the stream once everything is acked (the router keeps the worker rank for a grace period,
 * in case it reconnects); leave() has the router remove the rank at once, for a worker that stopped
 * serving.
 *
 * publish() queues; flush() waits for the router's ack of everything published before it. The
 * publisher keeps the Node.js process alive while it has work (its first registration, events not
 * acked, a flush, close or leave in progress) and not otherwise: a program that returns without
 * close() exits once every event it published was acked, and its open stream does not hold it.
 */
export class Publisher {
  private readonly opts: Required<Omit<PublisherOptions, "dump" | "log" | "hello" | "interceptors">> & Pick<PublisherOptions, "dump" | "log">;
  private readonly hello: WorkerHello;
  private readonly transports: OwnedTransport[];
  private readonly clients: Client<typeof WorkerService>[];
  private readonly changed = new Notifier(() => this.syncHold());
  private readonly stop = new AbortController(); // aborts the run loop (fatal error or forced close)

  private pending: Entry[] = []; // unacked events, in id order
  private sent = 0; // how many of pending were sent on the current stream
  private acked = -1n;
  private nextId = 0n;
  private load: LoadReport | undefined; // the latest load report, not yet sent on the current stream
  private lastLoad: LoadReport | undefined; // the latest load report, sent again after a reconnect
  private batchEvents: number;
  private batchBlocks: number;
  private dumping = false;
  private closing = false;
  private leaving: WorkerLeave | undefined; // set by leave(): sent in place of anything else
  private left = false; // the router removed the worker rank after the leave
  private flushWaiters = 0;
  private fatal: Error | undefined;
  private readonly done: Promise<void>;
  private readonly readyPromise: Promise<void>;
  private resolveReady!: () => void;
  private rejectReady!: (err: Error) => void;
  private everRegistered = false;
  private queueing = 0; // publish calls that have not queued their events (or failed) yet
  private publishTail: Promise<void> = Promise.resolve(); // settles when the latest publish call queued or failed
  private hasher: BlockHasher | undefined; // with hashTokens, once loaded
  private hasherLoading: Promise<BlockHasher> | undefined;
  private finished = false; // the run loop ended: the publisher stopped or closed
  private hold: NodeJS.Timeout | undefined; // a ref()ed timer that keeps the process alive while busy()

  /** What the publisher did so far. */
  readonly stats: PublisherStats = { registrations: 0, resyncRequests: 0, dumps: 0, dumpParts: 0, batches: 0, lastAcked: -1n };

  /**
   * Validates the options and the hello (with the router's messages for a hello it would refuse) and
   * starts streaming in the background.
   */
  constructor(opts: PublisherOptions) {
    if (opts.addresses.length === 0) {
      throw new Error("kvrouter: PublisherOptions.addresses must name at least one router");
    }
    this.hello = isMessage(opts.hello, WorkerHelloSchema) ? { ...opts.hello } : create(WorkerHelloSchema, opts.hello);
    const h = this.hello;
    if (h.workerId === 0n) {
      throw invalidArgument("hello.worker_id", "must not be 0");
    }
    if (h.model === "") {
      throw invalidArgument("hello.model", "must not be empty");
    }
    if (h.role < WorkerRole.PREFILL || h.role > WorkerRole.AGGREGATED) {
      throw invalidArgument("hello.role", `must be PREFILL, DECODE or AGGREGATED (got ${WorkerRole[h.role] ?? h.role})`);
    }
    if (h.blockSize === 0) {
      throw invalidArgument("hello.block_size", "must be > 0");
    }
    if (h.endpoint === "" && !h.noEndpoint) {
      throw invalidArgument("hello.endpoint", "must be set to the address frontends reach the worker at (or set hello.no_endpoint for a fleet whose frontends find workers by worker_id)");
    }
    if (h.endpoint !== "" && h.noEndpoint) {
      throw invalidArgument("hello.no_endpoint", "must not be set with hello.endpoint");
    }
    const unencodable = encodeError(WorkerHelloSchema, h);
    if (unencodable) {
      throw invalidArgument("hello", unencodable);
    }
    this.opts = {
      addresses: opts.addresses,
      dump: opts.dump,
      log: opts.log,
      maxBatchEvents: Math.min(opts.maxBatchEvents ?? DEFAULT_MAX_BATCH_EVENTS, MAX_BATCH_BLOCKS),
      maxBatchBlocks: Math.min(opts.maxBatchBlocks ?? MAX_BATCH_BLOCKS, MAX_BATCH_BLOCKS),
      maxDumpBlocks: Math.min(opts.maxDumpBlocks ?? DEFAULT_MAX_DUMP_BLOCKS, MAX_BATCH_BLOCKS),
      flushIntervalMs: opts.flushIntervalMs ?? DEFAULT_FLUSH_INTERVAL_MS,
      maxUnacked: opts.maxUnacked ?? DEFAULT_MAX_UNACKED,
      whenFull: opts.whenFull ?? "wait",
      minBackoffMs: opts.minBackoffMs ?? 50,
      maxBackoffMs: opts.maxBackoffMs ?? 5_000,
      hashTokens: opts.hashTokens ?? false,
    };
    for (const [name, min] of [["maxBatchEvents", 1], ["maxBatchBlocks", 1], ["maxDumpBlocks", 1], ["flushIntervalMs", 0], ["maxUnacked", 1], ["minBackoffMs", 1], ["maxBackoffMs", 1]] as const) {
      const v = this.opts[name];
      if (!Number.isFinite(v) || v < min) {
        throw new RangeError(`kvrouter: PublisherOptions.${name} must be a number >= ${min} (got ${v})`);
      }
    }
    this.batchEvents = this.opts.maxBatchEvents;
    this.batchBlocks = this.opts.maxBatchBlocks;
    const interceptors = [...(opts.interceptors ?? [])];
    this.transports = opts.addresses.map((address) => openDetachedTransport(address, { interceptors }));
    if (this.opts.hashTokens) {
      void this.loadHasher().catch(() => undefined); // early; a failure is reported by publish
    }
    this.clients = this.transports.map((t) => createClient(WorkerService, t.transport));
    this.readyPromise = new Promise<void>((resolve, reject) => {
      this.resolveReady = resolve;
      this.rejectReady = reject;
    });
    this.readyPromise.catch(() => undefined); // reported through every other call too
    this.done = this.run();
    this.syncHold();
  }

  /** Resolves once the first stream registered; rejects if the publisher stops before that. */
  get ready(): Promise<void> {
    return this.readyPromise;
  }

  /** The error that stopped the publisher, if one did. */
  get error(): Error | undefined {
    return this.fatal;
  }

  /** The number of events kept until the router acks them. */
  get unacked(): number {
    return this.pending.length;
  }

  /**
   * Queues events for the router and returns the ids assigned to them. It resolves once the events are
   * queued, not once the router has them: they go out in batches (after at most flushIntervalMs, 2 ms by
   * default) and a Route sent right after publish() may not see them yet. `await publisher.flush()`
   * waits until the router acked every event published before it: the replica it streams to applied
   * them (with Redis, also wrote them to the shared log, which the other replicas apply in order), so
   * route after that.
   *
   * Every event is checked first as the router would check it (tier, dp_rank, a stored block's token
   * count against the hello's block_size); an invalid one rejects the whole call with INVALID_ARGUMENT
   * and the router's message, and nothing is queued. With hashTokens, stored blocks get their
   * tokens_hash instead of token_ids.
   * When maxUnacked events await acks, waits for acks (or rejects with PublisherFullError, with
   * whenFull "reject"); opts.signal abandons the wait. Concurrent calls queue their events in call
   * order, so a removal published after a store is applied after it. The events given are not modified
   * (the publisher copies them), but their token_ids arrays are sent as they are: do not change them
   * until the router acked the events.
   */
  async publish(events: KvEventInit[], opts: { signal?: AbortSignal } = {}): Promise<bigint[]> {
    const earlier = this.queueing > 0;
    const prev = this.publishTail;
    let release!: () => void;
    const mine = new Promise<void>((resolve) => (release = resolve));
    this.publishTail = prev.then(() => mine); // later calls wait for the earlier ones too, even if this one gives up
    this.queueing++;
    this.syncHold();
    try {
      const evs = events.map((init, i) => this.prepare(init, `events.events[${i}]`));
      const hashing = this.opts.hashTokens ? this.hashTokens(evs) : undefined;
      if (hashing) {
        await hashing;
      }
      if (earlier) {
        await settledOrAborted(prev, opts.signal); // queue after the calls made before this one
      }
      for (;;) {
        this.throwIfStopped();
        opts.signal?.throwIfAborted();
        if (!this.dumping && this.pending.length + evs.length <= Math.max(this.opts.maxUnacked, evs.length)) {
          break;
        }
        if (!this.dumping && this.opts.whenFull === "reject") {
          throw new PublisherFullError(this.pending.length, this.opts.maxUnacked, evs.length);
        }
        await this.changed.wait(undefined, opts.signal);
      }
      const now = Date.now();
      const ids: bigint[] = [];
      for (const e of evs) {
        e.ev.eventId = this.nextId++;
        e.at = now;
        ids.push(e.ev.eventId);
        this.pending.push(e);
      }
      this.changed.notify();
      return ids;
    } finally {
      this.queueing--;
      release();
      this.syncHold();
    }
  }

  /** Sends the worker's own load view (the latest report wins if several wait); sent again after a reconnect. */
  reportLoad(init: LoadReportInit): void {
    this.throwIfStopped();
    const r = isMessage(init, LoadReportSchema) ? { ...init } : create(LoadReportSchema, init);
    if (init.dpRank === undefined) {
      r.dpRank = this.hello.dpRank;
    }
    if (r.dpRank !== this.hello.dpRank) {
      throw invalidArgument("load.dp_rank", `must equal the stream's registered dp_rank ${this.hello.dpRank} (got ${r.dpRank})`);
    }
    const unencodable = encodeError(LoadReportSchema, r);
    if (unencodable) {
      throw invalidArgument("load", unencodable);
    }
    this.load = r;
    this.lastLoad = r;
    this.changed.notify();
  }

  /**
   * Sends what is queued at once and resolves when the router acked every event published before the
   * call: the replica it streams to applied them then, so a Route it answers sees them (with Redis,
   * they are in the shared log too, which the other replicas apply in order). publish() only queues,
   * so flush() is what to await before anything that depends on the router having the events.
   * Rejects with the error that stopped the publisher, if one did; opts.signal abandons the wait (the
   * events stay queued).
   */
  async flush(opts: { signal?: AbortSignal } = {}): Promise<void> {
    const target = this.nextId - 1n;
    this.flushWaiters++;
    this.changed.notify();
    try {
      while (this.pending.length > 0 && this.pending[0]!.ev.eventId <= target) {
        if (this.fatal) {
          throw this.fatal;
        }
        opts.signal?.throwIfAborted();
        await this.changed.wait(undefined, opts.signal);
      }
    } finally {
      this.flushWaiters--;
      this.syncHold();
    }
  }

  /**
   * Flushes, waits for the last ack, then ends the stream and closes the connections. opts.signal
   * abandons the wait: the stream is then cut and unacked events are lost. Rejects with the error that
   * stopped the publisher, if one did.
   */
  async close(opts: { signal?: AbortSignal } = {}): Promise<void> {
    this.closing = true;
    this.changed.notify();
    const onAbort = (): void => this.stop.abort(opts.signal?.reason);
    opts.signal?.addEventListener("abort", onAbort, { once: true });
    if (opts.signal?.aborted) {
      onAbort();
    }
    try {
      await this.done;
    } finally {
      opts.signal?.removeEventListener("abort", onAbort);
    }
    if (this.fatal && !(this.fatal instanceof PublisherClosedError)) {
      throw this.fatal;
    }
    opts.signal?.throwIfAborted();
  }

  /**
   * Has the router remove the worker rank now, with its blocks, and closes the publisher: for a worker
   * that stopped serving (its engine is down) and must get no more requests. After close() the router
   * keeps the rank, and routes to it, for a grace period in case it reconnects. reason says why, for the
   * router's log (at most 256 UTF-8 bytes). Events not acked yet are dropped, since the worker's blocks
   * go with it. The leave is the last message of the stream (on a new one if the stream fails first,
   * after the reconnects' backoff); the router confirms the removal by ending the stream with OK, and
   * the promise resolves then. opts.signal abandons the wait (the promise rejects with its reason): the
   * stream is cut, and the router removes the rank a grace period later, as after close(). The
   * publisher is closed either way.
   *
   * A reason over 256 bytes rejects with INVALID_ARGUMENT and the router's message, and changes nothing.
   * It rejects with the error that stopped the publisher, if one did (before or during the leave), and
   * with PublisherClosedError after close() or a first leave().
   */
  async leave(reason: string, opts: { signal?: AbortSignal } = {}): Promise<void> {
    const invalid = checkLeaveReason(reason);
    if (invalid) {
      throw invalid;
    }
    this.throwIfStopped();
    opts.signal?.throwIfAborted();
    this.closing = true;
    this.leaving = create(WorkerLeaveSchema, { reason });
    this.pending = [];
    this.sent = 0;
    this.changed.notify();
    while (!this.left && !this.fatal && !opts.signal?.aborted) {
      await this.changed.wait(undefined, opts.signal);
    }
    if (!this.left && !this.fatal) {
      this.fatal = new ConnectError("kvrouter: the publisher was closed before the router confirmed the leave", Code.Canceled);
      this.rejectReady(this.fatal);
      this.stop.abort(opts.signal?.reason);
    }
    await this.done;
    if (this.left) {
      return;
    }
    opts.signal?.throwIfAborted();
    throw this.fatal;
  }

  /**
   * Says whether the publisher has work to do: its first registration, events not acked yet, publish()
   * calls not queued yet, flush() calls waiting, a dump, or a close() or leave() not finished. Nothing
   * else counts: not an open stream, nor a reconnect after a failure with nothing left to deliver, nor
   * a load report (the router keeps the last one it got).
   */
  private busy(): boolean {
    return !this.finished && (!this.everRegistered || this.pending.length > 0 || this.queueing > 0 || this.flushWaiters > 0 || this.dumping || this.closing);
  }

  /**
   * Keeps the Node.js process alive while busy(), and only then. Its connections (openDetachedTransport)
   * and its timers never hold the process themselves, since its Publish stream stays open for good: a
   * program that forgot close() exits once the router acked everything it published, as if it had
   * closed (the router sees the stream cut and keeps the worker rank for its grace period). Called at
   * every change of what busy() reads.
   */
  private syncHold(): void {
    const busy = this.busy();
    if (busy && this.hold === undefined) {
      this.hold = setInterval(() => undefined, 1 << 30); // ~12 days; never fires in practice
    } else if (!busy && this.hold !== undefined) {
      clearInterval(this.hold);
      this.hold = undefined;
    }
  }

  private throwIfStopped(): void {
    if (this.fatal) {
      throw this.fatal;
    }
    if (this.closing) {
      throw new PublisherClosedError();
    }
  }

  /** Copies and checks one event (field is its path in the router's messages). */
  private prepare(init: KvEventInit, field: string): Entry {
    // create returns a KvEvent message as it is: copy it, since eventId and dpRank are set here.
    const ev = isMessage(init, KvEventSchema) ? { ...init } : create(KvEventSchema, init);
    if (init.dpRank === undefined) {
      ev.dpRank = this.hello.dpRank;
    }
    const err = checkEvent(field, ev, this.hello.dpRank, this.hello.blockSize);
    if (err) {
      throw err;
    }
    const blocks = eventBlocks(ev);
    if (blocks > MAX_BATCH_BLOCKS) {
      throw new ConnectError(`${field}: holds ${blocks} blocks (stored blocks plus removed hashes), more than max_batch_blocks ${MAX_BATCH_BLOCKS}: split the event`, Code.ResourceExhausted);
    }
    return { ev, blocks, at: 0 };
  }

  private loadHasher(): Promise<BlockHasher> {
    this.hasherLoading ??= loadBlockHasher().then(
      (h) => (this.hasher = h),
      (err: unknown) => {
        this.hasherLoading = undefined; // tried again by the next publish
        throw new ConnectError(`kvrouter: hashTokens: loading the XXH3 hasher failed: ${err instanceof Error ? err.message : String(err)}`, Code.Internal, undefined, undefined, err);
      },
    );
    return this.hasherLoading;
  }

  /**
   * Replaces the token_ids of every stored block by its tokens_hash (the router's local hash, salted
   * with the event's lora_name and cache_namespace). The events' stored data and blocks are replaced,
   * not changed, so that objects the caller passed in stay as they were. Synchronous (returns
   * undefined) unless a hasher must be loaded: the first time, and for a new salt.
   */
  private hashTokens(entries: Entry[]): Promise<void> | undefined {
    const bh = this.hasher;
    if (bh) {
      const salts = this.saltsOf(entries, bh);
      if ([...salts.values()].every((s) => bh.hasSalt(s))) {
        this.hashWith(bh, salts);
        return undefined;
      }
    }
    return this.loadAndHash(entries);
  }

  private async loadAndHash(entries: Entry[]): Promise<void> {
    let bh = this.hasher ?? (await this.loadHasher());
    const salts = this.saltsOf(entries, bh);
    const missing = new Set([...salts.values()].filter((s) => !bh.hasSalt(s)));
    if (missing.size > 0) {
      // A hasher keeps the salts it loaded: start afresh now and then, so that a worker serving many
      // cache namespaces does not keep a hasher for each forever.
      bh = bh.saltsLoaded + missing.size > 64 ? await loadBlockHasher(...new Set(salts.values())) : await bh.load(...missing);
      this.hasher = bh;
    }
    this.hashWith(bh, salts);
  }

  /** The salt of each stored event with a block to hash. */
  private saltsOf(entries: Entry[], bh: BlockHasher): Map<Entry, bigint> {
    const salts = new Map<Entry, bigint>();
    for (const e of entries) {
      if (e.ev.data.case === "stored" && e.ev.data.value.blocks.some((b) => b.tokensHash === undefined)) {
        salts.set(e, bh.salt(e.ev.data.value.loraName, e.ev.data.value.cacheNamespace));
      }
    }
    return salts;
  }

  private hashWith(bh: BlockHasher, salts: Map<Entry, bigint>): void {
    for (const [e, salt] of salts) {
      if (e.ev.data.case !== "stored") {
        continue;
      }
      const st = e.ev.data.value;
      const blocks = st.blocks.map((b) =>
        b.tokensHash !== undefined
          ? b
          : { ...b, tokenIds: [], mmHashes: [], tokensHash: b.mmHashes.length > 0 ? bh.localMultimodal(b.tokenIds, b.mmHashes, salt) : bh.local(b.tokenIds, salt) },
      );
      e.ev.data = { case: "stored", value: { ...st, blocks } };
    }
  }

  private fail(err: Error): void {
    this.fatal ??= err;
    this.rejectReady(this.fatal);
    this.stop.abort(err);
    this.changed.notify();
  }

  private logLine(message: string, fields?: Record<string, unknown>): void {
    this.opts.log?.(message, fields);
  }

  /** Streams until closed or stopped, reconnecting after failures. */
  private async run(): Promise<void> {
    let index = 0;
    let attempt = 0;
    try {
      while (!this.stop.signal.aborted) {
        try {
          if (await this.stream(index, !this.everRegistered, () => (attempt = 0))) {
            return; // closed cleanly: everything acked
          }
        } catch (e) {
          if (this.stop.signal.aborted) {
            return;
          }
          const err = ConnectError.from(e);
          const fatal = this.classify(err);
          if (fatal) {
            this.fail(fatal);
            return;
          }
          if (err.code === Code.ResourceExhausted) {
            continue; // smaller messages, at once, same address
          }
          this.logLine("kvrouter: publish stream failed; reconnecting", { address: this.opts.addresses[index], code: Code[err.code], error: err.rawMessage });
        }
        index = (index + 1) % this.clients.length;
        const base = Math.min(this.opts.maxBackoffMs, this.opts.minBackoffMs * 2 ** Math.min(attempt, 30));
        attempt++;
        await sleep(base / 2 + Math.random() * (base / 2), this.stop.signal);
      }
    } finally {
      if (!this.fatal) {
        this.fatal = this.stop.signal.aborted ? new ConnectError("kvrouter: the publisher was closed before every event was acked", Code.Canceled) : new PublisherClosedError();
        this.rejectReady(this.fatal);
      }
      this.finished = true;
      this.changed.notify();
      for (const t of this.transports) {
        t.close();
      }
    }
  }

  /** Returns the error that stops the publisher for good, or undefined when a reconnect may help. */
  private classify(err: ConnectError): Error | undefined {
    switch (err.code) {
      case Code.FailedPrecondition:
        if (errorReason(err) === "WORKER_SUPERSEDED") {
          return new WorkerSupersededError(err);
        }
        return err;
      case Code.InvalidArgument:
      case Code.Unimplemented:
      case Code.PermissionDenied:
      case Code.Unauthenticated:
        return err;
      case Code.ResourceExhausted:
        if (this.batchEvents <= 1 && this.batchBlocks <= 1) {
          return err;
        }
        this.batchEvents = Math.max(1, Math.floor(this.batchEvents / 2));
        this.batchBlocks = Math.max(1, Math.floor(this.batchBlocks / 2));
        this.logLine("kvrouter: a message was too large; sending smaller ones", { maxBatchEvents: this.batchEvents, maxBatchBlocks: this.batchBlocks, error: err.rawMessage });
        return undefined;
      default:
        return undefined;
    }
  }

  /**
   * Runs one Publish stream: hello, Registered, resume, then batches, load reports and dumps until the
   * publisher is closed with everything acked (returns true) or the stream fails (throws).
   */
  private async stream(index: number, first: boolean, onRegistered: () => void): Promise<boolean> {
    const client = this.clients[index]!;
    const abort = new AbortController();
    const onStop = (): void => abort.abort();
    this.stop.signal.addEventListener("abort", onStop, { once: true });
    const out = new RequestQueue();
    const hello = create(WorkerHelloSchema, { ...this.hello, freshStart: first && this.hello.freshStart });
    out.push(create(PublishRequestSchema, { message: { case: "hello", value: hello } }));
    const responses = client.publish(out, { signal: abort.signal })[Symbol.asyncIterator]();
    try {
      const r = await responses.next();
      if (r.done) {
        throw new ConnectError("the router ended the stream before answering the hello", Code.Unavailable);
      }
      if (r.value.message.case !== "registered") {
        throw new ConnectError(`the router answered the hello with ${r.value.message.case ?? "nothing"}, not registered`, Code.Internal);
      }
      this.stats.registrations++;
      this.everRegistered = true;
      onRegistered();
      let needDump = this.resume(r.value.message.value, first, hello.freshStart);
      this.resolveReady();
      this.syncHold();

      let failed: unknown;
      let readerDone = false;
      let resync = false;
      const reader = (async (): Promise<void> => {
        try {
          for (;;) {
            const m = await responses.next();
            if (m.done) {
              return;
            }
            this.handleResponse(m.value, () => (resync = true));
          }
        } catch (e) {
          failed = e;
        } finally {
          readerDone = true;
          this.changed.notify();
        }
      })();

      for (;;) {
        if (failed !== undefined) {
          throw failed;
        }
        if (this.stop.signal.aborted) {
          throw new ConnectError("the publisher stopped", Code.Canceled);
        }
        if (this.leaving) {
          if (readerDone) {
            throw new ConnectError("the router ended the Publish stream", Code.Unavailable);
          }
          // The leave is the stream's last message. The router ends the stream with OK once it removed
          // the rank: it read the leave then, since nothing follows the leave but the half-close.
          out.push(create(PublishRequestSchema, { message: { case: "leave", value: this.leaving } }));
          out.end();
          await reader;
          if (failed !== undefined) {
            throw failed;
          }
          this.left = true;
          this.changed.notify();
          return true;
        }
        if (resync) {
          resync = false;
          needDump = true;
        }
        if (needDump) {
          await this.sendDump(out, abort.signal);
          needDump = false;
          continue;
        }
        if (readerDone) {
          throw new ConnectError("the router ended the Publish stream", Code.Unavailable);
        }
        const batch = this.nextBatch();
        if (batch.events) {
          out.push(create(PublishRequestSchema, { message: { case: "events", value: { events: batch.events } } }));
          this.stats.batches++;
          continue;
        }
        if (this.load) {
          out.push(create(PublishRequestSchema, { message: { case: "load", value: this.load } }));
          this.load = undefined;
          continue;
        }
        if (this.closing && this.pending.length === 0) {
          out.end();
          await reader;
          if (failed !== undefined) {
            throw failed;
          }
          return true;
        }
        await this.changed.wait(batch.waitMs, this.stop.signal);
      }
    } finally {
      this.stop.signal.removeEventListener("abort", onStop);
      out.end();
      abort.abort();
    }
  }

  private handleResponse(res: PublishResponse, onResync: () => void): void {
    switch (res.message.case) {
      case "ack":
        this.dropThrough(res.message.value.eventId);
        break;
      case "resync":
        this.stats.resyncRequests++;
        this.logLine("kvrouter: the router asked for a dump", { reason: res.message.value.reason, expectedEventId: res.message.value.expectedEventId });
        onResync();
        this.changed.notify();
        break;
      default:
        break;
    }
  }

  /**
   * Returns the next batch of unsent events when one is due (full, old enough, flushing or closing),
   * otherwise how long to wait for it.
   */
  private nextBatch(): { events?: KvEvent[]; waitMs?: number } {
    const unsent = this.pending.length - this.sent;
    if (unsent === 0) {
      return {};
    }
    const events: KvEvent[] = [];
    let blocks = 0;
    let i = this.sent;
    while (i < this.pending.length && events.length < this.batchEvents) {
      const e = this.pending[i]!;
      if (events.length > 0 && blocks + e.blocks > this.batchBlocks) {
        break;
      }
      events.push(e.ev);
      blocks += e.blocks;
      i++;
    }
    const full = i < this.pending.length || events.length >= this.batchEvents || blocks >= this.batchBlocks;
    const age = Date.now() - this.pending[this.sent]!.at;
    if (!full && !this.closing && this.flushWaiters === 0 && age < this.opts.flushIntervalMs) {
      return { waitMs: this.opts.flushIntervalMs - age };
    }
    this.sent = i;
    return { events };
  }

  /**
   * Applies a registration: drops what the router holds and rewinds to the first unacked event. A first
   * registration without fresh_start continues the rank's numbering after the router's last event.
   * Returns whether the router lost events this publisher saw acked, so that only a dump restores them.
   */
  private resume(reg: Registered, first: boolean, freshStart: boolean): boolean {
    this.sent = 0;
    this.load = this.lastLoad; // sent again on the new stream
    if (reg.lastEventId === undefined) {
      if (this.acked >= 0n && !freshStart) {
        this.logLine("kvrouter: the router holds none of the events it acked; sending a dump", { acked: this.acked });
        return true;
      }
      return false;
    }
    const last = reg.lastEventId;
    if (first && !freshStart) {
      // A worker resuming a rank: its events follow the router's last one.
      this.nextId = last + 1n;
      for (const e of this.pending) {
        e.ev.eventId = this.nextId++;
      }
      this.acked = last;
      this.stats.lastAcked = last;
      this.changed.notify();
      return false;
    }
    if (last < this.acked) {
      this.logLine("kvrouter: the router holds fewer events than it acked; sending a dump", { registered: last, acked: this.acked });
      return true;
    }
    this.dropThrough(last);
    return false;
  }

  /** Forgets the events through id: the router holds them. */
  private dropThrough(id: bigint): void {
    let n = 0;
    while (n < this.pending.length && this.pending[n]!.ev.eventId <= id) {
      n++;
    }
    if (n > 0) {
      this.pending.splice(0, n);
      this.sent = Math.max(this.sent - n, 0);
    }
    if (id > this.acked) {
      this.acked = id;
      this.stats.lastAcked = id;
    }
    this.changed.notify();
  }

  /**
   * Sends the worker's whole cache as a KvDump, in parts of at most maxDumpBlocks blocks (and no more
   * than the batches' block bound, halved after a message too large), with publishing paused; the
   * events it reflects are forgotten once it is queued on the stream (as the Go client does), and the
   * next event follows it.
   */
  private async sendDump(out: RequestQueue, signal: AbortSignal): Promise<void> {
    const dumpFn = this.opts.dump;
    if (!dumpFn) {
      throw new ConnectError("kvrouter: the router asked for a dump of the worker's cache and PublisherOptions.dump is not set", Code.Unimplemented);
    }
    this.dumping = true;
    this.syncHold();
    try {
      if (this.nextId === 0n) {
        this.nextId = 1n; // through_event_id 0 then stands for "nothing before"
      }
      const through = this.nextId - 1n;
      let inits: KvEventInit[];
      try {
        inits = await dumpFn(signal);
      } catch (e) {
        throw new ConnectError(`kvrouter: PublisherOptions.dump failed: ${e instanceof Error ? e.message : String(e)}`, Code.Unimplemented);
      }
      const events = inits.map((init, i) => this.prepare(init, `dump.events[${i}]`));
      for (const [i, e] of events.entries()) {
        if (e.ev.data.case !== "stored") {
          throw invalidArgument(`dump.events[${i}]`, "must be a stored event (a dump lists the blocks the worker holds)");
        }
      }
      if (this.opts.hashTokens) {
        await this.hashTokens(events);
      }
      const partBlocks = Math.min(this.opts.maxDumpBlocks, this.batchBlocks);
      let start = 0;
      do {
        let end = start;
        let blocks = 0;
        while (end < events.length && (end === start || blocks + events[end]!.blocks <= partBlocks)) {
          blocks += events[end]!.blocks;
          end++;
        }
        out.push(create(PublishRequestSchema, {
          message: { case: "dump", value: { throughEventId: through, events: events.slice(start, end).map((e) => e.ev), moreFollows: end < events.length } },
        }));
        this.stats.dumpParts++;
        start = end;
      } while (start < events.length);
      this.stats.dumps++;
      this.dropThrough(through); // in the dump; the router acks it when it applied it
    } finally {
      this.dumping = false;
      this.changed.notify();
    }
  }
}
