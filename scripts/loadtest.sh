#!/usr/bin/env bash
# loadtest.sh measures Route over gRPC on loopback. It builds kvrouter and kvload into .tmp/loadtest,
# starts kvrouter on a free 127.0.0.1 port, and for each mode runs kvload, which seeds it (fresh
# workers each time), then drives Route itself and prints its report: calls, errors by code,
# requests/s, latency percentiles, and the CPU per call of kvload and of kvrouter (read from
# /proc/<pid>/stat around the measured calls; both share the machine's cores). kvload sends
# requests marshaled once, so it costs far less CPU per call than ghz. The reports are kept in
# .tmp/loadtest (kvload-<mode>.txt and .json), and every process the script started is stopped, also
# on failure or Ctrl-C.
#
# Usage: scripts/loadtest.sh [query|book ...]     (default: query book)
#   query: query_only requests (a preview; nothing is booked)
#   book:  every request books load under its own request id, and kvload frees each booking once
#          Route returns (FREE=0 keeps them: they pile up for the whole run, as if no request ended)
# Environment (defaults in brackets):
#   N measured requests [20000], or DURATION of the measured run (e.g. 30s) instead; WARMUP requests
#   first, left out of the figures [1000]; C concurrent callers of the closed loop [8]; RATE: an
#   open loop at RATE requests/s instead (latency counted from each call's due time), with at most
#   MAX_INFLIGHT in flight [256]; CONNS gRPC connections [2]; PROMPTS distinct prompts cycled [16];
#   FREE [1]; WORKERS [64]; PREFILL workers [0: all aggregated]; BLOCKS published [1000000];
#   PROMPT_BLOCKS per published prompt [512]; ROOTS [100]; ROUTE_TOKENS of the routed prompts [2048].
#   GHZ=1 drives with ghz instead (pinned in scripts/tools.sh; it finds the method by reflection), as
#   this script did before kvload drove, for comparison: -n N -c C --connections CONNS --skipFirst
#   WARMUP, one prompt, and bookings never freed (ghz fills each request id in from a template, which
#   makes it parse the JSON request again per call). It prints ghz's summary, ghz's CPU time from
#   bash's `time`, and ghz's and kvrouter's CPU per request (over all N, warmup included).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-20000} DURATION=${DURATION:-} WARMUP=${WARMUP:-1000} C=${C:-8} RATE=${RATE:-0}
MAX_INFLIGHT=${MAX_INFLIGHT:-256} CONNS=${CONNS:-2} PROMPTS=${PROMPTS:-16} FREE=${FREE:-1}
WORKERS=${WORKERS:-64} PREFILL=${PREFILL:-0} BLOCKS=${BLOCKS:-1000000}
PROMPT_BLOCKS=${PROMPT_BLOCKS:-512} ROOTS=${ROOTS:-100} ROUTE_TOKENS=${ROUTE_TOKENS:-2048} GHZ=${GHZ:-0}
modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(query book)

[ "$GHZ" = 1 ] && scripts/tools.sh ghz
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
router=$!
pids+=("$router")
addr=
for _ in $(seq 100); do
  addr=$(sed -n 's/.*"msg":"serving gRPC","addr":"\([^"]*\)".*/\1/p' "$out/kvrouter.log")
  [ -n "$addr" ] && break
  kill -0 "$router" 2>/dev/null || { cat "$out/kvrouter.log" >&2; exit 1; }
  sleep 0.1
done
[ -n "$addr" ] || { echo "kvrouter did not start; see $out/kvrouter.log" >&2; exit 1; }
echo "kvrouter serving on $addr ($(go version | cut -d' ' -f3), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg))"

seed_flags=(--addr "$addr" --workers "$WORKERS" --prefill-workers "$PREFILL" --blocks "$BLOCKS"
  --prompt-blocks "$PROMPT_BLOCKS" --roots "$ROOTS" --route-tokens "$ROUTE_TOKENS")

# run_ghz seeds with kvload, which writes the request and holds the worker streams open, and runs
# ghz against it.
run_ghz() {
  local mode=$1 query_only=$2 request="$out/route-$1.json"
  rm -f "$request"
  "$out/kvload" "${seed_flags[@]}" --query-only="$query_only" --out "$request" --hold 1h &
  local kvload=$!
  pids+=("$kvload")
  # kvload writes the request once every event is acked, and keeps the worker streams open.
  until [ -f "$request" ]; do
    kill -0 "$kvload" 2>/dev/null || { echo "kvload failed" >&2; exit 1; }
    sleep 0.2
  done
  echo "== ghz: mode=$mode, $N requests (first $WARMUP left out), concurrency $C, $CONNS conns, $ROUTE_TOKENS-token prompt, $WORKERS workers ($PREFILL prefill), $BLOCKS blocks published"
  local before used
  before=$(cpu_ticks "$router")
  TIMEFORMAT="ghz CPU: %U s user, %S s system, %R s wall"
  { time .tmp/bin/ghz --insecure --call kvrouter.v1.RouterService/Route -D "$request" \
    -n "$N" -c "$C" --connections "$CONNS" --skipFirst "$WARMUP" "$addr" >"$out/ghz-$mode.txt" 2>&1; } 2>>"$out/ghz-$mode.txt"
  used=$(($(cpu_ticks "$router") - before))
  cat "$out/ghz-$mode.txt"
  {
    awk -v n="$N" '/^ghz CPU:/ { printf "ghz CPU per request: %.0f µs\n", ($3 + $6) / n * 1e6 }' "$out/ghz-$mode.txt"
    echo "kvrouter CPU: $(awk -v t="$used" -v hz="$hz" -v n="$N" 'BEGIN { printf "%.2f s, %.0f µs per request", t / hz, t / hz / n * 1e6 }')"
    echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  } | tee -a "$out/ghz-$mode.txt"
  kill "$kvload"
  wait "$kvload" 2>/dev/null || true
}

# run_kvload seeds and drives with kvload, which prints its report.
run_kvload() {
  local mode=$1 query_only=$2 amount=(--requests "$N") loop=(--concurrency "$C")
  [ -n "$DURATION" ] && amount=(--duration "$DURATION")
  [ "$RATE" != 0 ] && loop=(--rate "$RATE" --max-inflight "$MAX_INFLIGHT")
  local free=true
  [ "$FREE" = 1 ] || free=false
  echo "== kvload: mode=$mode, ${amount[*]} (after $WARMUP warmup), ${loop[*]}, $CONNS conns, $PROMPTS prompts of $ROUTE_TOKENS tokens, $WORKERS workers ($PREFILL prefill), $BLOCKS blocks published"
  "$out/kvload" "${seed_flags[@]}" --query-only="$query_only" --free="$free" "${amount[@]}" "${loop[@]}" \
    --warmup "$WARMUP" --conns "$CONNS" --prompts "$PROMPTS" --server-pid "$router" \
    --json "$out/kvload-$mode.json" 2>&1 | tee "$out/kvload-$mode.txt"
}

for mode in "${modes[@]}"; do
  case $mode in
    query) query_only=true ;;
    book) query_only=false ;;
    *) echo "unknown mode $mode (want query or book)" >&2; exit 2 ;;
  esac
  if [ "$GHZ" = 1 ]; then
    run_ghz "$mode" "$query_only"
  else
    run_kvload "$mode" "$query_only"
  fi
done
