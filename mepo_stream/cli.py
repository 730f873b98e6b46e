"""The ``mepo`` command: subcommands mapped to typed functions (LitGPT's pattern, via jsonargparse).

Subcommands are entry points in the ``mepo.commands`` group (see ``pyproject.toml``), so this core module
never imports the packages that implement them (``offline``, ``server``, ``producers``). A dotted name such
as ``backbone.import`` becomes the nested command ``mepo backbone import``. Each function's config
dataclasses become option groups (``--learner.lr``) whose help text is the fields' docstrings; ``--config
FILE.yaml`` loads a recipe and ``--print_config`` dumps the resolved one. Options accept dashes or
underscores (``--mepo-cov`` = ``--mepo_cov``).
"""

from __future__ import annotations

import logging
import re
import sys
from importlib.metadata import entry_points

COMMANDS_GROUP = "mepo.commands"


def commands() -> dict:
    """The nested ``{name: function | {name: function}}`` map of every installed subcommand.

    A group's help (``_help``) is the first line of the docstring of the module implementing its commands.
    """
    tree: dict = {}
    for ep in entry_points(group=COMMANDS_GROUP):
        *parents, leaf = ep.name.split(".")
        node = tree
        command = ep.load()
        for p in parents:
            node = node.setdefault(p, {})
            node.setdefault("_help", (sys.modules[command.__module__].__doc__ or "").strip().split("\n")[0])
        node[leaf] = command
    return tree


def _underscore_options(argv: list[str]) -> list[str]:
    """``--mepo-cov=x`` -> ``--mepo_cov=x``: dashes inside long option names become underscores."""
    def fix(arg: str) -> str:
        m = re.match(r"^--([^=]+)(=.*)?$", arg)
        return f"--{m.group(1).replace('-', '_')}{m.group(2) or ''}" if m else arg
    return [fix(a) for a in argv]


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import CLI, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)  # kafka-python narrates every connection at INFO
    args = _underscore_options(sys.argv[1:] if argv is None else argv)
    CLI(commands(), args=args, as_positional=False, prog="mepo",
        description="MePo streaming continual learner: refine, evaluate, serve.")


if __name__ == "__main__":
    main()
