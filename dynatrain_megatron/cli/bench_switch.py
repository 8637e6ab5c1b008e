"""`dynatrain bench-switch`: measure our switch against dist_checkpointing and megatron's refit.

    dynatrain bench-switch --model gpt-50m --nproc 4 --from tp2pp2 --to tp1pp4 --json

Spawns one group of `--nproc` gloo ranks on this machine and, on the same job at layout A
(trained for `--iters-before` steps), measures side by side: (a) our switch A -> B,
(b) dist_checkpointing save at A + build B + load, (c) megatron-core's weights-only
`resharding.swap_model_weights`, (d) the pairwise point-to-point bandwidth between the same
ranks; prints each time, the ratios, bytes moved against the lower bound, and our transfer
time against the floor (max per-rank bytes the plan sends or receives / measured bandwidth)
and against the cost model fed with the measured link. See `bench.run` for the method.
Bad input exits with 2 and one line naming the constraint, before any rank is spawned.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from ..bench.config import SKIPPABLE, BenchConfig
from ..mcore.train_config import TrainConfig
from ..vps.errors import DynatrainError, LayoutError
from .common import subcommand


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subcommand(
        subparsers, "bench-switch", help="benchmark a live switch against the checkpoint path "
                                         "and refit (spawns gloo ranks on this machine)",
        description=__doc__.split("\n\n")[0],
        examples=["dynatrain bench-switch --model tiny-gpt --nproc 4 --from tp2pp2 --to tp1pp4",
                  "dynatrain bench-switch --model gpt-50m --nproc 4 --from tp2pp2 --to tp1pp4 "
                  "--json"])
    p.add_argument("--model", required=True, metavar="NAME|YAML", help="model config: a name in configs/models "
                   "(tiny-gpt, gpt-50m, gpt-200m, ...) or a YAML path")
    p.add_argument("--nproc", type=int, required=True, metavar="RANKS",
                   help="gloo ranks to spawn on this machine (>= 2)")
    p.add_argument("--from", dest="src", required=True, metavar="LAYOUT", help="layout A, e.g. tp2pp2")
    p.add_argument("--to", dest="dst", required=True, metavar="LAYOUT", help="layout B, e.g. tp1pp4")
    p.add_argument("--iters-before", type=int, default=1, metavar="STEPS",
                   help="training steps at A before measuring (>= 1: Adam state must exist)")
    p.add_argument("--repeat", type=int, default=3, metavar="N",
                   help="repetitions of each measurement; medians are reported (3)")
    p.add_argument("--memory-budget", default=None, metavar="BYTES",
                   help="staging bytes per rank and round for our switch (e.g. 64M, 1GiB)")
    p.add_argument("--placement", choices=("best", "default"), default="best",
                   help="placement of B for our switch: chosen by the planner or megatron's order")
    p.add_argument("--prepare", choices=("background", "inline"), default="background",
                   help="background (default, as the training hook does it): B's groups and "
                        "objects are built, bound and planned in a thread while A trains, "
                        "and the pause is the rest; inline: all of it inside the pause")
    p.add_argument("--ckpt-repeat", type=int, default=None, metavar="N",
                   help="runs of the checkpoint path (default: --repeat); each run after the "
                        "first reloads A from the checkpoint, which needs the most memory")
    p.add_argument("--move-weights", action="store_true",
                   help="move the weights too instead of rebuilding them from fp32 masters")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="RANKS",
                   help="ranks per node for the planner (default: --nproc, one machine)")
    p.add_argument("--link-bytes", default="64M", metavar="BYTES",
                   help="buffer size of the bandwidth test, bytes (64M)")
    p.add_argument("--skip", default="", metavar="NAMES", help="comma list of measurements to skip: "
                   + ", ".join(SKIPPABLE))
    p.add_argument("--ckpt-dir", default=None, metavar="DIR", help="where the checkpoint path writes "
                   "(default /dev/shm where writable, else the system temp dir)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="seconds for the whole run (1800)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def _train_overrides(a_dp: int, b_dp: int) -> dict:
    """Small batches (one micro-batch of 1 per DP rank and layout, twice): the benchmark
    only needs real optimizer state, and the global batch must divide both layouts' DP."""
    g = a_dp * b_dp // math.gcd(a_dp, b_dp)
    return dict(micro_batch_size=1, global_batch_size=2 * g, lr=1e-3, min_lr=1e-4,
                lr_warmup_iters=1, train_iters=100)


def validate(args: argparse.Namespace) -> BenchConfig:
    """Everything checkable without spawning a rank; returns the run's config."""
    from ..configs import load_model, model_config_path
    from ..units import parse_bytes
    from ..vps.layout import Layout

    if args.nproc < 2:
        raise DynatrainError(f"--nproc must be >= 2 (the bandwidth test pairs ranks), "
                             f"got {args.nproc}")
    if args.iters_before < 1:
        raise DynatrainError(f"--iters-before must be >= 1 (the optimizer state must exist), "
                             f"got {args.iters_before}")
    if args.repeat < 1:
        raise DynatrainError(f"--repeat must be >= 1, got {args.repeat}")
    if args.ckpt_repeat is not None and args.ckpt_repeat < 1:
        raise DynatrainError(f"--ckpt-repeat must be >= 1, got {args.ckpt_repeat}")
    if args.timeout <= 0:
        raise DynatrainError(f"--timeout must be positive, got {args.timeout}")
    rpn = args.ranks_per_node if args.ranks_per_node is not None else args.nproc
    if rpn < 1:
        raise DynatrainError(f"--ranks-per-node must be >= 1, got {rpn}")
    skip = [x.strip() for x in args.skip.split(",") if x.strip()]
    bad = [x for x in skip if x not in SKIPPABLE]
    if bad:
        raise DynatrainError(f"--skip {bad}: can skip only {list(SKIPPABLE)}")
    budget = None
    if args.memory_budget is not None:
        try:
            budget = parse_bytes(args.memory_budget)
        except argparse.ArgumentTypeError as e:
            raise DynatrainError(f"--memory-budget: {e}") from None
        if budget <= 0:
            raise DynatrainError(f"--memory-budget must be positive, got {args.memory_budget!r}")
    try:
        link = parse_bytes(args.link_bytes)
    except argparse.ArgumentTypeError as e:
        raise DynatrainError(f"--link-bytes: {e}") from None
    if link < 4:
        raise DynatrainError(f"--link-bytes must be >= 4, got {args.link_bytes!r}")
    if args.ckpt_dir is not None:
        import os

        if not os.path.isdir(args.ckpt_dir) or not os.access(args.ckpt_dir, os.W_OK):
            raise DynatrainError(f"--ckpt-dir {args.ckpt_dir!r} is not a writable directory")
    spec = load_model(args.model)
    layouts = []
    for flag, text in (("--from", args.src), ("--to", args.dst)):
        try:
            lay = Layout.parse(text, args.nproc)
            lay.check_model(spec)
        except LayoutError as e:
            raise LayoutError(f"{flag}: {e}") from None
        if lay.cp > 1:
            from ..mcore.builders import transformer_engine_available

            if not transformer_engine_available():
                raise LayoutError(f"{flag} {lay}: context parallelism needs Transformer "
                                  f"Engine's attention (megatron-core's local attention refuses "
                                  f"cp > 1); plan it with `dynatrain plan` instead")
        layouts.append(lay)
    a, b = layouts
    return BenchConfig(model_path=str(model_config_path(args.model).resolve()),
                       model_name=spec.name, nproc=args.nproc, src=str(a), dst=str(b),
                       train=TrainConfig(**_train_overrides(a.dp, b.dp)), ranks_per_node=rpn,
                       iters_before=args.iters_before, repeat=args.repeat,
                       memory_budget=budget, placement=args.placement,
                       move_weights=args.move_weights, link_bytes=link, skip=tuple(skip),
                       ckpt_dir=args.ckpt_dir, ckpt_repeat=args.ckpt_repeat,
                       prepare=args.prepare, progress=not args.quiet)


def run(args: argparse.Namespace) -> int:
    """Entry point of `dynatrain bench-switch`; returns the exit code (2 on bad input)."""
    try:
        cfg = validate(args)
    except DynatrainError as e:
        print(f"dynatrain bench-switch: error: {e}", file=sys.stderr)
        return 2
    from ..bench import run as bench_run
    from ..bench.report import format_summary

    s = bench_run.run_bench(cfg, timeout=args.timeout)
    print(json.dumps(s, indent=1) if args.json else format_summary(s))
    return 0
