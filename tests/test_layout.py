"""Guards on the package's shape: modules stay small, and the architecture document
names every one of them.

Both read the source tree and the document as files: no import, no model. A failure
says what to do: split the module, or add its line to docs/architecture.md's layout.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tokenmill"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# A module past this many lines is split (docs/architecture.md, "Layout").
MAX_LINES = 500
# The modules over the limit when this guard was written (issue 48), each held to its
# line count then, so that none grows; a module split below the limit leaves this list.
# None is added: a new module over the limit is split instead.
OVER_LIMIT = {
    "config/deployments.py": 506,
    "engines/llamacpp/engine.py": 662,
    "engines/llamacpp/loop.py": 553,  # speculator.py and swapper.py split off
    "ledger/batches.py": 551,
    "server/responses/protocol.py": 525,
}


def modules() -> list[str]:
    """Every Python module of the package, as its path under ``src/tokenmill/``."""
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def line_count(module: str) -> int:
    return len((PACKAGE / module).read_text(encoding="utf-8").splitlines())


def test_no_module_grows_past_the_limit() -> None:
    sizes = {m: line_count(m) for m in modules()}
    over = {m: n for m, n in sizes.items() if n > OVER_LIMIT.get(m, MAX_LINES)}
    assert not over, (
        f"modules over {MAX_LINES} lines (or past their count in OVER_LIMIT): {over}; "
        "split them by what changes together"
    )
    stale = {m: sizes.get(m) for m in OVER_LIMIT if sizes.get(m, 0) <= MAX_LINES}
    assert not stale, f"now within {MAX_LINES} lines, or gone: {stale}; remove them from OVER_LIMIT"


# A line of the layout block: its indent (two spaces a level), then a module's file
# name or a package's folder name, then what it is.
_ENTRY = re.compile(r"^(?P<indent>(?:  )*)(?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.py|/))\s{2,}\S")


def documented() -> set[str]:
    """The modules docs/architecture.md's layout names, as paths under
    ``src/tokenmill/`` (a package's line stands for its ``__init__.py``)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    block = text.split("\n## Layout\n", 1)[1].split("```\n", 1)[1].split("\n```", 1)[0]
    lines = block.splitlines()
    assert lines[0].startswith("src/tokenmill/"), "the layout starts at src/tokenmill/"
    named: set[str] = {"__init__.py"}
    folders: list[str] = []  # the packages the current line is inside
    for number, line in enumerate(lines[1:], start=2):
        entry = _ENTRY.match(line)
        assert entry is not None, (
            f"layout line {number} is not '<indent><module.py or package/>  <what it is>': {line!r}"
        )
        depth = len(entry["indent"]) // 2
        assert 1 <= depth <= len(folders) + 1, f"layout line {number} is indented wrong: {line!r}"
        del folders[depth - 1 :]
        name = entry["name"]
        if name.endswith("/"):
            folders.append(name)
            named.add("".join(folders) + "__init__.py")
        else:
            named.add("".join(folders) + name)
    return named


def test_every_module_is_named_in_the_architecture() -> None:
    names = documented()
    missing = [m for m in modules() if m not in names]
    assert not missing, (
        f"modules docs/architecture.md's layout does not name: {missing}; "
        "add a line for each, saying what it is"
    )
    # A folder without an __init__.py (the playground's files) is named all the same.
    gone = sorted(
        n
        for n in names - set(modules())
        if not (n.endswith("__init__.py") and (PACKAGE / n).parent.is_dir())
    )
    assert not gone, f"docs/architecture.md's layout names modules that are gone: {gone}"


def test_no_exception_name_is_both_the_servers_and_the_clients() -> None:
    # tokenmill.X is the client's (what a caller of the HTTP API catches);
    # tokenmill.errors.X the server's: one name must never mean both.
    import tokenmill
    from tokenmill import errors

    server = {
        n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)
    }
    client = set(tokenmill.__all__) - {"__version__"}
    assert not server & client, server & client
