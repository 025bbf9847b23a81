#!/usr/bin/env bash
# test.sh runs every test, with the race detector. It installs what the tests need first: the pinned
# grpcurl (the walkthrough tests replay grpcurl commands against a real kvrouter process) and
# redis-server (the Redis tests start private servers and a local cluster on free ports).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/tools.sh grpcurl
export KVROUTER_GRPCURL="$PWD/.tmp/bin/grpcurl"
. scripts/redis.sh
go vet ./...
go test -race -count=1 -timeout 10m ./... "$@"
