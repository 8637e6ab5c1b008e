"""The `dynatrain` command: layout, lost, plan, request, join, launch, bench-switch,
suggest."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .vps.errors import DynatrainError


def _layout_cmd(args: argparse.Namespace) -> int:
    import time

    from .vps import Layout, ModelSpec, analytic_layout
    from .vps.distopt import resolve_bucket_size

    spec = ModelSpec.from_yaml(args.model)
    layout = Layout.parse(args.layout, args.world)
    layout.check_model(spec)
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


def _lost_cmd(args: argparse.Namespace) -> int:
    from .routing.recovery import lost_state
    from .vps import Layout, ModelSpec
    from .vps.distopt import resolve_bucket_size

    spec = ModelSpec.from_yaml(args.model)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dynatrain", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    lay = sub.add_parser("layout", help="fragments / per-rank summary of a layout")
    lay.add_argument("--model", required=True, help="configs/models/NAME.yaml")
    lay.add_argument("--layout", required=True)
    lay.add_argument("--world", type=int, required=True)
    lay.add_argument("--rank", type=int, default=None)
    lay.add_argument("--bucket-size", type=int, default=None,
                     help="DDP bucket size in elements (implies overlapped grad reduce)")
    lay.add_argument("--all", action="store_true")
    lay.add_argument("--json", action="store_true")
    lay.set_defaults(func=_layout_cmd)
    lost = sub.add_parser("lost", help="what would be lost if the given devices died")
    lost.add_argument("--model", required=True, help="configs/models/NAME.yaml")
    lost.add_argument("--layout", required=True)
    lost.add_argument("--world", type=int, required=True)
    lost.add_argument("--dead", required=True, help="comma-separated device ranks")
    lost.add_argument("--bucket-size", type=int, default=None)
    lost.add_argument("--limit", type=int, default=8, help="tensors named in the text")
    lost.add_argument("--json", action="store_true")
    lost.set_defaults(func=_lost_cmd)
    try:
        from .routing.plan_cli import add_plan_parser
    except ImportError:  # planner not available
        add_plan_parser = None
    if add_plan_parser is not None:
        add_plan_parser(sub)
    for extra in ("request", "join", "launch", "bench_switch", "suggest"):
        try:
            mod = __import__(f"dynatrain_megatron.integration.cli_{extra}", fromlist=["add_parser"])
        except ImportError:
            continue
        mod.add_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DynatrainError as e:
        print(f"dynatrain {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
