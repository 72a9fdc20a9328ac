"""``tokenmill serve``'s KV flags (``--n-ctx``, ``--max-num-seqs``, ``--kv-host-bytes``,
``--kv-disk-dir``),
through a real server started as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import ServerProcess
from tests.waiting import HANG_S, wait_until

# 4,096 tokens of SmolLM2's 23,040 B each (94,371,840 B) fit in 128 MiB.
HOST_BYTES = 128 << 20


def replica(srv: ServerProcess) -> dict[str, Any]:
    r = httpx.get(f"{srv.url}/v1/deployments/smollm2", timeout=HANG_S)
    assert r.status_code == 200, r.text
    (rep,) = r.json()["replicas"]
    return dict(rep)


def test_kv_flags_size_the_one_model(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    flags = ["--n-ctx", "4096", "--max-num-seqs", "4", "--kv-host-bytes", str(HOST_BYTES)]
    srv = start_server(args=[*flags, "--kv-disk-dir", str(tmp_path / "kv")])
    rep = wait_until(lambda: (rep := replica(srv)).get("kv") and rep, "the replica's kv stats")
    assert rep["slots"] == 4
    assert rep["kv"]["n_ctx"] == 4096
    assert rep["kv"]["host_capacity_bytes"] == HOST_BYTES
    assert rep["kv"]["disk_capacity_bytes"] > 0 and (tmp_path / "kv" / "replica-0").is_dir()
    # A request may use the whole 4,096 tokens, and not one more.
    body = {"prompt": "Hi", "max_tokens": 4096}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=HANG_S)
    assert r.status_code == 400 and "4096" in r.json()["error"]["message"], r.text


def test_a_host_tier_too_small_for_one_sequence_fails_start_up_naming_the_key(
    start_server: Callable[..., ServerProcess],
) -> None:
    srv = start_server(args=["--n-ctx", "4096", "--kv-host-bytes", "1"], wait=False)

    def failed() -> bool:
        try:
            r = httpx.get(f"{srv.url}/health", timeout=HANG_S)
        except httpx.TransportError:  # not listening yet
            return False
        return r.status_code == 503 and r.json() == {"status": "failed"}

    wait_until(failed, "GET /health to answer 503 failed")
    # The message names the key and what would do: one sequence's bytes, or 0.
    need = 4096 * 23_040
    assert "kv_host_bytes = 1 cannot hold one sequence: 4096 tokens (n_ctx)" in srv.log()
    assert f"Set at least {need}, or 0 to turn the host-memory tier off" in srv.log()


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    return subprocess.run(
        [sys.executable, "-m", "tokenmill", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_bad_kv_flags_exit_naming_the_flag(tmp_path: Path) -> None:
    out = serve("--max-num-seqs", "0", "--data-dir", str(tmp_path / "data"))
    assert out.returncode == 2
    assert "--max-num-seqs: Input should be greater than or equal to 1" in out.stderr
    # With a config file, they belong in its [[deployments]] tables.
    config = tmp_path / "tokenmill.toml"
    config.write_text('[[deployments]]\nid = "a"\n')
    out = serve("--config", str(config), "--n-ctx", "4096", "--data-dir", str(tmp_path / "data"))
    assert out.returncode == 2
    assert "--kv-host-bytes and --kv-disk-dir size the one model" in out.stderr
    assert "Traceback" not in out.stderr
