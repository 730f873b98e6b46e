"""MkDocs hook: the pages' generated parts, made from the code at build time so they cannot go stale.

* ``<!-- generated:cli -->`` (cli.md): every ``mepo`` subcommand's ``--help``, as the installed CLI prints it.
* ``<!-- generated:routes -->`` (http-api.md): every route of the served OpenAPI schema, with its summary and the
  statuses it answers.
* ``<!-- generated:readme -->`` (index.md): the README, its links made relative to the docs folder: the front
  page and the README are one text.
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
    return re.sub(r"\[([^\]]+)\]\((?!https?:)([^)]+/[^)]*)\)", r"\1 (`\2`)", text)


GENERATED = {"<!-- generated:cli -->": cli_reference, "<!-- generated:routes -->": route_table,
             "<!-- generated:readme -->": readme}


def on_page_markdown(markdown: str, page, config, files) -> str:
    for marker, make in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
