"""README's code map names every module of each folder it lists, and every package of src/ and bench/: it cannot
drift from the tree again (it had: three checkpoint modules went unlisted for several stops)."""

from __future__ import annotations

import re

from conftest import ROOT


def code_map(text: str) -> dict[str, str]:
    """The code map's entries: a path at the start of a line -> its words (continuation lines are indented)."""
    block = text.split("## Code map", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    path = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            path, _, words = line.partition(" ")
            entries[path] = words
        elif path is not None:
            entries[path] += " " + line.strip()
    return entries


def check(entries: dict[str, str]) -> list[str]:
    """What the map gets wrong: a folder's modules it leaves out or names wrongly, a package of src/ or bench/ it
    lacks."""
    wrong = []
    for path, words in entries.items():
        folder = ROOT / path
        if not path.startswith(("src/", "bench/")) or not folder.is_dir():  # tests/, conf/: described, not listed
            continue
        named = set(re.findall(r"\b(\w+\.py)\b", words))
        present = {f.name for f in folder.glob("*.py") if f.name != "__init__.py"}
        if named != present:
            wrong.append(f"{path}: unlisted {sorted(present - named)}, not in the folder {sorted(named - present)}")
    packages = {
        f"{top}/{p.name}/" for top in ("src", "bench") for p in (ROOT / top).iterdir() if (p / "__init__.py").is_file()
    }
    wrong += [f"{p}: no line in the code map" for p in sorted(packages - set(entries))]
    return wrong


def test_the_readme_code_map_matches_the_tree():
    assert check(code_map((ROOT / "README.md").read_text())) == []


def test_the_check_sees_a_module_left_out():
    entries = code_map((ROOT / "README.md").read_text())
    entries["src/parallel/"] = entries["src/parallel/"].replace("experts.py", "")
    del entries["src/launch/"]
    entries["bench/scale/"] = entries["bench/scale/"].replace("comm.py", "")
    del entries["bench/suite/"]
    assert check(entries) == [
        "src/parallel/: unlisted ['experts.py'], not in the folder []",
        "bench/scale/: unlisted ['comm.py'], not in the folder []",
        "bench/suite/: no line in the code map",
        "src/launch/: no line in the code map",
    ]
