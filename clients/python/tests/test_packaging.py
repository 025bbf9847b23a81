"""Tests of what the package promises without a router: the message of a missing dependency, the
version and the metadata of pyproject.toml, and the publisher's defaults, which are the Go client's."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import unittest

try:
    import tomllib  # Python 3.11
except ImportError:  # pragma: no cover
    tomllib = None  # type: ignore[assignment]

import kvrouter_client
from kvrouter_client import aio
from kvrouter_client._pubcore import PublisherBase
from kvserver import CLIENT_ROOT, REPO_ROOT


def import_without(setup: str) -> subprocess.CompletedProcess:
    """Imports kvrouter_client (from this tree) in a fresh interpreter after running setup."""
    code = f"import sys, types\n{setup}\nimport kvrouter_client\n"
    env = dict(os.environ, PYTHONPATH=CLIENT_ROOT)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)


class MissingDependencyTest(unittest.TestCase):
    def test_the_import_names_what_to_install(self) -> None:
        for module, pip_name, debian_name in (("grpc", "grpcio", "python3-grpcio"), ("google.protobuf", "protobuf", "python3-protobuf"), ("xxhash", "xxhash", "python3-xxhash")):
            with self.subTest(module):
                # None in sys.modules makes the import fail as if the package were not installed.
                out = import_without(f"sys.modules[{module!r}] = None")
                self.assertNotEqual(out.returncode, 0)
                last = out.stderr.strip().splitlines()[-1]
                self.assertTrue(last.startswith("ImportError: kvrouter_client needs "), last)
                self.assertIn(f"pip install {pip_name}", last)
                self.assertIn(f"apt-get install -y {debian_name}", last)
                self.assertNotIn("No module named 'google'\n", out.stderr)

    def test_every_missing_one_is_named_at_once(self) -> None:
        out = import_without("sys.modules['grpc'] = None\nsys.modules['xxhash'] = None")
        last = out.stderr.strip().splitlines()[-1]
        self.assertIn("pip install grpcio xxhash", last)
        self.assertIn("apt-get install -y python3-grpcio python3-xxhash", last)

    def test_an_xxhash_too_old_is_named(self) -> None:
        out = import_without("sys.modules['xxhash'] = types.ModuleType('xxhash')  # before 2.0: no xxh3")
        last = out.stderr.strip().splitlines()[-1]
        self.assertIn("xxhash: too old: it has no xxh3_64_intdigest", last)
        self.assertIn("pip install xxhash", last)


class MetadataTest(unittest.TestCase):
    @unittest.skipIf(tomllib is None, "needs tomllib (Python 3.11)")
    def test_pyproject(self) -> None:
        with open(os.path.join(CLIENT_ROOT, "pyproject.toml"), "rb") as f:
            project = tomllib.load(f)
        meta = project["project"]
        self.assertEqual((meta["name"], meta["version"]), ("kvrouter-client", kvrouter_client.__version__))
        self.assertEqual(project["build-system"]["build-backend"], "setuptools.build_meta")
        self.assertEqual(sorted(re.split(r"[<>=! ]", d)[0] for d in meta["dependencies"]), ["grpcio", "protobuf", "xxhash"])
        # Every package under kvrouter_client is listed (the generated code and aio included).
        found = sorted(
            os.path.relpath(d, CLIENT_ROOT).replace(os.sep, ".")
            for d, _, files in os.walk(os.path.join(CLIENT_ROOT, "kvrouter_client"))
            if "__init__.py" in files
        )
        self.assertEqual(sorted(project["tool"]["setuptools"]["packages"]), found)
        self.assertIn("py.typed", project["tool"]["setuptools"]["package-data"]["kvrouter_client"])


class DefaultsTest(unittest.TestCase):
    def test_publisher_defaults_are_the_go_clients(self) -> None:
        with open(os.path.join(REPO_ROOT, "clients", "go", "kvclient", "publisher.go"), encoding="utf-8") as f:
            go = f.read()

        def go_default(field: str) -> float:
            m = re.search(rf"opts\.{field} = (.+)", go)
            self.assertIsNotNone(m, f"no default for {field} in publisher.go")
            expr = m.group(1).strip().replace("time.Millisecond", "0.001")  # type: ignore[union-attr]
            self.assertRegex(expr, r"^[0-9_ .*<]+$")
            return float(eval(expr))  # noqa: S307 - digits and operators only, checked above

        params = inspect.signature(PublisherBase.__init__).parameters
        for py, field in (("max_batch_events", "MaxBatchEvents"), ("flush_interval", "FlushInterval"), ("max_unacked", "MaxUnacked"), ("max_dump_blocks", "MaxDumpBlocks")):
            with self.subTest(py):
                self.assertEqual(params[py].default, go_default(field))
        self.assertEqual((params["max_batch_events"].default, params["flush_interval"].default, params["max_unacked"].default, params["max_dump_blocks"].default),
                         (256, 0.002, 65_536, 16_384))
        # Both publishers take their options from PublisherBase.
        self.assertTrue(issubclass(kvrouter_client.Publisher, PublisherBase) and issubclass(aio.Publisher, PublisherBase))
        self.assertIs(kvrouter_client.Publisher.__init__, PublisherBase.__init__)


if __name__ == "__main__":
    unittest.main()
