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
# Usage: scripts/loadtest.sh [query|book|ingest|ingest-max ...]     (default: query book)
#   query: query_only requests (a preview; nothing is booked)
#   book:  every request books load under its own request id, and kvload frees each booking once
#          Route returns (FREE=0 keeps them: they pile up for the whole run, as if no request ended)
#   ingest: Route under ingestion (issue 12: Route p99 within twice its idle value while one Publish
#          stream carries 1M block events/s into the replica). For each loop of INGEST_LOOPS (cN: a
#          closed loop of N callers; rN: an open loop at N calls/s), query_only Route with no
#          ingest (idle); then, after every idle run, the same while INGEST_STREAMS extra workers each
#          publish INGEST_RATE block events/s (stored blocks plus removed hashes: a new prompt of
#          INGEST_EVENT_BLOCKS blocks stored, the oldest removed, INGEST_CAP blocks held; max: as
#          fast as the router acks) over one Publish stream; then a table of both p50s and p99s, the
#          p99 ratio, the acked ingest rate and kvrouter's CPU per call and cores (with the ingest's
#          share in the loaded runs), and the load average after each. C and RATE are not used.
#   ingest-max: no Route calls; INGEST_STREAMS streams publish as fast as the router acks for
#          DURATION (10s if unset): the most one replica takes in, and its CPU.
# Environment (defaults in brackets):
#   N measured requests [20000], or DURATION of the measured run (e.g. 30s) instead; WARMUP requests
#   first, left out of the figures [1000]; C concurrent callers of the closed loop [8]; RATE: an
#   open loop at RATE requests/s instead (latency counted from each call's due time), with at most
#   MAX_INFLIGHT in flight [256]; CONNS gRPC connections [2]; PROMPTS distinct prompts cycled [16];
#   FREE [1]; WORKERS [64]; PREFILL workers [0: all aggregated]; BLOCKS published [1000000];
#   PROMPT_BLOCKS per published prompt [512]; ROOTS [100]; ROUTE_TOKENS of the routed prompts [2048].
#   Ingest: INGEST_LOOPS [c8 c32]; INGEST_RATE per stream [1000000, or max]; INGEST_STREAMS [1];
#   INGEST_EVENT_BLOCKS [128]; INGEST_CAP [65536]; INGEST_BATCH events per Publish message [16].
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
INGEST_LOOPS=${INGEST_LOOPS:-c8 c32} INGEST_RATE=${INGEST_RATE:-1000000} INGEST_STREAMS=${INGEST_STREAMS:-1}
INGEST_EVENT_BLOCKS=${INGEST_EVENT_BLOCKS:-128} INGEST_CAP=${INGEST_CAP:-65536} INGEST_BATCH=${INGEST_BATCH:-16}
modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(query book)

for mode in "${modes[@]}"; do
  case $mode in
    query | book) ;;
    ingest | ingest-max) [ "$GHZ" = 1 ] && { echo "mode $mode drives with kvload only (unset GHZ)" >&2; exit 2; }
      scripts/need.sh jq=jq ;;
    *) echo "unknown mode $mode (want query, book, ingest or ingest-max)" >&2; exit 2 ;;
  esac
done
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

# The measured calls' amount and loop, as the environment sets them.
amount=(--requests "$N") loop=(--concurrency "$C")
[ -n "$DURATION" ] && amount=(--duration "$DURATION")
[ "$RATE" != 0 ] && loop=(--rate "$RATE" --max-inflight "$MAX_INFLIGHT")
ingest_flags=(--ingest-streams "$INGEST_STREAMS" --ingest-event-blocks "$INGEST_EVENT_BLOCKS" --ingest-cap "$INGEST_CAP" --ingest-batch "$INGEST_BATCH")

# run_kvload NAME QUERY_ONLY FLAGS... seeds and drives with kvload, which prints its report, kept in
# $out/kvload-NAME.txt and .json. FLAGS say how many calls in which loop, and anything else (they
# come last, so they override the environment's).
run_kvload() {
  local name=$1 query_only=$2
  shift 2
  local free=true
  [ "$FREE" = 1 ] || free=false
  echo "== kvload: $name, --warmup $WARMUP $*, $CONNS conns, $PROMPTS prompts of $ROUTE_TOKENS tokens, $WORKERS workers ($PREFILL prefill), $BLOCKS blocks published, load average $(cut -d' ' -f1-3 /proc/loadavg)"
  "$out/kvload" "${seed_flags[@]}" --query-only="$query_only" --free="$free" \
    --warmup "$WARMUP" --conns "$CONNS" --prompts "$PROMPTS" --server-pid "$router" "$@" \
    --json "$out/kvload-$name.json" 2>&1 | tee "$out/kvload-$name.txt"
}

# loop_flags prints kvload's flags for a loop of INGEST_LOOPS: cN or rN.
loop_flags() {
  case $1 in
    c[0-9]*) echo "--rate 0 --concurrency ${1#c}" ;;
    r[0-9]*) echo "--rate ${1#r} --max-inflight $MAX_INFLIGHT" ;;
    *) echo "INGEST_LOOPS: bad loop $1 (want cN or rN)" >&2; return 2 ;;
  esac
}

# run_ingest runs the idle runs, then the loaded ones (so that no idle run follows a loaded one
# while the router still keeps the last run's ingest workers for its grace period), and compares.
run_ingest() {
  local l flags
  for l in $INGEST_LOOPS; do loop_flags "$l" >/dev/null; done
  for l in $INGEST_LOOPS; do
    read -ra flags <<<"$(loop_flags "$l")"
    run_kvload "ingest-idle-$l" true "${amount[@]}" "${flags[@]}"
  done
  for l in $INGEST_LOOPS; do
    read -ra flags <<<"$(loop_flags "$l")"
    run_kvload "ingest-$l" true "${amount[@]}" "${flags[@]}" --ingest-rate "$INGEST_RATE" "${ingest_flags[@]}"
  done
  echo "== Route (query_only, $ROUTE_TOKENS tokens, $CONNS conns) idle and with $INGEST_STREAMS Publish stream(s) at $INGEST_RATE block events/s each (cN: closed loop of N callers, rN: open loop at N calls/s)"
  {
    printf 'loop\tidle p50 ms\tp99 ms\tingest p50 ms\tp99 ms\tp99 ratio\tacked block events/s\tkvrouter µs/call idle\tingest\tkvrouter cores idle\tingest\tload avg idle\tingest\n'
    for l in $INGEST_LOOPS; do
      jq -rs --arg loop "$l" '.[0] as $i | .[1] as $g | [$loop,
          ($i.latency_ms.p50, $i.latency_ms.p99, $g.latency_ms.p50, $g.latency_ms.p99 | . * 1000 | round / 1000),
          ($g.latency_ms.p99 / $i.latency_ms.p99 * 100 | round / 100), ($g.ingest.acked_rate | round),
          ($i.server_cpu_us_per_call, $g.server_cpu_us_per_call | . * 10 | round / 10),
          ($i.server_cores, $g.server_cores | . * 100 | round / 100), $i.loadavg, $g.loadavg] | @tsv' \
        "$out/kvload-ingest-idle-$l.json" "$out/kvload-ingest-$l.json"
    done
  } | column -t -s $'\t' | tee "$out/ingest-summary.txt"
}

for mode in "${modes[@]}"; do
  case $mode in
    query | book)
      query_only=true
      [ "$mode" = book ] && query_only=false
      if [ "$GHZ" = 1 ]; then
        run_ghz "$mode" "$query_only"
      else
        run_kvload "$mode" "$query_only" "${amount[@]}" "${loop[@]}"
      fi
      ;;
    ingest) run_ingest ;;
    ingest-max)
      run_kvload ingest-max true --duration "${DURATION:-10s}" --warmup 0 --rate 0 --concurrency 0 --ingest-rate max "${ingest_flags[@]}" ;;
  esac
done
