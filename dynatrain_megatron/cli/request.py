"""`dynatrain request --signal-file F [--layout tp4pp1dp1] [--world N] [--model M]`: ask a
running job to switch (atomic write-then-rename of the signal file).

With `--model`, the layout is checked by the one validator first, and nothing is written
when it is refused. Without `--layout`, `--world N` asks the job to move to its layout
advisor's best layout of N devices."""
from __future__ import annotations

import argparse
import os

from ..configs import load_model
from ..elastic.signal_file import write_request
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.validate import validate_layout
from .common import devices, subcommand


def add_parser(sub) -> None:
    p = subcommand(sub, "request", help="ask a running job to switch layout (writes its signal "
                                        "file)",
                   examples=["dynatrain request --signal-file /tmp/job/switch.json "
                             "--layout tp1pp2dp2",
                             "dynatrain request --signal-file /tmp/job/switch.json "
                             "--layout tp1pp2dp1 --world 2   # scale in to 2 ranks",
                             "dynatrain request --signal-file /tmp/job/switch.json "
                             "--world 4   # the job's advisor picks the layout of 4"])
    p.add_argument("--signal-file", required=True, metavar="FILE",
                   help="the job's --dynatrain-signal-file (its directory must exist)")
    p.add_argument("--layout", default=None, metavar="LAYOUT",
                   help="target layout, e.g. tp1pp2dp2; omitted: the job's advisor chooses "
                        "for --world")
    p.add_argument("--world", type=devices(), default=None, metavar="RANKS",
                   help="ranks of the new layout (default: the job's current number of ranks)")
    p.add_argument("--model", default=None, metavar="NAME|YAML",
                   help="a name in configs/models or a YAML path: validate the layout for it "
                        "(and --world) before writing")
    p.add_argument("--no-transformer-engine", action="store_true",
                   help="with --model: the job runs without Transformer Engine (then no CP)")
    p.set_defaults(func=run)


def _checked_path(text: str) -> str:
    """The signal file's path, refused when it cannot be a file we write by rename."""
    if not text:
        raise DynatrainError("--signal-file: empty path")
    if os.path.isdir(text):
        raise DynatrainError(f"--signal-file {text}: is a directory; give the job's "
                             f"--dynatrain-signal-file, e.g. {os.path.join(text, 'switch.json')}")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise DynatrainError(f"--signal-file {text}: directory {parent} does not exist")
    return text


def _write(path: str, layout, world):
    try:
        return write_request(path, layout, world)
    except OSError as e:
        raise DynatrainError(f"--signal-file {path}: cannot write: "
                             f"{e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    """Entry point of `dynatrain request`."""
    _checked_path(args.signal_file)
    if args.layout is None:
        if args.world is None or args.world < 1:
            raise DynatrainError("give --layout, or --world N (a positive device count) for "
                                 "the job to choose the layout")
        req = _write(args.signal_file, None, args.world)
        print(f"requested the advisor's best layout on {req.world} ranks via "
              f"{args.signal_file}")
        return 0
    layout = Layout.parse(args.layout, args.world)  # malformed layouts fail here, with the reason
    if args.model:
        validate_layout(load_model(args.model), layout,
                        transformer_engine=not args.no_transformer_engine)
    req = _write(args.signal_file, args.layout, args.world)
    print(f"requested {req.layout}" + (f" on {req.world} ranks" if req.world else "")
          + f" via {args.signal_file}")
    return 0
