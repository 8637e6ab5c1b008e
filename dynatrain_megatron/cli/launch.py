"""`dynatrain launch --nproc-per-node N SCRIPT ARGS...`: start a job's workers on this machine so
that the survivors keep running when one dies (see `loop/launch.py`)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ..vps.errors import DynatrainError

from .common import devices, subcommand


def add_parser(sub) -> None:
    p = subcommand(sub, "launch", help="start N workers on this machine with torchrun's "
                                       "environment; survivors keep running when one dies",
                   examples=["dynatrain launch --nproc-per-node 4 pretrain_gpt.py <its flags> "
                             "--dynatrain --dynatrain-rendezvous-dir /tmp/job/rdv"])
    # torchrun's own spelling (and its underscore form); --nproc: this command's first name
    p.add_argument("--nproc-per-node", "--nproc_per_node", "--nproc", dest="nproc",
                   type=devices(), required=True, metavar="N",
                   help="workers (ranks) to start on this machine")
    p.add_argument("script", help="the training script (e.g. pretrain_gpt.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..loop.launch import launch

    if not os.path.isfile(args.script):
        raise DynatrainError(f"training script {args.script} not found")

    logging.basicConfig(level=logging.INFO, format="[launch] %(message)s", stream=sys.stderr)
    log = logging.getLogger("dynatrain.launch")
    status, exits = launch(args.nproc, [sys.executable, args.script, *args.args])
    for e in exits:
        log.info("worker %d exited with %d after %.1f s", e.rank, e.code, e.seconds)
    return status
