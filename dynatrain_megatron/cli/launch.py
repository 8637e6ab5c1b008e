"""`dynatrain launch --nproc N SCRIPT ARGS...`: start a job's workers on this machine so
that the survivors keep running when one dies (see `loop/launch.py`)."""
from __future__ import annotations

import argparse
import logging
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("launch", help="start N workers; survivors keep running when one dies")
    p.add_argument("--nproc", type=int, required=True, help="workers to start")
    p.add_argument("script", help="the training script (e.g. scripts/pretrain_gpt.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..loop.launch import launch

    logging.basicConfig(level=logging.INFO, format="[launch] %(message)s", stream=sys.stderr)
    log = logging.getLogger("dynatrain.launch")
    status, exits = launch(args.nproc, [sys.executable, args.script, *args.args])
    for e in exits:
        log.info("worker %d exited with %d after %.1f s", e.rank, e.code, e.seconds)
    return status
