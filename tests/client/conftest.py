"""Servers for the client tests beyond the shared one."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.conftest import ServerProcess, free_port
from tests.driver import EngineDriver, scripted_deployment
from tests.waiting import HANG_S

# A prompt the model answers at length at temperature 0, so a stream can be held open.
LONG_PROMPT = "Write a long story about a dragon who lives in a mountain."


@pytest.fixture
def overload_server(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> ServerProcess:
    """One slot and no queue, on the scripted deployment ``scripted``: a stream holds
    the slot until the test ends it, and a second request is refused with 429 at once.
    """
    return start_server(config=scripted_deployment(driver, max_num_seqs=1, max_queue=0))


def in_flight(srv: ServerProcess) -> int:
    """Requests holding a slot of ``srv``'s scripted deployment."""
    r = httpx.get(f"{srv.url}/v1/deployments/scripted", timeout=HANG_S)
    assert r.status_code == 200, r.text
    return int(r.json()["in_flight"])


def dead_upstream_config() -> str:
    """A deployment whose upstream nobody listens on: every generation fails (502)."""
    return f"""
[[deployments]]
id = "dead"
engine = "upstream"
url = "http://127.0.0.1:{free_port()}/v1"
"""
