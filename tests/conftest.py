"""Shared fixtures: real tokenmill servers started as subprocesses, spoken to over HTTP.

``server`` is one gateway with the embedded SmolLM2 model, shared by the session.
``start_server`` starts others with a config file and environment of the test's own.
``ray_cluster`` is a Ray cluster on this machine for replicas placed on Ray.
``postgres`` is a PostgreSQL database for the session (tests/postgres.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.driver import EngineDriver
from tests.postgres import URL_ENV, throwaway_cluster
from tests.waiting import HANG_S, wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """A ``tokenmill serve`` subprocess; its log is kept in ``log_path``."""

    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    data_dir: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request_line(self, request_id: str) -> dict[str, Any] | None:
        """The request's record (``tokenmill.requests``) once it is logged, else None."""
        for line in self.log().splitlines():
            if request_id in line and "tokenmill.requests: " in line:
                record: dict[str, Any] = json.loads(line.split("tokenmill.requests: ", 1)[1])
                return record
        return None

    def wait_ready(self, timeout: float = HANG_S) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                return httpx.get(f"{self.url}/health", timeout=HANG_S).status_code == 200
            except httpx.TransportError:  # not listening yet
                return False

        try:
            wait_until(ready, "the server to answer GET /health with 200", timeout=timeout)
        except AssertionError as e:
            raise RuntimeError(f"{e}\n{self.log()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def launch(
    tmp: Path,
    *,
    config: str | None = None,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    wait: bool = True,
) -> ServerProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    seed_weights(tmp / "data")
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port)]
    cmd += ["--data-dir", str(tmp / "data")]
    if config is not None:
        cfg = tmp / "tokenmill.toml"
        cfg.write_text(config)
        cmd += ["--config", str(cfg)]
    cmd += args or []
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    full_env.update(env or {})
    log_path = tmp / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = ServerProcess(port, proc, log_path, tmp / "data", env or {})
    if wait:
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
    return server


# The embedded model converted as a server serves it by default (weights = "q8_0"),
# once a session, and hard-linked into every server's data dir: each would otherwise
# convert it at start (seconds) and leave 145 MB in its test's temp dir. The cache
# only ever replaces a file by renaming, never writes into one, so the links stay
# whole; a test that spoils a cached file makes its own (tests/engines/test_weights.py).
_weights_cache: list[Path] = []
_CONVERT = """
import sys
from pathlib import Path
from tokenmill.engines.embedded import embedded_model_path
from tokenmill.engines.llamacpp.weights import EMBEDDED_DEFAULT, cached_conversion
cached_conversion(embedded_model_path(), EMBEDDED_DEFAULT, Path(sys.argv[1]))
"""


@pytest.fixture(scope="session", autouse=True)
def _weights_seed(tmp_path_factory: pytest.TempPathFactory) -> None:
    _weights_cache.append(tmp_path_factory.mktemp("weights"))


def seed_weights(data_dir: Path) -> None:
    """Put the session's converted embedded model in ``data_dir``'s weights cache."""
    if not _weights_cache:
        return
    cache = _weights_cache[-1]
    if not any(cache.glob("*.gguf")):
        # In a process of its own: a test that only speaks HTTP never loads llama.cpp.
        subprocess.run([sys.executable, "-c", _CONVERT, str(cache)], check=True)
    target = data_dir / "weights"
    target.mkdir(parents=True, exist_ok=True)
    for made in cache.iterdir():
        if made.suffix in (".gguf", ".json") and not (target / made.name).exists():
            os.link(made, target / made.name)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default gateway: the embedded model, no config, auth off."""
    srv = launch(tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def stable_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The embedded model with a KV stream a slot (``--kv-layout per_slot``), for the
    tests that compare two greedy answers token for token (streamed against whole,
    batched against alone): what that layout promises. In the shared pool (the
    default) a repeat read after cached cells, or a prompt read in pieces of another
    size, differs in the last digits and may part at a near tie, as in llama-server
    (docs/exactness.md); tests/engines/test_kv_oracle.py bounds that noise."""
    srv = launch(tmp_path_factory.mktemp("stable"), args=["--kv-layout", "per_slot"])
    yield srv
    srv.stop()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start extra servers for one test; all are stopped after it."""
    started: list[ServerProcess] = []

    def start(**kwargs: object) -> ServerProcess:
        srv = launch(tmp_path / f"srv{len(started)}", **kwargs)  # type: ignore[arg-type]
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


@pytest.fixture
def driver(start_server: Callable[..., ServerProcess]) -> Iterator[EngineDriver]:
    """The driver of scripted engines, for ``scripted_deployment`` configs.

    It needs ``start_server`` so that it is closed first: its engines then fail what
    they still hold, and the servers stop without waiting for those streams to drain.
    """
    drv = EngineDriver()
    yield drv
    drv.close()


@dataclass
class RayCluster:
    """A Ray cluster owned by the test session: a head node, and nodes tests add."""

    cluster: Any

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add_node(self, **resources: float) -> str:
        """Start a node offering ``resources`` (and 1 CPU); its node id."""
        node = self.cluster.add_node(num_cpus=1, resources=resources, **RAY_NODE_ARGS)
        return str(node.node_id)

    def remove_node(self, node_id: str) -> None:
        """Kill a node's processes at once, as a machine dying would."""
        for node in self.cluster.list_all_nodes():
            if node.node_id == node_id:
                self.cluster.remove_node(node, allow_graceful=False)
                return
        raise KeyError(node_id)

    def node_ids(self) -> list[str]:
        return [str(node.node_id) for node in self.cluster.list_all_nodes()]


# Light nodes (no dashboard, monitors or big object store) that notice a dead node
# within about a second (tokenmill.replicas.rayactor.LOCAL_SYSTEM_CONFIG).
RAY_NODE_ARGS: dict[str, Any] = {
    "include_dashboard": False,
    "object_store_memory": 80 << 20,
}


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A real Ray cluster on this machine; servers reach it by ``ray_address``."""
    # Inherited by the gateways the tests start: no usage reports, no token files.
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from ray.cluster_utils import Cluster

    from tokenmill.replicas.rayactor import LOCAL_SYSTEM_CONFIG

    head = {
        **RAY_NODE_ARGS,
        "num_cpus": 2,
        "no_monitor": True,
        "include_log_monitor": False,
        "_system_config": LOCAL_SYSTEM_CONFIG,
    }
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=head)
    try:
        yield RayCluster(cluster)
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]


@pytest.fixture(scope="session")
def postgres() -> Iterator[str]:
    """A PostgreSQL database URL: ``TOKENMILL_TEST_POSTGRES_URL``'s, else that of a
    throwaway cluster started for the session (only when a test asks for it)."""
    given = os.environ.get(URL_ENV)
    if given:
        yield given
        return
    with throwaway_cluster(free_port()) as url:
        yield url
