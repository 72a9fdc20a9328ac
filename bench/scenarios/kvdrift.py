"""Whether load changes what the model says: answers alone, then after 192 streams.

Issue 46's experiment, on three servers of one model file (the shipped GGUF, served
as it is by all three): llama-server with ``-np 16 -c 32768 --kv-unified``, tokenmill
at its defaults (``kv_layout = "shared"``: 16 slots in one pool at the model's
context) and tokenmill with ``kv_layout = "per_slot"``. On each in turn:

1. every probe prompt alone, for its first token (``temperature`` 0, ``max_tokens``
   1, ``logprobs`` with ``top_logprobs`` 4);
2. ``ROUNDS`` rounds of ``PER_ROUND`` streamed requests, ``AT_ONCE`` at a time, of
   the load prompts (``temperature`` 0.7, ``seed`` i, ``max_tokens`` 128), counting
   the streams that end before any content;
3. every probe alone again.

Reported per server: the probes whose top token changed where it led by more than 1
nat alone, the largest move of the first answer's top token's log probability, and
the streams that ended at once where the model alone gives an end of turn less than
e^-4 (from tokenmill per-slot's own answer with that token forced: log probabilities
are the model's, before any bias). The targets (issue 46): none changed and none ended
at once on tokenmill; its drift beside llama-server's is the placement noise bound
(docs/exactness.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import httpx
from scenario import Bench
from servers import SLOTS, Server, llama_server, llama_server_binary, log, tokenmill_server

PROBES = (
    "Explain what a hash table is in two sentences.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the capital of France?",
    "Write a haiku about rivers.",
    "List three uses of copper.",
    "How do vaccines work?",
    "What is 12 times 12?",
    "Name the largest planet in the solar system.",
    "What does a compiler do?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is photosynthesis?",
    "Who wrote Pride and Prejudice?",
    "Describe a cat in one sentence.",
)
LOAD = PROBES[:8]
ROUNDS = 4
PER_ROUND = 48
AT_ONCE = 16
CLEAR = 1.0  # nats a top token must lead by for its change to count
EOS_FLOOR = -4.0


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def first_token(
    client: httpx.AsyncClient, model: str, text: str, force: int | None = None
) -> dict[str, Any]:
    """The first token of ``text``'s answer alone: its text, log probability and the
    top 4 (``force``: a token id given +100 logit bias)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": _messages(text),
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 4,
    }
    if force is not None:
        body["logit_bias"] = {str(force): 100}
    r = await client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    content = r.json()["choices"][0]["logprobs"]["content"]
    if not content:  # an end of turn at once: no content token listed
        return {"token": "", "logprob": 0.0, "top": []}
    first = content[0]
    return {
        "token": first["token"],
        "logprob": first["logprob"],
        "top": [(t["token"], t["logprob"]) for t in first["top_logprobs"]],
    }


async def stream(client: httpx.AsyncClient, model: str, text: str, seed: int) -> bool:
    """One streamed request of the load; True if it ended before any content."""
    body = {
        "model": model,
        "messages": _messages(text),
        "max_tokens": 128,
        "temperature": 0.7,
        "seed": seed,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    return False
    return True


async def load(client: httpx.AsyncClient, model: str) -> list[tuple[str, bool]]:
    """``ROUNDS`` x ``PER_ROUND`` streams, ``AT_ONCE`` at a time: (prompt, ended at once)."""
    gate = asyncio.Semaphore(AT_ONCE)
    out: list[tuple[str, bool]] = []

    async def one(i: int) -> None:
        text = LOAD[i % len(LOAD)]
        async with gate:
            out.append((text, await stream(client, model, text, i)))

    for r in range(ROUNDS):
        await asyncio.gather(*(one(r * PER_ROUND + i) for i in range(PER_ROUND)))
    return out


async def measure(server: Server) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=AT_ONCE + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=600.0, limits=limits) as client:
        before = [await first_token(client, server.model, p) for p in PROBES]
        ends = await load(client, server.model)
        after = [await first_token(client, server.model, p) for p in PROBES]
    return {"before": before, "after": after, "ended_at_once": [t for t, e in ends if e]}


async def eos_alone(server: Server) -> dict[str, float]:
    """Each load prompt's end of turn at once, alone (its log probability)."""
    async with httpx.AsyncClient(base_url=server.url, timeout=600.0) as client:
        body = {"model": server.model, "prompt": "<|im_end|>", "add_special_tokens": False}
        r = await client.post("/tokenize", json=body)
        r.raise_for_status()
        (eos,) = r.json()["tokens"]
        return {p: (await first_token(client, server.model, p, eos))["logprob"] for p in LOAD}


def judge(got: dict[str, Any], eos: dict[str, float]) -> dict[str, Any]:
    changed, drifts = [], []
    for text, a, b in zip(PROBES, got["before"], got["after"], strict=True):
        top = dict(a["top"])
        margin = a["logprob"] - max((lp for t, lp in top.items() if t != a["token"]), default=-99)
        if margin > CLEAR and b["token"] != a["token"]:
            changed.append(f"{text!r}: {a['token']!r} {a['logprob']:.3f} -> {b['token']!r}")
        here = dict(b["top"]).get(a["token"])
        if here is not None:
            drifts.append(abs(here - a["logprob"]))
    wrong_ends = [t for t in got["ended_at_once"] if eos.get(t, 0.0) < EOS_FLOOR]
    return {
        "changed": changed,
        "max_drift": round(max(drifts), 4) if drifts else None,
        "drifts": [round(d, 4) for d in drifts],
        "ended_at_once": len(got["ended_at_once"]),
        "ended_wrongly": len(wrong_ends),
        "streams": ROUNDS * PER_ROUND,
    }


class KvDrift:
    name = "kvdrift"
    about = "answers alone before and after 192 streams (issue 46's experiment)"
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, bench: Bench) -> None:
        out: dict[str, Any] = {}
        bench.results[self.name] = out
        threads = bench.args.threads
        configs = {
            "tokenmill-shared": "",
            "tokenmill-per-slot": 'kv_layout = "per_slot"\n',
        }
        servers: list[Server] = []
        for name, extra in configs.items():
            config = bench.tmp / f"{name}.toml"
            config.write_text(
                f'[[deployments]]\nid = "smollm2"\nmodel = "{bench.gguf}"\nweights = "as-is"\n'
                f"max_num_seqs = {SLOTS}\nn_threads = {threads}\n{extra}"
            )
            servers.append(tokenmill_server(name, bench.tmp, ("--config", str(config))))
        binary = llama_server_binary()
        servers.append(
            llama_server(binary, bench.gguf, threads, bench.tmp, extra=("--kv-unified",))
        )
        eos: dict[str, float] = {}
        try:
            for s in servers:  # one at a time: each alone on the cores
                s.start()
                if s.name == "tokenmill-per-slot":
                    eos = asyncio.run(eos_alone(s))
                got = asyncio.run(measure(s))
                out[s.name] = {"raw": got}
                log(f"kvdrift {s.name}: {len(got['ended_at_once'])} streams ended at once")
                s.stop()
        except KeyboardInterrupt:
            out["interrupted"] = True
            bench.results["interrupted"] = True
        finally:
            for s in servers:
                s.stop()
        out["eos_alone"] = eos
        for got in out.values():
            if isinstance(got, dict) and "raw" in got:
                got.update(judge(got["raw"], eos))

    def table(self, results: dict[str, Any]) -> str | None:
        d = results.get(self.name)
        if not d:
            return None
        rows = [
            "",
            f"kvdrift: {len(PROBES)} probes alone, {ROUNDS * PER_ROUND} streams "
            f"({AT_ONCE} at once, temperature 0.7, max_tokens 128), the probes alone again",
            "",
            f"{'server':<20} {'changed':>8} {'max drift':>10} {'ended at once':>14} "
            f"{'(wrongly)':>10}",
        ]
        for name, got in d.items():
            if not isinstance(got, dict) or "changed" not in got:
                continue
            drift = "-" if got["max_drift"] is None else f"{got['max_drift']:.3f}"
            rows.append(
                f"{name:<20} {len(got['changed']):>8} {drift:>10} "
                f"{got['ended_at_once']:>14} {got['ended_wrongly']:>10}"
            )
            rows += [f"    {c}" for c in got["changed"]]
        for name in ("tokenmill-shared", "tokenmill-per-slot"):
            got = d.get(name)
            if isinstance(got, dict) and "changed" in got:
                ok = not got["changed"] and not got["ended_wrongly"]
                rows.append(f"  {'PASS' if ok else 'MISS'} {name}: 0 changed, 0 ended wrongly")
        return "\n".join(rows)


SCENARIO = KvDrift()
