"""PostgreSQL for the tests: a throwaway cluster of the session's own, or a given server.

``make test`` needs no PostgreSQL running: the ``postgres`` fixture (tests/conftest.py)
runs ``initdb`` into a temporary folder, starts that cluster on a free port with its
sockets in the same folder, and removes it all at the end. Setting
``TOKENMILL_TEST_POSTGRES_URL`` (a database the tests may create schemas in) uses that
server instead. Each test then works in a schema of its own (:func:`pg_schema`).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg

from tests.waiting import wait_until

URL_ENV = "TOKENMILL_TEST_POSTGRES_URL"
PROGRAMS = ("initdb", "pg_ctl", "postgres")


def bin_dir() -> Path:
    """The folder of ``initdb``, ``pg_ctl`` and ``postgres``: PATH's, else Debian's
    (its package keeps them off PATH, in /usr/lib/postgresql/<version>/bin)."""
    candidates = []
    on_path = shutil.which("initdb")
    if on_path is not None:
        # A link on PATH (/usr/local/bin/initdb here) stands for the folder it points
        # into: pg_ctl and postgres must come from the same version.
        candidates.append(Path(on_path).resolve().parent)

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", path.parent.name))

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    for folder in candidates:
        if all((folder / name).is_file() for name in PROGRAMS):
            return folder
    raise RuntimeError(
        "PostgreSQL's initdb, pg_ctl and postgres were found neither on PATH nor in "
        f"/usr/lib/postgresql/*/bin: install PostgreSQL (Debian: apt-get install "
        f"postgresql) or set {URL_ENV} to a server's database"
    )


def unprivileged() -> dict[str, Any]:
    """subprocess arguments that run the cluster's programs as a user postgres accepts:
    it refuses to run as root, and ``make test`` runs as root in CI."""
    if os.geteuid() != 0:
        return {}
    try:
        user = pwd.getpwnam("postgres")  # Debian's package creates it
    except KeyError:
        user = pwd.getpwnam("nobody")
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def accepts_connections(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=5):
            return True
    except psycopg.OperationalError:  # not accepting connections yet
        return False


@contextlib.contextmanager
def throwaway_cluster(port: int) -> Iterator[str]:
    """A new cluster on ``port`` (127.0.0.1, trust auth), stopped and deleted after: the
    URL of its database ``test``."""
    programs = bin_dir()
    as_user = unprivileged()
    # Not pytest's tmp_path: its parents are private to root, and the cluster's user
    # must reach the folder. A short path also keeps the socket's under its 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="tokenmill-pg-"))
    data, log = root / "data", root / "postgres.log"

    def run(*args: str | Path) -> None:
        # cwd: the cluster's user may not be able to enter the caller's folder.
        done = subprocess.run(
            [str(a) for a in args], cwd=root, capture_output=True, text=True, **as_user
        )
        if done.returncode != 0:
            server_log = log.read_text(errors="replace") if log.exists() else ""
            raise RuntimeError(
                f"{' '.join(map(str, args))} exited with {done.returncode}:\n"
                f"{done.stdout}{done.stderr}{server_log}"
            )

    try:
        if as_user:
            os.chown(root, as_user["user"], as_user["group"])
        run(programs / "initdb", "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8")
        run_options = [
            f"port = {port}",
            "listen_addresses = '127.0.0.1'",
            f"unix_socket_directories = '{root}'",
            # The data dies with the session: durability would only slow the tests.
            "fsync = off",
            "synchronous_commit = off",
            "full_page_writes = off",
        ]
        with open(data / "postgresql.conf", "a") as conf:
            conf.write("\n".join(run_options) + "\n")
        started = False
        try:
            run(programs / "pg_ctl", "-D", data, "-l", log, "-w", "start")
            started = True
            server = f"postgresql://postgres@127.0.0.1:{port}"
            wait_until(
                lambda: accepts_connections(f"{server}/postgres"),
                f"the session's PostgreSQL on port {port} to accept connections",
            )
            with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
                conn.execute("CREATE DATABASE test")
            yield f"{server}/test"
        finally:
            if started:
                run(programs / "pg_ctl", "-D", data, "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def pg_schema(server_url: str) -> Iterator[str]:
    """A URL on ``server_url``'s database whose search_path is a fresh schema of its own
    (dropped after), so tests and parallel runs never clash."""
    schema = f"tm_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        query = "&" if "?" in server_url else "?"  # a given URL may have a query
        yield f"{server_url}{query}options={quote(f'-c search_path={schema}')}"
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
