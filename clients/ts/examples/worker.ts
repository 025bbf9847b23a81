/**
 * A worker that registers with the router, publishes a few stored KV blocks, reports its load, waits
 * for the router's ack of every block (flush), prints one JSON line, and stays connected until SIGINT
 * or SIGTERM (or closes at once with --once), flushing on the way out.
 *
 *   node dist/worker.js --addr 127.0.0.1:50051 [--worker-id 1] [--model demo] [--block-size 4]
 *       [--blocks 8] [--endpoint 10.0.0.1:8000] [--once]
 *
 * It imports the installed package, so it is compiled in a project that installed @kvrouter/client
 * (clients/ts/pack.sh makes one; README.md, Examples).
 */
import { parseArgs } from "node:util";
import { Publisher, StorageTier, WorkerRole, type KvEventInit } from "@kvrouter/client";

const { values } = parseArgs({
  options: {
    addr: { type: "string", default: "127.0.0.1:50051" },
    "worker-id": { type: "string", default: "1" },
    model: { type: "string", default: "demo" },
    "block-size": { type: "string", default: "4" },
    blocks: { type: "string", default: "8" },
    endpoint: { type: "string", default: "10.0.0.1:8000" },
    once: { type: "boolean", default: false },
  },
});

const blockSize = Number(values["block-size"]);
const nBlocks = Number(values.blocks);
const workerId = BigInt(values["worker-id"]);

// The worker's cache: blocks of the prompt 1, 2, 3, ... (block i holds tokens i*blockSize+1 ...).
const blocks = Array.from({ length: nBlocks }, (_, i) => ({
  blockHash: workerId * 1000n + BigInt(i + 1),
  tokenIds: Array.from({ length: blockSize }, (_, j) => i * blockSize + j + 1),
}));
const cache: KvEventInit[] = [{ storageTier: StorageTier.DEVICE, data: { case: "stored", value: { blocks } } }];

const publisher = new Publisher({
  addresses: values.addr.split(","),
  hello: {
    workerId,
    model: values.model,
    role: WorkerRole.AGGREGATED,
    blockSize,
    totalKvBlocks: 1024n,
    endpoint: values.endpoint,
    kvEventsEnabled: true,
    freshStart: true,
  },
  dump: () => cache, // the whole cache, for the router's resync requests
  log: (message, fields) => console.error(message, fields ?? {}),
});

await publisher.ready;
const ids = await publisher.publish(cache); // queued: sent within flushIntervalMs (2 ms)
publisher.reportLoad({ kvUsedBlocks: BigInt(nBlocks), waitingRequests: 0n });
await publisher.flush(); // the router acked every block: a Route from now on sees them
console.log(JSON.stringify({ registered: true, workerId: workerId.toString(), published: ids.map(String), blocks: nBlocks }));

const stop = async (): Promise<void> => {
  await publisher.close({ signal: AbortSignal.timeout(5_000) });
  console.log(JSON.stringify({ closed: true }));
};
if (values.once) {
  await stop();
} else {
  let stopping = false;
  for (const sig of ["SIGINT", "SIGTERM"] as const) {
    process.on(sig, () => {
      if (stopping) {
        return;
      }
      stopping = true;
      stop().then(
        () => process.exit(0),
        (err: unknown) => {
          console.error(err);
          process.exit(1);
        },
      );
    });
  }
  // Stay connected: the router keeps a worker whose stream is open.
  setInterval(() => publisher.reportLoad({ kvUsedBlocks: BigInt(nBlocks), waitingRequests: 0n }), 1_000);
}
