"""The ``mepo`` command end to end on tiny settings: help texts, covariance, import, evaluate."""

import contextlib
import functools
import io
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import timm
import torch

from mepo_stream.artifacts import load_sigma_pre, read_manifest
from mepo_stream.cli import COMMANDS_GROUP, main

TINY = ["--backbone.name", "test_vit", "--backbone.weights", "null", "--backbone.img_size", "32"]


def subcommands() -> list[tuple[str, ...]]:
    """Every command path: the root, each group (``backbone``) and each leaf (``backbone import``)."""
    names = [ep.name.split(".") for ep in entry_points(group=COMMANDS_GROUP)]
    return sorted({tuple(parts[:i]) for parts in names for i in range(len(parts) + 1)})


@functools.cache
def help_text(command: tuple[str, ...]) -> str:
    """``mepo COMMAND --help`` as printed, once per command (the help tests share it)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    return out.getvalue()


def help_entries(text: str) -> dict[str, str]:
    """Option (long form) or subcommand -> its help text, without the ``(type: ..., default: ...)`` suffix."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if m := re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line):  # "  --opt METAVAR   help"
            name = re.findall(r"(?:^|, )(-{1,2}\w(?:[\w.]*\w)?)", m.group(1))[-1]  # the long form, not a choice
            current = entries.setdefault(name, [m.group(2) or ""])
        elif m := re.match(r"^    (\w+)(?:\s{2,}(\S.*))?$", line):  # a subcommand: "    import   help"
            current = entries.setdefault(m.group(1), [m.group(2) or ""])
        elif current is not None and re.match(r"^ {8,}\S", line):  # the help text goes on
            current.append(line.strip())
        else:
            current = None
    joined = {name: " ".join(parts).strip() for name, parts in entries.items()}
    return {name: re.sub(r"\s*\((?:required, )?type: .*\)$", "", text) for name, text in joined.items()}


@dataclass(frozen=True)
class _Settings:
    documented: int = 1
    """Says what it is."""
    undocumented: str = "x"


def _command(cfg: _Settings = _Settings(), out: Path | None = None, count: int = 3) -> None:
    """A command.

    Args:
        cfg: Its settings.
        out: Where it writes,
            over two lines.
    """


def test_help_entries_finds_the_options_without_help(capsys):
    """The check below can fail: jsonargparse's help for an undocumented field and argument, read back."""
    from jsonargparse import CLI, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    with pytest.raises(SystemExit):
        CLI({"command": _command}, args=["command", "--help"], as_positional=False, prog="x")
    entries = help_entries(capsys.readouterr().out)
    assert entries["--cfg.documented"] == "Says what it is." and entries["--out"] == "Where it writes, over two lines."
    assert entries["--cfg.undocumented"] == "" and entries["--count"] == ""


@pytest.mark.parametrize("command", subcommands(), ids=lambda c: " ".join(c) or "mepo")
def test_help_explains_every_option_of_every_command(command):
    out = help_text(command)
    usage = out.split("\n\n", 1)[0]
    assert usage.startswith("usage: mepo"), usage
    entries = help_entries(out)
    options = set(re.findall(r"--[\w.]+", usage))
    assert options <= entries.keys(), f"options in the usage without an entry: {options - entries.keys()}"
    missing = sorted(name for name, text in entries.items() if not text)
    assert not missing, f"mepo {' '.join(command)}: options without help text: {missing}"
    below = {c[-1] for c in subcommands() if c and c[:-1] == command}  # a group lists its subcommands, with help
    assert below <= entries.keys(), f"subcommands not listed: {below - entries.keys()}"


def test_serve_args_give_mepo_serve_exactly_the_config(tmp_path, monkeypatch):
    """What the crash tests' ``mepo serve`` processes run is the ServeConfig the tests built, every field."""
    import functools
    from dataclasses import replace
    from types import SimpleNamespace

    import server.serve
    from tests.helpers import serve_args, settings

    cfg = settings(SimpleNamespace(bootstrap="127.0.0.1:9"), tmp_path, mepo=tmp_path / "bundle", learn_replays=True)
    cfg = replace(cfg, learner=replace(cfg.learner, slda_shrinkage=(0.1, 0.3), lr=1e-6, precision="fp32"),
                  kafka=replace(cfg.kafka, sasl_plain_password="pw 1", group_id="123"))
    received = []

    @functools.wraps(server.serve.serve)
    def serve(cfg=None):
        received.append(cfg)

    monkeypatch.setattr(server.serve, "serve", serve)  # what the entry point loads
    main(["serve", *serve_args(cfg)])
    assert received == [cfg]


def test_covariance_writes_a_verified_bundle(tmp_path):
    main(["covariance", "--out", str(tmp_path / "cov"), *TINY, "--cov.data.dataset", "cifar10",
          "--cov.data.train_per_class", "8"])
    manifest = read_manifest(tmp_path / "cov")
    assert manifest["covariance"]["n_classes"] == 10 and manifest["backbone"]["name"] == "test_vit"
    sigma = load_sigma_pre(tmp_path / "cov")
    assert sigma.shape == (64, 64) and sigma.dtype == torch.float64


def test_backbone_import_makes_a_usable_bundle(tmp_path):
    model = timm.create_model("test_vit", pretrained=False, num_classes=0)
    torch.save(model.state_dict(), tmp_path / "vit_test_meta_1.pth")
    import numpy as np

    np.save(tmp_path / "cov.npy", np.eye(64))
    main(["backbone", "import", "--source", str(tmp_path / "vit_test_meta_1.pth"), "--out", str(tmp_path / "b"),
          "--backbone.name", "test_vit", "--mepo_cov", str(tmp_path / "cov.npy")])
    assert set(read_manifest(tmp_path / "b")["files"]) == {"backbone.safetensors", "sigma_pre.safetensors"}
    from mepo_stream.backbone import BackboneConfig, create_backbone

    loaded = create_backbone(BackboneConfig("test_vit", str(tmp_path / "b"), 224))
    assert torch.equal(loaded.cls_token, model.cls_token)


def test_evaluate_end_to_end(tmp_path):
    sigma_dir = tmp_path / "cov"
    main(["covariance", "--out", str(sigma_dir), *TINY, "--cov.data.dataset", "cifar10",
          "--cov.data.train_per_class", "8"])
    main(["evaluate", "--out", str(tmp_path / "ev"), "--seed", "1-2", "--mepo-cov", str(sigma_dir), *TINY,
          "--data.dataset", "cifar10", "--data.train_per_class", "20", "--data.test_per_class", "5",
          "--protocol.eval_period", "50", "--learner.samples_per_slot", "40"])
    result = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert [r["seed"] for r in result["runs"]] == [1, 2]
    curve = result["runs"][0]["curves"]["running"]
    assert curve["samples"] == [50, 100, 150, 200] and 0 <= curve["A_auc"] <= 1
    assert len(curve["task_accuracy"]) >= 1
    table = (tmp_path / "ev" / "table.md").read_text()
    assert "| running |" in table and "| batch |" in table and "±" in table
    assert (tmp_path / "ev" / "anytime_accuracy.png").stat().st_size > 10_000


def test_sweep_of_methods_with_mepo_writes_table1_ablation_and_reuses_cached_runs(tmp_path):
    import numpy as np

    torch.save(timm.create_model("test_vit", pretrained=False, num_classes=0).state_dict(), tmp_path / "w.pth")
    np.save(tmp_path / "cov.npy", np.eye(64))
    main(["backbone", "import", "--source", str(tmp_path / "w.pth"), "--out", str(tmp_path / "bundle"),
          "--backbone.name", "test_vit", "--mepo_cov", str(tmp_path / "cov.npy")])
    args = ["evaluate", "--out", str(tmp_path / "sweep"), "--seed", "1", "--method", "misa,linear_probe",
            "--mepo", str(tmp_path / "bundle"), "--ablation", "true", *TINY, "--data.dataset", "cifar10",
            "--data.train_per_class", "10", "--data.test_per_class", "3", "--protocol.eval_period", "50"]
    main(args)
    result = json.loads((tmp_path / "sweep" / "results.json").read_text())
    done = sorted((r["method"], r["variant"]) for r in result["runs"])
    assert done == [("linear_probe", "host"), ("misa", "cov"), ("misa", "host"), ("misa", "mepo"), ("misa", "rep")]
    table = (tmp_path / "sweep" / "table.md").read_text()
    assert "| method | A_AUC w/o MePo | A_AUC w/ MePo |" in table and "**" in table
    assert "| linear_probe |" in table and "–" in table  # lower bounds run without MePo only
    assert "Meta Rep A_AUC" in (tmp_path / "sweep" / "ablation.md").read_text()
    assert "A_last ÷ probe w/o" in table and "Ceiling (offline heads" in table and "best offline head" in table
    assert set(result["ceiling"]) == {"w/o Meta Rep", "Meta Rep"}  # one probe per backbone
    assert all(0 < r["ceiling"] <= r["best_offline_head"] <= 1 for r in result["runs"])
    cache = tmp_path / "sweep" / "cache"
    ceilings = sorted(p.name for p in cache.iterdir() if p.name.startswith("ceiling-"))
    cached = sorted(p.name for p in cache.iterdir() if not p.name.startswith("ceiling-"))
    assert len(cached) == 5 and len(ceilings) == 2
    marked = cache / cached[0]
    run = json.loads(marked.read_text())
    run["wall_time_s"] = -1.0  # a value no computation produces: it can only come from the cache
    marked.write_text(json.dumps(run))
    main(args)  # a re-run reuses every finished run
    rerun = json.loads((tmp_path / "sweep" / "results.json").read_text())["runs"]
    assert -1.0 in [r["wall_time_s"] for r in rerun] and len(rerun) == 5
    assert sorted(p.name for p in cache.iterdir()) == sorted(cached + ceilings)  # nothing computed again


def option_types(command: tuple[str, ...]) -> dict[str, str]:
    """Option -> its type as ``--help`` states it, with None-ability left out (an optional path is a path)."""
    text = re.sub(r"\n {8,}", " ", help_text(command))  # one line per option
    types = {}
    for name, kind in re.findall(r"^  (?:-\S+, )?(--[\w.]+).*?\((?:required, )?type: (.*?), default: ", text, re.M):
        kind = re.sub(r"<class '(\w+)'>", r"\1", kind)
        types[name] = re.sub(r"^Optional\[(.*)\]$", r"\1", re.sub(r" \| (null|None)|(null|None) \| ", "", kind))
    return types


SYNONYMS = {
    "--mepo": r"--([\w.]+\.)?\w*bundle\w*",
    "--method": r"--[\w.]+\.method|--\w+_method|--methods",
    "--seed": r"--seeds|--\w+_seeds?|--random_state",
    "--method_config": r"--[\w.]+\.method_configs?|--(?!method_config$)\w*methods?_configs?|--configs",
    "--replay.*": r"--(rate|limit|partitions|replay_\w+)",
    "--mepo_cov": r"--covariance|--sigma_pre\w*|--cov_\w+",
    "--backbone.name": r"--name|--arch\w*",
}
"""Each meaning -> the names it once had or could slip into (an option matching one fails the test): the bundle
is --mepo, a host method --method (evaluate's takes a list too) with its settings --method_config, a seed --seed
(evaluate's takes a list too), the producer's pace and size --replay.*, Sigma_pre --mepo_cov and an architecture
--backbone.name, in every command."""
LISTS = {"--seed": "int"}
"""Options whose ``mepo evaluate`` form takes one value or a list of them (``--seed 1-5``), typed ``str`` there."""


def group_fields(options: set[str]) -> dict[str, set[str]]:
    """Option group (every dotted prefix) -> the options under it, relative (``--cov`` -> {augment, data.dataset})."""
    groups: dict[str, set[str]] = {}
    for name in options:
        parts = name.split(".")
        for i in range(1, len(parts)):
            groups.setdefault(".".join(parts[:i]), set()).add(".".join(parts[i:]))
    return groups


def test_one_option_name_means_one_thing_across_all_commands():
    """Same name => same meaning: an option has one type in every command, and an option group the same options
    (one command's may add to another's, as refine's --cov adds skip to covariance's); same meaning => same name:
    none of the known synonyms is an option anywhere."""
    seen: dict[str, dict[str, str]] = {}
    groups: dict[str, dict[str, set[str]]] = {}
    for command in subcommands():
        if command and command[-1] not in {"backbone"}:  # a group has no options of its own
            options = option_types(command)
            for name, kind in options.items():
                seen.setdefault(name, {})[" ".join(command)] = kind
            for group, fields in group_fields(set(options)).items():
                groups.setdefault(group, {})[" ".join(command)] = fields
    assert {"backbone import", "evaluate", "isa", "refine", "serve"} <= {c for by in seen.values() for c in by}
    assert len(seen) > 50
    conflicts = {name: by_command for name, by_command in seen.items() if len(set(by_command.values())) > 1
                 and not (name in LISTS and {k for c, k in by_command.items() if c != "evaluate"} == {LISTS[name]}
                          and by_command["evaluate"] == "str")}
    assert not conflicts, f"one option name, several types: {conflicts}"
    unlike = {group: {c: sorted(f) for c, f in by.items()} for group, by in groups.items()
              if any(not (a <= b or b <= a) for a in by.values() for b in by.values())}
    assert not unlike, f"one option group, different options: {unlike}"
    synonyms = {name: canonical for name in seen for canonical, pattern in SYNONYMS.items()
                if re.fullmatch(pattern, name)}
    assert not synonyms, {name: (f"use {canonical}", seen[name]) for name, canonical in synonyms.items()}
    assert "--stream.seed" not in {n for n, by in seen.items() if "evaluate" in by}  # evaluate's seeds: --seed
    precisions = {name: by for name, by in seen.items() if name.endswith(".precision")}
    assert len(precisions) >= 2 and len({k for by in precisions.values() for k in by.values()}) == 1, precisions


def test_each_command_function_carries_the_command_name():
    """No option group shadows its command: ``mepo refine`` is ``offline.refine:refine``, not a renamed function
    (nested commands are exempt: ``backbone import`` cannot be a Python function named ``import``)."""
    renamed = {ep.name: ep.value for ep in entry_points(group=COMMANDS_GROUP)
               if "." not in ep.name and ep.value.rsplit(":", 1)[1] != ep.name}
    assert not renamed, renamed


@pytest.mark.parametrize("command,own", [("export", "--format"), ("demo", "--replay.rate")])
def test_a_command_that_extends_serve_shows_its_own_options_first_and_points_to_serves(command, own):
    """``mepo export --help`` was 663 lines, nearly all of them ``mepo serve``'s options: now its own options come in
    full, and the inherited ones by name and group, behind a pointer (``mepo serve --help`` stays whole)."""
    text = help_text((command,))
    assert text.startswith(f"usage: mepo {command} [options]") and len(text.splitlines()) < 160
    assert own in help_entries(text) and "--learner.precision" not in help_entries(text)
    pointer = text.index("Every mepo serve option applies too; mepo serve --help documents each:")
    assert text.index(own) < pointer and "--kafka.*: Broker" in text[pointer:] and "--port" in text[pointer:]
    assert "--learner.precision" in help_entries(help_text(("serve",)))


def test_a_command_whose_extra_is_not_installed_says_which_to_install(monkeypatch, capsys):
    """A bare ``pip install`` leaves the server stack out: ``mepo serve`` then names the extra, in one line, where
    it would have failed on an import deep in the stack. A missing module of our own stays a bug, not an extra."""
    import importlib.metadata

    real = importlib.metadata.EntryPoint.load

    def load(ep):
        if ep.value.startswith("server."):
            raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")
        return real(ep)

    monkeypatch.setattr(importlib.metadata.EntryPoint, "load", load)
    with pytest.raises(SystemExit) as refused:
        main(["serve", "--port", "8000"])
    assert refused.value.code == 2
    assert "mepo serve needs the server extra" in (err := capsys.readouterr().err)
    assert "pip install 'mepo-stream[server]'" in err and "'fastapi'" in err
    with pytest.raises(SystemExit) as helped:
        main(["refine", "--help"])  # the core's commands still run
    assert helped.value.code == 0

    def ours(ep):
        raise ModuleNotFoundError("No module named 'server.gone'", name="server.gone")

    monkeypatch.setattr(importlib.metadata.EntryPoint, "load", ours)
    with pytest.raises(ModuleNotFoundError):
        main(["serve"])


@pytest.mark.parametrize("argv, loaded", [(["produce", "--nonsense"], set()),
                                          (["backbone", "import", "--nonsense"], {"offline"}),
                                          (["produce", "--help"], {"offline", "server"})])
def test_a_command_loads_only_the_package_that_implements_it(argv, loaded):
    """A producer's process is a command line away from the server's and the offline stack's imports, which cost
    most of a process's start: ``mepo produce`` loads neither. Help loads every command (it lists them all, and a
    command's help shows its parent's options)."""
    probe = (f"import sys\nfrom mepo_stream.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
             "import json\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'server', 'offline'})))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert json.loads(done.stdout.strip().splitlines()[-1]) == sorted(loaded), done.stderr[-2000:]


@pytest.mark.parametrize("option, value, why", [("--novelty.false_alarm", "1.5", "must be in \\(0, 1\\)"),
                                                ("--novelty.false_alarm", "0", "must be in \\(0, 1\\)"),
                                                ("--novelty.half_life", "-3", "positive number of samples"),
                                                ("--novelty.score", "confidence", "novelty.score")])
def test_a_novelty_setting_that_cannot_work_is_refused_before_any_work(capsys, option, value, why):
    """A target false-alarm rate outside (0, 1), a half-life that is no duration, an unknown score: one line that
    names the option, status 2, nothing started."""
    with pytest.raises(SystemExit) as refused:
        main(["serve", option, value])
    assert refused.value.code == 2 and re.search(why, capsys.readouterr().err)
