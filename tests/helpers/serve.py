"""Start ``poss serve`` in a child process on a free 127.0.0.1 port, wait for /health, stop it with SIGINT."""

import contextlib
import signal
import socket
import subprocess
import sys
import time

import httpx

from helpers.child_env import child_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log_path):
        self.proc, self.port, self.log_path = proc, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        r = httpx.get(self.url + "/health", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Wait until no request is open (nothing waits, nothing decodes)."""
        end = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["open_requests"], h["active"], h["queue_depth"]) == (0, 0, 0) or time.monotonic() > end:
                return h
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@contextlib.contextmanager
def running_server(args, log_path, startup_timeout: float = 180.0, threads: int = 1):
    """``poss serve ARGS --port P`` as a child; yields a :class:`Server` once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "poss.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads)] + [str(a) for a in args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=child_env(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false"))
    server = Server(proc, port, log_path)
    try:
        end = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"poss serve exited with {proc.returncode}:\n{server.log()}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"poss serve did not answer /health in {startup_timeout} s:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        server.stop()
