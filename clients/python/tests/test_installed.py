"""Tests of kvrouter-client as a user installs it: the examples, run with the python of a virtualenv
that install.sh made (KVROUTER_VENV; test.sh sets it), from a directory outside the source tree and
without PYTHONPATH, against a real `kvrouter serve`. Without KVROUTER_VENV they are skipped. (The
programs of docs/clients.md run in docs/clients_test.go, against the same kind of virtualenv.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from typing import Dict

from kvserver import CLIENT_ROOT, Server

VENV = os.environ.get("KVROUTER_VENV", "")


@unittest.skipUnless(VENV, "set KVROUTER_VENV to a virtualenv made by clients/python/install.sh (test.sh does)")
class InstalledTest(unittest.TestCase):
    def setUp(self) -> None:
        self.python = os.path.join(os.path.abspath(VENV), "bin", "python")
        self.dir = tempfile.mkdtemp(prefix="kvrouter-client-installed-")  # outside the source tree
        self.addCleanup(shutil.rmtree, self.dir, True)
        for name in os.listdir(os.path.join(CLIENT_ROOT, "examples")):
            if name.endswith(".py"):
                shutil.copy(os.path.join(CLIENT_ROOT, "examples", name), self.dir)
        self.server = Server()
        self.addCleanup(self.server.stop)

    def run_python(self, *args: str, env: Dict[str, str] = {}) -> str:  # noqa: B006 - read only
        clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
        out = subprocess.run([self.python, *args], cwd=self.dir, env={**clean, **env}, capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, f"{args[0]} failed:\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def test_the_package_imported_is_the_installed_one(self) -> None:
        out = self.run_python("-c", "import sysconfig, kvrouter_client, kvrouter_client.aio; print(sysconfig.get_paths()['purelib']); print(kvrouter_client.__file__)")
        site, found = out.split()
        self.assertEqual(found, os.path.join(site, "kvrouter_client", "__init__.py"))
        self.assertFalse(found.startswith(CLIENT_ROOT + os.sep + "kvrouter_client"), "the source tree was imported")

    def test_the_examples_run_with_the_installed_package(self) -> None:
        out = self.run_python("worker.py", "--addr", self.server.addr, "--worker-id", "3", "--endpoint", "10.0.0.3:8000")
        self.assertIn("worker 3: published 8 blocks", out)
        out = self.run_python("frontend.py", "--addr", self.server.addr, "--tokens", "34", "--request-id", "req-installed")
        self.assertIn("request req-installed: worker 3 rank 0 at 10.0.0.3:8000 (ROUTE_MODE_AGGREGATED, 8 cached blocks)", out)
        self.assertIn("request req-installed: freed", out)
        self.assertEqual(self.server.worker_status(3).load.active_requests, 0)


if __name__ == "__main__":
    sys.exit(unittest.main())
