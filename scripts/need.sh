#!/usr/bin/env bash
# need.sh installs the Debian packages that provide what is missing, so that the test and check
# scripts run on a fresh machine without anything installed by hand. Each argument is WHAT=PACKAGE,
# where WHAT is a command on PATH or py:MODULE (importable by /usr/bin/python3, which is where
# Debian's python3-* packages install). Nothing is installed when everything is present; otherwise
# it needs root and apt-get, and says what to install when it has neither.
#   scripts/need.sh redis-server=redis-server protoc=protobuf-compiler py:grpc=python3-grpcio
set -euo pipefail
missing=()
for arg in "$@"; do
  what=${arg%%=*} pkg=${arg#*=}
  case $what in
    py:*) /usr/bin/python3 -c "import ${what#py:}" 2>/dev/null || missing+=("$pkg") ;;
    *) command -v "$what" >/dev/null || missing+=("$pkg") ;;
  esac
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "need.sh: missing Debian packages: apt-get install ${missing[*]}" >&2
  exit 1
fi
echo "need.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq "${missing[@]}" </dev/null >/dev/null 2>&1 ||
  { apt-get update -qq </dev/null >/dev/null && apt-get install -y -qq "${missing[@]}" </dev/null >/dev/null; }
