#!/usr/bin/env bash
# check.sh runs the static checks: formatting, vet, buf lint and format, the breaking-change check
# against the previous commit, and that gen/ and the Python and TypeScript clients' stubs are exactly
# what scripts/generate.sh makes from proto/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/tools.sh protoc-gen-go protoc-gen-go-grpc buf
export PATH="$PWD/.tmp/bin:$PATH"

unformatted=$(gofmt -l $(git ls-files '*.go' | grep -v '^gen/'))
if [ -n "$unformatted" ]; then
  echo "gofmt would change: $unformatted" >&2
  exit 1
fi
# Every Go module of the repository (scripts/gomodules.sh): the server's, the client's, the
# contract's and the block hashing's.
for mod in $(scripts/gomodules.sh); do (cd "$mod" && go vet ./...); done
go vet -tags chaos ./cmd/kvrouter # the fault suite (scripts/chaos.sh)
buf lint
buf format -d --exit-code

if git rev-parse -q --verify HEAD~1 >/dev/null && [ -n "$(git ls-tree -d HEAD~1 proto)" ]; then
  buf breaking --against '.git#ref=HEAD~1,subdir=proto'
else
  echo "buf breaking: no previous commit with proto/ to compare against; skipped" >&2
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
buf generate --template buf.gen.yaml -o "$tmp"
# gen/go.mod and go.sum make gen/ a module of its own; they are not generated.
if ! diff -r -x go.mod -x go.sum "$tmp/gen" gen >/dev/null; then
  echo "gen/ differs from what scripts/generate.sh makes from proto/: run it and commit gen/" >&2
  diff -r -x go.mod -x go.sum "$tmp/gen" gen | head -20 >&2
  exit 1
fi
scripts/need.sh protoc=protobuf-compiler grpc_python_plugin=protobuf-compiler-grpc
clients/python/generate.sh --check
clients/ts/generate.sh --check
echo "checks passed"
