"""Every `draftflow …` command written in the README and the docs parses with the parser the
command builds (flows.cli.build_parser): no sub-command, flag or choice that does not exist."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from flows.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
COMMAND = re.compile(r"^(?:\$\s+)?(?:\S*/)?draftflow\s")


def commands(page: Path, prefix: re.Pattern = COMMAND) -> list[tuple[int, str]]:
    """(line number, command) of each command (default: draftflow's) in the page's shell code blocks."""
    found, open_fence, pending, start = [], None, "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = FENCE.match(line.strip())
        if fence:
            open_fence = fence.group(1) if open_fence is None else None
            continue
        if open_fence not in ("", "bash", "sh", "shell", "console"):
            continue
        text = line.strip()
        if pending:
            pending += " " + text.rstrip("\\").strip()
        elif prefix.match(text):
            pending, start = text.rstrip("\\").strip(), number
        if pending and not text.endswith("\\"):
            found.append((start, pending))
            pending = ""
    return found


def argv_of(command: str) -> list[str]:
    # usage notation: [--flag] is an optional flag, written as itself
    words = [
        w[1:-1] if w.startswith("[-") and w.endswith("]") else w for w in shlex.split(command, comments=True)
    ]
    if words[0] == "$":
        words = words[1:]
    for stop in ("|", "&&", ";", ">", "2>&1"):
        if stop in words:
            words = words[: words.index(stop)]
    return words[1:]


ALL = [(page, number, command) for page in PAGES for number, command in commands(page)]


def test_the_docs_hold_commands_to_check():
    assert len(ALL) >= 15
    assert {page.name for page, _, _ in ALL} >= {"README.md", "getting-started.md", "recipes.md"}


@pytest.mark.parametrize(("page", "number", "command"), ALL, ids=[f"{p.name}:{n}" for p, n, _ in ALL])
def test_documented_command_parses(page, number, command):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv_of(command))
        except SystemExit as done:
            assert done.code == 0, f"{page.name}:{number}: `{command}`: {err.getvalue().strip()}"


MAKE_TARGET = re.compile(r"(?:^|`|\$ )make ([a-z][a-z-]*)", re.MULTILINE)


def test_every_documented_make_target_exists():
    """`make X` in the README and the docs names a target of the Makefile."""
    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))
    named = {(page.name, t) for page in PAGES for t in MAKE_TARGET.findall(page.read_text())}
    assert {t for _, t in named} >= {"demo", "test", "test-fast", "docs"}
    assert sorted((page, t) for page, t in named if t not in targets) == []
