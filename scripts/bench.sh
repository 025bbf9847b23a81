#!/usr/bin/env bash
# bench.sh runs the benchmarks recorded in docs/BENCHMARKS.md, keeps the raw output under
# .tmp/bench/<time>/ and prints the medians: benchstat's table, then median [min–max] per metric.
#
# Usage: scripts/bench.sh [go|peer|profile ...]     (default: go peer)
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
# Environment: COUNT [5], RUNS [3], BENCH [.] (a -bench regexp), BENCHTIME [1s].
set -euo pipefail
cd "$(dirname "$0")/.."
COUNT=${COUNT:-5} RUNS=${RUNS:-3} BENCH=${BENCH:-.} BENCHTIME=${BENCHTIME:-1s}
what=("$@")
[ ${#what[@]} -eq 0 ] && what=(go peer)

scripts/tools.sh benchstat
out=.tmp/bench/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "go: $(go version)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
  echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' + uncommitted changes')"
} | tee "$out/machine.txt"

# summarize prints, for every benchmark line's name and unit, the median and [min–max] over runs.
summarize() { awk -f scripts/summarize.awk "$@"; }

for w in "${what[@]}"; do
  case $w in
  go)
    go test -run '^$' -bench "$BENCH" -benchmem -benchtime "$BENCHTIME" -count "$COUNT" -timeout 60m ./kvstate ./policy | tee "$out/go.txt"
    go test -run '^$' -bench '^BenchmarkApply$' -benchmem -benchtime "$BENCHTIME" -count "$COUNT" -cpu 1 -timeout 60m ./kvstate | tee "$out/go-cpu1.txt"
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
  *)
    echo "unknown benchmark set $w (want go, peer or profile)" >&2
    exit 2
    ;;
  esac
done
echo "results in $out"
