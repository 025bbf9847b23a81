#!/usr/bin/env bash
# redis.sh makes sure redis-server and redis-cli are installed (the tests start private servers on
# free ports; they never use a Redis already running). Sourced by test.sh and chaos.sh.
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing redis-server" >&2
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server and redis-cli are needed: apt-get install redis-server" >&2
    exit 1
  fi
fi
