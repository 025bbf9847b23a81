#!/usr/bin/env bash
# install.sh VENV_DIR installs kvrouter-client (this directory) into a new virtualenv without PyPI:
# the virtualenv is made with Debian's /usr/bin/python3 and --system-site-packages, so that Debian's
# python3-grpcio, python3-protobuf and python3-xxhash satisfy the package's dependencies and
# Debian's pip and setuptools build it (pip install --no-index --no-build-isolation). It installs
# the Debian packages it needs when they are missing (scripts/need.sh), and fails unless
# `import kvrouter_client` in the virtualenv, run outside this tree, finds the installed copy.
# A VENV_DIR that exists must be a virtualenv (it is made anew); on a machine that reaches PyPI,
# `python3 -m venv VENV_DIR && VENV_DIR/bin/pip install ./clients/python` does the same.
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: clients/python/install.sh VENV_DIR" >&2
  exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="$(realpath -m "$1")"
"$root/scripts/need.sh" py:grpc=python3-grpcio py:google.protobuf=python3-protobuf py:xxhash=python3-xxhash \
  py:pip=python3-pip py:setuptools=python3-setuptools py:wheel=python3-wheel

clear=()
if [ -e "$venv" ]; then
  if [ ! -f "$venv/pyvenv.cfg" ]; then
    echo "install.sh: $venv exists and is not a virtualenv; give a new directory or an old virtualenv" >&2
    exit 1
  fi
  clear=(--clear)
fi
# Debian's pip, seen through --system-site-packages, installs into the virtualenv: no ensurepip
# (python3-venv) needed.
/usr/bin/python3 -m venv --without-pip --system-site-packages "${clear[@]}" "$venv"

# Build from a copy of what the package holds, so that nothing is written into this tree (setuptools
# builds in place) and no stale build/ of an earlier run ends up in the install.
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
cp -r "$here/pyproject.toml" "$here/README.md" "$here/kvrouter_client" "$stage/"
find "$stage" -name __pycache__ -type d -prune -exec rm -rf {} +
env -u PYTHONPATH PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
  "$venv/bin/python" -m pip install -q --no-index --no-build-isolation "$stage"

site="$(env -u PYTHONPATH "$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
found="$(cd / && env -u PYTHONPATH "$venv/bin/python" -c 'import kvrouter_client, kvrouter_client.aio; print(kvrouter_client.__file__)')"
if [ "$found" != "$site/kvrouter_client/__init__.py" ]; then
  echo "install.sh: import kvrouter_client in $venv finds $found, not the copy installed in $site" >&2
  exit 1
fi
for f in py.typed _gen/kvrouter/v1/worker_pb2.py _gen/kvrouter/v1/worker_pb2.pyi aio/publisher.py; do
  if [ ! -f "$site/kvrouter_client/$f" ]; then
    echo "install.sh: the installed package lacks kvrouter_client/$f" >&2
    exit 1
  fi
done
echo "install.sh: kvrouter-client $(env -u PYTHONPATH "$venv/bin/python" -c 'import kvrouter_client; print(kvrouter_client.__version__)') installed in $venv ($site)"
