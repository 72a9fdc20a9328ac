"""The disk tier of the llama.cpp engine's KV cache: parked sequences as files that
outlive the replica's process (no llama.cpp here: the state is bytes).

What the host tier (:mod:`.hosttier`) parks is also written here, and what a slot
holds when its request ends, by a thread of its own (:class:`DiskWriter`), so that a
replica that crashes, restarts or is unloaded when idle finds its conversations'
histories again when it comes back: a later prompt that continues a file's sequence
further than any slot or parked entry does is restored from it.

One file a sequence, ``<sha256 of its tokens>.tmkv``: a magic line, a JSON header
(the fingerprint of the model and of llama.cpp's state format it was written with,
the token count, the state's size, a SHA-256 of tokens and state), the tokens as
little-endian int32, the state. A file is written to ``.tmp`` and renamed, so a crash
leaves a whole file or a ``.tmp`` that the next start removes. Nothing is restored
unchecked: at start a file whose header is unreadable or whose fingerprint is not
this replica's (another model, another llama.cpp, another RoPE) is deleted with a log
line; when read for a restore, one whose checksum fails is deleted the same way.

A write that fails (the disk full, the directory gone) turns the tier's writing off
with a log line; requests go on as without it.

Rules, as the host tier's: bounded in bytes (``capacity``; the least recently used
files go first, a file's mtime being its last use), and no sequence twice (a sequence
covered by a file is not written; writing one deletes the files it continues).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from tokenmill.engines.llamacpp.hosttier import covered, longest_prefix
from tokenmill.engines.llamacpp.slots import KV_COPY_MIN_TOKENS

__all__ = ["DiskEntry", "DiskStats", "DiskTier", "DiskWriter", "default_capacity"]

log = logging.getLogger("tokenmill.engines.llamacpp")

# The bound where kv_disk_bytes is unset: a tenth of the free space of its file system,
# at most 4 GiB. The tier is on by default, so it takes a modest share of a disk it
# may share with anything: room for several agent sessions' prefixes (SmolLM2: a whole
# 32k sequence is 755 MB), never half the disk.
DEFAULT_MAX_BYTES = 4 << 30
DEFAULT_FREE_SHARE = 10
MAGIC = b"tokenmill-kv 1\n"
SUFFIX = ".tmkv"
_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """One file: its sequence's tokens (position 0 on) and its size on disk."""

    name: str
    tokens: tuple[int, ...]
    nbytes: int


@dataclass(slots=True)
class DiskStats:
    writes: int = 0  # files written
    written_bytes: int = 0
    hits: int = 0  # prompts whose longest cached prefix was a file's
    restored_tokens: int = 0  # tokens of those a prompt reused
    evictions: int = 0  # files deleted, least recently used, for room
    dropped: int = 0  # files deleted as stale, foreign or corrupt


def default_capacity(directory: Path, one: int) -> int | None:
    """The tier's bound when ``kv_disk_bytes`` is unset; None (no disk tier, with a
    log line) where it could not hold one whole sequence (``one`` bytes)."""
    path = directory
    while not path.exists() and path != path.parent:
        path = path.parent
    capacity = min(DEFAULT_MAX_BYTES, shutil.disk_usage(path).free // DEFAULT_FREE_SHARE)
    if capacity < one:
        log.warning(
            "no KV disk tier in %s: a tenth of the free space there (%d bytes) cannot hold "
            "one sequence (%d bytes); set kv_disk_bytes for one",
            directory, capacity, one,
        )  # fmt: skip
        return None
    return capacity


def _name(tokens: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest()[:40]


@dataclass(slots=True)
class DiskTier:
    """Files of parked sequences in ``directory``, at most ``capacity`` bytes, each
    written for ``fingerprint`` (the model file and llama.cpp's state format)."""

    directory: Path
    capacity: int
    fingerprint: str
    # Hears of every file as it is added (name, tokens) and deleted (name, None).
    listener: Callable[[str, tuple[int, ...] | None], None] | None = None
    entries: dict[str, DiskEntry] = field(default_factory=dict)  # least recently used first
    used: int = 0
    stats: DiskStats = field(default_factory=DiskStats)
    # Set when a write failed (the disk full, the directory gone): nothing more is
    # written, what is there is still read. Requests never fail for it.
    off: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- start -----------------------------------------------------------------------

    def open(self) -> None:
        """Read what the directory holds (headers and tokens, not the states): keep
        this replica's whole files, oldest use first, and delete the rest."""
        self.directory.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, DiskEntry]] = []
        for path in self.directory.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)  # a write cut short
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                with path.open("rb") as f:
                    header = self._header(f)
                    n = header["tokens"]
                    expected = f.tell() + 4 * n + header["state_bytes"]
                    tokens = struct.unpack(f"<{n}i", f.read(4 * n))
                    size = os.fstat(f.fileno()).st_size
                    used = os.fstat(f.fileno()).st_mtime
            except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
                self._drop(path, f"unreadable ({e})")
                continue
            if header["fingerprint"] != self.fingerprint:
                self._drop(path, "written for another model or llama.cpp state format")
                continue
            if size != expected or path.stem != _name(tokens):
                self._drop(path, "cut short or renamed")
                continue
            found.append((used, DiskEntry(path.stem, tuple(tokens), size)))
        with self._lock:
            for _, entry in sorted(found, key=lambda pair: pair[0]):
                self._add(entry)
            self._evict_for(0)

    # -- placement -------------------------------------------------------------------

    def match(self, prompt: Sequence[int], *, better_than: int = 0) -> tuple[DiskEntry, int] | None:
        """The file sharing the longest prefix with ``prompt``, if it shares at least
        ``KV_COPY_MIN_TOKENS`` more than ``better_than`` (what a slot or the host
        tier offers), with how many tokens it shares."""
        with self._lock:
            entries = list(self.entries.values())
        return longest_prefix(((e, e.tokens) for e in reversed(entries)), prompt, better_than)

    def read(self, entry: DiskEntry) -> bytearray | None:
        """``entry``'s state, checked; None (and the file deleted) if it is gone or
        does not check out. Marks it used."""
        path = self.directory / (entry.name + SUFFIX)
        n = len(entry.tokens)
        try:
            with path.open("rb") as f:
                header = self._header(f)
                packed = f.read(4 * n)
                state = bytearray(max(0, header["state_bytes"]))
                got = f.readinto(state)
                trailing = f.read(1)
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._forget(entry.name, path, f"unreadable ({e})")
            return None
        digest = hashlib.sha256(packed)
        digest.update(state)
        if (
            header["fingerprint"] != self.fingerprint
            or header["tokens"] != n
            or got != len(state)
            or trailing
            or digest.hexdigest() != header.get("sha256")
        ):
            self._forget(entry.name, path, "its checksum does not match (corrupt)")
            return None
        now = time.time()
        with contextlib.suppress(OSError):
            os.utime(path, (now, now))
        with self._lock:
            if entry.name in self.entries:
                self.entries[entry.name] = self.entries.pop(entry.name)
        return state

    # -- writing ---------------------------------------------------------------------

    def covers(self, tokens: Sequence[int]) -> bool:
        """A file already holds (all but a few tokens of) ``tokens``."""
        with self._lock:
            return any(covered(tokens, e.tokens) for e in self.entries.values())

    def write(self, tokens: Sequence[int], state: bytes | bytearray) -> DiskEntry | None:
        """Write ``tokens`` and its ``state`` as a file (unless one covers it or it can
        never fit), deleting the files it continues and then the least recently used
        until it fits. None if nothing was written."""
        tokens = tuple(tokens)
        if self.off or len(tokens) < KV_COPY_MIN_TOKENS or self.covers(tokens):
            return None
        packed = struct.pack(f"<{len(tokens)}i", *tokens)
        digest = hashlib.sha256(packed)
        digest.update(state)
        header = json.dumps(
            {
                "fingerprint": self.fingerprint,
                "tokens": len(tokens),
                "state_bytes": len(state),
                "sha256": digest.hexdigest(),
            }
        ).encode()
        size = len(MAGIC) + _LEN.size + len(header) + len(packed) + len(state)
        if size > self.capacity:
            return None
        name = _name(tokens)
        with self._lock:
            for entry in list(self.entries.values()):
                if covered(entry.tokens, tokens):
                    self._remove(entry.name)
            self._evict_for(size)
        path = self.directory / (name + SUFFIX)
        tmp = path.with_suffix(".tmp")
        try:
            with tmp.open("wb") as f:
                f.write(MAGIC)
                f.write(_LEN.pack(len(header)))
                f.write(header)
                f.write(packed)
                f.write(state)
            tmp.replace(path)
        except OSError as e:
            log.error("the disk tier is turned off: writing %s failed: %s", path, e)
            self.off = True
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return None
        entry = DiskEntry(name, tokens, size)
        with self._lock:
            self._add(entry)
            self.stats.writes += 1
            self.stats.written_bytes += size
        return entry

    def clear(self) -> None:
        """Delete every file (the tier's content, not other files in the directory)."""
        with self._lock:
            for name in list(self.entries):
                self._remove(name)

    # -- internals -------------------------------------------------------------------

    @staticmethod
    def _header(f: BinaryIO) -> dict[str, Any]:
        read = f.read
        if read(len(MAGIC)) != MAGIC:
            raise ValueError("not a tokenmill KV file")
        (n,) = _LEN.unpack(read(_LEN.size))
        if n > 1 << 16:
            raise ValueError("header too long")
        header = json.loads(read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        for key, kind in (("fingerprint", str), ("tokens", int), ("state_bytes", int)):
            if not isinstance(header.get(key), kind):
                raise ValueError(f"header has no {key}")
        return header

    def _add(self, entry: DiskEntry) -> None:
        old = self.entries.pop(entry.name, None)
        if old is not None:
            self.used -= old.nbytes
        self.entries[entry.name] = entry
        self.used += entry.nbytes
        if self.listener is not None:
            self.listener(entry.name, entry.tokens)

    def _evict_for(self, size: int) -> None:
        for entry in list(self.entries.values()):
            if self.used + size <= self.capacity:
                break
            self._remove(entry.name)
            self.stats.evictions += 1

    def _remove(self, name: str) -> None:
        entry = self.entries.pop(name)
        self.used -= entry.nbytes
        (self.directory / (name + SUFFIX)).unlink(missing_ok=True)
        if self.listener is not None:
            self.listener(name, None)

    def _forget(self, name: str, path: Path, why: str) -> None:
        with self._lock:
            if name in self.entries:
                self._remove(name)
        self._drop(path, why)

    def _drop(self, path: Path, why: str) -> None:
        log.warning("dropped the parked KV file %s: %s", path, why)
        path.unlink(missing_ok=True)
        self.stats.dropped += 1


class DiskWriter:
    """Writes parked sequences to a :class:`DiskTier` off the decode thread, in the
    order they were parked; at most ``backlog`` wait (more are not written: the host
    tier still holds them)."""

    def __init__(self, tier: DiskTier, backlog: int = 64) -> None:
        self.tier = tier
        self._queue: queue.Queue[tuple[tuple[int, ...], bytes | bytearray] | None] = queue.Queue(
            backlog
        )
        self._thread = threading.Thread(target=self._run, name="tokenmill-kv-disk", daemon=True)
        self._thread.start()

    def submit(self, tokens: Sequence[int], state: bytes | bytearray) -> bool:
        """Queue ``tokens`` and ``state`` (not changed afterwards) to be written."""
        try:
            self._queue.put_nowait((tuple(tokens), state))
        except queue.Full:
            return False
        return True

    def flush(self) -> None:
        """Return once everything submitted so far is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                tokens, state = item
                try:
                    self.tier.write(tokens, state)
                except Exception:  # never let one bad write stop the writer
                    log.exception("writing a parked sequence to disk failed")
            finally:
                self._queue.task_done()
