"""Process replicas: an engine in a child process, ``placement = "process"``.

A :class:`ProcessLauncher` starts ``python -m tokenmill.replicas.runner`` with one end
of a ``socketpair``; the frames of :mod:`tokenmill.replicas.wire` cross it,
length-prefixed. The :class:`~tokenmill.replicas.supervisor.SupervisedHost` around it
does the rest (requests, cancellation, the health probe, restarts). A crash in native
code (a segfault in llama.cpp, an OOM kill) takes down that child only.

Priority: with ``replica_nice`` above 0 the child lowers its own priority before it
starts a thread, so every thread of the engine inherits it. The default is 0: a
niced replica yields the cores not only to the gateway but to every busy process on
the host, and starves (see ``replica_nice`` in :mod:`tokenmill.config`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
from typing import Any

from tokenmill.errors import EngineError
from tokenmill.replicas.host import KvLink, ReplicaLocation
from tokenmill.replicas.wire import encode_frame, read_frame

log = logging.getLogger("tokenmill.replicas.process")


class SocketChannel:
    """The gateway's end of a stream socket carrying :mod:`tokenmill.replicas.wire`'s
    length-prefixed frames: what a process replica (its socket pair) and a Ray replica
    (its TCP connection, :mod:`tokenmill.replicas.rayactor`) share. End of stream, or the
    socket closed here (``close_socket``), reads as None."""

    same_clock = False  # see Channel.same_clock

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    def send(self, message: dict[str, Any]) -> None:
        if self._writer.is_closing():
            raise EngineError("the replica is gone; retry the request")
        self._writer.write(encode_frame(message))

    async def receive(self) -> dict[str, Any] | None:
        return await read_frame(self._reader)

    def close_socket(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()

    def kv_link(self) -> KvLink | None:
        return None  # its KV state goes through the gateway


class ProcessChannel(SocketChannel):
    """A child process and its end of the socket pair."""

    # The child's time.monotonic() is the same clock as ours (tokenmill.stages).
    same_clock = True

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        super().__init__(reader, writer)
        self.proc = proc

    def detach(self) -> None:
        self.kill()  # this gateway's alone: nothing else uses it

    def kill(self) -> None:
        self.close_socket()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def wait(self) -> str:
        code = await self.proc.wait()
        return f"exit {code}"

    def location(self) -> ReplicaLocation:
        return ReplicaLocation(pid=self.proc.pid)

    @property
    def name(self) -> str:
        return f"replica process {self.proc.pid}"


class ProcessLauncher:
    """Starts replica processes running the engine of one deployment section."""

    kind = "process"

    def __init__(self, section: dict[str, Any], *, nice: int = 0) -> None:
        # The deployment's config section as JSON: the child builds its engine from it.
        self.section = section
        self.nice = nice

    async def launch(self) -> ProcessChannel:
        parent_sock, child_sock = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tokenmill.replicas.runner",
                "--fd",
                str(child_sock.fileno()),
                "--section",
                json.dumps(self.section),
                "--log-level",
                logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                "--nice",
                str(self.nice),
                pass_fds=(child_sock.fileno(),),
            )
        except BaseException:
            parent_sock.close()
            raise
        finally:
            # Only the child may hold its end: its death must read as EOF here.
            child_sock.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent_sock)
        return ProcessChannel(proc, reader, writer)

    async def close(self) -> None:
        pass  # nothing outlives a replica process


__all__ = ["ProcessChannel", "ProcessLauncher", "SocketChannel"]
