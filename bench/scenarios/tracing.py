"""What tracing costs: tokenmill at c=SLOTS with OpenTelemetry off and on, side by side.

Two tokenmill servers of the embedded model: one with no ``OTEL_*`` variable (tracing
off: nothing of OpenTelemetry loads), one exporting its traces and GenAI metrics
(``OTEL_EXPORTER_OTLP_ENDPOINT``) to an OTLP/HTTP sink in this process that reads
each export and discards it, answering 200 as a collector would; the SDK's defaults
otherwise (a batch of spans every 5 s, metrics every 60 s). Every request of the on
server is a trace: the gateway's span and stages, and the replica process's own
spans. Each repetition measures both in turn (``load.interleaved``), reported as the
on/off ratio of output tokens/s (issue 50: >= 0.97x) and the CPU each spent per token.

Off costs what the code on the request path does while tracing is off: one context
variable read a request (the replica client asking for a trace context), timed here
in this process with ``timeit``, since two runs of one server cannot tell it apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import timeit
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from load import interleaved, log_run, plan_line
from scenario import Bench
from servers import SLOTS, log, tokenmill_server

TARGET = 0.97  # on / off output tokens/s at c=SLOTS


class Sink:
    """An OTLP/HTTP endpoint that reads every export and discards it: counts only."""

    def __init__(self) -> None:
        self.exports = {"/v1/traces": 0, "/v1/metrics": 0}
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                size = int(self.headers.get("content-length", 0))
                self.rfile.read(size)
                sink.exports[self.path] = sink.exports.get(self.path, 0) + 1
                sink.bytes += size
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def off_path_ns() -> float:
    """Nanoseconds of what a request runs of tracing while it is off: the replica
    client's read of the request's trace context (none)."""
    from tokenmill import otel

    n = 200_000
    took = min(timeit.repeat(lambda: otel.traceparent(handed=True), number=n, repeat=5))
    return round(took / n * 1e9, 1)


def _config(bench: Bench) -> str:
    return (
        f'[[deployments]]\nid = "smollm2"\nmodel = "{bench.gguf}"\n'
        f"max_num_seqs = {SLOTS}\nn_threads = {bench.args.threads}\n"
    )


class Tracing:
    name = "tracing"
    about = "tokenmill at c=16 with OpenTelemetry traces off and on (to a discarding sink)"
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, bench: Bench) -> None:
        out: dict[str, Any] = {"reps": bench.reps}
        bench.results[self.name] = out
        inherited = sorted(k for k in os.environ if k.startswith("OTEL_"))
        if inherited:
            log(f"tracing: not run, this environment sets {inherited} (the off server's too)")
            out["skipped"] = f"OTEL_* set: {inherited}"
            return
        out["off_path_ns"] = off_path_ns()
        config = bench.tmp / "tracing.toml"
        config.write_text(_config(bench))
        args = ("--config", str(config))
        sink = Sink()
        on_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}
        servers = [
            tokenmill_server("tracing-off", bench.tmp, args),
            tokenmill_server("tracing-on", bench.tmp, args, on_env),
        ]
        tok_s: dict[str, list[float]] = {s.name: [] for s in servers}
        cpu: dict[str, list[float]] = {s.name: [] for s in servers}
        try:
            for s in servers:
                s.start()
            for rep, c, s in interleaved(servers, [SLOTS], bench.reps):
                report = bench.run(s, c)
                tok_s[s.name].append(report["output_tokens_per_s"])
                spent = report["cpu_ms_per_token"]
                cpu[s.name].append(round(spent["server"] + spent["children"], 3))
                log_run("tracing ", rep, bench.reps, c, s.name, report)
        except KeyboardInterrupt:
            out["interrupted"] = True
            bench.results["interrupted"] = True
            log("interrupted: reporting the runs completed so far")
        finally:
            for s in servers:
                s.stop()
            sink.close()
        out["tok_s"], out["cpu_ms_per_token"] = tok_s, cpu
        out["exports"], out["export_bytes"] = dict(sink.exports), sink.bytes
        off, on = (_median(tok_s[s.name]) for s in servers)
        out["medians"] = {"off": off, "on": on}
        out["cpu_medians"] = {
            "off": _median(cpu["tracing-off"]),
            "on": _median(cpu["tracing-on"]),
        }
        out["ratio"] = round(on / off, 3) if off else 0.0

    def table(self, results: dict[str, Any]) -> str | None:
        t = results.get(self.name)
        if not t or "ratio" not in t:
            return None
        m, c = t["medians"], t["cpu_medians"]
        rows = [
            "",
            f"tracing: {results['model_file']}, {results['threads']} threads, c={SLOTS}, "
            f"{t['reps']} runs each, off and on interleaved (medians)",
            plan_line([SLOTS], results["max_tokens"], results["lockstep"]),
            f"on: every request traced (gateway and replica spans) to an OTLP/HTTP sink in "
            f"the bench process that discards: {t['exports']} exports, "
            f"{t['export_bytes']:,} bytes",
            "",
            f"{'':<28} {'off':>8} {'on':>8} {'on/off':>7}",
            f"{'output tok/s':<28} {m['off']:>8.1f} {m['on']:>8.1f} {t['ratio']:>6.3f}x",
            f"{'CPU ms/token (server tree)':<28} {c['off']:>8.3f} {c['on']:>8.3f}",
            f"off: {t['off_path_ns']} ns a request (the one context-variable read left on the "
            "request path; nothing of OpenTelemetry is loaded)",
            "",
            f"  {'PASS' if t['ratio'] >= TARGET else 'MISS'} on/off tok/s at c={SLOTS} "
            f"{t['ratio']:.3f}x (>= {TARGET}x)",
        ]
        return "\n".join(rows)


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 1) if xs else 0.0


SCENARIO = Tracing()
