"""The kvcluster scenario's table and targets, from its results alone."""

from __future__ import annotations

from typing import Any

from summary import mark

# The bars.
RESTORED = 0.9  # of a killed replica's conversations' later turns
MOVE_RATIO = 0.5  # moved continuations' TTFT p50 against computing them


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def rows(title: str, servers: dict[str, Any]) -> list[str]:
    lines = [title, f"{'server':<16} {'whole cached':>13} {'2nd-turn ttft p50':>18}  notes"]
    for name, r in servers.items():
        whole = f"{r.get('whole_cached')}/{r.get('second_turns')}"
        notes = ""
        if "kill" in r:
            notes = f"back after {r['kill'].get('back_s')} s"
        if r.get("kv_moves"):
            notes = f"kv_moves {r['kv_moves']}"
        lines.append(
            f"{name:<16} {whole:>13} {fmt(r.get('second_ttft_p50_ms'), '.1f') + ' ms':>18}  {notes}"
        )
    return lines


def report(section: dict[str, Any]) -> str:
    s = section["settings"]
    restart, moves = section.get("restart") or {}, section.get("moves") or {}
    lines = [""]
    if restart:
        lines += rows(
            f"kvcluster (issue 35) restart: one replica of {s['slots']} slots (n_ctx "
            f"{s['n_ctx']}), {s['conversations']} conversations' first turns, SIGKILL, "
            f"back, their second turns; llama-server -np {s['slots']} -c {s['llama_ctx']} "
            "killed and started again",
            restart,
        )
    if moves:
        lines += rows(
            f"kvcluster moves: 2 replicas of 1 slot, {s['moves']} conversations whose home "
            "is busy with a long answer at their second turn, kv_moves on and off",
            moves,
        )
    lines.append(
        f"  load average (1, 5, 15 min) before {s.get('load_average_before')}, "
        f"after {s.get('load_average_after')}"
    )
    disk, ls = restart.get("tokenmill-disk"), restart.get("llama-server")
    if disk:
        share = disk.get("whole_cached_share")
        ok = share is not None and share >= RESTORED
        line = f"  {mark(ok)} after a SIGKILL, {fmt(share)} of second turns restored"
        line += f" (>= {RESTORED})"
        if ls:
            line += f"; llama-server {fmt(ls.get('whole_cached_share'))}"
            a, b = disk.get("second_ttft_p50_ms"), ls.get("second_ttft_p50_ms")
            if a is not None and b:
                line += f", TTFT p50 {a / b:.2f}x llama-server's"
        lines.append(line)
    on, off = moves.get("moves-on"), moves.get("moves-off")
    if on and off:
        a, b = on.get("second_ttft_p50_ms"), off.get("second_ttft_p50_ms")
        r = None if a is None or not b else a / b
        ok = r is not None and r <= MOVE_RATIO
        lines.append(
            f"  {mark(ok)} moved continuations' TTFT p50 {fmt(r)}x computing them (<= {MOVE_RATIO})"
        )
    return "\n".join(lines)
