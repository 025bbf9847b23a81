/**
 * Publisher throughput against a real `kvrouter serve` (embedded mode, loopback): one Publisher
 * publishes --events stored events of 64 blocks each (block size 16, distinct tokens, built before the
 * clock starts), one publish() call per event, and close() waits for the router's last ack. Rounds
 * alternate between sending token_ids and hashTokens (tokens hashed inside the timing), --rounds of
 * each after one untimed warm-up of each; prints every round, then the medians, as text and as a last
 * JSON line. Run it with clients/ts/bench.sh.
 *
 *   node build/bench/publisher.js [--events 2000] [--rounds 5]
 */
import { readFileSync } from "node:fs";
import path from "node:path";
import { parseArgs } from "node:util";
import { Publisher, StorageTier, WorkerRole, type KvEventInit } from "../src/index.js";
import { startRouter, TS_DIR, type RouterProcess } from "../test/helpers.js";

const { values } = parseArgs({
  options: {
    events: { type: "string", default: "2000" },
    rounds: { type: "string", default: "5" },
  },
});
const N = Number(values.events);
const ROUNDS = Number(values.rounds);
const BLOCKS_PER_EVENT = 64;
const BLOCK_SIZE = 16;
const MODEL = "bench";
const WORKER = 1n;

type Variant = "token_ids" | "hashTokens";

/** N stored events continuing one chain; block b holds tokens b*16 ... b*16+15 (all distinct). */
function buildEvents(n: number): KvEventInit[] {
  return Array.from({ length: n }, (_, e) => {
    const first = e * BLOCKS_PER_EVENT;
    return {
      storageTier: StorageTier.DEVICE,
      data: {
        case: "stored",
        value: {
          ...(e > 0 ? { parentHash: BigInt(first) } : {}),
          blocks: Array.from({ length: BLOCKS_PER_EVENT }, (_, k) => {
            const b = first + k;
            return { blockHash: BigInt(b + 1), tokenIds: Array.from({ length: BLOCK_SIZE }, (_, j) => b * BLOCK_SIZE + j) };
          }),
        },
      },
    };
  });
}

/** Publishes the events through a fresh Publisher (fresh_start drops the worker's earlier blocks) and returns the seconds taken. */
async function round(server: RouterProcess, events: KvEventInit[], variant: Variant): Promise<number> {
  const pub = new Publisher({
    addresses: [server.addr],
    hello: { workerId: WORKER, model: MODEL, role: WorkerRole.AGGREGATED, blockSize: BLOCK_SIZE, totalKvBlocks: 1n << 30n, endpoint: "10.0.0.99:8000", kvEventsEnabled: true, freshStart: true },
    hashTokens: variant === "hashTokens",
    maxUnacked: Math.max(100_000, events.length),
  });
  try {
    await pub.ready;
    const start = process.hrtime.bigint();
    for (const ev of events) {
      await pub.publish([ev]);
    }
    await pub.close();
    const seconds = Number(process.hrtime.bigint() - start) / 1e9;
    const [w] = await server.workers(MODEL);
    const want = BigInt(events.length * BLOCKS_PER_EVENT);
    if (w?.cachedBlocks?.device !== want || w.lastEventId !== BigInt(events.length - 1)) {
      throw new Error(`the router holds ${w?.cachedBlocks?.device} blocks up to event ${w?.lastEventId}, want ${want} up to ${events.length - 1}`);
    }
    return seconds;
  } finally {
    await pub.close({ signal: AbortSignal.timeout(1) }).catch(() => undefined);
  }
}

const median = (xs: number[]): number => {
  const s = [...xs].sort((a, b) => a - b);
  const m = Math.floor(s.length / 2);
  return s.length % 2 ? s[m]! : (s[m - 1]! + s[m]!) / 2;
};
const version = (pkg: string): string =>
  (JSON.parse(readFileSync(path.join(TS_DIR, "node_modules", pkg, "package.json"), "utf8")) as { version: string }).version;
const fmt = (n: number): string => Math.round(n).toLocaleString("en-US");

const server = await startRouter();
try {
  const kvrouterVersion = process.env.KVROUTER_REV ?? "unknown";
  console.log(`node ${process.version} (${process.platform}/${process.arch}); @connectrpc/connect ${version("@connectrpc/connect")}, @connectrpc/connect-node ${version("@connectrpc/connect-node")}, @bufbuild/protobuf ${version("@bufbuild/protobuf")}, hash-wasm ${version("hash-wasm")}; kvrouter ${kvrouterVersion}`);
  console.log(`${N} stored events x ${BLOCKS_PER_EVENT} blocks x ${BLOCK_SIZE} tokens = ${fmt(N * BLOCKS_PER_EVENT)} blocks per round, one publish() per event, close() waits for the last ack; router ${server.addr} (embedded)`);
  const events = buildEvents(N);
  const warm = events.slice(0, Math.max(1, Math.floor(N / 4)));
  await round(server, warm, "token_ids");
  await round(server, warm, "hashTokens");
  const results: Record<Variant, number[]> = { token_ids: [], hashTokens: [] };
  for (let r = 1; r <= ROUNDS; r++) {
    const order: Variant[] = r % 2 === 1 ? ["token_ids", "hashTokens"] : ["hashTokens", "token_ids"];
    for (const v of order) {
      const seconds = await round(server, events, v);
      const rate = (N * BLOCKS_PER_EVENT) / seconds;
      results[v].push(rate);
      console.log(`round ${r} ${v.padEnd(10)} ${seconds.toFixed(3)} s  ${fmt(rate).padStart(10)} blocks/s`);
    }
  }
  const summary = { token_ids: median(results.token_ids), hashTokens: median(results.hashTokens) };
  console.log(`median of ${ROUNDS}: token_ids ${fmt(summary.token_ids)} blocks/s, hashTokens ${fmt(summary.hashTokens)} blocks/s`);
  console.log(JSON.stringify({ events: N, blocksPerEvent: BLOCKS_PER_EVENT, blockSize: BLOCK_SIZE, rounds: ROUNDS, medianBlocksPerSecond: summary, node: process.version }));
} finally {
  await server.stop();
}
