"""The servers ``make bench`` measures: started, made ready, warmed up and stopped.

Every scenario starts its servers through :class:`Server` (tokenmill through
:func:`tokenmill_server`, llama.cpp's own through :func:`llama_server`), so that each
gets the same environment (no ``TOKENMILL_`` variable leaks in from the caller), the
same warm-up and the same clean stop (children that outlive it are killed and listed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from probes import process_tree, survivors

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".bench-cache"
# Every server of the bench: 16 slots of 2048 tokens (llama-server: -np 16, -c 16*2048).
SLOTS = 16
N_CTX = 2048
# min_p 0 explicitly: llama-server would otherwise add its default min_p 0.05 to the chain.
SAMPLING = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.0}


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        log_path: Path,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.name, self.port, self.log_path = name, port, log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
        env.update(extra_env or {})
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.model = ""
        # Processes of the tree whose CPU is reported apart (the replica, Ray's
        # daemons): filled once the server is up (see scenarios/ray.py).
        self.cpu_groups: dict[str, list[int]] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def is_tokenmill(self) -> bool:
        """Whether it logs tokenmill's per-request stages (every server but llama-server)."""
        return self.name.startswith(("tokenmill", "tm-"))

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    models = httpx.get(f"{self.url}/v1/models", timeout=5.0).json()
                    self.model = models["data"][0]["id"]
                    return
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout}s; see {self.log_path}")

    def warm_up(self) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 16,
            **SAMPLING,
        }
        for _ in range(2):
            r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=120.0)
            r.raise_for_status()

    def start(self) -> Server:
        """Wait until ready, warm up, say so; returns itself."""
        self.wait_ready()
        self.warm_up()
        log(f"{self.name} ready on {self.url} (model {self.model!r})")
        return self

    def stop(self, timeout: float = 20.0) -> dict[int, str]:
        """SIGTERM, then SIGKILL after ``timeout``; returns the processes of its tree
        still running after it exited (killed then), by pid and command name."""
        tree = process_tree(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        time.sleep(0.5)  # children exiting with it
        left = survivors(tree)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return left


def tokenmill_server(
    name: str,
    tmp: Path,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    files: str | None = None,
) -> Server:
    """``tokenmill serve`` on a free port, its data in ``tmp/data-FILES``, its log in
    ``tmp/FILES.log`` (``files``: the name unless given); ``args`` are more ``serve``
    arguments (``--config FILE``)."""
    files = files or name
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port)]
    cmd += ["--data-dir", str(tmp / f"data-{files}"), *args]
    return Server(name, cmd, port, tmp / f"{files}.log", env)


def llama_server_binary() -> Path:
    """Built from the pinned llama-cpp-python sdist if not cached (minutes, once)."""
    script = ROOT / "bench" / "build_llama_server.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run([str(script)], check=True, stdout=subprocess.PIPE, text=True, env=env)
    return Path(out.stdout.strip().splitlines()[-1]).resolve()


def llama_server(
    binary: Path,
    gguf: Path,
    threads: int,
    tmp: Path,
    slots: int = SLOTS,
    n_ctx: int = SLOTS * N_CTX,
    files: str = "llama-server",
    extra: Sequence[str] = (),
) -> Server:
    """llama.cpp's own server as tokenmill runs the model: same file, threads and slots."""
    from tokenmill.engines.llamacpp.threads import extra_buffers_work

    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads)]
    # -np slots sharing -c n_ctx tokens (the bench's default: 16 of 2048); log in tmp/FILES.log
    cmd += ["-np", str(slots), "-c", str(n_ctx), "--host", "127.0.0.1", "--port", str(port)]
    if not extra_buffers_work():  # as tokenmill loads the model (see threads.py)
        cmd.append("--no-repack")
    cmd += extra
    return Server("llama-server", cmd, port, tmp / f"{files}.log")
