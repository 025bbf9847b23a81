#!/usr/bin/env bash
# test.sh runs every test, with the race detector. It installs the pinned grpcurl first: the
# walkthrough test replays the README's grpcurl commands against a real kvrouter process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/tools.sh grpcurl
export KVROUTER_GRPCURL="$PWD/.tmp/bin/grpcurl"
go vet ./...
go test -race -count=1 -timeout 10m ./... "$@"
