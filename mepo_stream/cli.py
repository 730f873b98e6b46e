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

import contextlib
import dataclasses
import faulthandler
import functools
import io
import json
import logging
import re
import sys
import textwrap
import typing
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

import yaml

from mepo_stream.errors import ConfigError
from mepo_stream.recipes import mark_given, typed_under
from mepo_stream.shutdown import Stopped, stop_signals

COMMANDS_GROUP = "mepo.commands"


EXTRAS = {"server": "server", "producers": "kafka"}
"""The extra that brings what the commands of each package import beyond the core library (``pyproject.toml``)."""
OURS = ("mepo_stream", "offline", "server", "producers")


def commands() -> dict:
    """The nested ``{name: function | {name: function}}`` map of every installed subcommand that can run here.

    A group's help (``_help``) is the first line of the docstring of the module implementing its commands.
    """
    return _load_commands()[0]


def _load_commands(asked: str | None = None) -> tuple[dict, dict[tuple[str, ...], str]]:
    """The commands (``commands``), and those whose packages this install leaves out, each with the error that says
    which extra brings them (``mepo serve`` on a bare ``pip install``). ``asked``: a command or group name; only
    its entry points are loaded when it names one (``mepo produce`` then imports neither the server nor torch's
    model stack, and builds the parser of one command), else all."""
    tree: dict = {}
    missing: dict[tuple[str, ...], str] = {}
    found = entry_points(group=COMMANDS_GROUP)
    for ep in [ep for ep in found if ep.name.split(".")[0] == asked] or found:
        *parents, leaf = ep.name.split(".")
        node = tree
        try:
            command = ep.load()
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in OURS:  # our own module: a bug, not a missing extra
                raise
            extra = EXTRAS.get(ep.value.split(".")[0], "test")
            missing[(*parents, leaf)] = (f"mepo {' '.join([*parents, leaf])} needs the {extra} extra, which this "
                                         f"install leaves out (no module {e.name!r}): "
                                         f"pip install 'mepo-stream[{extra}]'")
            continue
        for p in parents:
            node = node.setdefault(p, {})
            node.setdefault("_help", (sys.modules[command.__module__].__doc__ or "").strip().split("\n")[0])
        node[leaf] = command
    return tree, missing


def config_of(command: Callable) -> type | None:
    """The config dataclass a command takes as its one parameter, else None."""
    try:
        params = [(name, hint) for name, hint in typing.get_type_hints(command).items() if name != "return"]
    except (NameError, TypeError):  # hints it cannot resolve: not a config command
        return None
    if len(params) == 1 and isinstance(hint := params[0][1], type) and dataclasses.is_dataclass(hint):
        return hint
    return None


def inherited_from(config: type, configs: list[type]) -> type | None:
    """The other command's config that ``config`` extends (``ExportConfig`` extends ``ServeConfig``), else None."""
    return next((base for base in config.__mro__[1:] if base in configs), None)


def brief_help(text: str, own: set[str], command: str, parent: str) -> str:
    r"""The ``--help`` of ``command``, whose config extends ``parent``'s: its own options in full, first, and the
    inherited ones by name and by group, behind a pointer to the other command's help (``mepo export --help`` was
    hundreds of lines of ``mepo serve``'s options).

    Example:
        >>> full = ("usage: mepo [-h]\n       [--kafka.topic T]\n\nExports.\n\noptions:\n"
        ...         "  -h, --help  Show this help.\n  --port PORT  The port.\n  --out OUT  Where.\n"
        ...         "              (default: x)\n\nBroker:\n  --kafka.topic T  The topic.\n")
        >>> print(brief_help(full, {"out"}, "mepo export", "serve"))
        usage: mepo export [options]
        <BLANKLINE>
        Exports.
        <BLANKLINE>
        options:
          -h, --help  Show this help.
          --out OUT  Where.
                      (default: x)
        <BLANKLINE>
        Every mepo serve option applies too; mepo serve --help documents each:
          * --port
          * --kafka.*: Broker (1 option)
    """
    def name(entry: str) -> str:
        found = re.search(r"--([\w.]+)", entry)
        assert found is not None, entry  # argparse lists every option by its long name
        return found.group(1)

    kept, inherited = [f"usage: {command} [options]"], []
    groups: dict[str, tuple[str, int]] = {}
    for section in text.rstrip("\n").split("\n\n")[1:]:
        lines = section.split("\n")
        entries: list[list[str]] = []
        for line in lines[1:]:
            if line.startswith("  -"):
                entries.append([line])
            elif entries:
                entries[-1].append(line)
        if not entries:  # the description
            kept.append(section)
        elif lines[0] == "options:":
            mine = [e for e in entries if name(e[0]) in own | {"help", "config", "print_config"}]
            kept.append("\n".join([lines[0], *(line for e in mine for line in e)]))
            inherited += [f"--{name(e[0])}" for e in entries if e not in mine]
        elif (group := name(entries[0][0]).split(".")[0]) in own:
            kept.append(section)
        else:
            title, count = groups.setdefault(group, (lines[0].rstrip(":"), 0))
            groups[group] = title, count + sum(1 for e in entries if "." in name(e[0]))
    listed = textwrap.wrap(", ".join(inherited), 116, initial_indent="  * ", subsequent_indent="    ")
    listed += [f"  * --{g}.*: {title} ({n} option{'s' * (n != 1)})" for g, (title, n) in groups.items()]
    pointer = f"Every mepo {parent} option applies too; mepo {parent} --help documents each:"
    return "\n\n".join(kept) + ("\n\n" + "\n".join([pointer, *listed]) if listed else "")


def _brief(tree: dict, argv: list[str]) -> tuple[set[str], str, str] | None:
    """For ``--help`` of a command whose config extends another command's: its own option names, its command line
    and the other command's name (``brief_help``); else None."""
    node: object = tree
    path: list[str] = []
    for arg in argv:
        if arg.startswith("-") or not isinstance(node, dict) or arg not in node:
            break
        node, path = node[arg], [*path, arg]
    names = {config: name for name, config in tree.items() if isinstance(config, type)}
    parent = inherited_from(node, list(names)) if isinstance(node, type) else None
    if parent is None:
        return None
    return set(vars(node).get("__annotations__", {})), " ".join(["mepo", *path]), names[parent]


def _flatten(tree: dict, runners: dict[type, Callable], typed: frozenset[str] = frozenset()) -> dict:
    """Replace each config-taking command by its dataclass (jsonargparse then parses the fields as top-level
    options and returns the instance); ``runners`` maps the dataclass back to the command. Other commands get
    their config arguments marked with the ``typed`` options (``marking_typed``)."""
    out: dict[str, object] = {}
    for name, node in tree.items():
        if isinstance(node, dict):
            out[name] = _flatten(node, runners, typed)
        elif callable(node) and (config := config_of(node)) is not None:
            runners[config], out[name] = node, config
        else:
            out[name] = marking_typed(node, typed) if callable(node) else node
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


def given_options(argv: list[str]) -> frozenset[str]:
    """The dotted option names a command line gives: those typed, and the fields a config file it names sets
    (``--config FILE``, or a group's ``--loop FILE.yaml``), which count as given as typed ones do.

    Example:
        >>> sorted(given_options(["refine", "--preset", "best", "--loop.head=mlp", "--out", "-"]))
        ['loop.head', 'out', 'preset']
    """
    given: set[str] = set()
    for i, arg in enumerate(argv):
        if not (m := re.match(r"^--([^=]+)(?:=(.*))?$", arg)):
            continue
        name, value = m.group(1), m.group(2) if m.group(2) is not None else next(iter(argv[i + 1:]), None)
        values = _file_values(value)
        if values is None:
            given.add(name)
        else:
            given |= {name if key == "" else key if name == "config" else f"{name}.{key}"
                      for key in _dotted(values)}
    return frozenset(given)


def _file_values(value: str | None) -> dict | None:
    """The values of a YAML or JSON config file an option names, else None."""
    path = Path(value) if value else None
    if path is None or path.suffix not in (".yaml", ".yml", ".json") or not path.is_file():
        return None
    loaded = yaml.safe_load(path.read_text())
    return loaded if isinstance(loaded, dict) else {}


def _dotted(values: dict, prefix: str = "") -> list[str]:
    """A nested config's field names, dotted (``{"loop": {"head": "mlp"}}`` -> ``loop.head``)."""
    return [name for key, value in values.items()
            for name in (_dotted(value, f"{prefix}{key}.") if isinstance(value, dict) and value
                         else [f"{prefix}{key}"])]


def marking_typed(command: Callable, typed: frozenset[str]) -> Callable:
    """``command``, its config arguments marked with the options typed for them (``mepo_stream.recipes.mark_given``),
    so a recipe it layers under them (``mepo refine --preset``) keeps what the user typed, as it keeps what a
    Python caller passed."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        for name, value in kwargs.items():
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                mark_given(value, typed_under(name, typed))
        return command(*args, **kwargs)
    return run


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
    return _parser().parse_args(_underscore_options(argv))


@functools.cache
def _parser():
    """The whole CLI's parser, built once: building it takes most of a check's time."""
    from jsonargparse import auto_parser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    return auto_parser(_flatten(commands(), {}), as_positional=False, prog="mepo")


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import CLI, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)  # kafka-python narrates every connection at INFO
    # its network loop warns when one of its steps took over 0.1 s: on a busy CPU the model's steps hold the
    # interpreter lock that long, which slows the client's thread but breaks nothing (timeouts are seconds)
    logging.getLogger("kafka.net.selector").setLevel(logging.ERROR)
    # a crash in native code (a segfault, an abort) prints every thread's stack as it dies, to file descriptor 2
    # (whoever calls ``main`` may have swapped sys.stderr for a stream that has none)
    faulthandler.enable(file=2)
    args = _underscore_options(sys.argv[1:] if argv is None else argv)
    runners: dict[type, Callable] = {}
    asked = tuple(a for a in args[:2] if not a.startswith("-"))
    helped = bool({"-h", "--help"} & set(args))  # help lists every command, and a command's help its parent's
    available, missing = _load_commands(None if helped or not asked else asked[0])
    if asked and (
            reason := missing.get(asked) or missing.get(asked[:1])):
        print(f"mepo: error: {reason}", file=sys.stderr)
        raise SystemExit(2)
    tree = _flatten(available, runners, given_options(args))
    cli = functools.partial(CLI, tree, args=args, as_positional=False, prog="mepo",
                            description="MePo streaming continual learner: refine, evaluate, serve.")
    if helped and (brief := _brief(tree, args)) is not None:
        full = io.StringIO()
        with contextlib.redirect_stdout(full), contextlib.suppress(SystemExit):
            cli()
        print(brief_help(full.getvalue(), *brief))
        raise SystemExit(0)  # as argparse's own --help
    try:
        with stop_signals():  # SIGTERM takes SIGINT's path: every command's cleanup runs (mepo_stream.shutdown)
            result = cli()
            if type(result) in runners:
                runners[type(result)](result)
    except ConfigError as e:  # the user's to fix: one line, no traceback
        print(f"mepo: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except Stopped as stop:  # stopped before its work was done; its cleanup has run
        print(f"mepo: stopped by {stop.name}", file=sys.stderr)
        raise SystemExit(stop.exit_code) from None


if __name__ == "__main__":
    main()
