#!/usr/bin/env bash
# bench.sh runs the benchmarks recorded in docs/BENCHMARKS.md and docs/benchmarks/curves.md, keeps
# the raw output under .tmp/bench/<time>/ and prints the medians: benchstat's table, then
# median [min – max] per metric. Every result is a Go benchmark line, so benchstat,
# scripts/summarize.awk and cmd/kvcurves read them all.
#
# Usage: scripts/bench.sh [--update-baseline[=missing]] [SET ...]     (default: go peer)
#   go:      the Go benchmarks, COUNT runs each with -benchmem:
#              go test -run '^$' -bench "$BENCH" -benchmem -count "$COUNT" -timeout 60m ./kvstate ./policy
#            plus BenchmarkApply on one P (everything, GC included, on one core):
#              go test -run '^$' -bench '^BenchmarkApply$' -benchmem -count "$COUNT" -cpu 1 ./kvstate
#   peer:    the peers' index workload (TestPeerIndexBench), insert and lookup runs, RUNS separate
#            processes each, as the peers measured:
#              KVROUTER_PEER_BENCH=1 go test -run 'TestPeerIndexBench/insert' -count=1 -v ./kvstate
#              KVROUTER_PEER_BENCH=1 go test -run 'TestPeerIndexBench/lookup' -count=1 -v ./kvstate
#   profile: CPU and memory profiles of event ingestion, routing with booking and lookups, with the
#            top of each (go tool pprof -top), into the same directory.
#   curves:  the in-process scaling curves (issue 12, item 4 a-c): Route latency against prompt
#            length, workers and index size (policy/curves_test.go), and the index's heap against
#            its size (kvstate/curves_test.go), CURVE_ROUNDS rounds of CURVE_TIME per point and mode:
#              KVROUTER_CURVES=1 go test -run TestRouteCurves -count=1 -v ./policy
#              KVROUTER_CURVES=1 go test -run TestMemoryCurve -count=1 -v ./kvstate
#   grpc:    Route over gRPC against concurrency (item 4 d): one `kvrouter serve` on loopback; for
#            each of GRPC_CONCURRENCY, GRPC_ROUNDS times, cmd/kvload seeds it afresh (64 workers,
#            1M blocks in 512-block prompts over 100 roots) and drives query-only Route calls of
#            2,048 tokens for GRPC_DURATION after 500 warmup calls, reading kvrouter's CPU from /proc.
#   redis:   Redis mode against replicas (item 4 e): for each of REDIS_REPLICAS, REDIS_ROUNDS
#            times, a private redis-server and that many `kvrouter serve --redis-addr` replicas;
#            kvload seeds the first with 1M blocks; cmd/kvcurves replicate reports the acked
#            blocks/s and how long after the last ack each replica's index holds every block.
#   plot:    cmd/kvcurves draws the curves of this run (PNG and Markdown tables) into <run>/plots.
#   all:     everything, compact (under 15 minutes on 2 cores): go (COUNT 3), peer (RUNS 1),
#            curves, grpc, redis, plot, then compare.
#   compare [DIR]: the headline metrics of run DIR (default: this run, or the latest) against
#            docs/benchmarks/baseline.txt: median [min – max], the committed figure, the ratio, and
#            REGRESSION where more than THRESHOLD worse. --update-baseline rewrites the baseline
#            from the run's medians (=missing: only metrics without a committed figure).
#   publish [DIR]: the curves of run DIR (default: the latest) into docs/benchmarks: PNGs, and the
#            tables between the kvcurves markers of docs/benchmarks/curves.md.
# Environment: COUNT [5; 3 in all], RUNS [3; 1 in all], BENCH [.] (a -bench regexp), BENCHTIME [1s],
#   CURVE_ROUNDS [3], CURVE_TIME [500ms; 300ms in all], CURVE_TOKENS, CURVE_WORKERS, CURVE_BLOCKS
#   (comma lists such as 1k,2k or 10k,1M; default every point of the issue), GRPC_CONCURRENCY
#   [1 2 4 8 16 32 64], GRPC_ROUNDS [2], GRPC_DURATION [3s], GRPC_BLOCKS [1000000], REDIS_REPLICAS [1 2 3 4],
#   REDIS_ROUNDS [2], REDIS_BLOCKS [1000000], THRESHOLD [0.2], UPDATE_BASELINE [1 or missing],
#   STRICT [0; 1 exits with status 3 on a regression].
set -euo pipefail
cd "$(dirname "$0")/.."

update=${UPDATE_BASELINE:-}
what=()
for a in "$@"; do
  case $a in
  --update-baseline) update=all ;;
  --update-baseline=*) update=${a#--update-baseline=} ;;
  *) what+=("$a") ;;
  esac
done
[ "$update" = 1 ] && update=all
[ ${#what[@]} -eq 0 ] && what=(go peer)
all=0
if [ "${what[0]}" = all ]; then
  all=1
  what=(go peer curves grpc redis plot compare)
fi
if [ $all = 1 ]; then
  COUNT=${COUNT:-3} RUNS=${RUNS:-1} CURVE_TIME=${CURVE_TIME:-300ms}
fi
COUNT=${COUNT:-5} RUNS=${RUNS:-3} BENCH=${BENCH:-.} BENCHTIME=${BENCHTIME:-1s}
CURVE_ROUNDS=${CURVE_ROUNDS:-3} CURVE_TIME=${CURVE_TIME:-500ms}
GRPC_CONCURRENCY=${GRPC_CONCURRENCY:-1 2 4 8 16 32 64} GRPC_ROUNDS=${GRPC_ROUNDS:-2} GRPC_DURATION=${GRPC_DURATION:-3s}
GRPC_BLOCKS=${GRPC_BLOCKS:-1000000}
REDIS_REPLICAS=${REDIS_REPLICAS:-1 2 3 4} REDIS_ROUNDS=${REDIS_ROUNDS:-2} REDIS_BLOCKS=${REDIS_BLOCKS:-1000000}
THRESHOLD=${THRESHOLD:-0.2} STRICT=${STRICT:-0}
baseline=docs/benchmarks/baseline.txt
started=$(date +%s)

# A directory argument of compare or publish names an earlier run; otherwise this run gets a new one.
run_dir=
case ${what[0]} in
compare | publish)
  run_dir=${what[1]:-$(ls -d .tmp/bench/2*/ 2>/dev/null | sort | tail -1)}
  run_dir=${run_dir%/}
  [ -d "$run_dir" ] || { echo "no run directory to ${what[0]} (run scripts/bench.sh all first)" >&2; exit 2; }
  what=("${what[0]}")
  ;;
esac

# Binaries are built once per run (kvrouter, kvload, kvcurves) into .tmp/bench/bin.
bin=.tmp/bench/bin
built=0
build() {
  [ $built = 1 ] && return
  mkdir -p "$bin"
  go build -o "$bin/kvrouter" ./cmd/kvrouter
  go build -o "$bin/kvload" ./cmd/kvload
  go build -o "$bin/kvcurves" ./cmd/kvcurves
  built=1
}

if [ -z "$run_dir" ]; then
  out=.tmp/bench/$(date -u +%Y%m%dT%H%M%SZ)
  mkdir -p "$out"
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "go: $(go version)"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB; kernel $(uname -r)"
    echo "redis: $(redis-server --version 2>/dev/null | awk '{print $3}' | sed 's/^v=//')"
    echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' + uncommitted changes')"
    echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  } | tee "$out/machine.txt"
else
  out=$run_dir
fi

# summarize prints, for every benchmark line's name and unit, the median and [min–max] over runs.
summarize() { awk -f scripts/summarize.awk "$@"; }

# The files of a run that hold benchmark lines. go-cpu1.txt's BenchmarkApply is renamed
# (gomaxprocs1.txt) so that it does not merge with BenchmarkApply-2 once names lose their -N suffix.
results() {
  local f
  for f in go.txt gomaxprocs1.txt peer.txt curves-policy.txt curves-kvstate.txt grpc.txt redis.txt; do
    [ -f "$out/$f" ] && echo "$out/$f"
  done
  return 0
}

# Processes this script started, stopped at exit (also on failure or Ctrl-C), by their pids only.
pids=()
stop_all() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
trap stop_all EXIT
trap 'exit 130' INT TERM

# start_router LOG ARGS... starts `kvrouter serve` on a free loopback port, logging to LOG, and sets
# router_pid and router_addr (kvrouter logs the address it got).
start_router() {
  local log=$1
  shift
  "$bin/kvrouter" serve --listen 127.0.0.1:0 --metrics-listen '' "$@" 2>"$log" &
  router_pid=$!
  pids+=("$router_pid")
  router_addr=
  for _ in $(seq 200); do
    router_addr=$(sed -n 's/.*"msg":"serving gRPC","addr":"\([^"]*\)".*/\1/p' "$log")
    [ -n "$router_addr" ] && return 0
    kill -0 "$router_pid" 2>/dev/null || break
    sleep 0.05
  done
  echo "kvrouter did not start; see $log" >&2
  cat "$log" >&2
  exit 1
}

seed_flags=(--workers 64 --blocks 1000000 --prompt-blocks 512 --roots 100 --route-tokens 2048)

for w in "${what[@]}"; do
  case $w in
  go)
    scripts/tools.sh benchstat
    go test -run '^$' -bench "$BENCH" -benchmem -benchtime "$BENCHTIME" -count "$COUNT" -timeout 60m ./kvstate ./policy | tee "$out/go.txt"
    go test -run '^$' -bench '^BenchmarkApply$' -benchmem -benchtime "$BENCHTIME" -count "$COUNT" -cpu 1 -timeout 60m ./kvstate | tee "$out/go-cpu1.txt"
    sed -E 's/^BenchmarkApply([[:space:]])/BenchmarkApply\/gomaxprocs=1\1/' "$out/go-cpu1.txt" >"$out/gomaxprocs1.txt"
    echo "== benchstat (median ± 95% confidence interval over $COUNT runs)"
    .tmp/bin/benchstat "$out/go.txt" | tee "$out/go.benchstat.txt"
    .tmp/bin/benchstat "$out/go-cpu1.txt" | tee -a "$out/go.benchstat.txt"
    echo "== median [min – max]"
    summarize "$out/go.txt" "$out/go-cpu1.txt" | tee "$out/go.summary.txt"
    ;;
  peer)
    for i in $(seq "$RUNS"); do
      for run in insert lookup; do
        KVROUTER_PEER_BENCH=1 go test -run "TestPeerIndexBench/$run" -count=1 -v -timeout 30m ./kvstate | tee -a "$out/peer.txt"
      done
    done
    echo "== median [min – max] over $RUNS processes"
    summarize "$out/peer.txt" | tee "$out/peer.summary.txt"
    ;;
  profile)
    go test -run '^$' -bench '^BenchmarkApply$' -benchtime 3s -cpuprofile "$out/apply.cpu" -o "$out/kvstate.test" ./kvstate
    go test -run '^$' -bench 'Route/fleet=agg64/tokens=32k/mode=book' -benchtime 3s \
      -cpuprofile "$out/book.cpu" -memprofile "$out/book.mem" -memprofilerate 4096 -o "$out/policy.test" ./policy
    go test -run '^$' -bench 'Route/fleet=agg64/tokens=32k/mode=query' -benchtime 3s -cpuprofile "$out/query.cpu" -o "$out/policy.test" ./policy
    for p in apply.cpu:kvstate book.cpu:policy query.cpu:policy; do
      echo "== pprof -top ${p%%:*}"
      go tool pprof -top -nodecount 15 "$out/${p##*:}.test" "$out/${p%%:*}" 2>/dev/null | tee "$out/${p%%:*}.top.txt"
    done
    echo "== pprof -top -sample_index=alloc_space book.mem"
    go tool pprof -top -nodecount 10 -sample_index=alloc_space "$out/policy.test" "$out/book.mem" 2>/dev/null | tee "$out/book.mem.top.txt"
    ;;
  curves)
    export KVROUTER_CURVES=1 KVROUTER_CURVE_ROUNDS=$CURVE_ROUNDS KVROUTER_CURVE_TIME=$CURVE_TIME
    [ -n "${CURVE_TOKENS:-}" ] && export KVROUTER_CURVE_TOKENS=$CURVE_TOKENS
    [ -n "${CURVE_WORKERS:-}" ] && export KVROUTER_CURVE_WORKERS=$CURVE_WORKERS
    [ -n "${CURVE_BLOCKS:-}" ] && export KVROUTER_CURVE_BLOCKS=$CURVE_BLOCKS
    avail=$(free -g | awk '/^Mem:/ {print $7}')
    echo "== curves: $avail GiB of memory available (a 20M-block point takes about 3 GB of heap)"
    if [ -z "${CURVE_BLOCKS:-}" ] && [ "$avail" -lt 8 ]; then
      export KVROUTER_CURVE_BLOCKS=10k,100k,1M,5M
      echo "   less than 8 GiB available: the index curves stop at 5M blocks"
    fi
    go test -run 'TestMemoryCurve' -count=1 -v -timeout 30m ./kvstate | tee "$out/curves-kvstate.txt"
    go test -run 'TestRouteCurves' -count=1 -v -timeout 60m ./policy | tee "$out/curves-policy.txt"
    unset KVROUTER_CURVES
    echo "== median [min – max] over $CURVE_ROUNDS rounds"
    summarize "$out/curves-kvstate.txt" "$out/curves-policy.txt" | tee "$out/curves.summary.txt"
    ;;
  grpc)
    build
    start_router "$out/grpc-kvrouter.log"
    echo "== grpc: kvrouter $router_addr; concurrency $GRPC_CONCURRENCY, $GRPC_ROUNDS rounds of $GRPC_DURATION each"
    : >"$out/grpc.txt"
    for round in $(seq "$GRPC_ROUNDS"); do
      for c in $GRPC_CONCURRENCY; do
        r=$out/grpc-c$c-r$round
        "$bin/kvload" --addr "$router_addr" "${seed_flags[@]}" --blocks "$GRPC_BLOCKS" --query-only --duration "$GRPC_DURATION" --warmup 500 \
          --concurrency "$c" --conns 2 --prompts 16 --server-pid "$router_pid" --json "$r.json" >"$r.txt" 2>&1 ||
          { cat "$r.txt" >&2; exit 1; }
        "$bin/kvcurves" kvload -name "CurveGRPC/curve=concurrency/concurrency=$c/mode=query" -json "$r.json" \
          -seed-name "SeedGRPC/workers=64/blocks=$GRPC_BLOCKS" -log "$r.txt" | tee -a "$out/grpc.txt"
      done
    done
    stop_all
    echo "== median [min – max] over $GRPC_ROUNDS rounds"
    summarize "$out/grpc.txt" | tee "$out/grpc.summary.txt"
    ;;
  redis)
    build
    scripts/need.sh redis-server=redis-server redis-cli=redis-server
    echo "== redis: replicas $REDIS_REPLICAS, $REDIS_ROUNDS rounds, $REDIS_BLOCKS blocks each"
    : >"$out/redis.txt"
    for round in $(seq "$REDIS_ROUNDS"); do
      for n in $REDIS_REPLICAS; do
        d=$PWD/$out/redis-n$n-r$round # absolute: redis-server changes into its --dir
        mkdir -p "$d"
        port=$("$bin/kvcurves" freeport)
        redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$d" --logfile "$d/redis.log" &
        pids+=($!)
        for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
        addrs=()
        for i in $(seq "$n"); do
          start_router "$d/kvrouter-$i.log" --redis-addr "127.0.0.1:$port" --replica-id "bench-$i" --snapshot-every 1000000000
          addrs+=("$router_addr")
        done
        list=$(IFS=,; echo "${addrs[*]}")
        "$bin/kvcurves" ready -replicas "$list"
        "$bin/kvload" --addr "${addrs[0]}" "${seed_flags[@]}" --blocks "$REDIS_BLOCKS" --out "$d/acked.json" --hold 1h >"$d/kvload.txt" 2>&1 &
        kvload=$!
        pids+=("$kvload")
        "$bin/kvcurves" replicate -redis "127.0.0.1:$port" -replicas "$list" -ack-file "$d/acked.json" -log "$d/kvload.txt" \
          -pid "$kvload" -timeout 3m -name "CurveRedis/curve=replicas/replicas=$n" | tee -a "$out/redis.txt" ||
          { cat "$d/kvload.txt" >&2; exit 1; }
        stop_all
      done
    done
    echo "== median [min – max] over $REDIS_ROUNDS rounds"
    summarize "$out/redis.txt" | tee "$out/redis.summary.txt"
    ;;
  plot)
    build
    # shellcheck disable=SC2046 # one argument per file
    "$bin/kvcurves" plot -out "$out/plots" -machine "$out/machine.txt" $(results)
    ;;
  publish)
    build
    # shellcheck disable=SC2046
    "$bin/kvcurves" plot -out docs/benchmarks -md docs/benchmarks/curves.md -machine "$out/machine.txt" $(results)
    ;;
  compare)
    build
    flags=(-baseline "$baseline" -threshold "$THRESHOLD" -run "$(basename "$out")")
    [ -n "$update" ] && flags+=(-update "$update")
    [ "$STRICT" = 1 ] && flags+=(-strict)
    # shellcheck disable=SC2046
    "$bin/kvcurves" compare "${flags[@]}" $(results) | tee "$out/compare.txt" || { [ "$STRICT" = 1 ] && exit 3; }
    ;;
  *)
    echo "unknown benchmark set $w (want go, peer, profile, curves, grpc, redis, plot, all, compare or publish)" >&2
    exit 2
    ;;
  esac
done
echo "results in $out ($(($(date +%s) - started)) s)"
