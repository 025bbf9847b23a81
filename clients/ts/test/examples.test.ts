import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn, execFile } from "node:child_process";
import { once } from "node:events";
import { createInterface } from "node:readline";
import path from "node:path";
import { promisify } from "node:util";
import { scratchDir, startRouter, waitFor } from "./helpers.js";

test("the example worker publishes, the example frontend routes to it and frees (run from a project that installed the tarball)", async () => {
  // test.sh compiled examples/*.ts in the scratch project made by pack.sh, with its own tsc: they import
  // @kvrouter/client, which only the installed tarball provides there.
  const EXAMPLES = path.join(scratchDir(), "dist");
  const router = await startRouter();
  const worker = spawn(process.execPath, [path.join(EXAMPLES, "worker.js"), "--addr", router.addr, "--worker-id", "7", "--endpoint", "10.9.9.9:8000"], {
    stdio: ["ignore", "pipe", "inherit"],
  });
  try {
    const lines = createInterface({ input: worker.stdout! });
    const [first] = (await once(lines, "line")) as [string];
    const reg = JSON.parse(first) as { registered: boolean; blocks: number };
    assert.equal(reg.registered, true);

    const [w] = await router.workers("demo");
    assert.ok(w, "the worker is listed");
    assert.equal(w.worker?.workerId, 7n);
    assert.equal(w.cachedBlocks?.device, 8n);
    assert.equal(w.load?.kvUsedBlocks, 8n, "the load report arrived");
    assert.equal(w.connected, true);

    const { stdout } = await promisify(execFile)(process.execPath, [path.join(EXAMPLES, "frontend.js"), "--addr", router.addr]);
    const [decision, freed] = stdout.trim().split("\n").map((l) => JSON.parse(l) as Record<string, unknown>);
    assert.equal(decision?.workerId, "7");
    assert.equal(decision?.endpoint, "10.9.9.9:8000");
    assert.equal(decision?.mode, "AGGREGATED");
    assert.equal(decision?.overlapBlocks, "8");
    assert.deepEqual(freed, { freed: true });

    const after = await router.workers("demo");
    assert.equal(after[0]?.load?.activeRequests, 0n, "no active requests after the frontend freed");
    assert.equal(after[0]?.load?.activeBlocks, 0n);

    worker.kill("SIGTERM");
    const [code] = (await once(worker, "exit")) as [number];
    assert.equal(code, 0, "the worker flushed and closed cleanly");
    await waitFor("the worker to show disconnected", async () => (await router.workers("demo"))[0]?.connected === false);
  } finally {
    if (worker.exitCode === null) {
      worker.kill("SIGKILL");
    }
    await router.stop();
  }
});
