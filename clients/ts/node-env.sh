# node-env.sh is sourced (not run) by generate.sh, test.sh, bench.sh and pack.sh: the one place that makes sure
# Node.js >= 20 and npm are there, and that node_modules matches package-lock.json.
#   need_node          fails (or, as root with apt-get, first installs Debian's package nodejs, which
#                      the machine's apt pinning takes from nodesource) unless node >= 20 and npm run.
#   need_node_modules  runs `npm ci` in clients/ts when node_modules is missing or its stamp (the
#                      sha256 of package-lock.json, written after a complete install) differs.
# Both print to stderr only, so they can run before a script's own output.

NODE_ENV_TS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NODE_MIN_MAJOR=20

# Prints node's major version, or nothing when node does not run.
node_major() {
  node -p 'process.versions.node.split(".")[0]' 2>/dev/null || true
}

node_ok() {
  local major
  major="$(node_major)"
  [ -n "$major" ] && [ "$major" -ge "$NODE_MIN_MAJOR" ] && command -v npm >/dev/null
}

need_node() {
  node_ok && return 0
  local have
  have="$(node --version 2>/dev/null || echo "no node")"
  command -v npm >/dev/null || have="$have, no npm"
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "clients/ts: Node.js >= $NODE_MIN_MAJOR and npm needed (found: $have); installing nodejs with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq nodejs </dev/null >/dev/null 2>&1 ||
      { apt-get update -qq </dev/null >/dev/null 2>&1 && apt-get install -y -qq nodejs </dev/null >/dev/null 2>&1; } || true
    hash -r
    node_ok && return 0
    have="$(node --version 2>/dev/null || echo "no node")"
    command -v npm >/dev/null || have="$have, no npm"
  fi
  echo "clients/ts: needs Node.js >= $NODE_MIN_MAJOR with npm (found: $have); install Node.js $NODE_MIN_MAJOR or later (e.g. nodesource's nodejs package) and retry" >&2
  return 1
}

need_node_modules() {
  local stamp="$NODE_ENV_TS_DIR/node_modules/.kvrouter-lock.sha256" want
  want="$(sha256sum "$NODE_ENV_TS_DIR/package-lock.json" | cut -d' ' -f1)"
  if [ ! -d "$NODE_ENV_TS_DIR/node_modules" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    (cd "$NODE_ENV_TS_DIR" && npm ci --no-audit --no-fund --loglevel=error >&2)
    echo "$want" >"$stamp"
  fi
}
