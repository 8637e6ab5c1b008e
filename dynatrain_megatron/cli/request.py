"""`dynatrain request --signal-file F [--layout tp4pp1dp1] [--world N] [--model M]`: ask a
running job to switch (atomic write-then-rename of the signal file).

With `--model`, the layout is checked by the one validator first, and nothing is written
when it is refused. Without `--layout`, `--world N` asks the job to move to its layout
advisor's best layout of N devices."""
from __future__ import annotations

import argparse

from ..configs import load_model
from ..elastic.signal_file import write_request
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.validate import validate_layout


def add_parser(sub) -> None:
    p = sub.add_parser("request", help="ask a running job to switch layout")
    p.add_argument("--signal-file", required=True)
    p.add_argument("--layout", default=None,
                   help="target layout; omitted: the job's advisor chooses for --world")
    p.add_argument("--world", type=int, default=None)
    p.add_argument("--model", default=None,
                   help="a name in configs/models or a YAML path: validate the layout for it "
                        "(and --world) before writing")
    p.add_argument("--no-transformer-engine", action="store_true",
                   help="with --model: the job runs without Transformer Engine (then no CP)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of `dynatrain request`."""
    if args.layout is None:
        if args.world is None or args.world < 1:
            raise DynatrainError("give --layout, or --world N (a positive device count) for "
                                 "the job to choose the layout")
        req = write_request(args.signal_file, None, args.world)
        print(f"requested the advisor's best layout on {req.world} ranks via "
              f"{args.signal_file}")
        return 0
    layout = Layout.parse(args.layout, args.world)  # malformed layouts fail here, with the reason
    if args.model:
        validate_layout(load_model(args.model), layout,
                        transformer_engine=not args.no_transformer_engine)
    req = write_request(args.signal_file, args.layout, args.world)
    print(f"requested {req.layout}" + (f" on {req.world} ranks" if req.world else "")
          + f" via {args.signal_file}")
    return 0
