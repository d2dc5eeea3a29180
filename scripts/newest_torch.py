"""Says which torch `make test-latest` tested, and names a newer release that pip could install here but
pyproject.toml's range keeps out, so the next torch release is seen the day it is installable (docs/install.md).

Usage: python scripts/newest_torch.py REPORT, REPORT being what `pip install --dry-run --no-deps
--ignore-installed --report REPORT torch` wrote (pip's own choice: this machine's index, its constraints)."""

from __future__ import annotations

import json
import sys

import torch
from packaging.version import Version


def main(report: str) -> str:
    newest = Version(json.load(open(report))["install"][0]["metadata"]["version"])
    tested = Version(torch.__version__.split("+")[0])
    line = f"test-latest: torch {tested}"
    if newest > tested:
        line += (
            f"; torch {newest} installs here but is outside pyproject.toml's range: raise the cap in a branch and "
            "run make test-latest again to try it"
        )
    return line


if __name__ == "__main__":
    print(main(sys.argv[1]))
