#!/usr/bin/env bash
# pack.sh SCRATCH_DIR builds @kvrouter/client and installs it as a user would, from its tarball:
#   1. checks for Node.js >= 20 and runs `npm ci` in clients/ts when node_modules is missing or stale
#      (node-env.sh);
#   2. `npm pack` (its prepack script builds dist/ with tsconfig.build.json: the .js and .d.ts of
#      src/ only) writes SCRATCH_DIR/kvrouter-client-<version>.tgz;
#   3. makes SCRATCH_DIR a scratch npm project: package.json ("type": "module"), a strict tsconfig.json
#      (src/*.ts to dist/, NodeNext, no skipLibCheck, so the package's .d.ts are checked too), and
#      `npm install` of the tarball (its dependencies from the npm registry) with the typescript and
#      @types/node that clients/ts pins, so that `npx tsc` compiles the project's src/.
# It prints the tarball's path on stdout (one line); everything else goes to stderr. SCRATCH_DIR is
# created when missing; an existing one must be empty or a scratch project made by pack.sh (marked by
# .kvrouter-scratch), whose package files, node_modules and tarballs are replaced (src/ is kept).
# Then, for example:
#   mkdir -p SCRATCH_DIR/src && cp clients/ts/examples/*.ts SCRATCH_DIR/src/
#   (cd SCRATCH_DIR && npx tsc) && node SCRATCH_DIR/dist/worker.js --addr 127.0.0.1:50051 --once
set -euo pipefail
if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: clients/ts/pack.sh SCRATCH_DIR" >&2
  exit 2
fi
TS="$(cd "$(dirname "$0")" && pwd)"
. "$TS/node-env.sh"
need_node
need_node_modules

mkdir -p "$1"
SCRATCH="$(cd "$1" && pwd)"
if [ -e "$SCRATCH/.kvrouter-scratch" ]; then
  rm -rf "$SCRATCH/node_modules" "$SCRATCH/package.json" "$SCRATCH/package-lock.json" "$SCRATCH/tsconfig.json" "$SCRATCH"/kvrouter-client-*.tgz
elif [ -n "$(ls -A "$SCRATCH")" ]; then
  echo "clients/ts/pack.sh: $SCRATCH is not empty and is not a scratch project made by pack.sh; give a new or empty directory" >&2
  exit 2
fi
touch "$SCRATCH/.kvrouter-scratch"

# npm pack runs prepack (npm run build); with --json its own report is the only thing on stdout.
tarball="$(cd "$TS" && npm pack --json --pack-destination "$SCRATCH" | node -e '
  let s = ""; process.stdin.on("data", (d) => (s += d)).on("end", () => console.log(JSON.parse(s)[0].filename));')"
tarball="$SCRATCH/$tarball"
[ -f "$tarball" ] || { echo "clients/ts/pack.sh: npm pack wrote no $tarball" >&2; exit 1; }

# The scratch project's own tsc and Node types: the versions clients/ts pins.
node -e '
  const ts = require(process.argv[1]);
  const pkg = { name: "kvrouter-client-scratch", version: "0.0.0", private: true, type: "module",
    devDependencies: { typescript: ts.devDependencies.typescript, "@types/node": ts.devDependencies["@types/node"] } };
  require("node:fs").writeFileSync(process.argv[2], JSON.stringify(pkg, null, 2) + "\n");' "$TS/package.json" "$SCRATCH/package.json"
cat >"$SCRATCH/tsconfig.json" <<'EOF'
{
  "compilerOptions": {
    "target": "ES2022",
    "module": "NodeNext",
    "moduleResolution": "NodeNext",
    "strict": true,
    "types": ["node"],
    "rootDir": "src",
    "outDir": "dist"
  },
  "include": ["src/**/*.ts"]
}
EOF
(
  cd "$SCRATCH"
  npm install --no-audit --no-fund --loglevel=error "./$(basename "$tarball")" >&2
)
echo "$tarball"
