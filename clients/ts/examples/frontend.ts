/**
 * A frontend that routes one prompt, prints the chosen worker as a JSON line, and frees the booking.
 *
 *   node dist/frontend.js --addr 127.0.0.1:50051 [--model demo] [--tokens 34]
 *
 * The prompt is the tokens 1, 2, ..., --tokens (the example worker caches its first blocks, and
 * prints its first line once the router acked them: run this after that line).
 *
 * It imports the installed package, so it is compiled in a project that installed @kvrouter/client
 * (clients/ts/pack.sh makes one; README.md, Examples).
 */
import { parseArgs } from "node:util";
import { RouteMode, Router } from "@kvrouter/client";

const { values } = parseArgs({
  options: {
    addr: { type: "string", default: "127.0.0.1:50051" },
    model: { type: "string", default: "demo" },
    tokens: { type: "string", default: "34" },
  },
});

const router = new Router({ address: values.addr });
try {
  const prompt = Array.from({ length: Number(values.tokens) }, (_, i) => i + 1);
  await router.withRoute({ model: values.model, tokenIds: prompt }, async (route) => {
    const r = route.response;
    // A real frontend sends the request to r.decode (after r.prefill in DISAGGREGATED mode) here,
    // and calls route.prefillComplete() when the first token arrives.
    console.log(JSON.stringify({
      requestId: route.requestId,
      mode: RouteMode[r.mode],
      workerId: r.decode?.workerId.toString(),
      dpRank: r.decode?.dpRank,
      endpoint: r.decode?.endpoint,
      overlapBlocks: r.diagnostics?.decode?.overlapBlocks?.device.toString() ?? "0",
    }));
    await route.prefillComplete();
  });
  console.log(JSON.stringify({ freed: true }));
} finally {
  router.close();
}
