#!/usr/bin/env bash
# Publisher throughput benchmark: installs what it needs (Debian packages), builds the kvrouter
# server, starts one `kvrouter serve` (embedded mode) on a free loopback port and runs bench.py
# against it; arguments are passed to bench.py (--events, --rounds, --max-batch-events, ...).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
PYTHON="${PYTHON:-/usr/bin/python3}"
"$root/scripts/need.sh" py:grpc=python3-grpcio py:google.protobuf=python3-protobuf py:xxhash=python3-xxhash

bin="${KVROUTER_BIN:-}"
if [ -z "$bin" ]; then
  echo "bench.sh: building kvrouter"
  mkdir -p "$here/.tmp"
  bin="$here/.tmp/kvrouter-bench"  # not test.sh's binary, so the two may run at once
  (cd "$root" && go build -o "$bin" ./cmd/kvrouter)
fi

port="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log="$(mktemp "${TMPDIR:-/tmp}/kvrouter-bench-XXXXXX.log")"
"$bin" serve --listen "127.0.0.1:$port" --metrics-listen '' >"$log" 2>&1 &
pid=$!
cleanup() {
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rm -f "$log"
}
trap cleanup EXIT

cd "$here"
export PYTHONDONTWRITEBYTECODE=1
if ! "$PYTHON" bench.py --addr "127.0.0.1:$port" "$@"; then
  echo "bench.sh: bench.py failed; the router's log:" >&2
  tail -20 "$log" >&2
  exit 1
fi
