#!/usr/bin/env bash
# test.sh runs every test, with the race detector. It installs what the tests need first: the pinned
# grpcurl (the walkthrough tests replay grpcurl commands against a real kvrouter process) and
# redis-server (the Redis tests start private servers and a local cluster on free ports).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/tools.sh grpcurl
export KVROUTER_GRPCURL="$PWD/.tmp/bin/grpcurl"
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing redis-server" >&2
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server and redis-cli are needed: apt-get install redis-server" >&2
    exit 1
  fi
fi
go vet ./...
go test -race -count=1 -timeout 10m ./... "$@"
