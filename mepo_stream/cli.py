"""The ``mepo`` command: subcommands mapped to typed functions (LitGPT's pattern, via jsonargparse).

Subcommands are entry points in the ``mepo.commands`` group (see ``pyproject.toml``), so this core module
never imports the packages that implement them (``offline``, ``server``, ``producers``). A dotted name such
as ``backbone.import`` becomes the nested command ``mepo backbone import``. Each function's config
dataclasses become option groups (``--learner.lr``) whose help text is the fields' docstrings; ``--config
FILE.yaml`` loads a recipe and ``--print_config`` dumps the resolved one. Options accept dashes or
underscores (``--mepo-cov`` = ``--mepo_cov``).

A command whose one parameter is a config dataclass (``serve(cfg: ServeConfig)``) takes that dataclass's
fields as its own options (``mepo serve --learner.lr 1e-3 --port 8000``, not ``--cfg.learner.lr``), so the
service and ``mepo evaluate`` share option names.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import typing
from collections.abc import Callable
from contextvars import ContextVar
from importlib.metadata import entry_points
from pathlib import Path

from mepo_stream.errors import ConfigError
from mepo_stream.shutdown import Stopped, stop_signals

COMMANDS_GROUP = "mepo.commands"
TYPED: ContextVar[frozenset[str]] = ContextVar("TYPED", default=frozenset())
"""The options typed on the running command's line (``loop.head`` for ``--loop.head``), for a command that layers
defaults of its own under them (``mepo refine --preset``: what the user typed wins, even at its default value)."""


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


def config_of(command: Callable) -> type | None:
    """The config dataclass a command takes as its one parameter, else None."""
    try:
        params = [(name, hint) for name, hint in typing.get_type_hints(command).items() if name != "return"]
    except (NameError, TypeError):  # hints it cannot resolve: not a config command
        return None
    if len(params) == 1 and dataclasses.is_dataclass(params[0][1]):
        return params[0][1]
    return None


def _flatten(tree: dict, runners: dict[type, Callable]) -> dict:
    """Replace each config-taking command by its dataclass (jsonargparse then parses the fields as top-level
    options and returns the instance); ``runners`` maps the dataclass back to the command."""
    out = {}
    for name, node in tree.items():
        if isinstance(node, dict):
            out[name] = _flatten(node, runners)
        elif callable(node) and (config := config_of(node)) is not None:
            runners[config], out[name] = node, config
        else:
            out[name] = node
    return out


def config_options(config, prefix: str = "--") -> list[str]:
    """A config dataclass as the command-line options that parse back to it (nested groups flattened), so a
    config object reaches a command exactly, with nothing restated.

    Example:
        >>> from mepo_stream.anytime import ProtocolConfig
        >>> config_options(ProtocolConfig(eval_period=0), "--protocol.")
        ['--protocol.eval_period', '0', '--protocol.eval_batch_size', '128']
    """
    options: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            options += config_options(value, f"{prefix}{f.name}.")
        else:  # strings and paths as they are; None, booleans, numbers and sequences as YAML/JSON scalars
            text = str(value) if isinstance(value, str | Path) else json.dumps(list(value) if isinstance(
                value, tuple) else value)
            options += [f"{prefix}{f.name}", text]
    return options


def typed_options(argv: list[str]) -> frozenset[str]:
    """The option names on a command line, without their dashes.

    Example:
        >>> sorted(typed_options(["refine", "--preset", "best", "--loop.head=mlp", "--out", "-"]))
        ['loop.head', 'out', 'preset']
    """
    return frozenset(m.group(1) for a in argv if (m := re.match(r"^--([^=]+)", a)))


def typed(prefix: str) -> frozenset[str]:
    """The fields of option group ``prefix`` typed on the running command's line (empty outside the CLI).

    Example:
        >>> token = TYPED.set(frozenset({"loop.head", "loop.lr_head", "out"}))
        >>> sorted(typed("loop"))
        ['head', 'lr_head']
        >>> TYPED.reset(token)
    """
    return frozenset(name.removeprefix(f"{prefix}.") for name in TYPED.get() if name.startswith(f"{prefix}."))


def _underscore_options(argv: list[str]) -> list[str]:
    """``--mepo-cov=x`` -> ``--mepo_cov=x``: dashes inside long option names become underscores."""
    def fix(arg: str) -> str:
        m = re.match(r"^--([^=]+)(=.*)?$", arg)
        return f"--{m.group(1).replace('-', '_')}{m.group(2) or ''}" if m else arg
    return [fix(a) for a in argv]


def parse(argv: list[str]) -> object:
    """Check a command line against the CLI without running it: the parsed namespace, or ``SystemExit`` with the
    CLI's error message (the docs' command examples are checked this way, in the test suite).

    Example:
        >>> parse(["produce", "--replay.partitions", "4"]).subcommand
        'produce'
    """
    from jsonargparse import auto_parser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = auto_parser(_flatten(commands(), {}), as_positional=False, prog="mepo")
    return parser.parse_args(_underscore_options(argv))


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import CLI, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)  # kafka-python narrates every connection at INFO
    args = _underscore_options(sys.argv[1:] if argv is None else argv)
    runners: dict[type, Callable] = {}
    token = TYPED.set(typed_options(args))
    try:
        with stop_signals():  # SIGTERM takes SIGINT's path: every command's cleanup runs (mepo_stream.shutdown)
            result = CLI(_flatten(commands(), runners), args=args, as_positional=False, prog="mepo",
                         description="MePo streaming continual learner: refine, evaluate, serve.")
            if type(result) in runners:
                runners[type(result)](result)
    except ConfigError as e:  # the user's to fix: one line, no traceback
        print(f"mepo: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except Stopped as stop:  # stopped before its work was done; its cleanup has run
        print(f"mepo: stopped by {stop.name}", file=sys.stderr)
        raise SystemExit(stop.exit_code) from None
    finally:
        TYPED.reset(token)


if __name__ == "__main__":
    main()
