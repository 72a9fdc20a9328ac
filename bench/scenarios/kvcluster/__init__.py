"""KV memory across the cluster (issue 35): a replica killed and back, and
continuations that must move to another replica.

**Restart.** One tokenmill process replica of 4 slots (``n_ctx`` 2048) with a disk
tier (``kv_disk_dir``), the same without one, and llama.cpp's own ``llama-server``
(``-np 4 -c 8192``, its defaults: ``--cache-ram`` on), one after another. Each gets
``--kvcluster-conversations`` conversations' first turns (4 at a time), each opening
with its own ~300-token document; then it is SIGKILLed: tokenmill's replica process
(the gateway restarts it), llama-server's process (started again the same way). Once
it is back, every conversation's second turn goes (4 at a time). Reported per server:
the second turns that found their whole first turn cached, and their TTFT p50. Before
the kill, tokenmill's disk tier is given up to 30 s until its files hold every
conversation (``disk_entries`` in ``GET /v1/deployments/{id}``): a replica killed in
the middle of a write loses that write, and the case measures the restore, not a race.

**Moves.** Two tokenmill process replicas of one slot each (``cache_aware``), one
gateway with ``kv_moves`` on and one with it off, in turn. For each of
``--kvcluster-moves`` conversations: its first turn; then a long answer to a
question about the same document starts, which routing sends to the conversation's
replica (its document is cached there) and which parks the conversation there; while
that runs, the conversation's second turn is measured: its home is busy, so it goes to
the other replica, with its history moved there or computed again. Then the long
answer is dropped. Reported: the second turns' TTFT p50 with moves and without and
their ratio, their whole-cached share, and the deployment's ``kv_moves``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from servers import Server, llama_server, llama_server_binary, log, tokenmill_server

from ..kvtier.workload import QUESTIONS, document, opening
from ..routing.workload import fresh_connections, ms, stream_turn
from .report import report

if TYPE_CHECKING:
    from scenario import Bench

DEPLOYMENT = "kvcluster"
SLOTS = 4
N_CTX = 2048
LLAMA_CTX = 8192
OPEN = 4  # conversations at once, each phase
LONG_TOKENS = 400  # the long answer that keeps a conversation's home busy


def restart_config(disk: Path | None) -> str:
    text = (
        f'[[deployments]]\nid = "{DEPLOYMENT}"\nmax_num_seqs = {SLOTS}\nn_ctx = {N_CTX}\n'
        "max_queue = 256\nqueue_timeout_s = 600\n"
    )
    return text + ("" if disk is None else f'kv_disk_dir = "{disk}"\n')


def moves_config(on: bool) -> str:
    return (
        f'[[deployments]]\nid = "{DEPLOYMENT}"\nreplicas = 2\nmax_num_seqs = 1\n'
        f"n_ctx = {N_CTX}\nmax_queue = 256\nqueue_timeout_s = 600\n"
        f"kv_moves = {'true' if on else 'false'}\n"
    )


def deployment(server: Server) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/v1/deployments/{DEPLOYMENT}", timeout=30.0)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


@dataclass
class Conversation:
    seed: str
    messages: list[dict[str, str]] = field(default_factory=list)
    first_prompt: int = 0
    second: tuple[float, int] | None = None  # TTFT, cached tokens

    def start(self) -> list[dict[str, str]]:
        self.messages = [{"role": "user", "content": opening(document(f"doc-{self.seed}"))}]
        return self.messages

    def next_turn(self, answer: str) -> list[dict[str, str]]:
        self.messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": QUESTIONS[0]},
        ]
        return self.messages

    def summary(self) -> dict[str, Any]:
        return {"first_prompt": self.first_prompt, "second": self.second}


async def turns(server: Server, convs: list[Conversation], n: int, max_tokens: int) -> None:
    """Turn ``n`` (1 or 2) of every conversation, ``OPEN`` at a time."""
    gate = asyncio.Semaphore(OPEN)
    async with httpx.AsyncClient(
        base_url=server.url, timeout=600.0, limits=fresh_connections()
    ) as client:

        async def one(i: int, c: Conversation) -> None:
            async with gate:
                messages = c.start() if n == 1 else c.messages
                text, ttft, usage = await stream_turn(client, server.model, messages, max_tokens, i)
                if n == 1:
                    c.first_prompt = int(usage["prompt_tokens"])
                    c.next_turn(text)
                else:
                    details = usage.get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens")
                    if cached is None:
                        cached = (usage.get("timings") or {}).get("cache_n", 0)
                    c.second = (ttft, int(cached or 0))

        await asyncio.gather(*(one(i, c) for i, c in enumerate(convs)))


def second_turns(convs: list[Conversation]) -> dict[str, Any]:
    done = [c for c in convs if c.second is not None]
    whole = sum(1 for c in done if c.second is not None and c.second[1] >= c.first_prompt)
    ttfts = [c.second[0] for c in done if c.second is not None]
    return {
        "conversations": len(convs),
        "second_turns": len(done),
        "whole_cached": whole,
        "whole_cached_share": round(whole / len(done), 4) if done else None,
        "second_ttft_p50_ms": ms(statistics.median(ttfts)) if ttfts else None,
        "first_prompt_p50": statistics.median(c.first_prompt for c in convs) if convs else None,
    }


def kill_tokenmill_replica(server: Server, files: int | None) -> dict[str, Any]:
    """SIGKILL the replica process once its disk tier holds ``files`` (if given);
    return once the gateway has it back."""
    if files is not None:
        try:
            wait_for(
                lambda: (
                    deployment(server)["replicas"][0].get("kv", {}).get("disk_entries", 0) >= files
                ),
                30.0,
                "the disk tier to hold every conversation",
            )
        except RuntimeError as e:
            log(f"kvcluster: {e}; killing anyway")
    before = deployment(server)["replicas"][0]
    os.kill(int(before["pid"]), signal.SIGKILL)
    killed = time.monotonic()
    after = wait_for(
        lambda: (
            (r := deployment(server)["replicas"][0])["state"] == "ready"
            and r["pid"] != before["pid"]
            and r
        ),
        180.0,
        "the replica to be back",
    )
    return {
        "kv_before": before.get("kv"),
        "back_s": round(time.monotonic() - killed, 2),
        "kv_after": after.get("kv"),
    }


def restart(bench: Bench, binary: Path, out: dict[str, Any]) -> None:
    args = bench.args
    tmp = bench.tmp / "kvcluster"
    tmp.mkdir(parents=True, exist_ok=True)
    n = args.kvcluster_conversations
    max_tokens = args.kvcluster_max_tokens
    for name in ("tokenmill-disk", "tokenmill", "llama-server"):
        # The same documents for every server: seeds without the server's name.
        convs = [Conversation(f"{args.kvcluster_seed}-{i}") for i in range(n)]
        result: dict[str, Any] = {}
        if name.startswith("tokenmill"):
            disk = tmp / "kv" if name == "tokenmill-disk" else None
            cfg = tmp / f"{name}.toml"
            cfg.write_text(restart_config(disk))
            server = tokenmill_server(name, tmp, ("--config", str(cfg)), files=f"kvc-{name}")
            try:
                server.start()
                asyncio.run(turns(server, convs, 1, max_tokens))
                result["kill"] = kill_tokenmill_replica(server, n if disk else None)
                asyncio.run(turns(server, convs, 2, max_tokens))
                result["kv_end"] = deployment(server)["replicas"][0].get("kv")
            finally:
                server.stop()
        else:
            server = llama_server(binary, bench.gguf, args.threads, tmp, SLOTS, LLAMA_CTX, "kvc-ls")
            again: Server | None = None
            try:
                server.start()
                asyncio.run(turns(server, convs, 1, max_tokens))
                server.proc.send_signal(signal.SIGKILL)
                server.proc.wait()
                killed = time.monotonic()
                log_path = server.log_path.with_name("kvc-ls-restarted.log")
                again = Server(server.name, list(server.proc.args), server.port, log_path)
                again.start()
                result["kill"] = {"back_s": round(time.monotonic() - killed, 2)}
                asyncio.run(turns(again, convs, 2, max_tokens))
            finally:
                (again or server).stop()
        result.update(second_turns(convs))
        out[name] = result
        log(
            f"kvcluster restart: {name}: {result['whole_cached']}/{result['second_turns']} "
            f"second turns whole-cached, TTFT p50 {result['second_ttft_p50_ms']} ms"
        )


async def forced_moves(server: Server, seeds: list[str], max_tokens: int) -> list[Conversation]:
    """Each conversation's second turn while its home runs a long answer about the
    same document (see the module docstring)."""
    done: list[Conversation] = []
    async with httpx.AsyncClient(
        base_url=server.url, timeout=600.0, limits=fresh_connections()
    ) as client:
        for i, seed in enumerate(seeds):
            c = Conversation(seed)
            text, _, usage = await stream_turn(client, server.model, c.start(), max_tokens, i)
            c.first_prompt = int(usage["prompt_tokens"])
            doc = c.messages[0]["content"]
            busy = {
                "model": server.model,
                "messages": [{"role": "user", "content": doc + "\n\nNow retell it at length."}],
                "max_tokens": LONG_TOKENS,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0,
            }
            async with client.stream("POST", "/v1/chat/completions", json=busy) as running:
                lines = running.aiter_lines()
                async for line in lines:  # its first token: it holds the home's slot
                    if line.startswith("data: ") and '"content"' in line:
                        break
                _, ttft, usage = await stream_turn(
                    client, server.model, c.next_turn(text), max_tokens, 1000 + i
                )
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                c.second = (ttft, cached)
            done.append(c)
    return done


def moves(bench: Bench, out: dict[str, Any]) -> None:
    args = bench.args
    tmp = bench.tmp / "kvcluster"
    tmp.mkdir(parents=True, exist_ok=True)
    seeds = [f"{args.kvcluster_seed}-move-{i}" for i in range(args.kvcluster_moves)]
    for on in (True, False):
        name = "moves-on" if on else "moves-off"
        cfg = tmp / f"{name}.toml"
        cfg.write_text(moves_config(on))
        server = tokenmill_server(f"tokenmill-{name}", tmp, ("--config", str(cfg)), files=name)
        try:
            server.start()
            convs = asyncio.run(forced_moves(server, seeds, args.kvcluster_max_tokens))
            result = second_turns(convs)
            result["kv_moves"] = deployment(server).get("kv_moves")
        finally:
            server.stop()
        out[name] = result
        log(
            f"kvcluster moves: {name}: TTFT p50 {result['second_ttft_p50_ms']} ms, "
            f"{result['whole_cached']}/{result['second_turns']} whole-cached"
        )


class KvCluster:
    name = "kvcluster"
    about = (
        "a replica SIGKILLed and back with its disk tier against llama-server restarted, "
        "and continuations moved between two replicas against computed again (issue 35)"
    )
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("--kvcluster-conversations", type=int, default=12, help="conversations killed")
        add("--kvcluster-moves", type=int, default=8, help="conversations that must move")
        add("--kvcluster-max-tokens", type=int, default=32, help="tokens of every answer")
        add("--kvcluster-seed", type=int, default=35, help="seed of the documents")
        add("--no-kvcluster-restart", action="store_true", help="skip the restart case")
        add("--no-kvcluster-moves", action="store_true", help="skip the moves case")

    def run(self, bench: Bench) -> None:
        args = bench.args
        section: dict[str, Any] = {
            "settings": {
                "slots": SLOTS,
                "n_ctx": N_CTX,
                "llama_ctx": LLAMA_CTX,
                "threads": args.threads,
                "conversations": args.kvcluster_conversations,
                "moves": args.kvcluster_moves,
                "max_tokens": args.kvcluster_max_tokens,
                "load_average_before": [round(x, 2) for x in os.getloadavg()],
            },
            "restart": {},
            "moves": {},
        }
        bench.results[self.name] = section
        try:
            if not args.no_kvcluster_restart:
                log("llama-server: building if not cached (several minutes the first time)")
                restart(bench, llama_server_binary(), section["restart"])
            if not args.no_kvcluster_moves:
                moves(bench, section["moves"])
        except KeyboardInterrupt:
            bench.results["interrupted"] = True
        section["settings"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]

    def table(self, results: dict[str, Any]) -> str | None:
        section = results.get(self.name)
        return None if section is None else report(section)


SCENARIO = KvCluster()
