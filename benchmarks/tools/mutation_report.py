"""Summarise a finished ``mutmut run`` (``make mutate``): the score and every surviving mutant with its diff.

Writes ``benchmarks/results/mutation.json`` and prints the survivors, one diff each, for docs/reliability.md's "Mutation
testing" section, which says for each why it is harmless or which test now kills it.

    .venv/bin/mutmut run && .venv/bin/python -m benchmarks.tools.mutation_report
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

RESULTS = Path(__file__).parents[1] / "results" / "mutation.json"
LINE = re.compile(r"^\s*(\S+): (.+)$")


def mutmut(*args: str) -> str:
    return subprocess.run([str(Path(sys.executable).with_name("mutmut")), *args], check=True, capture_output=True,
                          text=True).stdout


def statuses() -> dict[str, str]:
    """Every mutant's outcome: killed, survived, no tests, timeout, suspicious, skipped or not checked."""
    return {m[1]: m[2] for line in mutmut("results", "--all", "true").splitlines() if (m := LINE.match(line))}


def diff(name: str) -> str:
    """The mutant's changed lines, without the file header."""
    return "\n".join(line for line in mutmut("show", name).splitlines()
                     if line[:1] in "+-" and not line.startswith(("+++", "---")))


def main() -> None:
    outcome = statuses()
    counts = Counter(outcome.values())
    tested = counts["killed"] + counts["survived"] + counts["timeout"]
    survivors = sorted(n for n, s in outcome.items() if s == "survived")
    report = {"mutants": len(outcome), "counts": dict(counts),
              "score": round((counts["killed"] + counts["timeout"]) / tested, 4) if tested else None,
              "survivors": [{"name": n, "diff": diff(n)} for n in survivors]}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{len(outcome)} mutants: {dict(counts)}; score {report['score']} (killed or timed out / tested)")
    for s in report["survivors"]:
        print(f"\n{s['name']}\n{s['diff']}")


if __name__ == "__main__":
    main()
