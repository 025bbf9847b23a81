import { spawn, type ChildProcess } from "node:child_process";
import { once } from "node:events";
import { createServer, connect, type AddressInfo, type Socket } from "node:net";
import { fileURLToPath } from "node:url";
import path from "node:path";
import { createClient, type Client, type Interceptor } from "@connectrpc/connect";
import { isMessage, type Message } from "@bufbuild/protobuf";
import { AdminService, openTransport, PublishRequestSchema, type OwnedTransport, type StoredBlock, type WorkerStatus } from "../src/index.js";

/** The client's directory (clients/ts), whether the tests run from test/ or build/test/. */
const here = path.dirname(fileURLToPath(import.meta.url));
export const TS_DIR = here.includes(`${path.sep}build${path.sep}`) ? path.resolve(here, "../..") : path.resolve(here, "..");
export const REPO_DIR = path.resolve(TS_DIR, "../..");
/** The kvrouter binary that test.sh builds. */
export const KVROUTER_BIN = process.env.KVROUTER_BIN ?? path.join(REPO_DIR, ".tmp/bin/kvrouter");

/**
 * The scratch npm project that test.sh made with pack.sh (KVROUTER_TS_SCRATCH): @kvrouter/client
 * installed from its tarball, the examples compiled into its dist/ with its own tsc.
 */
export function scratchDir(): string {
  const dir = process.env.KVROUTER_TS_SCRATCH;
  if (!dir) {
    throw new Error("KVROUTER_TS_SCRATCH is not set: run the tests with clients/ts/test.sh, which makes the scratch project with pack.sh");
  }
  return dir;
}

/** Returns a free TCP port on loopback. */
export async function freePort(): Promise<number> {
  const srv = createServer();
  srv.listen(0, "127.0.0.1");
  await once(srv, "listening");
  const port = (srv.address() as AddressInfo).port;
  srv.close();
  await once(srv, "close");
  return port;
}

/** A real `kvrouter serve` process in embedded mode on a free port. */
export interface RouterProcess {
  addr: string;
  proc: ChildProcess;
  /** What the server logged to stderr so far. */
  log(): string;
  /** The AdminService client. */
  admin: Client<typeof AdminService>;
  /** Lists the workers of a model. */
  workers(model: string): Promise<WorkerStatus[]>;
  stop(): Promise<void>;
}

/** Starts `kvrouter serve` with extra flags on a free port and waits until it serves. */
export async function startRouter(...flags: string[]): Promise<RouterProcess> {
  return startRouterOn(await freePort(), ...flags);
}

/**
 * Starts `kvrouter serve` with extra flags on the given loopback port and waits until it serves: for a
 * router restarted on the address of one that was stopped (embedded mode keeps its state in memory,
 * so the new one starts empty).
 */
export async function startRouterOn(port: number, ...flags: string[]): Promise<RouterProcess> {
  const addr = `127.0.0.1:${port}`;
  const proc = spawn(KVROUTER_BIN, ["serve", "--listen", addr, "--metrics-listen", "", ...flags], { stdio: ["ignore", "ignore", "pipe"] });
  let stderr = "";
  proc.stderr!.setEncoding("utf8");
  const serving = new Promise<void>((resolve, reject) => {
    proc.stderr!.on("data", (d: string) => {
      stderr += d;
      if (stderr.includes("serving gRPC")) {
        resolve();
      }
    });
    proc.on("exit", (code) => reject(new Error(`kvrouter exited with ${code} before serving:\n${stderr}`)));
  });
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`kvrouter did not start:\n${stderr}`)), 10_000);
  });
  try {
    await Promise.race([serving, timeout]);
  } finally {
    clearTimeout(timer);
  }
  const t: OwnedTransport = openTransport(addr);
  const admin = createClient(AdminService, t.transport);
  return {
    addr,
    proc,
    log: () => stderr,
    admin,
    workers: async (model) => (await admin.listWorkers({ model })).workers,
    stop: async () => {
      t.close();
      if (proc.exitCode === null && proc.signalCode === null) { // not yet exited; stop() may be called twice
        proc.kill("SIGKILL");
        await once(proc, "exit");
      }
    },
  };
}

/**
 * A private `redis-server` on a free loopback port, without persistence. pause() stops the process
 * (SIGSTOP): its connections stay open and nothing answers, as a Redis that hangs or a network that
 * drops everything; resume() lets it go on.
 */
export interface RedisProcess {
  addr: string;
  pause(): void;
  resume(): void;
  stop(): Promise<void>;
}

/** Starts `redis-server` on a free port and waits until it accepts connections. */
export async function startRedis(): Promise<RedisProcess> {
  const port = await freePort();
  const proc = spawn("redis-server", ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], { stdio: "ignore" });
  const failed = new Promise<never>((_, reject) => {
    proc.on("error", (err) => reject(new Error(`redis-server did not start (apt-get install redis-server): ${err.message}`)));
    proc.on("exit", (code) => reject(new Error(`redis-server exited with ${code}`)));
  });
  const listening = waitFor("redis-server to listen", () => new Promise<boolean>((resolve) => {
    const sock = connect(port, "127.0.0.1");
    sock.once("connect", () => { sock.destroy(); resolve(true); });
    sock.once("error", () => resolve(false));
  }), 10_000);
  await Promise.race([listening, failed]);
  failed.catch(() => undefined); // it exits when stopped
  const alive = (): boolean => proc.exitCode === null && proc.signalCode === null;
  return {
    addr: `127.0.0.1:${port}`,
    pause: () => { proc.kill("SIGSTOP"); },
    resume: () => { if (alive()) proc.kill("SIGCONT"); },
    stop: async () => {
      if (alive()) {
        proc.kill("SIGKILL"); // ends a stopped process too
        await once(proc, "exit");
      }
    },
  };
}

export const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** Polls fn until it returns a truthy value, or fails after timeoutMs with the last value. */
export async function waitFor<T>(what: string, fn: () => Promise<T> | T, timeoutMs = 5_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let last: T | undefined;
  for (;;) {
    last = await fn();
    if (last) {
      return last;
    }
    if (Date.now() > deadline) {
      throw new Error(`timed out waiting for ${what}; last value: ${String(last)}`);
    }
    await sleep(20);
  }
}

/**
 * A TCP proxy in front of a router, to cut streams: cut() destroys every connection, and the
 * directions can be held (their bytes dropped) to keep events unapplied or acks undelivered.
 */
export class Proxy {
  readonly addr: string;
  dropToServer = false;
  dropToClient = false;
  private readonly sockets = new Set<Socket>();

  private constructor(private readonly server: ReturnType<typeof createServer>, target: string) {
    this.addr = `127.0.0.1:${(server.address() as AddressInfo).port}`;
    void target;
  }

  static async start(target: string): Promise<Proxy> {
    const [host, port] = target.split(":") as [string, string];
    const server = createServer();
    server.listen(0, "127.0.0.1");
    await once(server, "listening");
    const p = new Proxy(server, target);
    server.on("connection", (client) => {
      const upstream = connect(Number(port), host);
      p.sockets.add(client);
      p.sockets.add(upstream);
      client.on("data", (d) => {
        if (!p.dropToServer) {
          upstream.write(d);
        }
      });
      upstream.on("data", (d) => {
        if (!p.dropToClient) {
          client.write(d);
        }
      });
      const end = (): void => {
        client.destroy();
        upstream.destroy();
        p.sockets.delete(client);
        p.sockets.delete(upstream);
      };
      client.on("close", end).on("error", end);
      upstream.on("close", end).on("error", end);
    });
    return p;
  }

  /** Destroys every connection through the proxy and forwards everything again. */
  cut(): void {
    for (const s of this.sockets) {
      s.destroy();
    }
    this.sockets.clear();
    this.dropToServer = false;
    this.dropToClient = false;
  }

  async close(): Promise<void> {
    this.cut();
    this.server.close();
  }
}

/** Stored blocks of a chain for a worker: block i holds tokens base+i*blockSize+1 ... */
export function chain(hashBase: bigint, first: number, n: number, blockSize: number): { blockHash: bigint; tokenIds: number[] }[] {
  return Array.from({ length: n }, (_, k) => {
    const i = first + k;
    return { blockHash: hashBase + BigInt(i + 1), tokenIds: Array.from({ length: blockSize }, (_, j) => i * blockSize + j + 1) };
  });
}

/** Records the stored blocks of every Publish request (events and dumps) that goes out. */
export function recordBlocks(): { interceptor: Interceptor; blocks: StoredBlock[] } {
  const blocks: StoredBlock[] = [];
  const interceptor: Interceptor = (next) => async (req) => {
    if (!req.stream) {
      return next(req);
    }
    const source = req.message;
    async function* recorded(): AsyncIterable<Message> {
      for await (const m of source) {
        if (isMessage(m, PublishRequestSchema) && (m.message.case === "events" || m.message.case === "dump")) {
          for (const ev of m.message.value.events) {
            if (ev.data.case === "stored") {
              blocks.push(...ev.data.value.blocks);
            }
          }
        }
        yield m;
      }
    }
    return next({ ...req, message: recorded() });
  };
  return { interceptor, blocks };
}
