#!/usr/bin/env bash
# chaos.sh runs the fault suite (cmd/kvrouter/chaos_test.go): real kvrouter processes and private
# Redis servers on loopback, broken as an operator would break them (kill -9 of a replica, Redis
# paused, restarted from its AOF or empty, a stream cut, a cluster replica killed, two streams for
# one worker id, junk calls, an oversized batch), and prints one line per scenario: Route calls
# made and failed, acked events lost, time to converge, whether the digests agree. It fails if any
# scenario loses an acked event, fails a Route call, or does not converge. Every scenario runs on one log and on a log sharded by model. Bounded to 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/need.sh redis-server=redis-server redis-cli=redis-server
report=$(mktemp)
trap 'rm -f "$report"' EXIT
status=0
KVROUTER_CHAOS_REPORT="$report" go test -tags chaos -count=1 -timeout 10m -run '^TestChaos$' ./cmd/kvrouter "$@" || status=$?
echo
cat "$report"
exit $status
