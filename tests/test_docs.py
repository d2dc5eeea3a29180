"""The docs stay references a user reads top to bottom: short enough, no prose line too long to read, no
process bookkeeping (stop or issue numbers), and every measurement table generated from docs/results/ as it stands.
Fast: reads files, and runs scripts/results_tables.py --check in one subprocess."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GENERATED_ELSEWHERE = {ROOT / "docs" / "matrix.md"}  # written by python -m tests.test_matrix, checked there
MAX_LINES = {"README.md": 250, "docs/performance.md": 300}
MAX_PROSE = 200
BOOKKEEPING = re.compile(r"\b(stop|issue)s? \d+", re.IGNORECASE)


def prose_lines(text: str):
    """(line number, line) of every line outside ``` code blocks that is not a table row."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.lstrip().startswith("|"):
            yield number, line


def results_tables():
    spec = importlib.util.spec_from_file_location("results_tables", ROOT / "scripts" / "results_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name,limit", sorted(MAX_LINES.items()))
def test_the_doc_is_short_enough_to_read(name, limit):
    assert len((ROOT / name).read_text().splitlines()) <= limit


def test_no_prose_line_is_over_200_characters():
    long = [
        f"{doc.relative_to(ROOT)}:{number}: {len(line)} characters"
        for doc in DOCS
        if doc not in GENERATED_ELSEWHERE
        for number, line in prose_lines(doc.read_text())
        if len(line) > MAX_PROSE
    ]
    assert long == []


def test_no_stop_or_issue_numbers_in_the_docs():
    found = [
        f"{doc.relative_to(ROOT)}:{number}: {match.group(0)!r}"
        for doc in DOCS
        for number, line in enumerate(doc.read_text().splitlines(), 1)
        for match in BOOKKEEPING.finditer(line)
    ]
    assert found == []


def test_the_prose_check_skips_tables_and_code_blocks():
    text = "short\n| " + "x" * 300 + " |\n  ```\n" + "y" * 300 + "\n  ```\n" + "z" * 201
    assert [number for number, line in prose_lines(text) if len(line) > MAX_PROSE] == [6]


def test_every_results_table_in_the_docs_is_generated_from_its_file():
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "results_tables.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_stale_block_and_a_bad_record_are_caught(tmp_path):
    tables = results_tables()
    name = sorted(path.stem for path in (ROOT / "docs" / "results").glob("*.jsonl"))[0]
    stale = f"text\n<!-- results:{name} -->\n| an old table |\n<!-- /results:{name} -->\nmore\n"
    fresh = tables.update(stale)
    assert fresh != stale and tables.update(fresh) == fresh
    assert fresh == f"text\n<!-- results:{name} -->\n{tables.generate(name)}<!-- /results:{name} -->\nmore\n"

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"date": "2026-11-27", "commit": "unknown", "bench": "x", "ms": 1.0}\n')
    with pytest.raises(tables.ResultsError, match="no machine"):
        tables.load(bad)
    bad.write_text(
        '{"date": "2026-11-27", "machine": "m", "commit": "unknown", "bench": "x"}\n'
        '{"date": "2026-11-26", "machine": "m", "commit": "unknown", "bench": "x"}\n'
    )
    with pytest.raises(tables.ResultsError, match="append in order"):
        tables.load(bad)


def test_numbers_print_as_written_and_the_newest_record_first(tmp_path):
    tables = results_tables()
    path = tmp_path / "bench.jsonl"
    path.write_text(
        '{"date": "2026-11-26", "machine": "m", "commit": "abc1234", "bench": "b", "ratio": 1.0000}\n'
        '{"date": "2026-11-27", "machine": "m", "commit": "unknown", "bench": "b", "ratio": 9.5e-7, "note": "a|b"}\n'
    )
    assert tables.table(tables.load(path)).splitlines() == [
        "| date | machine | commit | bench | ratio | note |",
        "|---|---|---|---|---|---|",
        "| 2026-11-27 | m | unknown | b | 9.5e-7 | a\\|b |",
        "| 2026-11-26 | m | abc1234 | b | 1.0000 |  |",
    ]


def test_every_refusal_in_docs_refusals_is_where_it_says_and_tested():
    """docs/refusals.md is the one list of refused combinations: each row's sentence fragment is in the file it names,
    and the test it names exists."""
    rows = [line for line in (ROOT / "docs" / "refusals.md").read_text().splitlines() if line.startswith("| ")][2:]
    assert len(rows) >= 15, "the table lost its rows"
    for row in rows:
        _, fragment, where, test = (cell.strip() for cell in row.strip("|").split(" | "))
        fragment = fragment.strip("`")
        assert fragment in (ROOT / where).read_text(), f"{where} has no {fragment!r}"
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), f"{path} has no test {name}"
