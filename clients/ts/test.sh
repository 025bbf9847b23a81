#!/usr/bin/env bash
# test.sh runs the TypeScript client's tests against a real `kvrouter serve`: checks for Node.js >= 20
# and installs the pinned npm packages when node_modules is missing or older than package-lock.json
# (node-env.sh), builds the Go server into .tmp/bin/kvrouter, compiles the client, examples and tests
# with tsc (strict), and runs the tests with node's built-in runner. Exits non-zero on any failure.
# Needs no stdin; runs as any user (installing Node.js with apt-get needs root).
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

rm -rf dist
node_modules/.bin/tsc -p tsconfig.json

tests=(dist/test/*.test.js)
node --test --test-timeout 60000 "${tests[@]}"
