"""The test's end of the scripted engine (:mod:`tokenmill.engines.scripted`).

An :class:`EngineDriver` listens on a Unix socket; every scripted engine (in the
gateway or in a replica process) connects to it when it starts. The driver records
the engines' events (``hello``, ``started``, ``aborted``, ``ended``, ``ignored``) in
the order they arrive and sends commands to the engine serving a request. A test
waits for an event, not for time: "r1 started", then "emit 3 tokens to r1".

An engine finishes starting only when the driver answers its ``hello`` with ``go``.
The driver answers at once, unless the test called :meth:`EngineDriver.hold_starts`:
then a (re)starting replica stays loading until :meth:`EngineDriver.release_starts`,
however long the test needs it down.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

from tests.waiting import HANG_S

# The engine's connections (one per engine instance) are few.
BACKLOG = 16


class EngineDriver:
    def __init__(self) -> None:
        # A short path: a Unix socket's is limited to about 100 bytes.
        self._dir = Path(tempfile.mkdtemp(prefix="tm-drv-"))
        self.path = self._dir / "control.sock"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        self._listener.listen(BACKLOG)
        self._changed = threading.Condition()
        self.events: list[dict[str, Any]] = []  # every event, in arrival order
        self._origin: list[socket.socket] = []  # the connection each event came on
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._holding = False
        self._held: list[socket.socket] = []  # engines whose hello awaits go
        self._start(self._accept)

    def _start(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._changed:
                self._conns.append(conn)
            self._start(self._read, conn)

    def _read(self, conn: socket.socket) -> None:
        with conn.makefile("rb") as lines:
            try:
                for line in lines:
                    event = json.loads(line)
                    go = False
                    with self._changed:
                        self.events.append(event)
                        self._origin.append(conn)
                        if event["event"] == "hello":
                            if self._holding:
                                self._held.append(conn)
                            else:
                                go = True
                        self._changed.notify_all()
                    if go:
                        self._go(conn)
            except OSError:  # closed by close()
                return

    @staticmethod
    def _go(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):  # the engine may have died since its hello
            conn.sendall(json.dumps({"op": "go"}).encode() + b"\n")

    def close(self) -> None:
        """Disconnect every engine (their running requests fail) and stop listening."""
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        with self._changed:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):  # the engine's end may be gone already
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(HANG_S)
        for conn in conns:
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- events ---------------------------------------------------------------------

    def _find(self, event: str, rid: str | None, count: int) -> int | None:
        seen = 0
        for i, e in enumerate(self.events):
            if e["event"] == event and (rid is None or e.get("id") == rid):
                seen += 1
                if seen == count:
                    return i
        return None

    def wait(self, event: str, rid: str | None = None, count: int = 1) -> dict[str, Any]:
        """The ``count``-th ``event`` (of request ``rid``, if given), once it arrived."""
        with self._changed:
            # Index 0 is an event found, too: compare with None.
            self._changed.wait_for(lambda: self._find(event, rid, count) is not None, HANG_S)
            found = self._find(event, rid, count)
            if found is None:
                raise AssertionError(
                    f"no {event!r} event #{count} for {rid or 'any request'}; got {self.events}"
                )
            return self.events[found]

    def index(self, event: str, rid: str | None = None, count: int = 1) -> int:
        """Where that event stands in arrival order (waiting for it): to assert orders."""
        self.wait(event, rid, count)
        with self._changed:
            found = self._find(event, rid, count)
        assert found is not None
        return found

    def seen(self, event: str, rid: str | None = None) -> int:
        """How many such events arrived so far (without waiting)."""
        with self._changed:
            return sum(
                1
                for e in self.events
                if e["event"] == event and (rid is None or e.get("id") == rid)
            )

    def started(self, rid: str) -> dict[str, Any]:
        return self.wait("started", rid)

    # -- commands -------------------------------------------------------------------

    def hold_starts(self) -> None:
        """From now on, an engine that says hello is not told ``go``: it stays loading."""
        with self._changed:
            self._holding = True

    def release_starts(self) -> None:
        """Tell every held engine ``go``, and stop holding the ones that come later."""
        with self._changed:
            self._holding = False
            held, self._held = self._held, []
        for conn in held:
            self._go(conn)

    def _engine(self, rid: str, nth: int = 1) -> socket.socket:
        """The connection of the engine that runs the ``nth`` request named ``rid``."""
        self.wait("started", rid, nth)
        with self._changed:
            found = self._find("started", rid, nth)
            assert found is not None
            return self._origin[found]

    def _send(self, rid: str, command: dict[str, Any], nth: int = 1) -> None:
        """Send to the engine that runs ``rid`` (waiting until it started)."""
        self._engine(rid, nth).sendall(json.dumps(command).encode() + b"\n")

    def pid(self, rid: str, nth: int = 1) -> int:
        """The pid of the engine's process that runs ``rid`` (from its ``hello``)."""
        conn = self._engine(rid, nth)
        with self._changed:
            for event, origin in zip(self.events, self._origin, strict=True):
                if origin is conn and event["event"] == "hello":
                    return int(event["pid"])
        raise AssertionError(f"no hello from the engine that runs {rid}")

    def emit(self, rid: str, n: int = 1, nth: int = 1) -> None:
        """``n`` tokens to ``rid`` (to the ``nth`` request of that name)."""
        self._send(rid, {"op": "emit", "id": rid, "n": n}, nth)

    def finish(self, rid: str, reason: str = "stop", nth: int = 1, stop: str | None = None) -> None:
        """End ``rid`` with ``reason``; ``stop``: on that stop string of the request."""
        command: dict[str, Any] = {"op": "finish", "id": rid, "reason": reason}
        if stop is not None:
            command["stop"] = stop
        self._send(rid, command, nth)

    def say(self, rid: str, text: str, nth: int = 1) -> None:
        """``text`` to ``rid`` as one chunk (a token a word): a tool call's JSON, an answer."""
        self._send(rid, {"op": "say", "id": rid, "text": text}, nth)

    def eos(self, rid: str, nth: int = 1) -> None:
        """End ``rid`` as a model's end-of-sequence token does: one more token, no text."""
        self._send(rid, {"op": "eos", "id": rid}, nth)

    def fail(self, rid: str, message: str = "scripted failure", nth: int = 1) -> None:
        self._send(rid, {"op": "fail", "id": rid, "message": message}, nth)

    def crash(self, rid: str, code: int = 1) -> None:
        """Exit the replica process that runs ``rid``."""
        self._send(rid, {"op": "crash", "code": code})

    def stall(self, rid: str) -> None:
        """Wedge the replica process that runs ``rid``: it answers nothing from now on."""
        self._send(rid, {"op": "stall"})


def scripted_deployment(driver: EngineDriver, id: str = "scripted", **keys: object) -> str:
    """A ``[[deployments]]`` table of a scripted deployment that ``driver`` drives."""
    lines = ["[[deployments]]", f'id = "{id}"', 'engine = "scripted"', f'control = "{driver.path}"']
    for key, value in keys.items():
        if isinstance(value, bool):
            lines.append(f"{key} = {str(value).lower()}")
        elif isinstance(value, str):
            lines.append(f"{key} = {json.dumps(value)}")
        else:
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"
