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
from .common import devices, int_at_least, subcommand


def add_parser(sub) -> None:
    lost = subcommand(sub, "lost", help="what the death of some devices would lose of a "
                                        "layout's state",
                      examples=["dynatrain lost --model tiny-gpt --layout tp1pp2dp2 --world 4 "
                                "--dead 3",
                                "dynatrain lost --model tiny-gpt --layout tp1pp2doi2dp2 "
                                "--world 4 --dead 3   # two optimizer instances: nothing lost"])
    lost.add_argument("--model", required=True, metavar="NAME|YAML",
                      help="model config: a name in configs/models or a YAML path")
    lost.add_argument("--layout", required=True, metavar="LAYOUT",
                      help="the job's layout, e.g. tp1pp2doi2dp2")
    lost.add_argument("--world", type=devices(), required=True, metavar="DEVICES",
                      help="number of devices (ranks) of the job")
    lost.add_argument("--dead", required=True, metavar="RANKS",
                      help="the ranks that die, comma-separated (e.g. 3,5)")
    lost.add_argument("--bucket-size", type=int_at_least(1), default=None, metavar="ELEMENTS",
                      help="DDP bucket size in elements; default: one bucket per buffer")
    lost.add_argument("--limit", type=int_at_least(0), default=8, metavar="N",
                      help="lost tensors named in the text (8)")
    lost.add_argument("--json", action="store_true", help="print one JSON object")
    lost.set_defaults(func=run)


def parse_ranks(text: str, world: int) -> list[int]:
    """`3,5` -> [3, 5]: each an integer rank of the world, none twice."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            r = int(part)
        except ValueError:
            raise DynatrainError(f"--dead {text!r}: {part!r} is not a rank number") from None
        if not 0 <= r < world:
            raise DynatrainError(f"--dead {text!r}: rank {r} is outside the world of {world} "
                                 f"ranks")
        if r in out:
            raise DynatrainError(f"--dead {text!r}: rank {r} given twice")
        out.append(r)
    if not out:
        raise DynatrainError(f"--dead {text!r}: name at least one rank")
    return out


def run(args: argparse.Namespace) -> int:
    """Entry point of `dynatrain lost`."""
    spec = load_model(args.model)
    layout = Layout.parse(args.layout, args.world)
    layout.check_model(spec)
    dead = parse_ranks(args.dead, layout.world_size)
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
