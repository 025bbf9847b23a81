#!/usr/bin/env bash
# generate.sh regenerates every stub of the contract from proto/, after formatting and linting it: the
# Go code in gen/ (buf's local plugins), the Python client's in clients/python/kvrouter_client/_gen
# (Debian's protoc and grpc_python_plugin) and the TypeScript client's in clients/ts/src/gen (the
# protoc-gen-es pinned in clients/ts/package-lock.json). scripts/check.sh fails when any differs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/tools.sh protoc-gen-go protoc-gen-go-grpc buf
export PATH="$PWD/.tmp/bin:$PATH"
buf format -w
buf lint
rm -rf gen/kvrouter # what proto/ no longer declares goes too; gen/go.mod stays
buf generate
scripts/need.sh protoc=protobuf-compiler grpc_python_plugin=protobuf-compiler-grpc
clients/python/generate.sh
clients/ts/generate.sh
