import { test } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";
import { promisify } from "node:util";
import { scratchDir, startRouter, TS_DIR } from "./helpers.js";

const exec = promisify(execFile);

/** The tarball pack.sh made (test.sh passes its path). */
function tarball(): string {
  const t = process.env.KVROUTER_TS_TARBALL;
  if (!t) {
    throw new Error("KVROUTER_TS_TARBALL is not set: run the tests with clients/ts/test.sh");
  }
  return t;
}

test("the tarball holds the built library, its README and package.json, nothing else", async () => {
  const { stdout } = await exec("tar", ["-tzf", tarball()]);
  const files = stdout.trim().split("\n").sort();
  for (const f of files) {
    assert.match(f, /^package\/(package\.json|README\.md|dist\/[\w/]+(\.js|\.d\.ts))$/, `${f} should not be in the tarball`);
  }
  for (const f of ["package.json", "README.md", "dist/index.js", "dist/index.d.ts", "dist/publisher.js", "dist/router.d.ts", "dist/gen/kvrouter/v1/worker_pb.js"]) {
    assert.ok(files.includes(`package/${f}`), `${f} is in the tarball`);
  }
  assert.ok(!files.some((f) => /\/(test|examples|bench|src)\//.test(f) || f.endsWith(".map")), "no tests, examples, sources or maps");
});

test("the installed package is a public, versioned ES module whose dependencies come from the registry", () => {
  const installed = path.join(scratchDir(), "node_modules/@kvrouter/client");
  const pkg = JSON.parse(readFileSync(path.join(installed, "package.json"), "utf8")) as Record<string, unknown>;
  const ours = JSON.parse(readFileSync(path.join(TS_DIR, "package.json"), "utf8")) as Record<string, unknown>;
  assert.equal(pkg.name, "@kvrouter/client");
  assert.equal(pkg.version, "0.1.0");
  assert.notEqual(pkg.private, true);
  assert.equal(pkg.type, "module");
  assert.deepEqual(pkg.exports, { ".": { types: "./dist/index.d.ts", default: "./dist/index.js" }, "./package.json": "./package.json" });
  assert.deepEqual(pkg.dependencies, ours.dependencies);
  for (const dep of Object.keys(pkg.dependencies as object)) {
    const got = JSON.parse(readFileSync(path.join(scratchDir(), "node_modules", dep, "package.json"), "utf8")) as { version: string };
    assert.equal(got.version, (ours.dependencies as Record<string, string>)[dep], `${dep} installed at its pinned version`);
  }
});

test("`@kvrouter/client` resolves to the installed tarball in the scratch project, with ConnectError and Code", async () => {
  const { stdout } = await exec(process.execPath, ["--input-type=module", "-e", `
    const m = await import("@kvrouter/client");
    const err = new m.ConnectError("no", m.Code.NotFound);
    console.log(JSON.stringify({ url: import.meta.resolve("@kvrouter/client"), names: Object.keys(m), code: err.code, isError: err instanceof m.ConnectError }));
  `], { cwd: scratchDir() });
  const got = JSON.parse(stdout) as { url: string; names: string[]; code: number; isError: boolean };
  assert.equal(got.url, pathToFileURL(path.join(scratchDir(), "node_modules/@kvrouter/client/dist/index.js")).href);
  for (const name of ["Publisher", "Router", "RouteHandle", "ConnectError", "Code", "errorReason", "WorkerRole", "StorageTier", "loadBlockHasher", "DEFAULT_MAX_BATCH_EVENTS"]) {
    assert.ok(got.names.includes(name), `exports ${name}`);
  }
  assert.equal(got.code, 5);
  assert.equal(got.isError, true);
});

/**
 * Returns the ```ts blocks of the section of a markdown file whose level-2 heading starts with
 * heading, up to the next level-2 heading, concatenated in document order.
 */
function tsProgram(file: string, heading: string): string {
  const lines = readFileSync(file, "utf8").split("\n");
  const start = lines.findIndex((l) => l.startsWith(`## ${heading}`));
  assert.ok(start >= 0, `${file} has a "## ${heading}" section`);
  const blocks: string[] = [];
  let block: string[] | undefined;
  for (const line of lines.slice(start + 1)) {
    if (block === undefined && line.startsWith("## ")) {
      break;
    }
    if (block === undefined && line.trim() === "```ts") {
      block = [];
    } else if (block !== undefined && line.trim() === "```") {
      blocks.push(block.join("\n"));
      block = undefined;
    } else {
      block?.push(line);
    }
  }
  return blocks.join("\n");
}

/**
 * Compiles program in the scratch project (its own tsc, its strict tsconfig.json) and runs it against a
 * fresh `kvrouter serve` (embedded, nothing registered) whose address is in KVROUTER_ADDR; it must exit
 * 0 on its own.
 */
async function compileAndRun(name: string, program: string): Promise<string> {
  const dir = path.join(scratchDir(), `doc-${name}`);
  rmSync(dir, { recursive: true, force: true });
  mkdirSync(path.join(dir, "src"), { recursive: true });
  writeFileSync(path.join(dir, "src/main.ts"), program);
  writeFileSync(path.join(dir, "tsconfig.json"), JSON.stringify({ extends: "../tsconfig.json", compilerOptions: { rootDir: "src", outDir: "dist" }, include: ["src/**/*.ts"] }));
  const tsc = path.join(scratchDir(), "node_modules/.bin/tsc");
  await exec(tsc, ["-p", path.join(dir, "tsconfig.json")]).catch((err: { stdout?: string }) => assert.fail(`tsc failed on ${name}'s program:\n${err.stdout ?? String(err)}\n--- program ---\n${program}`));
  const server = await startRouter();
  try {
    const { stdout } = await exec(process.execPath, [path.join(dir, "dist/main.js")], {
      cwd: scratchDir(),
      env: { ...process.env, KVROUTER_ADDR: server.addr },
      timeout: 60_000,
    }).catch((err: { stdout?: string; stderr?: string; code?: unknown }) => assert.fail(`${name}'s program failed (${String(err.code)}):\n${err.stdout ?? ""}\n${err.stderr ?? String(err)}`));
    return stdout;
  } finally {
    await server.stop();
  }
}

test("README.md's Quick start is one program that compiles and runs in the scratch project", { timeout: 120_000 }, async () => {
  const out = await compileAndRun("readme", tsProgram(path.join(TS_DIR, "README.md"), "Quick start"));
  assert.match(out, /10\.0\.0\.7:8000/, "it routed to the worker's endpoint");
});
