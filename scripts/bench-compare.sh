#!/usr/bin/env bash
# bench-compare.sh compares the hot paths of two commits on this machine, in one run, so that both
# see the same noise: it builds both commits' test binaries first, then runs ROUNDS rounds; each
# round runs every benchmark once per commit, alternating, each in its own process. It prints, per
# benchmark and metric, the median [min – max] of each commit. docs/BENCHMARKS.md quotes these.
#
# Usage: scripts/bench-compare.sh OLD [NEW]     (commits; NEW defaults to HEAD, and . is the
#   working tree: HEAD with the uncommitted changes)
# Environment: ROUNDS [3], ONLY (a regexp of benchmark names below: apply, route, cd, ingest),
#   OLD_TAGS (Go build tags for OLD's binaries only: `OLD_TAGS=kvrouter_notracing
#   scripts/bench-compare.sh HEAD .` compares a build without tracing with the working tree),
#   SETS (sets of scripts/bench.sh, such as "go peer curves grpc redis": then every set runs
#   once per commit, alternating, with the settings of `scripts/bench.sh all`, instead of the
#   benchmarks below; the comparison covers every metric those sets report).
#
# The benchmarks (each found in whichever package of the commit defines it):
#   apply   BenchmarkApply on one P                                   (block events/s)
#   route   BenchmarkRoute, both fleets, 2k tokens, query and booking (p50-ns, p99-ns)
#   cd      BenchmarkRouteConditionalDisagg, 2k tokens, query         (p50-ns, p99-ns)
#   ingest  BenchmarkRedisIngest, one Redis, 512-block batches, flat out, 3 s (needs redis-server)
#   grpc    Route over gRPC, as issue 32 measures it: each commit's `kvrouter serve`, fresh for every
#           run, on loopback; the working tree's kvload seeds 64 workers with 1M blocks (prompts of
#           512 blocks on 100 roots) and drives query-only Routes of 2,048 tokens, 16 prompts in
#           turn, over 4 connections, GRPC_WARMUP [3000] calls then GRPC_DURATION [10s]: at
#           concurrency 32 and 8, and at 32 with a bearer token checked (plaintext loopback);
#           then at 32 with prompt=hashed: the callers key their prompts (kvload --hash-prompts,
#           block_hashes) where the commit's RouteRequest has block_hashes, and send token ids
#           where it has not (the ratio is then what a caller that hashes gains over the other).
#           Metrics: kvrouter's CPU per call (server-cpu-us/op), req/s, p50-ns, p99-ns, and kvload's
#           own CPU per call (it shares the machine).
#
# After the medians it prints, per benchmark and metric, the ratio NEW/OLD of the medians and the
# range of the per-round ratios (round i of NEW over round i of OLD): the spread a goal's ratio must
# clear.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
old=$(git rev-parse --short "$1")
if [ "${2:-}" = . ]; then
  new=$(git rev-parse --short HEAD)+wt # the working tree: HEAD with every uncommitted change
else
  new=$(git rev-parse --short "${2:-HEAD}")
fi
ROUNDS=${ROUNDS:-3} ONLY=${ONLY:-.}

# name|function|-bench pattern|extra flags
benchmarks=(
  "apply|BenchmarkApply|^BenchmarkApply\$|-test.cpu=1"
  "route|BenchmarkRoute|^BenchmarkRoute\$/fleet=.*/tokens=2k/|"
  "cd|BenchmarkRouteConditionalDisagg|^BenchmarkRouteConditionalDisagg\$/tokens=2k/mode=query|"
  "ingest|BenchmarkRedisIngest|^BenchmarkRedisIngest\$/redis=single/batch=512/rate=max|-test.benchtime=3s"
  "grpc|-|-|"
)
if echo ingest | grep -qE "$ONLY"; then
  scripts/need.sh redis-server=redis-server # the benchmark starts its own
fi
GRPC_DURATION=${GRPC_DURATION:-10s} GRPC_WARMUP=${GRPC_WARMUP:-3000}

out=$PWD/.tmp/bench-compare/$(date -u +%Y%m%dT%H%M%SZ)-$old-$new
mkdir -p "$out"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "go: $(go version)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores; kernel $(uname -r)"
  echo "redis: $(redis-server --version 2>/dev/null | awk '{print $3}')"
  echo "old: $old $(git log -1 --format=%s "$old" | cut -c1-80)${OLD_TAGS:+ (built with -tags $OLD_TAGS)}"
  echo "new: $new $(git log -1 --format=%s "${new%+wt}" | cut -c1-80)${new#"${new%+wt}"}"
} | tee "$out/machine.txt"

# Build each commit's test binaries in a worktree of its own.
for rev in "$old" "$new"; do
  tree=$out/tree-$rev
  tags=()
  [ "$rev" = "$old" ] && [ -n "${OLD_TAGS:-}" ] && tags=(-tags "$OLD_TAGS")
  git worktree add -q --detach "$tree" "${rev%+wt}"
  if [ "$rev" != "${rev%+wt}" ]; then
    git diff --binary HEAD | (cd "$tree" && git apply --allow-empty)
    git ls-files --others --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$tree"
  fi
  [ -z "${SETS:-}" ] || continue
  for spec in "${benchmarks[@]}"; do
    IFS='|' read -r name fn _ _ <<<"$spec"
    echo "$name" | grep -qE "$ONLY" || continue
    if [ "$name" = grpc ]; then
      (cd "$tree" && go build "${tags[@]}" -o "$out/kvrouter.$rev" ./cmd/kvrouter)
      cp "$tree/proto/kvrouter/v1/router.proto" "$out/proto.$rev" # what its RouteRequest takes
      continue
    fi
    pkg=$(cd "$tree" && grep -rl --include='*_test.go' "^func $fn(" . | head -1 | xargs -r dirname)
    [ -n "$pkg" ] || { echo "$rev has no $fn" >&2; exit 1; }
    (cd "$tree" && go test "${tags[@]}" -c -o "$out/$name.$rev.test" "$pkg")
    echo "$pkg" >"$out/$name.$rev.pkg"
  done
done

# The gRPC runs: the working tree's load generator and report converter for both commits, so that
# only the router differs; a bearer token and the credentials file that lets it in.
. scripts/procs.sh # pids, stopped at exit
if echo grpc | grep -qE "$ONLY" && [ -z "${SETS:-}" ]; then
  go build -o "$out/kvload" ./cmd/kvload
  go build -o "$out/kvcurves" ./cmd/kvcurves
  openssl rand -hex 32 | tr -d '\n' >"$out/bench.token"
  printf 'credentials:\n  - name: kvload\n    roles: [worker, frontend]\n    any_worker: true\n    token_sha256: %s\n' \
    "$(sha256sum <"$out/bench.token" | cut -d' ' -f1)" >"$out/credentials.yaml"
fi

# grpc_run REV NAME CONCURRENCY [SERVE FLAGS...] runs one measured Route load against a fresh router
# of REV and appends its benchmark line to REV's results.
grpc_run() {
  local rev=$1 name=$2 c=$3
  shift 3
  local r=$out/grpc-$(echo "$name" | tr '/=' '-_')-$rev addr= kvload_creds=() kvload_prompts=()
  [[ $name == */prompt=hashed ]] && grep -q block_hashes "$out/proto.$rev" && kvload_prompts=(--hash-prompts)
  local log=$r.log
  [ $# -gt 0 ] && kvload_creds=(--token-file "$out/bench.token")
  "$out/kvrouter.$rev" serve --listen 127.0.0.1:0 --metrics-listen '' --worker-grace-period 10m "$@" 2>"$log" &
  local pid=$!
  pids+=("$pid")
  for _ in $(seq 200); do
    addr=$(sed -n 's/.*"msg":"serving gRPC","addr":"\([^"]*\)".*/\1/p' "$log")
    [ -n "$addr" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  [ -n "$addr" ] || { echo "kvrouter $rev did not start; see $log" >&2; cat "$log" >&2; exit 1; }
  "$out/kvload" --addr "$addr" --workers 64 --blocks 1000000 --prompt-blocks 512 --roots 100 --route-tokens 2048 \
    --query-only --prompts 16 --conns 4 --concurrency "$c" --warmup "$GRPC_WARMUP" --duration "$GRPC_DURATION" \
    --server-pid "$pid" "${kvload_creds[@]}" "${kvload_prompts[@]}" --json "$r.json" >"$r.txt" 2>&1 || { cat "$r.txt" >&2; exit 1; }
  kill "$pid" && wait "$pid" 2>/dev/null || true
  "$out/kvcurves" kvload -name "GRPCRoute/$name" -json "$r.json" | tee -a "$out/$rev.txt" >&2
}

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
    if [ "$name" = grpc ]; then
      for rev in "$old" "$new"; do
        echo "== round $round: grpc at $rev" >&2
        grpc_run "$rev" concurrency=32/credentials=off 32
        grpc_run "$rev" concurrency=8/credentials=off 8
        # A commit from before credentials existed has no credentials run.
        if { "$out/kvrouter.$rev" serve --help 2>&1 || true; } | grep -q -- -credentials-file; then
          grpc_run "$rev" concurrency=32/credentials=token 32 --credentials-file "$out/credentials.yaml"
        fi
        grpc_run "$rev" concurrency=32/prompt=hashed 32
      done
      continue
    fi
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
echo "== ratio $new/$old of the medians [range of the per-round ratios]"
awk -v oldf="$out/$old.txt" -f scripts/ratios.awk "$out/$new.txt" | tee "$out/ratios.txt"
if grep -q 'credentials=token' "$out/$new.txt"; then
  echo "== $new: credentials=token over credentials=off, round by round"
  grep 'credentials=token' "$out/$new.txt" | sed 's/credentials=token/credentials=off/' >"$out/$new.token.txt"
  awk -v oldf="$out/$new.txt" -f scripts/ratios.awk "$out/$new.token.txt" | tee -a "$out/ratios.txt"
fi
echo "results in $out"
