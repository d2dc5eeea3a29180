"""The config group options a command line names (`logger=mlflow`, `model/size=small`, `trainer=[...]`), checked
before Hydra composes: an option that is no file of conf/ is one sentence listing the ones there, exit 2 (Hydra's
own message is a paragraph with its search path, exit 1); so is an option given as a key's value
(`model.objective=dpo` for `model/objective=dpo`). Hydra's own groups (`hydra/...`) and options a plugin
brings are left to Hydra."""

from __future__ import annotations

import sys
from pathlib import Path

CONF = Path(__file__).resolve().parents[2] / "conf"


def unknown_choice(args: list[str], conf: Path = CONF) -> str | None:
    """The sentence for the first `group=option` of `args` whose option conf/<group>/ lacks, else None. Sweep
    functions (`glob(*)`, `choice(...)`) and command lines that add config dirs are left to Hydra."""
    if any(a.startswith(("--config-dir", "-cd", "hydra.searchpath", "+hydra.searchpath")) for a in args):
        return None
    for arg in args:
        key, sep, value = arg.lstrip("+~").partition("=")
        group = key.replace(".", "/")
        if sep and "." in key and (conf / group).is_dir() and (conf / group / f"{value}.yaml").is_file():
            return (
                f"{key}={value} sets a key, and {key} is chosen from a config group: write {group}={value} "
                f"(and its options as {key}.<option>)."
            )
        if not sep or "." in key or "(" in value or key.startswith("hydra") or not key or not (conf / key).is_dir():
            continue
        options = sorted(p.stem for p in (conf / key).glob("*.yaml"))
        for option in value.strip("[]").split(","):
            option = option.strip()
            if option and option != "null" and option not in options:
                return f"{key}={option}: no such option in conf/{key}/: use one of {', '.join(options)}."
    return None


def check_choices() -> None:
    """Exits 2 with one sentence on stderr when the command line names an option conf/ lacks."""
    sentence = unknown_choice(sys.argv[1:])
    if sentence:
        print(f"error: {sentence}", file=sys.stderr)
        sys.exit(2)
