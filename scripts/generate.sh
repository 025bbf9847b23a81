#!/usr/bin/env bash
# generate.sh regenerates gen/ from proto/ with buf's local plugins, after formatting and linting.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/tools.sh protoc-gen-go protoc-gen-go-grpc buf
export PATH="$PWD/.tmp/bin:$PATH"
buf format -w
buf lint
buf generate
