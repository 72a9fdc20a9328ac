"""Importing tokenmill loads no inference or cluster library: they load when used."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import tokenmill.replicas

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


def test_replica_hosting_imports_neither_the_gateway_nor_the_server() -> None:
    # tokenmill.replicas sits under the gateway's request path: the gateway imports
    # it, never the other way round. Read from the source, so that an import inside a
    # function or under TYPE_CHECKING counts too.
    package = Path(tokenmill.replicas.__file__).parent
    above = ("tokenmill.gateway", "tokenmill.server")
    found = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module]
            else:
                continue
            found += [f"{path.name}: {n}" for n in names if n.startswith(above)]
    assert len(list(package.glob("*.py"))) > 10  # the package, not an empty folder
    assert not found, found


LAYER_PROBE = """
import json, sys
import tokenmill.ledger.meter, tokenmill.ledger.sql, tokenmill.metering, tokenmill.identity
print(json.dumps(sorted(sys.modules)))
"""


def test_the_ledger_and_the_metering_contract_import_nothing_of_the_gateway() -> None:
    # The ledger and the contract it implements stand below the gateway: it calls
    # them, never the other way round.
    out = subprocess.run(
        [sys.executable, "-c", LAYER_PROBE], capture_output=True, text=True, check=True
    ).stdout
    loaded = set(json.loads(out))
    assert "tokenmill.ledger.meter" in loaded
    above = {m for m in loaded if m.startswith(("tokenmill.gateway", "tokenmill.server"))}
    assert not above, above
