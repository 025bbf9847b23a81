#!/usr/bin/env bash
# bench-security.sh measures what TLS and credential checks cost Route: it starts three kvrouter
# processes on loopback, one plaintext and open, one with TLS and a credentials file (bearer token),
# one with mutual TLS and the same file, and runs kvload's query_only Route load against each in
# turn, ROUNDS times interleaved (plaintext, tls+token, mtls+token, plaintext, ...), so that the
# machine's drift touches every variant alike. kvload seeds each router with fresh workers (through
# Publish, with the same credentials) before every run. It prints every run's report, then a table of
# each variant's median p50, p99 and kvrouter CPU per call over the rounds, and the ratios to
# plaintext. Reports are kept in .tmp/bench-security; every process started is stopped, also on
# failure or Ctrl-C.
#
# Environment (defaults in brackets): ROUNDS [3]; N measured requests per run [20000]; WARMUP [1000];
# C concurrent callers [8]; CONNS [2]; WORKERS [64]; BLOCKS published [1000000]; ROUTE_TOKENS [2048].
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3} N=${N:-20000} WARMUP=${WARMUP:-1000} C=${C:-8} CONNS=${CONNS:-2}
WORKERS=${WORKERS:-64} BLOCKS=${BLOCKS:-1000000} ROUTE_TOKENS=${ROUTE_TOKENS:-2048}
scripts/need.sh jq=jq openssl=openssl
out=.tmp/bench-security
rm -rf "$out"
mkdir -p "$out"
go build -o "$out/kvrouter" ./cmd/kvrouter
go build -o "$out/kvload" ./cmd/kvload

# Certificates (a CA, the routers' for 127.0.0.1, a client's) and one token whose credential may
# publish for any worker and route, as kvload does both.
(
  cd "$out"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj "/CN=bench CA" -keyout ca.key -out ca.crt 2>/dev/null
  for who in server client; do
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$who" -keyout "$who.key" -out "$who.csr" 2>/dev/null
  done
  openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -out server.crt \
    -extfile <(printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n') 2>/dev/null
  openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -out client.crt \
    -extfile <(printf 'subjectAltName=URI:spiffe://bench/kvload\nextendedKeyUsage=clientAuth\n') 2>/dev/null
  openssl rand -hex 32 | tr -d '\n' >bench.token
  cat >credentials.yaml <<EOF
credentials:
  - name: kvload
    roles: [worker, frontend]
    any_worker: true
    token_sha256: $(sha256sum <bench.token | cut -d' ' -f1)
EOF
)

. scripts/procs.sh # pids, stopped at exit

declare -A addr pid
# start NAME FLAGS... starts a router and waits for the address it logs.
start() {
  local name=$1
  shift
  "$out/kvrouter" serve --listen 127.0.0.1:0 --metrics-listen '' --worker-grace-period 2s "$@" 2>"$out/kvrouter-$name.log" &
  pid[$name]=$!
  pids+=("$!")
  for _ in $(seq 100); do
    addr[$name]=$(sed -n 's/.*"msg":"serving gRPC","addr":"\([^"]*\)".*/\1/p' "$out/kvrouter-$name.log")
    [ -n "${addr[$name]}" ] && return
    kill -0 "${pid[$name]}" 2>/dev/null || { cat "$out/kvrouter-$name.log" >&2; exit 1; }
    sleep 0.1
  done
  echo "kvrouter $name did not start" >&2
  exit 1
}
tls=(--tls-cert-file "$out/server.crt" --tls-key-file "$out/server.key" --credentials-file "$out/credentials.yaml")
start plaintext
start tls-token "${tls[@]}"
start mtls-token "${tls[@]}" --tls-client-ca-file "$out/ca.crt"
declare -A client=(
  [plaintext]=""
  [tls-token]="--cacert $out/ca.crt --token-file $out/bench.token"
  [mtls-token]="--cacert $out/ca.crt --cert $out/client.crt --key $out/client.key --token-file $out/bench.token"
)
variants=(plaintext tls-token mtls-token)
echo "$(go version | cut -d' ' -f3), $(nproc) cores, $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1), kernel $(uname -r)"

for round in $(seq "$ROUNDS"); do
  for v in "${variants[@]}"; do
    echo "== round $round, $v: $N query_only Route calls (first $WARMUP left out), $C callers, $CONNS conns, load average $(cut -d' ' -f1-3 /proc/loadavg)"
    # shellcheck disable=SC2086 # the client flags are words
    "$out/kvload" --addr "${addr[$v]}" ${client[$v]} --workers "$WORKERS" --blocks "$BLOCKS" --route-tokens "$ROUTE_TOKENS" \
      --query-only --requests "$N" --warmup "$WARMUP" --concurrency "$C" --conns "$CONNS" --server-pid "${pid[$v]}" \
      --json "$out/$v-$round.json" 2>&1 | tee "$out/$v-$round.txt"
    sleep 3 # the run's workers leave after the 2 s grace period
  done
done

echo "== medians over $ROUNDS rounds"
{
  printf 'variant\tp50 ms\tp99 ms\tkvrouter µs/call\tp50 ratio\tp99 ratio\tCPU ratio\n'
  base=$(jq -s '[(map(.latency_ms.p50) | sort | .[length/2|floor]), (map(.latency_ms.p99) | sort | .[length/2|floor]), (map(.server_cpu_us_per_call) | sort | .[length/2|floor])]' "$out"/plaintext-*.json)
  for v in "${variants[@]}"; do
    jq -rs --arg v "$v" --argjson base "$base" '[(map(.latency_ms.p50) | sort | .[length/2|floor]), (map(.latency_ms.p99) | sort | .[length/2|floor]), (map(.server_cpu_us_per_call) | sort | .[length/2|floor])] as $m
      | [$v, ($m[0], $m[1] | . * 1000 | round / 1000), ($m[2] | . * 10 | round / 10),
         ($m[0] / $base[0], $m[1] / $base[1], $m[2] / $base[2] | . * 100 | round / 100)] | @tsv' "$out/$v"-*.json
  done
} | column -t -s $'\t' | tee "$out/summary.txt"
