"""The disk tier across a replica's death: what a replica parked is written under
``kv_disk_dir``, and the process that replaces it (SIGKILLed, restarted by the
gateway) finds it: the conversation's next turn reports its history cached, served
from the file. A file changed on disk is refused at the restore, never restored.

One process replica of one slot, the real model: two conversations take turns, so
each one's slot is given to the other and what it held is parked (host memory, and
its file)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, launch
from tests.gateway.test_deployments import process_gone
from tests.waiting import HANG_S, wait_until

SUFFIX = ".tmkv"


def config(disk: Path) -> str:
    return f"""
[[deployments]]
id = "smollm2"
max_num_seqs = 1
n_ctx = 1024
n_threads = 1
kv_host_bytes = {256 << 20}
kv_disk_dir = "{disk}"
"""


def opening(topic: str) -> str:
    return (
        f"Here are some notes about {topic}, written for a museum guide. "
        f"The history of {topic} is long and full of surprising people. "
        * 4
        + f"The most surprising fact about {topic} is that"
    )


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[tuple[ServerProcess, Path]]:
    disk = tmp_path / "kv"
    srv = launch(tmp_path / "gw", config=config(disk))
    yield srv, disk / "replica-0"
    srv.stop()


def complete(c: httpx.Client, prompt: str) -> dict[str, Any]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json(), request_id=r.headers["x-request-id"])


def kv(c: httpx.Client) -> dict[str, Any]:
    r = c.get("/v1/deployments/smollm2")
    assert r.status_code == 200, r.text
    return dict(r.json()["replicas"][0])


def two_conversations(c: httpx.Client) -> tuple[str, int]:
    """The first turns of two conversations on one slot: the first one's is parked,
    and written. Returns its next prompt and its first prompt's tokens."""
    first = opening("lighthouses")
    answer = complete(c, first)
    complete(c, opening("glaciers"))  # takes the slot: the lighthouses are parked
    wait_until(lambda: kv(c)["kv"].get("disk_entries", 0) >= 1, "the parked sequence to be written")
    following = first + answer["choices"][0]["text"] + " Another fact is that"
    return following, int(answer["usage"]["prompt_tokens"])


def kill_and_wait(c: httpx.Client) -> None:
    before = kv(c)
    os.kill(before["pid"], signal.SIGKILL)
    wait_until(lambda: process_gone(before["pid"]), "the replica to die")
    wait_until(
        lambda: (r := kv(c))["state"] == "ready" and r["pid"] != before["pid"],
        "the replica to be back",
    )


def test_a_killed_replicas_successor_restores_from_disk(
    server: tuple[ServerProcess, Path],
) -> None:
    srv, disk = server
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        following, first_prompt = two_conversations(c)
        assert list(disk.glob("*" + SUFFIX))
        kill_and_wait(c)
        # The new process read the directory and announced what it holds.
        after = kv(c)["kv"]
        assert after["disk_entries"] >= 1 and after["disk_hits"] == 0
        assert after["host_entries"] == 0  # host memory died with the process
        got = complete(c, following)
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first_prompt, got["usage"]
        # Routing knew where: the new process announced the file (its route log).
        line = wait_until(partial(srv.request_line, got["request_id"]), "the log line")
        assert (line["route"]["tier"], line["route"]["continues"]) == ("disk", True), line
        # (The view is the replica's last health report: wait for the next one.)
        stats = wait_until(
            lambda: k if (k := kv(c)["kv"])["disk_hits"] else None, "the hit to be reported"
        )
        assert stats["disk_hits"] == 1 and stats["disk_restored_tokens"] >= first_prompt
        assert 0 < stats["disk_bytes"] <= stats["disk_capacity_bytes"]


def test_a_changed_file_is_refused_not_restored(server: tuple[ServerProcess, Path]) -> None:
    srv, disk = server
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        following, first_prompt = two_conversations(c)
        kill_and_wait(c)
        # Every file gets one bit flipped in its state (the process that wrote them is
        # gone; the new one has checked only their headers).
        files = list(disk.glob("*" + SUFFIX))
        assert files
        for path in files:
            raw = bytearray(path.read_bytes())
            raw[-100] ^= 1
            path.write_bytes(raw)
        got = complete(c, following)  # computed, not restored: still answered
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] < first_prompt
        stats = wait_until(
            lambda: k if (k := kv(c)["kv"])["disk_dropped"] else None, "the drop to be reported"
        )
        assert stats["disk_hits"] == 0
    assert "does not match (corrupt)" in srv.log()


# The config of a deployment that names no disk tier: it gets one under the data dir.
UNNAMED = '[[deployments]]\nid = "smollm2"\nmax_num_seqs = 1\nn_ctx = 1024\nn_threads = 1\n'


def test_a_restarted_server_starts_from_its_cached_prefixes_by_default(tmp_path: Path) -> None:
    # Stopped and started again on its data dir (a new version, a crash), a server
    # finds the prefixes its replica had computed: the next session's prompt is read
    # from the file, not computed.
    files = tmp_path / "gw" / "data" / "kv" / "smollm2" / "replica-0"
    first = opening("lighthouses")
    srv = launch(tmp_path / "gw", config=UNNAMED)
    try:
        with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
            answer = complete(c, first)
            # What the slot holds is written once its request ended (and at shutdown).
            stats = wait_until(
                lambda: k if (k := kv(c)["kv"]).get("disk_entries") else None, "a file written"
            )
            assert 0 < stats["disk_capacity_bytes"] <= 4 << 30  # a modest default bound
    finally:
        srv.stop()
    assert list(files.glob("*" + SUFFIX))
    following = first + answer["choices"][0]["text"] + " Another fact is that"
    srv = launch(tmp_path / "gw", config=UNNAMED)
    try:
        with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
            got = complete(c, following)
            cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= int(answer["usage"]["prompt_tokens"]), got["usage"]
            line = wait_until(partial(srv.request_line, got["request_id"]), "the log line")
            assert line["route"]["tier"] == "disk", line
    finally:
        srv.stop()


def test_an_empty_kv_disk_dir_turns_the_disk_tier_off(tmp_path: Path) -> None:
    srv = launch(tmp_path / "gw", config=UNNAMED + 'kv_disk_dir = ""\n')
    try:
        with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
            complete(c, opening("glaciers"))
            stats = wait_until(lambda: kv(c)["kv"], "the replica's kv stats")
            assert "disk_capacity_bytes" not in stats and stats["host_capacity_bytes"] > 0
    finally:
        srv.stop()
    assert not (tmp_path / "gw" / "data" / "kv").exists()
