"""`dynatrain lost --model M --layout L --world N --dead 3,5`: what the death of some
devices would lose of a layout's state, and whether training can go on in memory."""
from __future__ import annotations

import argparse
import json

from ..configs import load_model
from ..routing.lost_state import lost_state
from ..vps.distopt import resolve_bucket_size
from ..vps.errors import DynatrainError
from ..vps.layout import Layout


def add_parser(sub) -> None:
    lost = sub.add_parser("lost", help="what would be lost if the given devices died")
    lost.add_argument("--model", required=True, help="model config: a name in configs/models "
                                                     "or a YAML path")
    lost.add_argument("--layout", required=True)
    lost.add_argument("--world", type=int, required=True)
    lost.add_argument("--dead", required=True, help="comma-separated device ranks")
    lost.add_argument("--bucket-size", type=int, default=None)
    lost.add_argument("--limit", type=int, default=8, help="tensors named in the text")
    lost.add_argument("--json", action="store_true")
    lost.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of `dynatrain lost`."""
    spec = load_model(args.model)
    layout = Layout.parse(args.layout, args.world)
    layout.check_model(spec)
    dead = [int(x) for x in args.dead.split(",") if x.strip()]
    bad = [d for d in dead if not 0 <= d < layout.world_size]
    if bad:
        raise DynatrainError(f"--dead {bad}: outside the world of {layout.world_size} ranks")
    rep = lost_state(spec, layout, dead, bucket_size=resolve_bucket_size(
        args.bucket_size, args.bucket_size is not None, layout.dp))
    if args.json:
        print(json.dumps(dict(dead=list(rep.dead), recoverable=rep.recoverable,
                              weights_recoverable=rep.weights_recoverable,
                              lost_elements=rep.lost_elements,
                              lost=[dict(key=b.key, kind=b.kind, offsets=b.box.offsets,
                                         shape=b.box.shape) for b in rep.lost])))
    else:
        print(rep.describe(limit=args.limit))
        print("in memory: " + ("everything recoverable" if rep.recoverable else
                               "weights recoverable, optimizer state lost: resume from the last "
                               "checkpoint" if rep.weights_recoverable else
                               "weights lost: resume from the last checkpoint"))
    return 0
