#!/usr/bin/env bash
# bench.sh measures the Publisher's throughput against a real `kvrouter serve` (embedded mode, a free
# loopback port): checks for Node.js >= 20 and installs the pinned npm packages when needed
# (node-env.sh), builds the Go server into .tmp/bin/kvrouter, compiles with tsc, and runs
# build/bench/publisher.js, which publishes stored events of 64 blocks (block size 16) with token_ids and
# with hashTokens, 5 interleaved rounds each, and prints every round and the medians in blocks/s.
# Arguments go to the benchmark (--events N, --rounds R).
set -euo pipefail
TS="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$TS/../.." && pwd)"
cd "$TS"

. "$TS/node-env.sh"
need_node
need_node_modules

(cd "$ROOT" && go build -o .tmp/bin/kvrouter ./cmd/kvrouter)
export KVROUTER_BIN="$ROOT/.tmp/bin/kvrouter"
KVROUTER_REV="$(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown), $(go version | cut -d' ' -f3)"
export KVROUTER_REV

rm -rf build
node_modules/.bin/tsc -p tsconfig.json

node build/bench/publisher.js "$@"
