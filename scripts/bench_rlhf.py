#!/usr/bin/env python
"""RLHF's train -> generate move, side by side in one run: our weights-only switch
(`ElasticJob.weights_to`) against megatron-core's own weight refit
(`megatron.core.resharding.swap_model_weights(src, dst, "gloo")`, what RL frameworks use
today), on the same live job, into the same generation layout, both targets built as
model chunks only (no DDP, no optimizer) in megatron's default rank order.

Prints, per method: bytes moved between ranks, seconds (ours: the first call, which builds
the target's groups and chunks inside it, then calls with the target kept
(`weights_back(keep=True)`) and their transfer phase; the refit: its first call, which
plans, and its cached calls, with the target built beforehand), whether the
optimizer state was touched, and checks that both targets hold the same weights, bit for
bit, rank by rank.

    python scripts/bench_rlhf.py [--model-config configs/models/tiny-gpt.yaml]
        [--train tp2pp2dp1] [--generate tp4pp1dp1] [--nproc 4] [--repeat 3]

The refit's caveats (megatron-core 0.16.1), printed with the figures: its plan is cached on
the target model (`_cached_reshard_plan`) and never checked again, so once the training
model changes layout a later call uses a stale plan (a shape error, or a hang); a failed
call leaves its copy service unusable; with SequentialMLP experts (`local_experts.K`) an EP
change silently gives EP rank 1 the wrong experts (only TE's grouped `weightK` names are
remapped). This benchmark uses a dense model and one layout of the training model, where
the refit is correct.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CAVEATS = (
    "refit plan cached on the target (_cached_reshard_plan), never revalidated: stale once "
    "the training model changes layout (shape error or hang)",
    "a failed refit call leaves its copy service unusable",
    "SequentialMLP experts (local_experts.K) across an EP change: EP rank 1 silently gets "
    "the wrong experts (only TE grouped 'weightK' names are remapped)",
)


def _bench(model_config: str, train_layout: str, gen_layout: str, repeat: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core.resharding import swap_model_weights

    from dynatrain_megatron import ElasticJob
    from dynatrain_megatron.adapters.live import storage_fingerprint
    from dynatrain_megatron.bench.measure import max_over_ranks, refit_bytes, sum_over_ranks, timed
    from dynatrain_megatron.elastic.groups import build_groups, install
    from dynatrain_megatron.mcore.builders import MegatronBuilder
    from dynatrain_megatron.mcore.session import release, start_job
    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.transition.switch_types import SwitchOptions
    from dynatrain_megatron.vps import Layout, Placement
    from dynatrain_megatron.vps.model_spec import ModelSpec

    spec = ModelSpec.from_yaml(model_config)
    train = TrainConfig(global_batch_size=8, micro_batch_size=2, train_iters=10)
    builder = MegatronBuilder(spec, train)
    tr = start_job(spec, train_layout, train)
    tr.step()
    # the default placement on both sides: the refit knows no other
    job = ElasticJob.from_objects(tr.objs, builder, SwitchOptions(placement="default"))
    fp = storage_fingerprint(tr.objs.model, tr.objs.optimizer)
    plan = job.plan(gen_layout, weights_only=True)

    # the first call builds G's groups and chunks; the next ones reuse them (keep=True)
    ours, transfer = [], []
    for i in range(repeat + 1):
        gen, t = timed(job.weights_to, gen_layout)
        ours.append(t)
        transfer.append(max_over_ranks(dict(gen.phases).get("transfer", 0.0)))
        bytes_ours = gen.bytes_moved
        if i == repeat:
            ours_weights = [p.detach().clone() for m in gen.model for p in m.parameters()]
            ours_phases = {k: round(v * 1e3, 1) for k, v in gen.phases}
        job.weights_back(keep=True)
    job.release_kept_weights()
    ours_touched = storage_fingerprint(tr.objs.model, tr.objs.optimizer) != fp

    lg = Layout.parse(gen_layout, dist.get_world_size())
    groups, t_groups = timed(build_groups, lg, Placement.default(lg.world_size))
    install(groups)
    target = builder.build_weights_detached(lg, groups).model
    install(tr.objs.groups)
    _, t_first = timed(swap_model_weights, tr.objs.model, target, "gloo")
    cached = [timed(swap_model_weights, tr.objs.model, target, "gloo")[1] for _ in range(repeat)]
    remote, _ = refit_bytes(target)
    refit_weights = [p.detach() for m in target for p in m.parameters()]
    same = len(ours_weights) == len(refit_weights) and all(
        torch.equal(a, b) for a, b in zip(ours_weights, refit_weights))
    same_everywhere = sum_over_ranks(0 if same else 1) == 0
    refit_touched = storage_fingerprint(tr.objs.model, tr.objs.optimizer) != fp
    groups.destroy()
    release(tr.objs)
    return dict(plan_bytes=plan.bytes_moved, plan_estimate=plan.estimated_seconds,
                ours_bytes=bytes_ours, ours_first_seconds=ours[0],
                ours_seconds=statistics.median(ours[1:]),
                ours_transfer_seconds=statistics.median(transfer[1:]),
                ours_optimizer_touched=ours_touched, ours_phases=ours_phases,
                refit_bytes=int(sum_over_ranks(remote)), refit_first_seconds=t_first,
                refit_seconds=statistics.median(cached), refit_groups_seconds=t_groups,
                refit_optimizer_touched=refit_touched, same_weights=same_everywhere)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", default=str(ROOT / "configs/models/tiny-gpt.yaml"))
    p.add_argument("--train", default="tp2pp2dp1")
    p.add_argument("--generate", default="tp4pp1dp1")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    t0 = time.perf_counter()
    r = run_on_ranks(_bench, a.nproc, a.model_config, a.train, a.generate, a.repeat)[0]
    mib = 2 ** 20
    print(f"train {a.train} -> generate {a.generate}, {Path(a.model_config).stem}, "
          f"{a.nproc} gloo ranks, median of {a.repeat}")
    print(f"  plan (ours, before moving):  {r['plan_bytes'] / mib:8.2f} MiB, "
          f"link-model estimate {r['plan_estimate'] * 1e3:.2f} ms")
    print(f"  ours weights_to:             {r['ours_bytes'] / mib:8.2f} MiB, "
          f"{r['ours_seconds'] * 1e3:8.1f} ms call with G kept (first call, building G's "
          f"groups and chunks: {r['ours_first_seconds'] * 1e3:.1f} ms), of which transfer "
          f"{r['ours_transfer_seconds'] * 1e3:.1f} ms; optimizer touched: "
          f"{'yes' if r['ours_optimizer_touched'] else 'no'}")
    print(f"  ours, last call's phases on rank 0 (ms): {r['ours_phases']}")
    print(f"  megatron refit:              {r['refit_bytes'] / mib:8.2f} MiB, "
          f"{r['refit_seconds'] * 1e3:8.1f} ms cached call (first, with planning: "
          f"{r['refit_first_seconds'] * 1e3:.1f} ms; target groups "
          f"{r['refit_groups_seconds'] * 1e3:.1f} ms beforehand); optimizer touched: "
          f"{'yes' if r['refit_optimizer_touched'] else 'no'}")
    print(f"  ratios: bytes ours/refit {r['ours_bytes'] / max(1, r['refit_bytes']):.2f}, "
          f"call ours (G kept) / refit cached "
          f"{r['ours_seconds'] / max(1e-9, r['refit_seconds']):.2f}, first calls "
          f"{r['ours_first_seconds'] / max(1e-9, r['refit_first_seconds']):.2f}")
    print(f"  same weights at {a.generate}, every rank: {r['same_weights']}")
    for c in CAVEATS:
        print(f"  refit caveat: {c}")
    print(f"  wall {time.perf_counter() - t0:.0f} s")
    return 0 if r["same_weights"] else 1


if __name__ == "__main__":
    sys.exit(main())
