import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.conftest import ServerProcess
from tests.waiting import HANG_S


def test_health_and_models(server: ServerProcess, http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert ids == ["smollm2"]


def test_serve_another_gguf_under_a_name(start_server: Callable[..., ServerProcess]) -> None:
    from tokenmill.engines.embedded import embedded_model_path

    srv = start_server(args=["--model", str(embedded_model_path()), "--name", "tiny"])
    assert "tokenmill serving on http://127.0.0.1:" in srv.log()
    ids = [m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=HANG_S).json()["data"]]
    assert ids == ["tiny"]
    # httpx's default 5 s is a speed assumption: a loaded machine took longer.
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        timeout=HANG_S,
    )
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_settings_from_environment(start_server: Callable[..., ServerProcess]) -> None:
    srv = start_server(env={"TOKENMILL_MAX_BODY_BYTES": "2048"})
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": "x" * 4000, "max_tokens": 1},
        timeout=HANG_S,
    )
    assert r.status_code == 413


def test_missing_model_file_stops_startup(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill", "serve", "--model", str(tmp_path / "no.gguf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "no.gguf" in out.stderr and "Traceback" not in out.stderr
