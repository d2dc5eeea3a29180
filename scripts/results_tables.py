"""Markdown tables from the measurement history in docs/results/*.jsonl, one table per benchmark, newest first.

Each results file is one benchmark's record: one JSON object a line, appended in the order the measurements were
made (oldest first), each with at least `date` (YYYY-MM-DD, or "unknown"), `machine`, `commit` (the template's
commit measured, or "unknown") and `bench` (the command), then its figures as named numbers, optional labels
(strings: the way, the shape, ...) and an optional `note`. Numbers are printed as they are written in the file.

    python scripts/results_tables.py            # every table
    python scripts/results_tables.py NAME ...   # the tables of docs/results/NAME.jsonl
    python scripts/results_tables.py --check    # exit 1 if a marked block in the docs is not what NAME generates
    python scripts/results_tables.py --write    # rewrite the marked blocks

A marked block in README.md or docs/*.md is the generated table between `<!-- results:NAME -->` and
`<!-- /results:NAME -->`, each on a line of its own; `<!-- results:NAME latest -->` shows only the records of the
file's newest date and commit.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
REQUIRED = ("date", "machine", "commit", "bench")
MAX_COLUMNS = 10  # more named figures than this across a file: one "figures" column of name=value pairs
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
BLOCK = re.compile(r"(<!-- results:(\w+)( latest)? -->\n)(.*?)(<!-- /results:\2 -->)", re.DOTALL)


class Number(str):
    """A number of a results file, as it is written there (1.0000 stays 1.0000)."""


class ResultsError(ValueError):
    """A results file that breaks the format: the file, the line and what is wrong."""


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def load(path: Path) -> list[dict]:
    """The records of one results file, checked: required keys, numbers or strings as values, dates in order."""
    records, last_date = [], ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{shown(path)}:{number}"
        try:
            record = json.loads(line, parse_float=Number, parse_int=Number)
        except json.JSONDecodeError as e:
            raise ResultsError(f"{where}: not JSON ({e})") from None
        if not isinstance(record, dict):
            raise ResultsError(f"{where}: not a JSON object")
        missing = [key for key in REQUIRED if key not in record]
        if missing:
            raise ResultsError(f"{where}: no {', '.join(missing)}")
        for key, value in record.items():
            if not isinstance(value, str):  # a number parses as a Number, which is a str
                raise ResultsError(f"{where}: {key} is neither a number nor a string")
            if key in REQUIRED and isinstance(value, Number):
                raise ResultsError(f"{where}: {key} is a number, not a string")
        date = record["date"]
        if date != "unknown":
            if not DATE.fullmatch(date):
                raise ResultsError(f"{where}: date {date!r} is neither YYYY-MM-DD nor 'unknown'")
            if date < last_date:
                raise ResultsError(f"{where}: {date} is older than the line before ({last_date}): append in order")
            last_date = date
        records.append(record)
    if not records:
        raise ResultsError(f"{shown(path)}: no records")
    return records


def cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(records: list[dict]) -> str:
    """One markdown table, newest record first; the figures as columns, or as one column when there are many."""
    keys: list[str] = []
    for record in records:
        keys += [key for key in record if key not in (*REQUIRED, "note", *keys)]
    has_note = any("note" in record for record in records)
    columns = [*REQUIRED, *(keys if len(keys) <= MAX_COLUMNS else ["figures"]), *(["note"] if has_note else [])]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for record in reversed(records):
        if len(keys) > MAX_COLUMNS:
            figures = ", ".join(f"{key}={record[key]}" for key in keys if key in record)
            record = {**record, "figures": figures}
        lines.append("| " + " | ".join(cell(record.get(column, "")) for column in columns) + " |")
    return "\n".join(lines) + "\n"


def names() -> list[str]:
    return sorted(path.stem for path in RESULTS.glob("*.jsonl"))


def generate(name: str, latest: bool = False) -> str:
    """The table of docs/results/NAME.jsonl; `latest`: only the records of its newest date and commit (the current
    figures; the file keeps the history)."""
    path = RESULTS / f"{name}.jsonl"
    if not path.is_file():
        raise ResultsError(f"no results file docs/results/{name}.jsonl")
    records = load(path)
    if latest and records:
        newest = (records[-1]["date"], records[-1]["commit"])
        records = [r for r in records if (r["date"], r["commit"]) == newest]
    return table(records)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def update(text: str) -> str:
    """The text with every marked block replaced by what its results file generates."""
    return BLOCK.sub(lambda m: m.group(1) + generate(m.group(2), bool(m.group(3))) + m.group(5), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="results files (docs/results/NAME.jsonl); default: all")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if a marked block differs from its table")
    mode.add_argument("--write", action="store_true", help="rewrite the marked blocks in README.md and docs/*.md")
    args = parser.parse_args(argv)
    try:
        if args.check or args.write:
            for name in names():  # every results file parses, marked or not
                generate(name)
            stale = []
            for doc in documents():
                text = doc.read_text()
                new = update(text)
                if new != text:
                    stale.append(shown(doc))
                    if args.write:
                        doc.write_text(new)
            if stale and args.check:
                print(
                    f"results tables out of date in {', '.join(map(str, stale))}: run python scripts/results_tables.py "
                    "--write",
                    file=sys.stderr,
                )
                return 1
            for doc in stale:
                print(f"rewrote the results tables of {doc}")
            return 0
        for name in args.names or names():
            print(f"### {name}\n\n{generate(name)}")
        return 0
    except ResultsError as e:
        print(f"results_tables: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
