"""Servers for the client tests beyond the shared one."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.conftest import ServerProcess, free_port

# One slot and no queue: a second concurrent request is refused with 429 at once.
OVERLOAD_CONFIG = """
[[deployments]]
id = "smollm2"
max_num_seqs = 1
max_queue = 0
"""

# A prompt the model answers at length at temperature 0, so a stream can be held open.
LONG_PROMPT = "Write a long story about a dragon who lives in a mountain."


@pytest.fixture
def overload_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(config=OVERLOAD_CONFIG)


def dead_upstream_config() -> str:
    """A deployment whose upstream nobody listens on: every generation fails (502)."""
    return f"""
[[deployments]]
id = "dead"
engine = "upstream"
url = "http://127.0.0.1:{free_port()}/v1"
"""
