#!/usr/bin/env bash
# loadtest.sh measures Route over gRPC on loopback. It builds kvrouter and kvload into .tmp/loadtest,
# starts kvrouter on a free 127.0.0.1 port, and for each mode seeds it with kvload (fresh workers each
# time) and runs ghz (pinned in scripts/tools.sh; it finds the method by reflection, no proto files)
# bounded by -n and -c. It prints ghz's summaries and the CPU time kvrouter spent per request (ghz
# shares the machine's cores), keeps them in .tmp/loadtest, and stops every process it started, also
# on failure or Ctrl-C.
#
# Usage: scripts/loadtest.sh [query|book ...]     (default: query book)
#   query: query_only requests (a preview; nothing is booked)
#   book:  every request books load under its own request id (bookings are never freed: they pile up
#          for the whole run, as if no request finished). ghz fills the id in from a template, which
#          makes it parse the 2k-token JSON again for every call: on 2 cores that client work, not
#          kvrouter, limits this mode's requests/s (compare the CPU figures printed).
# Environment (defaults in brackets): N requests per ghz run [20000], C concurrent calls [8], SKIP
# first responses left out of the statistics [1000], WORKERS [64], PREFILL workers [0: all
# aggregated], BLOCKS published [1000000], PROMPT_BLOCKS per published prompt [512], ROOTS [100],
# ROUTE_TOKENS of the routed prompt [2048].
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-20000} C=${C:-8} SKIP=${SKIP:-1000}
WORKERS=${WORKERS:-64} PREFILL=${PREFILL:-0} BLOCKS=${BLOCKS:-1000000}
PROMPT_BLOCKS=${PROMPT_BLOCKS:-512} ROOTS=${ROOTS:-100} ROUTE_TOKENS=${ROUTE_TOKENS:-2048}
modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(query book)

scripts/tools.sh ghz
out=.tmp/loadtest
mkdir -p "$out"
go build -o "$out/kvrouter" ./cmd/kvrouter
go build -o "$out/kvload" ./cmd/kvload

# cpu_ticks prints the user+system CPU time a process has used so far, in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)

pids=()
cleanup() {
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Port 0: the kernel picks a free port, and kvrouter logs the address it got.
"$out/kvrouter" serve --listen 127.0.0.1:0 --metrics-listen '' 2>"$out/kvrouter.log" &
pids+=($!)
addr=
for _ in $(seq 100); do
  addr=$(sed -n 's/.*"msg":"serving gRPC","addr":"\([^"]*\)".*/\1/p' "$out/kvrouter.log")
  [ -n "$addr" ] && break
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$out/kvrouter.log" >&2; exit 1; }
  sleep 0.1
done
[ -n "$addr" ] || { echo "kvrouter did not start; see $out/kvrouter.log" >&2; exit 1; }
echo "kvrouter serving on $addr ($(go version | cut -d' ' -f3), $(nproc) cores)"

for mode in "${modes[@]}"; do
  case $mode in
    query) query_only=true ;;
    book) query_only=false ;;
    *) echo "unknown mode $mode (want query or book)" >&2; exit 2 ;;
  esac
  request="$out/route-$mode.json"
  rm -f "$request"
  "$out/kvload" --addr "$addr" --workers "$WORKERS" --prefill-workers "$PREFILL" --blocks "$BLOCKS" \
    --prompt-blocks "$PROMPT_BLOCKS" --roots "$ROOTS" --route-tokens "$ROUTE_TOKENS" \
    --query-only="$query_only" --out "$request" --hold 1h &
  kvload=$!
  pids+=("$kvload")
  # kvload writes the request once every event is acked, and keeps the worker streams open.
  until [ -f "$request" ]; do
    kill -0 "$kvload" 2>/dev/null || { echo "kvload failed" >&2; exit 1; }
    sleep 0.2
  done
  echo "== ghz: mode=$mode, $N requests (first $SKIP left out), concurrency $C, $ROUTE_TOKENS-token prompt, $WORKERS workers ($PREFILL prefill), $BLOCKS blocks published"
  before=$(cpu_ticks "${pids[0]}")
  TIMEFORMAT="ghz CPU: %U s user, %S s system, %R s wall"
  { time .tmp/bin/ghz --insecure --call kvrouter.v1.RouterService/Route -D "$request" \
    -n "$N" -c "$C" --skipFirst "$SKIP" "$addr" >"$out/ghz-$mode.txt" 2>&1; } 2>>"$out/ghz-$mode.txt"
  used=$(($(cpu_ticks "${pids[0]}") - before))
  cat "$out/ghz-$mode.txt"
  echo "kvrouter CPU: $(awk -v t="$used" -v hz="$hz" -v n="$N" 'BEGIN { printf "%.2f s, %.0f µs per request", t / hz, t / hz / n * 1e6 }')" |
    tee -a "$out/ghz-$mode.txt"
  kill "$kvload"
  wait "$kvload" 2>/dev/null || true
done
