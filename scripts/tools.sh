#!/usr/bin/env bash
# tools.sh installs the pinned developer tools into .tmp/bin (git-ignored). Idempotent: a tool whose
# pinned version is already installed is skipped. Usage: scripts/tools.sh [tool ...] (default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="$PWD/.tmp/bin"
mkdir -p "$BIN"
export GOBIN="$BIN"

declare -A PKG=(
  [protoc-gen-go]=google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
  [protoc-gen-go-grpc]=google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2
  [buf]=github.com/bufbuild/buf/cmd/buf@v1.75.0
  [grpcurl]=github.com/fullstorydev/grpcurl/cmd/grpcurl@v1.9.4
  [ghz]=github.com/bojand/ghz/cmd/ghz@v0.93.0
  [benchstat]=golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da
)

tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(protoc-gen-go protoc-gen-go-grpc buf grpcurl ghz benchstat)
for t in "${tools[@]}"; do
  pkg=${PKG[$t]:?unknown tool $t}
  stamp="$BIN/.$t.version"
  if [ -x "$BIN/$t" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$pkg" ]; then
    continue
  fi
  echo "installing $pkg" >&2
  go install "$pkg"
  echo "$pkg" > "$stamp"
done
