#!/usr/bin/env bash
# test.sh runs the TypeScript client's tests against a real `kvrouter serve`: checks for Node.js >= 20
# and installs the pinned npm packages when node_modules is missing or older than package-lock.json
# (node-env.sh), builds the Go server into .tmp/bin/kvrouter, compiles the client, tests and benchmark
# with tsc (strict) into build/, and packs the client as a user installs it: pack.sh builds dist/,
# runs npm pack and installs the tarball into a scratch npm project (a temporary directory, removed
# at the end), where examples/*.ts are compiled with that project's own tsc, importing
# @kvrouter/client from the tarball. Then it runs the tests with node's built-in runner; they run the
# examples from the scratch project, and the README's Quick start compiled there (docs/clients.md's
# programs run in docs/clients_test.go). Exits non-zero on any failure. Needs no stdin, and the npm registry for
# the scratch project's packages (npm's cache serves them after the first run); runs as any user
# (installing Node.js with apt-get needs root).
set -euo pipefail
TS="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$TS/../.." && pwd)"
cd "$TS"

. "$TS/node-env.sh"
need_node
need_node_modules

"$ROOT/scripts/need.sh" redis-server=redis-server
(cd "$ROOT" && go build -o .tmp/bin/kvrouter ./cmd/kvrouter)
export KVROUTER_BIN="$ROOT/.tmp/bin/kvrouter"

rm -rf build
node_modules/.bin/tsc -p tsconfig.json

SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/kvrouter-ts-scratch.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
KVROUTER_TS_TARBALL="$("$TS/pack.sh" "$SCRATCH")"
mkdir -p "$SCRATCH/src"
cp "$TS"/examples/*.ts "$SCRATCH/src/"
(cd "$SCRATCH" && node_modules/.bin/tsc -p tsconfig.json)
export KVROUTER_TS_SCRATCH="$SCRATCH" KVROUTER_TS_TARBALL

tests=(build/test/*.test.js)
node --test --test-timeout 60000 "${tests[@]}"
