"""`dynatrain layout --model M --layout L --world N [--rank R]`: the fragments one rank
holds in a layout, or the per-rank summary of the state (tensors, bytes per kind)."""
from __future__ import annotations

import argparse
import json
import time

from ..configs import load_model
from ..vps.analytic import analytic_layout
from ..vps.distopt import resolve_bucket_size
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.validate import validate_layout
from .common import devices, int_at_least, subcommand


def add_parser(sub) -> None:
    lay = subcommand(sub, "layout", help="the state each rank holds in a layout (no job needed)",
                     examples=["dynatrain layout --model tiny-gpt --layout tp2pp2 --world 8",
                               "dynatrain layout --model llama3-70b --layout tp8pp4dp4 "
                               "--world 128 --rank 0 --json"])
    lay.add_argument("--model", required=True, metavar="NAME|YAML",
                     help="model config: a name in configs/models (tiny-gpt, llama3-70b, ...) "
                          "or a YAML path")
    lay.add_argument("--layout", required=True, metavar="LAYOUT",
                     help="parallel layout, e.g. tp2pp2dp2 (dp: derived from --world)")
    lay.add_argument("--world", type=devices(), required=True, metavar="DEVICES",
                     help="number of devices (ranks)")
    lay.add_argument("--rank", type=int_at_least(0), default=None, metavar="RANK",
                     help="print this rank's fragments instead of the per-rank summary")
    lay.add_argument("--bucket-size", type=int_at_least(1), default=None, metavar="ELEMENTS",
                     help="DDP bucket size in elements (implies overlapped grad reduce); "
                          "default: one bucket per buffer")
    lay.add_argument("--no-transformer-engine", action="store_true",
                     help="the job runs without Transformer Engine (then no CP)")
    lay.add_argument("--all", action="store_true",
                     help="show every rank (default: the first and last 8 of a large world)")
    lay.add_argument("--json", action="store_true", help="print JSON instead of a table")
    lay.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of `dynatrain layout`."""
    spec = load_model(args.model)
    layout = Layout.parse(args.layout, args.world)
    validate_layout(spec, layout, transformer_engine=not args.no_transformer_engine)
    t0 = time.perf_counter()
    an = analytic_layout(spec, layout, resolve_bucket_size(args.bucket_size, args.bucket_size is not None,
                                                          layout.dp))
    if args.rank is not None:
        if not 0 <= args.rank < layout.world_size:
            raise DynatrainError(f"--rank {args.rank} outside world of {layout.world_size}")
        frags = an.fragments(args.rank)
        if args.json:
            print(json.dumps([dict(key=f.key, kind=f.kind, offsets=f.box.offsets, shape=f.box.shape,
                                   rank=f.rank, replica=f.replica, chunk=f.chunk,
                                   local_name=f.local_name, local_offsets=f.local_offsets)
                              for f in frags]))
        else:
            for f in frags:
                print(f)
        return 0
    sums = an.summaries()
    dt = time.perf_counter() - t0
    if args.json:
        print(json.dumps(dict(model=spec.name, layout=str(layout), world=layout.world_size,
                              seconds=dt, ranks=[dict(rank=s.rank, tensors=s.tensors, bytes=s.bytes)
                                                 for s in sums])))
        return 0
    print(f"model {spec.name}, layout {layout}, {layout.world_size} ranks ({dt * 1000:.1f} ms)")
    kinds = list(sums[0].bytes)
    print(f"{'rank':>6} {'tensors':>8} " + " ".join(f"{k:>14}" for k in kinds))
    shown = sums if len(sums) <= 16 or args.all else sums[:8] + sums[-8:]
    for s in shown:
        print(f"{s.rank:>6} {s.tensors:>8} " + " ".join(f"{s.bytes[k]:>14,}" for k in kinds))
    if shown is not sums:
        print(f"... ({len(sums) - 16} ranks not shown; --all shows every rank)")
    return 0
