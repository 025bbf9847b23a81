# procs.sh is sourced by the benchmark scripts that start processes in the background: each appends
# its process id to pids, and every one of them is stopped and waited for when the script exits,
# however it exits (the end, an error under set -e, Ctrl-C or SIGTERM).
pids=()
stop_started() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_started EXIT
trap 'exit 130' INT TERM
