"""The architecture x strategy table of docs/models.md, from the outcomes tests/test_architecture_matrix.py records:

TEST_ALL_ARCHITECTURES=1 TEST_MATRIX_RECORD=/tmp/matrix.jsonl pytest tests/test_architecture_matrix.py
python -m tests.helpers.matrix /tmp/matrix.jsonl
"""

from __future__ import annotations

import json
import re
import sys

STRATEGIES = ("fsdp", "tp", "pipeline", "experts")
HEADERS = {"experts": "expert_parallel_size=2"}  # trainer=fsdp with each MoE model's experts split over the 2 ranks


def cell(row: dict) -> str:
    if row["outcome"] == "equal":
        return "equal"
    if row["outcome"] != "refused":
        return row["outcome"]
    sentence = re.sub(r"^(Error|ConfigError)[:\s]*", "", row["detail"])
    sentence = re.sub(r"[:;,] (train it|set model\.router_aux_loss|set trainer\.strategy\.expert).*$", "", sentence)
    sentence = re.sub(r" \(colwise, rowwise[^)]*\)", "", sentence)  # the styles trainer=tp implements, said below
    return "refused: " + sentence.replace("|", "\\|")


def table(rows: list[dict]) -> str:
    by_arch: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_arch.setdefault(row["arch"], {})[row["strategy"]] = row
    versions = sorted({row["transformers"] for row in rows})
    built = {a: c for a, c in by_arch.items() if not any(r["outcome"] == "unbuilt" for r in c.values())}
    lines = [
        f"transformers {', '.join(versions)}: {len(built)} of {len(by_arch)} architectures built and trained.",
        "Each refusal is one sentence before step 1, shortened here: the whole one ends with what to use instead",
        "(trainer=fsdp or trainer=ddp; for the router's loss, model.router_aux_loss=false; expert_parallel_size=1), and",
        "trainer=tp's names the styles it implements.",
        "",
        "| architecture | " + " | ".join(HEADERS.get(s, f"trainer={s}") for s in STRATEGIES) + " |",
        "| --- | " + " | ".join("---" for _ in STRATEGIES) + " |",
    ]
    for arch, cells in sorted(built.items()):
        lines.append(f"| {arch} | " + " | ".join(cell(cells[s]) if s in cells else "" for s in STRATEGIES) + " |")
    unbuilt = {a: next(iter(c.values()))["detail"] for a, c in by_arch.items() if a not in built}
    if unbuilt:
        lines += ["", "Not built at the test's size (its config defaults name sizes otherwise, or it fails there):", ""]
        lines += [f"- {arch}: {' '.join(detail.split())}" for arch, detail in sorted(unbuilt.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table([json.loads(line) for line in f if line.strip()]))
