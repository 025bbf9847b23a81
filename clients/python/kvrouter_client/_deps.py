"""The check that kvrouter_client's dependencies import, run before anything imports them.

Without it a missing protobuf surfaces as ``No module named 'google'`` from deep inside the
generated code; with it ``import kvrouter_client`` says what to install, under pip's and Debian's
names.
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Tuple

# (the module imported, its pip package, its Debian package, an attribute the client needs of it)
DEPENDENCIES: Tuple[Tuple[str, str, str, str], ...] = (
    ("grpc.aio", "grpcio", "python3-grpcio", "insecure_channel"),
    ("google.protobuf", "protobuf", "python3-protobuf", "__version__"),
    # xxh3_64_intdigest came with xxhash 2.0; the package has no version bound (Debian's says 0.0.0).
    ("xxhash", "xxhash", "python3-xxhash", "xxh3_64_intdigest"),
)


def missing() -> List[Tuple[str, str, str, str]]:
    """Returns (module, pip package, Debian package, why) for every dependency that does not import,
    or lacks what the client needs of it."""
    out = []
    for module, pip_name, debian_name, needed in DEPENDENCIES:
        try:
            m = importlib.import_module(module)
        except ImportError as e:
            out.append((module, pip_name, debian_name, str(e)))
            continue
        if not hasattr(m, needed):
            out.append((module, pip_name, debian_name, f"too old: it has no {needed}"))
    return out


def require() -> None:
    """Raises ImportError naming what to install when a dependency does not import."""
    gone = missing()
    if not gone:
        return
    pip_names = " ".join(m[1] for m in gone)
    debian_names = " ".join(m[2] for m in gone)
    why = "; ".join(f"{m[0]}: {m[3]}" for m in gone)
    raise ImportError(
        f"kvrouter_client needs {', '.join(m[1] for m in gone)}, which {sys.executable} cannot import ({why}). "
        f"Install with pip: pip install {pip_names} (pip install kvrouter-client brings them all); "
        f"or on Debian/Ubuntu: apt-get install -y {debian_names}, which install for /usr/bin/python3 "
        "(a virtualenv sees them when made with --system-site-packages)."
    )
