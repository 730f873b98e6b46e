"""MkDocs hook: the pages' generated parts, made from the code at build time so they cannot go stale.

* ``<!-- generated:cli -->`` (cli.md): every ``mepo`` subcommand's ``--help``, as the installed CLI prints it.
* ``<!-- generated:routes -->`` (http-api.md): every route of the served OpenAPI schema, with its summary and the
  statuses it answers.
* ``<!-- generated:readme -->`` (index.md): the README, its links made relative to the docs folder: the front
  page and the README are one text.

The README's "what to expect" rows are written from ``benchmarks/results/expect.json`` between its
``<!-- expect:start -->`` and ``<!-- expect:end -->`` markers by ``python docs/_hooks/generated.py readme``
(GitHub shows the README as it is, so they are written into the file; ``tests/test_numbers.py`` fails when they
differ from the file).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _help(command: list[str]) -> str:
    from mepo_stream.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*command, "--help"])
    return out.getvalue().rstrip()


def _commands(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, node in sorted(tree.items()):
        if name.startswith("_"):
            continue
        out += _commands(node, (*prefix, name)) if isinstance(node, dict) else [(*prefix, name)]
    return out


def cli_reference() -> str:
    from mepo_stream.cli import commands

    os.environ.setdefault("COLUMNS", "110")
    sections = []
    for command in [(), *_commands(commands())]:
        name = " ".join(("mepo", *command))
        sections.append(f"### `{name}`\n\n```text\n{_help(list(command))}\n```\n")
    return "\n".join(sections)


def route_table() -> str:
    from server.config import ServeConfig
    from server.web.app import create_app

    schema = create_app(ServeConfig()).openapi()
    rows = ["| method | route | what | statuses |", "|---|---|---|---|"]
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            statuses = ", ".join(sorted(op.get("responses", {})))
            rows.append(f"| {method.upper()} | `{path}` | {op.get('summary', '')} | {statuses} |")
    return "\n".join(rows)


def readme() -> str:
    """README.md with ``docs/x`` links as ``x``, and links into the repository as code paths."""
    text = (ROOT / "README.md").read_text().replace("](docs/", "](")

    def link(m: re.Match) -> str:
        target = m.group(2).split("#")[0]
        return m.group(0) if (ROOT / "docs" / target).is_file() else f"{m.group(1)} (`{m.group(2)}`)"

    return re.sub(r"\[([^\]]+)\]\((?!https?:)([^)]+/[^)]*)\)", link, text)


EXPECT = ROOT / "benchmarks" / "results" / "expect.json"
EXPECT_START, EXPECT_END = "<!-- expect:start -->", "<!-- expect:end -->"


def minutes(seconds: float) -> str:
    """``305`` as ``5 min 5 s``."""
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def expect_rows(expect: dict | None = None) -> str:
    """The README's "what to expect" table: one row per CPU kind of ``expect.json``."""
    import json

    expect = expect or json.loads(EXPECT.read_text())
    rows = ["| CPU, 2 cores (precision) | `make demo`, with setup | its A_last | `make test` | `make test-fast` |",
            "|---|---|---|---|---|"]
    for m in expect["machines"]:
        cpu = f"{m['cpu']} ({m['precision']}" + (f": `{m['env']}`" if m["env"] else "") + ")"
        demo, test, fast = m["demo"], m["test"], m["test_fast"]
        wall = f"{minutes(test['wall_s'])} wall" + (" with setup" if test["with_setup"] else ", setup not timed")
        tests = f"{minutes(test['pytest_s'])} of pytest, {test['passed']} passed ({wall})"
        quick = f"{minutes(fast['pytest_s'])}, {fast['passed']} passed" if fast else "–"
        rows.append(f"| {cpu} | {minutes(demo['wall_s'])} | {demo['a_last']:.2f} | {tests} | "
                    f"{quick} |")
    return "\n".join(rows)


def write_readme_expect(readme: Path = ROOT / "README.md") -> None:
    """Rewrite the README's "what to expect" rows from ``expect.json``."""
    text = readme.read_text()
    head, rest = text.split(EXPECT_START, 1)
    readme.write_text(f"{head}{EXPECT_START}\n{expect_rows()}\n{EXPECT_END}{rest.split(EXPECT_END, 1)[1]}")


GENERATED = {"<!-- generated:cli -->": cli_reference, "<!-- generated:routes -->": route_table,
             "<!-- generated:readme -->": readme}


def on_page_markdown(markdown: str, page, config, files) -> str:
    for marker, make in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["readme"]:
        sys.exit("usage: python docs/_hooks/generated.py readme   (rewrites README.md's what-to-expect rows)")
    write_readme_expect()
