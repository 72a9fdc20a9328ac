"""The disk tier's files (tokenmill.engines.llamacpp.disktier): written, found again by
a new process's tier, bounded, and never restored unchecked. No model: states are bytes."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tokenmill.engines.llamacpp.disktier import SUFFIX, DiskTier, DiskWriter
from tokenmill.engines.llamacpp.slots import KV_COPY_MIN_TOKENS

FP = '{"model": "a"}'


def seq(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def state(tokens: tuple[int, ...]) -> bytes:
    return b"".join(t.to_bytes(4, "little") * 8 for t in tokens)  # 32 bytes a token


def tier(path: Path, capacity: int = 1 << 20, fingerprint: str = FP) -> DiskTier:
    t = DiskTier(path, capacity, fingerprint)
    t.open()
    return t


def test_a_new_tier_finds_what_an_earlier_one_wrote(tmp_path: Path) -> None:
    heard: list[tuple[str, tuple[int, ...] | None]] = []
    first = tier(tmp_path)
    a, b = seq(0, 100), seq(1000, 60)
    assert first.write(a, state(a)) is not None
    assert first.write(b, state(b)) is not None
    assert first.stats.writes == 2

    again = DiskTier(tmp_path, 1 << 20, FP, listener=lambda k, t: heard.append((k, t)))
    again.open()  # as a restarted replica does
    assert sorted(e.tokens for e in again.entries.values()) == [a, b]
    assert sorted(t for _, t in heard if t is not None) == [a, b]  # announced
    assert again.used == first.used

    prompt = (*a[:90], 7, 7, 7)
    found = again.match(prompt)
    assert found is not None
    entry, common = found
    assert entry.tokens == a and common == 90
    assert again.read(entry) == bytearray(state(a))
    # A prompt that shares less than a copy's worth beyond what a slot offers: nothing.
    assert again.match(prompt, better_than=90 - KV_COPY_MIN_TOKENS + 1) is None
    assert again.match(seq(5000, 50)) is None


def test_no_sequence_twice(tmp_path: Path) -> None:
    t = tier(tmp_path)
    short, long = seq(0, 50), seq(0, 120)
    assert t.write(short, state(short)) is not None
    assert t.write(long, state(long)) is not None  # continues short: short's file goes
    assert [e.tokens for e in t.entries.values()] == [long]
    assert t.write(short, state(short)) is None  # covered by long's
    assert t.write(seq(0, KV_COPY_MIN_TOKENS - 1), b"x") is None  # too short to matter
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 1


def test_bounded_least_recently_used_first(tmp_path: Path) -> None:
    a, b, c, d = (seq(i * 1000, 100) for i in range(4))
    probe = tier(tmp_path / "probe").write(a, state(a))
    assert probe is not None
    one = probe.nbytes + 100  # a file: its state, tokens and header (digits vary)
    t = tier(tmp_path / "t", capacity=3 * one)
    for s in (a, b, c):
        assert t.write(s, state(s)) is not None
    found = t.match(a)
    assert found is not None
    assert t.read(found[0]) is not None  # a is used: b is now the oldest
    assert t.write(d, state(d)) is not None
    assert sorted(e.tokens for e in t.entries.values()) == [a, c, d]
    assert t.stats.evictions == 1
    assert t.used <= t.capacity
    files = list((tmp_path / "t").glob("*" + SUFFIX))
    assert sum(p.stat().st_size for p in files) == t.used
    # A smaller bound at the next start keeps the most recently used.
    os.utime(files[0], (1, 1))
    smaller = tier(tmp_path / "t", capacity=2 * one)
    assert len(smaller.entries) == 2 and files[0].stem not in smaller.entries
    assert t.write(seq(0, 10_000), b"y" * (4 * one)) is None  # can never fit


def test_a_file_for_another_model_is_dropped_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a = seq(0, 100)
    tier(tmp_path, fingerprint='{"model": "other"}').write(a, state(a))
    (tmp_path / "junk.tmp").write_bytes(b"half a file")
    caplog.set_level(logging.WARNING, "tokenmill.engines.llamacpp")
    t = tier(tmp_path)
    assert t.entries == {}
    assert t.stats.dropped == 1
    assert "another model" in caplog.text
    assert list(tmp_path.iterdir()) == []  # both gone


def test_a_cut_or_corrupt_file_is_never_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = seq(0, 100), seq(1000, 100)
    t = tier(tmp_path)
    ea, eb = t.write(a, state(a)), t.write(b, state(b))
    assert ea is not None and eb is not None
    caplog.set_level(logging.WARNING, "tokenmill.engines.llamacpp")
    # One bit flipped in a's state: it is read (at a restore) and refused.
    path = tmp_path / (ea.name + SUFFIX)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1
    path.write_bytes(raw)
    assert t.read(ea) is None
    assert "checksum" in caplog.text
    assert not path.exists() and ea.name not in t.entries
    # b cut short: dropped when the next process starts.
    short = tmp_path / (eb.name + SUFFIX)
    short.write_bytes(short.read_bytes()[:-10])
    again = tier(tmp_path)
    assert again.entries == {} and again.stats.dropped == 1
    assert "cut short" in caplog.text
    # Not a tokenmill file at all.
    (tmp_path / ("0" * 40 + SUFFIX)).write_bytes(b"hello")
    assert tier(tmp_path).stats.dropped == 1


def test_the_writer_writes_in_order_off_the_caller(tmp_path: Path) -> None:
    heard: list[tuple[str, tuple[int, ...] | None]] = []
    t = DiskTier(tmp_path, 1 << 20, FP, listener=lambda k, s: heard.append((k, s)))
    t.open()
    writer = DiskWriter(t)
    short, long = seq(0, 40), seq(0, 90)
    assert writer.submit(short, state(short))
    assert writer.submit(long, state(long))
    writer.close()  # writes what is queued first
    assert [e.tokens for e in t.entries.values()] == [long]
    assert [s for _, s in heard] == [short, None, long]
    t.clear()
    assert list(tmp_path.iterdir()) == [] and t.used == 0


def test_a_failed_write_turns_writing_off_and_raises_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "kv"
    t = tier(directory)
    a, b = seq(0, 100), seq(1000, 100)
    assert t.write(a, state(a)) is not None
    # The directory is gone and a file took its name: no write can succeed.
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()
    directory.write_bytes(b"not a directory")
    caplog.set_level(logging.ERROR, "tokenmill.engines.llamacpp")
    assert t.write(b, state(b)) is None
    assert t.off and "turned off" in caplog.text
    assert t.write(seq(2000, 100), state(seq(2000, 100))) is None  # quietly, now
    assert not list(tmp_path.glob("**/*.tmp"))
