#!/usr/bin/env bash
# gomodules.sh prints the directory of every Go module of the repository, the server's (.) first:
# the client (clients/go), the contract's generated code (gen) and the block hashing
# (kvstate/blockhash) are modules of their own, which `go test ./...` from the root does not reach.
set -euo pipefail
cd "$(dirname "$0")/.."
echo .
git ls-files --cached --others --exclude-standard '*/go.mod' | grep -v -e node_modules -e '^\.tmp/' -e '^bench/' | xargs -r -n1 dirname | sort
