"""Importing tokenmill loads no inference or cluster library: they load when used."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("llama_cpp", "ray", "torch")

PROBE = """
import json, sys
import tokenmill, tokenmill.cli, tokenmill.server.app, tokenmill.gateway.deployment
import tokenmill.client
from tokenmill.config import Settings
from tokenmill.gateway.core import Gateway
# A gateway with the default deployment, built but not started: still nothing heavy.
Gateway(Settings().with_default_deployment())
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_import_tokenmill_loads_no_engine_or_cluster_library() -> None:
    # A fresh interpreter: this test process has loaded them all by now.
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout
    loaded = set(json.loads(out))
    assert "tokenmill" in loaded
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


CORE_PROBE = """
import json, sys
import tokenmill.chat
print(json.dumps(sorted(sys.modules)))
"""


def test_the_generation_core_imports_no_web_framework_nor_server() -> None:
    # The core sits under the HTTP layer: every API adapter imports it, never the
    # other way round.
    out = subprocess.run(
        [sys.executable, "-c", CORE_PROBE], capture_output=True, text=True, check=True
    ).stdout
    loaded = set(json.loads(out))
    assert "tokenmill.chat.generation" in loaded
    above = {m for m in loaded if m.split(".")[0] in ("fastapi", "starlette", "uvicorn")}
    above |= {m for m in loaded if m.startswith("tokenmill.server")}
    assert not above, above


def test_the_layers_hold_as_import_linter_checks_them() -> None:
    # The contracts in .importlinter (server -> chat -> gateway -> replicas -> engines;
    # the ledger and the client import nothing above them; no circle), imports under
    # TYPE_CHECKING and inside functions included. make lint runs the same check.
    root = Path(__file__).resolve().parents[1]
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run(
        [str(lint), "--config", str(root / ".importlinter"), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout, run.stdout
