"""docs/architecture.md (the maintainers' page) stays true: every package of src/ is named there as one of the rooms,
and every path it names (src/..., conf/..., tests/...) exists."""

from __future__ import annotations

import re

from conftest import ROOT

PAGE = ROOT / "docs" / "architecture.md"


def named_paths(text: str) -> set[str]:
    """The `src/...`, `conf/...` and `tests/...` paths in backticks, the <name> placeholders left out."""
    return {p for p in re.findall(r"`((?:src|conf|tests)/[^`\s]*)`", text) if "<" not in p and "NAME" not in p}


def test_every_package_of_src_is_a_room_on_the_page():
    packages = [p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "src").rglob("__init__.py")]
    missing = sorted(f"{p}/" for p in packages if p != "src" and f"`{p}/`" not in PAGE.read_text())
    assert missing == [], f"docs/architecture.md names no room for {missing}: add each to its floor's row"


def test_every_path_the_page_names_exists():
    gone = sorted(p for p in named_paths(PAGE.read_text()) if not (ROOT / p).exists())
    assert gone == [], f"docs/architecture.md names paths that do not exist: {gone}"


def test_the_path_reader_sees_what_the_page_names():
    assert named_paths("`src/no_such.py`, `conf/x/<name>.yaml`, `tests/test_parity.py`") == {
        "src/no_such.py",
        "tests/test_parity.py",
    }
