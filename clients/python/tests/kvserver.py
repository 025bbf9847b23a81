"""Starts real `kvrouter serve` processes (embedded mode) on free loopback ports for the tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from typing import List, Optional

import grpc

from kvrouter_client import pb

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT_ROOT = os.path.dirname(HERE)
REPO_ROOT = os.path.dirname(os.path.dirname(CLIENT_ROOT))
_LOCAL = os.path.join(CLIENT_ROOT, ".tmp", "kvrouter")  # built by test.sh
BINARY = os.environ.get("KVROUTER_BIN") or (_LOCAL if os.path.exists(_LOCAL) else os.path.join(REPO_ROOT, ".tmp", "bin", "kvrouter"))


def free_port() -> int:
    """Returns a loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """Server is one `kvrouter serve` process; its JSON log goes to a temporary file."""

    def __init__(self, *flags: str, port: Optional[int] = None) -> None:
        if not os.access(BINARY, os.X_OK):
            raise RuntimeError(f"kvrouter binary not found at {BINARY} (set KVROUTER_BIN, or run clients/python/test.sh)")
        self.port = port or free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="kvrouter-", suffix=".log", delete=False)
        args: List[str] = [BINARY, "serve", "--listen", self.addr, "--metrics-listen", "", *flags]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        # Wait for the port first: a gRPC channel that failed to connect backs off for a second or more.
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvrouter exited with {self.proc.returncode}: {self.log_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvrouter did not listen: {self.log_text()}")
                time.sleep(0.01)
        self.channel = grpc.insecure_channel(self.addr)
        self.admin = pb.admin_grpc.AdminServiceStub(self.channel)
        self.router = pb.router_grpc.RouterServiceStub(self.channel)
        self.worker = pb.worker_grpc.WorkerServiceStub(self.channel)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvrouter exited with {self.proc.returncode}: {self.log_text()}")
            try:
                self.admin.GetState(pb.admin.GetStateRequest(), timeout=1)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvrouter did not start: {self.log_text()}")
                time.sleep(0.05)

    def log_text(self) -> str:
        """Returns what the server logged so far."""
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def workers(self, model: str = "") -> List["pb.admin.WorkerStatus"]:
        """Returns AdminService/ListWorkers' workers."""
        return list(self.admin.ListWorkers(pb.admin.ListWorkersRequest(model=model), timeout=5).workers)

    def worker_status(self, worker_id: int, model: str = "") -> Optional["pb.admin.WorkerStatus"]:
        """Returns one worker's status (rank 0), or None when it is not registered."""
        for w in self.workers(model):
            if w.worker.worker_id == worker_id and w.worker.dp_rank == 0:
                return w
        return None

    def stop(self) -> None:
        """Kills the process (it is private to the test: no drain needed) and removes its log."""
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)
        self.log.close()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)


def wait_until(cond, timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Polls cond() until it is true or the timeout passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v or time.monotonic() > deadline:
            return bool(v)
        time.sleep(interval)
