import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { once } from "node:events";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { createInterface } from "node:readline";
import { freePort, startRouter, startRouterOn, waitFor } from "./helpers.js";

/**
 * How long a child process may take to exit on its own: longer than every timeout of the client (the
 * Router's 5 s call timeout, the 10 s ping timeout, the 15 s ping interval, the 60 s idle-connection
 * timeout), so that passing shows the process was not held until one of them fired. It exits well
 * within a second of returning; the time is printed as a diagnostic.
 */
const EXIT_BOUND_MS = 70_000;

/** The package as the tests build it (build/src), for the child programs. */
const INDEX = new URL("../src/index.js", import.meta.url).href;

/** Writes an ES module program that imports the package (as `kv`) into a temporary directory. */
function program(body: string): { file: string; cleanup: () => void } {
  const dir = mkdtempSync(path.join(tmpdir(), "kvrouter-ts-lifetime-"));
  const file = path.join(dir, "main.mjs");
  writeFileSync(file, `import * as kv from ${JSON.stringify(INDEX)};\n${body}\n`);
  return { file, cleanup: () => rmSync(dir, { recursive: true, force: true }) };
}

interface Child {
  proc: ChildProcess;
  stdout: string[];
  stderr: string[];
  /** When the first stdout line arrived (performance.now()). */
  firstLineAt?: number;
  /** Settles once the process exited and its output was read ("close"). */
  exited: Promise<{ code: number | null; at: number }>;
}

/** A child node process running file with args, its stdout and stderr lines collected. */
function run(file: string, ...args: string[]): Child {
  const proc = spawn(process.execPath, [file, ...args], { stdio: ["ignore", "pipe", "pipe"] });
  const stdout: string[] = [];
  const stderr: string[] = [];
  const exited = once(proc, "close").then(([code]) => ({ code: code as number | null, at: performance.now() }));
  const child: Child = { proc, stdout, stderr, exited };
  createInterface({ input: proc.stdout! }).on("line", (l) => {
    child.firstLineAt ??= performance.now();
    stdout.push(l);
  });
  createInterface({ input: proc.stderr! }).on("line", (l) => stderr.push(l));
  return child;
}

/** Resolves when the child exits, or rejects after EXIT_BOUND_MS. */
async function exitWithinBound(child: Child): Promise<{ code: number | null; at: number }> {
  let timer: NodeJS.Timeout | undefined;
  const bound = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`the child did not exit within ${EXIT_BOUND_MS} ms; stdout: ${child.stdout.join("\n")}; stderr: ${child.stderr.join("\n")}`)), EXIT_BOUND_MS);
  });
  try {
    return await Promise.race([child.exited, bound]);
  } finally {
    clearTimeout(timer);
  }
}

const HELLO = (workerId: number, model: string): string =>
  `{ workerId: ${workerId}n, model: ${JSON.stringify(model)}, role: kv.WorkerRole.AGGREGATED, blockSize: 4, totalKvBlocks: 1024n, endpoint: "10.0.3.${workerId}:8000", kvEventsEnabled: true, freshStart: true }`;
const STORED = `[{ storageTier: kv.StorageTier.DEVICE, data: { case: "stored", value: { blocks: [0, 1, 2, 3].map((i) => ({ blockHash: BigInt(100 + i), tokenIds: [1, 2, 3, 4].map((t) => i * 4 + t) })) } } }]`;

test("a program that publishes, flushes, routes and frees, and returns without close(), exits on its own", { timeout: EXIT_BOUND_MS + 30_000 }, async (t) => {
  const server = await startRouter();
  const { file, cleanup } = program(`
const addr = process.argv[2];
const pub = new kv.Publisher({ addresses: [addr], hello: ${HELLO(1, "forgot")} });
await pub.publish(${STORED});
await pub.flush();
const router = new kv.Router({ address: addr });
const route = await router.route({ model: "forgot", tokenIds: Array.from({ length: 18 }, (_, i) => i + 1) });
await route.free();
console.log(JSON.stringify({ returned: true, overlap: String(route.response.diagnostics?.decode?.overlapBlocks?.device) }));
// No pub.close(), no router.close(): the Publish stream and both connections are still open.
`);
  const child = run(file, server.addr);
  try {
    const { code, at } = await exitWithinBound(child);
    assert.equal(code, 0, `stderr: ${child.stderr.join("\n")}`);
    assert.deepEqual(JSON.parse(child.stdout[0] ?? "null"), { returned: true, overlap: "4" }, "flush() made the blocks routable");
    t.diagnostic(`the child exited ${Math.round(at - (child.firstLineAt ?? at))} ms after its program returned (bound ${EXIT_BOUND_MS} ms)`);
    const [w] = await server.workers("forgot");
    assert.equal(w?.cachedBlocks?.device, 4n, "what it published stays with the router (the worker rank stays for its grace period)");
    assert.equal(w?.load?.activeRequests, 0n, "the route was freed");
  } finally {
    child.proc.kill("SIGKILL");
    cleanup();
    await server.stop();
  }
});

test("a program that returns with events not acked yet stays alive until the router acks them, then exits", { timeout: EXIT_BOUND_MS + 30_000 }, async () => {
  // No router listens on the port yet: the publisher cannot register, and its events wait.
  const port = await freePort();
  const addr = `127.0.0.1:${port}`;
  const { file, cleanup } = program(`
const pub = new kv.Publisher({ addresses: [process.argv[2]], hello: ${HELLO(2, "pending")}, minBackoffMs: 20, maxBackoffMs: 200,
  log: (message) => console.error(message) });
await pub.publish(${STORED});
console.log(JSON.stringify({ returned: true, unacked: pub.unacked }));
// No flush(), no close(): the program returns with 1 event queued and nothing registered.
`);
  const child = run(file, addr);
  let server: Awaited<ReturnType<typeof startRouter>> | undefined;
  try {
    await waitFor("the child to return from its program", () => child.stdout.length > 0, 20_000);
    assert.deepEqual(JSON.parse(child.stdout[0]!), { returned: true, unacked: 1 });
    // The effect that shows it is still alive after returning: it goes on trying to connect.
    const reconnects = (): number => child.stderr.filter((l) => l.includes("reconnecting")).length;
    const before = reconnects();
    await waitFor("three more failed connection attempts after the program returned", () => reconnects() >= before + 3, 20_000);
    assert.equal(child.proc.exitCode, null, "the process is still running");

    server = await startRouterOn(port);
    const { code } = await exitWithinBound(child);
    assert.equal(code, 0);
    const [w] = await server.workers("pending");
    assert.equal(w?.cachedBlocks?.device, 4n, "the router got and applied the event before the process exited");
  } finally {
    child.proc.kill("SIGKILL");
    cleanup();
    await server?.stop();
  }
});
