"""Checkpoints from the command line (the functions: src/checkpoint/convert.py):

    python -m src.tools.checkpoints consolidate CKPT_DIR [OUT.ckpt]   # sharded dir -> one fp32 file
    python -m src.tools.checkpoints export-hf CKPT OUT_DIR            # any causal LM or classifier -> Hugging Face format

Resume training from the sharded dir itself (`ckpt_path=.../last.ckpt`; src/checkpoint/resharding.py says which
strategy reads which form); the consolidated file holds the weights, step counters and config for eval and export,
not the optimizer state.
"""

from __future__ import annotations

import argparse
import os
import sys

from src.checkpoint import safe_load
from src.checkpoint.convert import consolidate, export_hf
from src.utils.errors import EXIT_USER_ERROR, translate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="sharded DCP dir -> one .ckpt file")
    c.add_argument("ckpt")
    c.add_argument("out", nargs="?")
    e = sub.add_parser("export-hf", help="language-model or classifier checkpoint -> Hugging Face dir")
    e.add_argument("ckpt")
    e.add_argument("out_dir")
    for p in (c, e):
        p.add_argument(
            "--trust-checkpoint", action="store_true", help="load with plain pickle: a trusted writer's only"
        )
    args = parser.parse_args()
    safe_load.trust(args.trust_checkpoint, "--trust-checkpoint")
    try:
        print(consolidate(args.ckpt, args.out) if args.command == "consolidate" else export_hf(args.ckpt, args.out_dir))
    except Exception as exc:
        message = translate(exc)
        if message is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise  # a bug: keep the traceback
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR) from None


if __name__ == "__main__":
    main()
