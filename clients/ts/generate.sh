#!/usr/bin/env bash
# generate.sh regenerates the TypeScript stubs in clients/ts/src/gen from proto/ with buf and the local
# protoc-gen-es pinned in package.json. Idempotent: running it twice changes nothing.
# `generate.sh --check` writes nothing to src/gen: it generates into a temporary directory and fails
# when that differs from src/gen (scripts/check.sh runs it). Both install node_modules when needed.
set -euo pipefail
check=false
case "${1:-}" in
  "") ;;
  --check) check=true ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac
TS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$TS/../.." && pwd)"
. "$TS/node-env.sh"
need_node
need_node_modules
"$ROOT/scripts/tools.sh" buf
cd "$ROOT" # buf.gen.yaml's paths are relative to the repository root
if ! $check; then
  "$ROOT/.tmp/bin/buf" generate --template clients/ts/buf.gen.yaml
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# -o prefixes the template's out path (clients/ts/src/gen) with $tmp.
"$ROOT/.tmp/bin/buf" generate --template clients/ts/buf.gen.yaml -o "$tmp"
if ! diff -r "$tmp/clients/ts/src/gen" "$TS/src/gen" >/dev/null 2>&1; then
  diff -r "$tmp/clients/ts/src/gen" "$TS/src/gen" | head -20 >&2 || true
  echo "generate.sh: clients/ts/src/gen is out of date with proto/; run scripts/generate.sh" >&2
  exit 1
fi
