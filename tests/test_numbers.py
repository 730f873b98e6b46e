"""The numbers the README and the docs pages show are the results files' (``benchmarks/results/*.json``).

* The README's headline section: each line is written here again from the files, and every number in the section
  must come from one of these lines.
* The README's "what to expect" rows: written from ``expect.json`` (one entry per CPU kind, each value with its
  source), and the ``make demo`` summary it shows is the one ``expect.json`` records and the other pages quote.
* The docs pages' measured blocks (``<!-- numbers: FILE ... -->`` ... ``<!-- /numbers -->``): every number in one
  is a value of the named results files, at the precision shown, in one of the units the pages use.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from tests.helpers import ROOT

RESULTS = ROOT / "benchmarks" / "results"
NUMBER = re.compile(r"(?<![\w.\-/])\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?![\w/])")


def result(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def section(text: str, title: str) -> str:
    """The section under ``## title``, without code spans and link targets (names and paths, not numbers)."""
    body = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.sub(r"`[^`]*`|\]\([^)]*\)", "", body)


def pct(mean: float, std: float) -> str:
    return f"{100 * mean:.2f} ± {100 * std:.2f} %"


def quality_row(stream: str, r: dict) -> str:
    return (f"| {stream}, {r['stream_samples']:,} samples | {pct(r['a_last'], r['a_last_std'])} | "
            f"{pct(r['a_auc'], r['a_auc_std'])} | {100 * r['ceiling']:.2f} % | {r['ratio']:.2f} |")


def seeds(values: list[int]) -> str:
    return f"{values[0]}–{values[-1]}" if values == list(range(values[0], values[-1] + 1)) else ", ".join(
        map(str, values))


def headline_claims() -> list[str]:
    """Every phrase of the README's headline section that holds a number, written from the results files."""
    cifar, tiny = result("learning_quality"), result("learning_quality_tinyimagenet")
    assert cifar["spec"]["img_size"] == tiny["spec"]["img_size"] and cifar["seeds"] == tiny["seeds"]
    assert cifar["machine"]["dtype"] == tiny["machine"]["dtype"]
    reference, equivalence = result("reference_run"), result("reference_equivalence")
    verdicts = Counter(row["verdict"] for row in equivalence["rows"])
    assert equivalence["all_passed"] and sum(verdicts.values()) == len(equivalence["rows"])
    learner, scale = result("learner_throughput"), result("scale_out")
    camera, gpu = result("predict_latency_camera"), result("gpu_camera_learner")
    exact = scale["same_model"]  # the "1e-9" below: the groups' merged sums and every shrinkage's top-1 agree
    assert max(exact["relative_difference"].values()) <= 1e-9 and all(exact["identical_predictions_per_shrinkage"])
    return [
        f"Measured on {learner['machine']['cpus']}-core CPUs without a GPU",
        f"at {cifar['spec']['img_size']} px, {cifar['machine']['dtype'].replace('bfloat16', 'bf16')}, "
        f"seeds {seeds(cifar['seeds'])}",
        quality_row("CIFAR-10", cifar),
        quality_row("Tiny-ImageNet downstream", tiny),
        f"on the same CIFAR-10 streams: {pct(reference['A_last_mean'], reference['A_last_std'])} over seeds "
        f"{seeds(reference['stream']['seeds'])}",
        f"all {len(equivalence['rows'])} compared tensors pass: {verdicts['yes']} within "
        f"{equivalence['tolerance']:.0e} as they are, {verdicts['fp32 noise']} within our own fp32 noise floor, "
        f"{verdicts['fp32 resolution']} within fp32 resolution and {verdicts['documented']} the documented "
        f"index-bug fix",
        f"the service learns at {learner['learn_only']['ratio']:.2f}× its bare loop, "
        f"{learner['prequential']['ratio']:.2f}× with prequential scoring",
        f"Two learners in a group on {scale['machine']['cpus']} cores learn {scale['ratio']:.2f}× as fast as one",
        f"({scale['machine']['dtype'].replace('bfloat16', 'bf16')}, timed runs of at least "
        f"{scale['min_seconds']:.0f} s), where two bare loops reach {scale['bare_ratio']:.2f}×: "
        f"{scale['of_limit']:.2f} of the machine's limit, with the single learner's model to 1e-9",
        f"a {camera['camera']} upload is answered in {1000 * camera['http_idle_raw_client']['p50_s']:.1f} ms at p50, "
        f"against {1000 * camera['bare_scaled_decode_and_forward_idle']['p50_s']:.1f} ms for its decode and forward "
        f"alone ({camera['machine']['dtype'].replace('bfloat16', 'bf16')})",
        f"learns a {gpu['spec']['dataset'].split('-')[-2]} JPEG stream with the paper's recipe at "
        f"{gpu['paper_recipe']['ratio']:.2f}× its bare loop",
    ]


def disagreements(readme: str) -> tuple[list[str], list[str]]:
    """The results' phrases the headline section lacks, and its numbers no results file gives."""
    flat = " ".join(section(readme, "Headline numbers").split())
    claims = headline_claims()
    traced = Counter(n for claim in claims for n in NUMBER.findall(claim))
    return [claim for claim in claims if claim not in flat], sorted(Counter(NUMBER.findall(flat)) - traced)


def test_every_headline_number_is_read_from_a_results_file():
    missing, untraced = disagreements((ROOT / "README.md").read_text())
    assert not missing, f"the README's headline section does not say (from benchmarks/results): {missing}"
    assert not untraced, f"numbers in the headline section that no results file gives: {untraced}"


def test_a_stale_or_unsourced_number_is_caught():
    readme = (ROOT / "README.md").read_text()
    row = headline_claims()[2]  # the CIFAR-10 row
    stale = readme.replace(row, row.replace(row.split(" | ")[1], "66.93 ± 0.92 %"))
    missing, untraced = disagreements(stale)
    assert missing == [row] and untraced == ["0.92", "66.93"]
    assert disagreements(readme.replace("## Install", "Up to 3× faster.\n\n## Install"))[1] == ["3"]
    assert NUMBER.findall("bf16 at 84 px, ViT-S/14, CIFAR-10, 1e-04, 1,000") == ["84", "1e-04", "1,000"]


@pytest.mark.parametrize("page,pattern", [
    ("docs/results.md", "A_last **{a_last}**,\nA_AUC {a_auc}, prequential {prequential}"),
])
def test_the_demo_summary_is_the_same_on_every_page(page, pattern):
    summary = json.loads(re.search(r'^(\{"samples_seen".*\})$', (ROOT / "README.md").read_text(), re.M).group(1))
    assert pattern.format(**summary) in (ROOT / page).read_text()


# --- the docs pages: "what to expect", and the numbers of every measured block ------------------------------------
BLOCK = re.compile(r"<!-- numbers: ([\w ]+) -->\n(.*?)<!-- /numbers -->", re.S)
USER_PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SCALES = (1, 100, 1000, 1e-3, 1e-6, 2 ** -20, 1 / 60, 1e9)  # as is, %, ms (µs), k, MB, MiB, min, ns


def generated():
    import importlib.util

    spec = importlib.util.spec_from_file_location("generated", ROOT / "docs" / "_hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def values(node) -> list[float]:
    """Every number a results file holds, its strings' and keys' numbers included ("1920x1080", "224")."""
    if isinstance(node, bool) or node is None:
        return []
    if isinstance(node, (int, float)):
        return [float(node)]
    if isinstance(node, str):
        return [float(n) for n in re.findall(r"\d+(?:\.\d+)?", node)]
    if isinstance(node, dict):  # keys name sizes too ({"224": ...})
        return [v for key, item in node.items() for v in values(key) + values(item)]
    return [v for item in node for v in values(item)]


def traced(token: str, held: list[float]) -> bool:
    """Whether a number as a page shows it (``1,284``, ``0.82``, ``2.9``) is one of ``held`` at the page's precision,
    in one of the units the pages use."""
    shown = float(token.replace(",", ""))
    half = 0.5 * 10 ** -(len(token.split(".")[1]) if "." in token else 0)
    return any(abs(v * scale - shown) <= half * (1 + 1e-9) for v in held for scale in SCALES)


def untraced(page_text: str) -> list[tuple[str, str]]:
    """``(results files, number)`` for each number of a measured block that its named results files do not hold."""
    out = []
    for names, body in BLOCK.findall(page_text):
        held = [v for name in names.split() for v in values(result(name))]
        body = re.sub(r"`[^`]*`|\]\([^)]*\)|<!--.*?-->", "", body)
        out += [(names, n) for n in NUMBER.findall(body) if not traced(n, held)]
    return out


def test_the_readme_what_to_expect_rows_are_written_from_the_results_file():
    """One row per CPU kind of ``expect.json``; ``python docs/_hooks/generated.py readme`` rewrites them."""
    readme = (ROOT / "README.md").read_text()
    module = generated()
    rows = readme.split(module.EXPECT_START, 1)[1].split(module.EXPECT_END, 1)[0].strip()
    assert rows == module.expect_rows(), "stale: run python docs/_hooks/generated.py readme"
    expect = result("expect")
    assert len(rows.splitlines()) == 2 + len(expect["machines"])
    for machine in expect["machines"]:
        for run in (machine["demo"], machine["test"], machine["test_fast"]):
            assert run is None or (run["source"] and run["commit"] and run["date"]), machine["cpu"]
    assert module.minutes(305) == "5 min 5 s" and module.minutes(771) == "12 min 51 s"


def test_the_demo_summary_the_readme_shows_is_the_recorded_one():
    readme = (ROOT / "README.md").read_text()
    shown = json.loads(re.search(r'^(\{"samples_seen".*\})$', readme, re.M).group(1))
    assert shown == result("expect")["example_summary"]["summary"]


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_every_number_of_a_measured_block_is_in_its_results_file(page):
    assert not untraced(page.read_text()), f"{page.name}: numbers its results files do not hold"


def test_the_measured_blocks_are_where_the_pages_show_measurements():
    blocks = {p.name: BLOCK.findall(p.read_text()) for p in USER_PAGES}
    for name in ("your-images.md", "scale-out.md", "corrections.md", "labels-later.md"):
        assert blocks[name], f"{name} has no <!-- numbers: FILE --> block"
    assert all((RESULTS / f"{n}.json").is_file() for found in blocks.values() for names, _ in found
               for n in names.split())


def test_a_stale_number_in_a_measured_block_is_caught():
    block = "<!-- numbers: scale_out -->\n{}\n<!-- /numbers -->\n"
    assert untraced(block.format("two learners learn 337.2 samples/s, 1.96× one, in 49.1 s")) == []
    assert untraced(block.format("two learners learn 337.9 samples/s")) == [("scale_out", "337.9")]
    assert untraced(block.format("a state of 1.2 MB, `337.9` in code")) == []
