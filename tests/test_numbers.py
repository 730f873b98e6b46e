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


def derived(name: str, node: dict) -> list[float]:
    """The counts a page shows of a results file's rows: how many rows, of each verdict, in each step."""
    rows = node.get("rows") if isinstance(node, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return []
    counts = [len(rows)]
    for key in ("verdict", "step"):
        counts += Counter(r.get(key) for r in rows).values()
    steps = Counter(str(r.get("step", "")).split(" ")[0] for r in rows)  # "1 forward (train)", "1 forward (eval)"
    return [float(c) for c in counts + list(steps.values())]


def traced(token: str, held: list[float]) -> bool:
    """Whether a number as a page shows it (``1,284``, ``0.82``, ``2.9``) is one of ``held`` at the page's precision,
    in one of the units the pages use."""
    shown = float(token.replace(",", ""))
    mantissa, _, exponent = token.lower().partition("e")
    half = 0.5 * 10 ** (int(exponent or 0) - (len(mantissa.split(".")[1]) if "." in mantissa else 0))
    return any(abs(abs(v) * scale - shown) <= half * (1 + 1e-9) for v in held for scale in SCALES)  # the page signs it


def untraced(page_text: str) -> list[tuple[str, str]]:
    """``(results files, number)`` for each number of a measured block that its named results files do not hold."""
    out = []
    for names, body in BLOCK.findall(page_text):
        held = [v for name in names.split() for v in values(result(name)) + derived(name, result(name))]
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


# --- no measured number outside a measured block, a generated table or code -----------------------------------------
GENERATED_TABLES = re.compile(r"<!-- (benchmarks:start|frontier:begin|expect:start) -->.*?"
                              r"<!-- (benchmarks:end|frontier:end|expect:end) -->", re.S)
FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", re.S | re.M)
UNIT = r"(?:%|×|ms|µs|s|min|minutes|seconds|h|hours|B|KB|kB|MB|MiB|GB|GiB|bytes|samples/s|images/s|/s)"
# a decimal figure, or a number with a unit (a percentage, a time, a size, a rate, a factor); not a piece of a version
# or an address (3.8.1, 127.0.0.1), nor a number inside a word or a path
MEASURED = re.compile(rf"(?<![\w.\-/^])(\d[\d,]*(?:\.\d+)?)(?!\.\d|[\w/])(\s?{UNIT}(?![\w/]))?")
NUM = rf"\d[\d,.]*(?:\s?{UNIT})?"
# what reads like a measurement and is not one: a goal or a bound a page states, a setting (a hyperparameter, an
# option's value), a version
NOT_MEASURED = re.compile("|".join([
    rf"\bgoals?\b[^()]{{0,24}}?[≥≤<>]\s?{NUM}(?:,\s*p99\s*[≥≤]\s*{NUM})?",  # goal ≥ 0.90, goal p50 ≤ 3×, p99 ≤ 6×
    rf"growth under {NUM}",
    rf"(?:[=αεγ]|\blr(?: ×)?|momentum|layer decay|weight decay|label smoothing|warmup|defaults? to)\s?{NUM}",
    rf"\b[NM] (?:= )?{NUM}",  # Si-Blurry's disjoint-class and blurry-sample shares
    rf"`[^`\n]+` \({NUM}(?: by default)?\)|\({NUM} by default\)",  # an option's default, after its name
    r"\b(?:Python|py-lmdb|lmdb|mutmut|torch|timm) (?:before )?\d+\.\d+",
]))
# Per page, the phrases whose numbers are settings, sizes worked out from them, or examples, not measurements; each
# must still be on its page, so the list cannot outlive what it excuses.
SETTINGS = {
    "README.md": ["2.5 minutes of training"],
    "getting-started.md": ["2.5 minutes of training"],
    "refine.md": ["2.5 minutes of training", "What 2.5 minutes buy"],
    "deploy.md": ["10 s later"],
    "corrections.md": ["waiting up to 500 ms", "wait at most 100 ms"],
    "http-api.md": ["not 0 %", "sending 200 MB JSON"],
    "labels-later.md": ["(4 × 384 bytes for ViT-S, about 15 MB at the default bound)",
                        "3 × S² bytes, 21 KB at 84 px (210 MB at the default bound), 147 KB at 224 px (1.5 GB:",
                        "with 25 % of labels never coming"],
    "monitor.md": ["for 5 s", "for 10 minutes", "More than 5% of records dead-lettered for 5 minutes",
                   "older than 15 minutes", "at least 50 % within", "More than 1 % of a protocol's", "for 5 minutes."],
    "performance.md": ["at 10 % and 100 % of the stream", "for 30 s", "and 30 % never coming",
                       "about 6 % of the records"],
    "reliability.md": ["after 60 s", "for over 12 s", "2.5, true", "200 KB image limit", "300 MB", "for 60 s",
                       "at most 30 %", "chunked 19 MB", "a 20 MB limit", "40 MB", "of 200 MB", "under 30 s",
                       "every 2 s"],
    "scale-out.md": ["1 MiB request limit", "2.4 MB, 4.2 MB with Meta Cov", "(2.4 MB each"],
    "your-images.md": ["about 3× the FLOPs", "about 5× the time"],
    "fidelity.md": ["within 10× its noise floor", "clears 0.8 × the probe", "10 × 100 is not available"],
}


def unmeasured(page: str, text: str) -> list[str]:
    """The measured-looking numbers of a user page outside its measured blocks, its generated tables and its code:
    each must be read from a results file (a ``<!-- numbers: FILE -->`` block) or moved to a design record."""
    if page == "README.md":  # its headline section is checked line by line above
        head, rest = text.split("## Headline numbers\n", 1)
        text = head + "\n## " + rest.split("\n## ", 1)[1]
    for phrase in SETTINGS.get(page, []):
        assert phrase in text, f"{page}: {phrase!r} is no longer on the page: drop it from SETTINGS"
        text = text.replace(phrase, "")
    for pattern in (GENERATED_TABLES, BLOCK, FENCE, NOT_MEASURED,
                    re.compile(r"`[^`\n]*`|\]\([^)]*\)|<!--.*?-->", re.S)):
        text = pattern.sub(" ", text)
    return [m.group(0).strip() for m in MEASURED.finditer(text) if "." in m.group(1) or m.group(2)]


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_no_measured_number_is_typed_into_a_user_page(page):
    """Every measured number a user page shows is checked against its results file or generated from it."""
    found = unmeasured(page.name, page.read_text())
    assert not found, (f"{page.name}: measured-looking numbers outside a <!-- numbers: FILE --> block, a generated "
                       f"table or code (wrap them in a block naming their results file, or move them to a "
                       f"docs/design/ record): {found}")


def test_a_number_typed_into_a_user_page_is_caught():
    page = ROOT / "docs" / "scale-out.md"
    text = page.read_text()
    assert unmeasured(page.name, text) == []
    stale = "Two learners learn 337.9 samples/s, 1.96× one, 12 % faster, in 49 s.\n\n"
    assert unmeasured(page.name, stale + text) == ["337.9 samples/s", "1.96×", "12 %", "49 s"]
    block = "<!-- numbers: scale_out -->\n{}<!-- /numbers -->\n"
    assert unmeasured(page.name, block.format(stale) + text) == []  # in a block, test_every_number_... checks it
    assert ("scale_out", "337.9") in untraced(block.format(stale))
    assert unmeasured("x.md", "```json\n{\"novelty\": 0.83}\n```\n`--max 512 MB`, 127.0.0.1, mutmut 3.8.1, "
                              "torch 2.14, goal ≥ 0.90, lr 1e-4, α = 0.7, 5,000 images, ViT-S/14 at 84 px") == []
