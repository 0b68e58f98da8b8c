"""docs/benchmarks.md stays a reference: every table names the command that produced it, the
commands it names exist, it has no commit hashes, it stays short, and docs/notes/ is indexed.

The rule (stated at the top of the doc): every Markdown table is preceded, in its section (the
text since the last `##` or `###` heading), by a fenced block holding a command:
`poolkeeper bench <benchmark>`, `python -m poolkeeper.bench.<module>` or `make bench`.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

from poolkeeper.cli.main import build_parser

DOCS = Path(__file__).resolve().parents[2] / "docs"
DOC = (DOCS / "benchmarks.md").read_text()
MAX_LINES = 800
COMMAND = re.compile(r"poolkeeper bench [a-z]|python -m poolkeeper\.bench\.|make bench")
BENCH_CLI = re.compile(r"poolkeeper bench ([a-z]+)([^#;]*)")
MODULE = re.compile(r"python -m (poolkeeper\.bench\.[a-z_.]*[a-z_])")
# Seven or more hex digits with at least one digit and one letter: what a commit hash looks like.
HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def _blocks_and_prose(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(line number, fenced block text) for each fenced block; (line number, line) outside them."""
    blocks: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    current: list[str] | None = None
    start = 0
    for number, line in enumerate(text.splitlines()):
        if line.startswith("```"):
            if current is None:
                current, start = [], number
            else:
                blocks.append((start, "\n".join(current)))
                current = None
        elif current is not None:
            current.append(line)
        else:
            prose.append((number, line))
    assert current is None, "unclosed fenced block"
    return blocks, prose


def _commands(block: str) -> list[str]:
    """The block's lines, with shell continuations (`\\` at the end) joined."""
    return block.replace("\\\n", " ").splitlines()


def test_the_reference_stays_under_800_lines() -> None:
    assert len(DOC.splitlines()) < MAX_LINES


def test_every_table_is_preceded_in_its_section_by_the_command_that_produced_it() -> None:
    blocks, prose = _blocks_and_prose(DOC)
    section_start = 0
    lines = dict(prose)
    tables = 0
    for number, line in prose:
        if re.match(r"#{2,3} ", line):
            section_start = number
        is_table = line.startswith("|") and re.match(r"\|[ :]*-", lines.get(number + 1, ""))
        if not is_table:
            continue
        tables += 1
        commands = [
            b for start, b in blocks if section_start < start < number and COMMAND.search(b)
        ]
        assert commands, f"table at line {number + 1} ({line[:60]!r}) has no command before it"
    assert tables >= 15  # the rule is checked on the real tables, not on a parse that found none


def test_the_commands_it_names_exist() -> None:
    blocks, _ = _blocks_and_prose(DOC)
    benchmarks = _bench_subcommands()
    named = 0
    for _, block in blocks:
        for line in _commands(block):
            for name, rest in BENCH_CLI.findall(line):
                assert name in benchmarks, f"no `poolkeeper bench {name}`: {line}"
                known = benchmarks[name]
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest):
                    assert flag in known, f"`poolkeeper bench {name}` has no {flag}: {line}"
                named += 1
            for module in MODULE.findall(line):
                assert importlib.util.find_spec(module) is not None, module
                named += 1
    assert named >= 15


def test_no_commit_hashes_in_the_reference() -> None:
    assert HASH.findall(DOC) == []


def test_every_note_is_indexed() -> None:
    index = (DOCS / "notes" / "README.md").read_text()
    notes = sorted(p.name for p in (DOCS / "notes").glob("*.md") if p.name != "README.md")
    assert notes
    for name in notes:
        assert f"({name})" in index, f"docs/notes/README.md does not link {name}"


def _bench_subcommands() -> dict[str, set[str]]:
    """`poolkeeper bench` subcommand -> its option strings, from the real CLI parser."""

    def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    bench = subparsers(build_parser())["bench"]
    return {
        name: {flag for action in sub._actions for flag in action.option_strings}
        for name, sub in subparsers(bench).items()
    }
