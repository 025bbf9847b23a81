"""Starts real `kvrouter serve` processes (embedded mode, or on a private `redis-server`) on free
loopback ports for the tests."""

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

    def health(self, service: str) -> int:
        """Returns the grpc.health.v1 status of a service (1 SERVING, 2 NOT_SERVING).

        The request and answer are encoded by hand (one field each), so that no grpc_health package
        is needed.
        """
        check = self.channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
        name = service.encode()
        answer = check(b"\x0a" + bytes([len(name)]) + name, timeout=2)
        return answer[1] if len(answer) == 2 and answer[0] == 0x08 else 0

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


class Redis:
    """Redis is a private `redis-server` on a free loopback port, without persistence, for a test.

    pause() stops the process (SIGSTOP): connections stay open and nothing answers, as a Redis that
    hangs or a network that drops everything; resume() lets it go on.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        try:
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise RuntimeError("redis-server not found (apt-get install redis-server, or run clients/python/test.sh)") from None
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not listen") from None
                time.sleep(0.01)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Kills the process (SIGKILL ends a stopped process too)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)
