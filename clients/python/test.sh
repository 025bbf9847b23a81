#!/usr/bin/env bash
# Installs what the Python client needs (Debian packages), checks that kvrouter_client/_gen matches
# proto/, builds the kvrouter server, installs the package into clients/python/.tmp/venv with
# install.sh, and runs the tests against real `kvrouter serve` processes (some on a private
# redis-server, which it installs too): the threaded clients', the asyncio ones', and the examples
# run with the virtualenv's python outside this tree (docs/clients.md's programs run in
# docs/clients_test.go).
# The last line is "N passed, N failed"; the exit status is non-zero on any failure.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
# Debian's python3-grpcio, python3-protobuf and python3-xxhash install into the system interpreter.
PYTHON="${PYTHON:-/usr/bin/python3}"
"$root/scripts/need.sh" py:grpc=python3-grpcio py:google.protobuf=python3-protobuf py:xxhash=python3-xxhash protoc=protobuf-compiler grpc_python_plugin=protobuf-compiler-grpc redis-server=redis-server

echo "test.sh: checking that kvrouter_client/_gen matches proto/"
"$here/generate.sh" --check

echo "test.sh: building kvrouter"
mkdir -p "$here/.tmp"
(cd "$root" && go build -o "$here/.tmp/kvrouter" ./cmd/kvrouter)
export KVROUTER_BIN="$here/.tmp/kvrouter"

echo "test.sh: installing kvrouter-client into .tmp/venv (install.sh)"
"$here/install.sh" "$here/.tmp/venv"
export KVROUTER_VENV="$here/.tmp/venv"

cd "$here"
export PYTHONDONTWRITEBYTECODE=1
rc=0
timeout 300 "$PYTHON" tests/run.py || rc=$?
if [ "$rc" -eq 124 ]; then
  echo "test.sh: the tests timed out after 300 s"
  echo "0 passed, 1 failed"
fi
exit "$rc"
