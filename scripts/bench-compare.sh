#!/usr/bin/env bash
# bench-compare.sh compares the hot paths of two commits on this machine, in one run, so that both
# see the same noise: it builds both commits' test binaries first, then runs ROUNDS rounds; each
# round runs every benchmark once per commit, alternating, each in its own process. It prints, per
# benchmark and metric, the median [min – max] of each commit. docs/BENCHMARKS.md quotes these.
#
# Usage: scripts/bench-compare.sh OLD [NEW]     (commits; NEW defaults to HEAD)
# Environment: ROUNDS [3], ONLY (a regexp of benchmark names below: apply, route, cd, ingest),
#   SETS (sets of scripts/bench.sh, such as "go peer curves grpc redis": then every set runs
#   once per commit, alternating, with the settings of `scripts/bench.sh all`, instead of the
#   benchmarks below; the comparison covers every metric those sets report).
#
# The benchmarks (each found in whichever package of the commit defines it):
#   apply   BenchmarkApply on one P                                   (block events/s)
#   route   BenchmarkRoute, both fleets, 2k tokens, query and booking (p50-ns, p99-ns)
#   cd      BenchmarkRouteConditionalDisagg, 2k tokens, query         (p50-ns, p99-ns)
#   ingest  BenchmarkRedisIngest, one Redis, 512-block batches, flat out, 3 s (needs redis-server)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
old=$(git rev-parse --short "$1")
new=$(git rev-parse --short "${2:-HEAD}")
ROUNDS=${ROUNDS:-3} ONLY=${ONLY:-.}

# name|function|-bench pattern|extra flags
benchmarks=(
  "apply|BenchmarkApply|^BenchmarkApply\$|-test.cpu=1"
  "route|BenchmarkRoute|^BenchmarkRoute\$/fleet=.*/tokens=2k/|"
  "cd|BenchmarkRouteConditionalDisagg|^BenchmarkRouteConditionalDisagg\$/tokens=2k/mode=query|"
  "ingest|BenchmarkRedisIngest|^BenchmarkRedisIngest\$/redis=single/batch=512/rate=max|-test.benchtime=3s"
)
if echo ingest | grep -qE "$ONLY"; then
  scripts/need.sh redis-server=redis-server # the benchmark starts its own
fi

out=$PWD/.tmp/bench-compare/$(date -u +%Y%m%dT%H%M%SZ)-$old-$new
mkdir -p "$out"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "go: $(go version)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores; kernel $(uname -r)"
  echo "redis: $(redis-server --version 2>/dev/null | awk '{print $3}')"
  echo "old: $old $(git log -1 --format=%s "$old" | cut -c1-80)"
  echo "new: $new $(git log -1 --format=%s "$new" | cut -c1-80)"
} | tee "$out/machine.txt"

# Build each commit's test binaries in a worktree of its own.
for rev in "$old" "$new"; do
  tree=$out/tree-$rev
  git worktree add -q --detach "$tree" "$rev"
  [ -z "${SETS:-}" ] || continue
  for spec in "${benchmarks[@]}"; do
    IFS='|' read -r name fn _ _ <<<"$spec"
    echo "$name" | grep -qE "$ONLY" || continue
    pkg=$(cd "$tree" && grep -rl --include='*_test.go' "^func $fn(" . | head -1 | xargs -r dirname)
    [ -n "$pkg" ] || { echo "$rev has no $fn" >&2; exit 1; }
    (cd "$tree" && go test -c -o "$out/$name.$rev.test" "$pkg")
    echo "$pkg" >"$out/$name.$rev.pkg"
  done
done

# With SETS, each set of scripts/bench.sh runs in both trees in turn, as `bench.sh all` sets them.
for set in ${SETS:-}; do
  for rev in "$old" "$new"; do
    echo "== $set at $rev" >&2
    mkdir -p "$out/tree-$rev/.tmp" && cp -r .tmp/bin "$out/tree-$rev/.tmp/" 2>/dev/null || true
    (cd "$out/tree-$rev" && COUNT=${COUNT:-3} RUNS=${RUNS:-1} CURVE_TIME=${CURVE_TIME:-300ms} scripts/bench.sh "$set") \
      >"$out/$set.$rev.log" 2>&1 || { tail -20 "$out/$set.$rev.log" >&2; exit 1; }
    run=$(ls -d "$out/tree-$rev"/.tmp/bench/2*/ | sort | tail -1)
    for f in go.txt gomaxprocs1.txt peer.txt curves-policy.txt curves-kvstate.txt grpc.txt redis.txt; do
      [ -f "$run/$f" ] && cat "$run/$f" >>"$out/$rev.txt"
    done
    mv "$run" "$out/$set.$rev.run"
  done
done
[ -n "${SETS:-}" ] && ROUNDS=0

for round in $(seq "$ROUNDS"); do
  for spec in "${benchmarks[@]}"; do
    IFS='|' read -r name _ pattern flags <<<"$spec"
    echo "$name" | grep -qE "$ONLY" || continue
    for rev in "$old" "$new"; do
      echo "== round $round: $name at $rev" >&2
      # Run from the package's directory, as go test does (testdata is found relative to it).
      (cd "$out/tree-$rev/$(cat "$out/$name.$rev.pkg")" &&
        "$out/$name.$rev.test" -test.run '^$' -test.bench "$pattern" -test.benchmem $flags -test.timeout 30m) \
        | tee -a "$out/$rev.txt" | grep '^Benchmark' >&2 || true
    done
  done
done

for rev in "$old" "$new"; do
  git worktree remove --force "$out/tree-$rev"
done

# One line per benchmark and metric: old median [min – max], new median [min – max].
awk -v tsv=1 -f scripts/summarize.awk "$out/$old.txt" >"$out/$old.summary.tsv"
awk -v tsv=1 -f scripts/summarize.awk "$out/$new.txt" >"$out/$new.summary.tsv"
echo "== median [min – max]${SETS:+ of sets $SETS}: $old | $new"
awk -F'\t' -v old="$out/$old.summary.tsv" '
  BEGIN { while ((getline line < old) > 0) { split(line, f, "\t"); o[f[1] "\t" f[3]] = f[2] " " f[4] } }
  { k = $1 "\t" $3; printf "%-66s %-22s %-30s | %s %s\n", $1, $3, (k in o ? o[k] : "-"), $2, $4 }
' "$out/$new.summary.tsv" | tee "$out/compare.txt"
echo "results in $out"
