"""What ``make bench`` watches besides throughput: memory, /health latency, profiles.

Linux-only (it reads ``/proc``); imported by the scenarios of ``bench/scenarios/``.
"""

from __future__ import annotations

import collections
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

# The engine issue's bar: /health answers within this while 16 streams run.
HEALTH_TARGET_MS = 50.0
HEALTH_PERIOD_S = 0.1


# -- memory ------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The command name may hold spaces; the ppid is the 2nd field after ')'.
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree[ppid].append(int(entry.name))
    return tree


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``: children, theirs, and so on."""
    tree = _children()
    todo, out = list(tree.get(pid, [])), []
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(tree.get(p, []))
    return out


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS of the process, of its children (tokenmill's replicas) and of the whole tree."""
    pids = [pid, *_descendants(pid)]
    rss = _status_kb(pid, "VmRSS") / 1024
    tree_rss = sum(_status_kb(p, "VmRSS") for p in pids) / 1024
    return {
        "rss_mb": rss,
        "hwm_mb": _status_kb(pid, "VmHWM") / 1024,
        "children_rss_mb": tree_rss - rss,
        "tree_rss_mb": tree_rss,
        "processes": len(pids),
    }


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process, all its threads."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime and stime are fields 14 and 15 of stat; after ')' they are the 12th and 13th.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far of the process itself and of its children (tokenmill's replicas)."""
    return {"process": _cpu_s(pid), "children": sum(_cpu_s(p) for p in _descendants(pid))}


def cpu_split(pid: int, groups: dict[str, list[int]]) -> dict[str, float]:
    """:func:`cpu_seconds` plus the CPU seconds of each named group of processes (each
    group one or more processes of the tree below ``pid``: a replica, Ray's daemons)."""
    out = cpu_seconds(pid)
    for name, pids in groups.items():
        out[name] = sum(_cpu_s(p) for p in pids)
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").rstrip("\0").split("\0")


# The daemons of a Ray node: a private local instance runs them as children of the
# process that called ray.init.
RAY_DAEMONS = ("raylet", "gcs_server")


def ray_daemons(pid: int) -> list[int]:
    """The Ray daemons (raylet, gcs_server) in the tree below ``pid``, by executable name
    (a Ray worker's command line names the raylet too, in its arguments)."""
    out = []
    for p in _descendants(pid):
        argv = _cmdline(p)
        if argv and Path(argv[0]).name in RAY_DAEMONS:
            out.append(p)
    return out


def processes_below(pid: int, needle: str) -> list[int]:
    """Processes in the tree below ``pid`` whose command line holds ``needle`` (Ray
    names an actor's process after its class: ``ray::ProxyActor``)."""
    return [p for p in _descendants(pid) if needle in " ".join(_cmdline(p))]


def parent_pid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def process_tree(pid: int) -> dict[int, str]:
    """``pid`` and every process below it, each with its command name (to tell a
    survivor from a reused pid after the tree was stopped)."""
    return {p: _comm(p) for p in [pid, *_descendants(pid)]}


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def survivors(tree: dict[int, str]) -> dict[int, str]:
    """The processes of a :func:`process_tree` snapshot still running (zombies aside)."""
    out = {}
    for p, comm in tree.items():
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and _comm(p) == comm:
            out[p] = comm
    return out


def client_cpu_seconds() -> float:
    """CPU seconds of this process's waited-for children (the ``tokenmill bench`` runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def maps_file(pid: int, path: Path) -> bool:
    """Whether the process has ``path`` mapped (llama.cpp mmaps the model file)."""
    try:
        return str(path.resolve()) in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


# -- /health while streams run -----------------------------------------------------------


class HealthProbe:
    """GET /health every ``HEALTH_PERIOD_S`` on a thread of its own while a load runs.

    Each probe is timed end to end from this process: the figure includes the
    HTTP round trip, so it is what a load balancer's health check would see.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies_ms: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self.latencies_ms.append((time.perf_counter() - start) * 1000)
                else:
                    self.failures += 1
                self._stop.wait(HEALTH_PERIOD_S)


def health_summary(probes: list[HealthProbe]) -> dict[str, Any]:
    """Latency figures over every probe of several runs."""
    lat = sorted(ms for p in probes for ms in p.latencies_ms)
    failures = sum(p.failures for p in probes)
    if not lat:
        return {"probes": 0, "failures": failures}
    return {
        "probes": len(lat),
        "failures": failures,
        "p50_ms": round(statistics.median(lat), 2),
        "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
        "max_ms": round(lat[-1], 2),
    }


# -- profile -----------------------------------------------------------------------------


def py_spy() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def profile(pid: int, load: Callable[[], object], out_path: Path) -> dict[str, Any] | None:
    """Run ``load`` under py-spy attached to ``pid`` and its children; summarize."""
    tool = py_spy()
    if tool is None:
        return None
    cmd = [tool, "record", "-p", str(pid), "-r", "100", "-f", "raw"]
    # Replicas may run as child processes of the gateway: sample those too.
    cmd += ["-o", str(out_path), "--threads", "--subprocesses", "--nonblocking", "-d", "600"]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    try:
        load()
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            _, err = spy.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            return None
    if not out_path.exists():
        return {"error": (err or "")[-500:]}
    return summarize_profile(out_path)


def summarize_profile(path: Path) -> dict[str, Any]:
    """Collapsed stacks → share of samples per thread and per leaf function (self time)."""
    by_thread: collections.Counter[str] = collections.Counter()
    by_leaf: collections.Counter[str] = collections.Counter()
    by_frame: collections.Counter[str] = collections.Counter()  # inclusive
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        # Leading pseudo-frames name the process and thread the sample was taken in.
        where = [f for f in frames[:2] if f.startswith(("process ", "thread "))]
        frames = frames[len(where) :] or ["?"]
        total += n
        by_thread[" / ".join(w[:60] for w in where)] += n
        by_leaf[frames[-1]] += n
        for frame in set(frames):
            by_frame[frame] += n

    def top(counter: collections.Counter[str], k: int) -> list[tuple[str, float]]:
        return [(name, round(100 * n / max(total, 1), 1)) for name, n in counter.most_common(k)]

    return {
        "samples": total,
        "threads": top(by_thread, 6),
        "self": top(by_leaf, 15),
        "inclusive": top(by_frame, 15),
        "raw": str(path),
    }
