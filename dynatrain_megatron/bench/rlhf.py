"""RLHF's train -> generate move, side by side on one live job: our weights-only switch
(`ElasticJob.weights_to`) against megatron-core's own weight refit
(`megatron.core.resharding.swap_model_weights(src, dst, "gloo")`, what RL frameworks use
today), into the same generation layout, both targets model chunks only (no DDP, no
optimizer) in megatron's default rank order (the refit knows no other). Run on every rank
of the job by `scripts/bench_rlhf.py` (our stand-in job) and
`scripts/bench_rlhf_megatron_lm.py` (inside Megatron-LM).

Like for like: our first call builds G's process groups and chunks inside it, the refit's
first call plans (its target built beforehand); our later calls reuse G
(`weights_back(keep=True)`), the refit's reuse its cached plan.
"""
from __future__ import annotations

import contextlib
import statistics
from typing import Any, Iterator

# what megatron-core's refit does not guard against (found on the CPU; docs/bench/rlhf.md)
CAVEATS = (
    "megatron-core 0.16: the plan is cached on the target (_cached_reshard_plan) and never "
    "revalidated: stale once the training model changes layout (shape error or hang); "
    "0.19 keys a module-level cache by (rank, TP/PP/EP/DP/expert-TP sizes, world size): a "
    "layout change that keeps those sizes (rank order, VPP) would reuse a stale plan "
    "(not reproduced here)",
    "a failed refit call leaves its copy service unusable",
    "SequentialMLP experts (local_experts.K) across an EP change: EP rank 1 silently gets "
    "the wrong experts (only TE grouped 'weightK' names are remapped; found on 0.16); "
    "0.19 inside Megatron-LM, tp1pp2ep2 -> tp1pp1ep4: the refit's experts are not A's "
    "either (scripts/bench_rlhf_megatron_lm.py --experts 4)",
    "megatron-core 0.19's gloo copy service stages every received piece in pinned memory: "
    "it fails on a machine without an accelerator (run here with pin_memory dropped)",
)


@contextlib.contextmanager
def _without_pinned_memory() -> Iterator[None]:
    """On a machine without an accelerator: allocations asking for pinned memory get plain
    memory (there is no pinned allocator; megatron-core 0.19's gloo refit asks for it).
    Elsewhere: nothing changes."""
    import torch
    from torch.overrides import TorchFunctionMode

    if torch.cuda.is_available() or torch.cuda.device_count() > 0:
        yield
        return

    class _Unpinned(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if kwargs.get("pin_memory"):
                kwargs = dict(kwargs, pin_memory=False)
            return func(*args, **kwargs)

    with _Unpinned():
        yield


def compare_with_refit(job: Any, gen_layout: str, repeat: int) -> dict:
    """Every rank: `repeat` + 1 weights-only round trips of `job` to `gen_layout` (the first
    builds G), then megatron-core's refit from the job's training chunks into chunks built
    at G by the job's own builder, its first call and `repeat` cached ones. Returns the
    figures (the same on every rank), whether both targets hold the same weights, bit for
    bit, on every rank, and whether each holds A's weights in every replica (against A's
    whole weights, gathered first). `job` must use the default placement (`SwitchOptions(
    placement="default")`)."""
    import torch
    import torch.distributed as dist
    from megatron.core.resharding import swap_model_weights

    from ..adapters.live import LiveState, storage_fingerprint
    from ..testing.gather import (broadcast_full_state, gather_full_state,
                                  mismatches_against)
    from ..elastic.groups import build_groups, install
    from ..vps import Layout, Placement
    from .measure import max_over_ranks, refit_bytes, sum_over_ranks, timed

    a = job.objects
    spec = job.builder.spec
    # A's weights, whole, on every rank: what every replica at G must hold
    full = gather_full_state(LiveState(a.model, a.optimizer, a.groups.virtual_rank,
                                       spec.vocab_size), spec, kinds=("param",), dst=0)
    full = broadcast_full_state(full)

    def correct(model: list) -> bool:  # every replica of every weight at G is A's
        live = LiveState(model, None, dist.get_rank(), spec.vocab_size)
        return sum_over_ranks(len(mismatches_against(live, full, ("param",)))) == 0

    fp = storage_fingerprint(a.model, a.optimizer)
    plan = job.plan(gen_layout, weights_only=True)
    ours, transfer = [], []
    for i in range(repeat + 1):
        gen, t = timed(job.weights_to, gen_layout)
        ours.append(t)
        transfer.append(max_over_ranks(dict(gen.phases).get("transfer", 0.0)))
        bytes_ours = gen.bytes_moved
        if i == repeat:
            ours_weights = [p.detach().clone() for m in gen.model for p in m.parameters()]
            ours_correct = correct(gen.model)
            ours_phases = {k: round(v * 1e3, 1) for k, v in gen.phases}
        job.weights_back(keep=True)
    job.release_kept_weights()
    ours_touched = storage_fingerprint(a.model, a.optimizer) != fp

    lg = Layout.parse(gen_layout, dist.get_world_size())
    groups, t_groups = timed(build_groups, lg, Placement.default(lg.world_size))
    install(groups)
    target = job.builder.build_weights_detached(lg, groups).model
    install(a.groups)
    with _without_pinned_memory():
        _, t_first = timed(swap_model_weights, a.model, target, "gloo")
        cached = [timed(swap_model_weights, a.model, target, "gloo")[1] for _ in range(repeat)]
    remote, _ = refit_bytes(target, a.model)
    refit_weights = [p.detach() for m in target for p in m.parameters()]
    refit_correct = correct(target)
    same = len(ours_weights) == len(refit_weights) and all(
        torch.equal(x, y) for x, y in zip(ours_weights, refit_weights))
    same_everywhere = sum_over_ranks(0 if same else 1) == 0
    refit_touched = storage_fingerprint(a.model, a.optimizer) != fp
    del target
    groups.destroy()
    return dict(plan_bytes=plan.bytes_moved, plan_estimate=plan.estimated_seconds,
                ours_bytes=bytes_ours, ours_first_seconds=ours[0],
                ours_seconds=statistics.median(ours[1:]),
                ours_transfer_seconds=statistics.median(transfer[1:]),
                ours_optimizer_touched=ours_touched, ours_phases=ours_phases,
                refit_bytes=int(sum_over_ranks(remote)), refit_first_seconds=t_first,
                refit_seconds=statistics.median(cached), refit_groups_seconds=t_groups,
                refit_optimizer_touched=refit_touched, same_weights=same_everywhere,
                ours_correct=ours_correct, refit_correct=refit_correct)


def report_lines(r: dict, gen_layout: str) -> list[str]:
    """The comparison's figures and ratios, for a human."""
    mib = 2 ** 20
    yes = {True: "yes", False: "no"}
    out = [
        f"  plan (ours, before moving):  {r['plan_bytes'] / mib:8.2f} MiB, "
        f"link-model estimate {r['plan_estimate'] * 1e3:.2f} ms",
        f"  ours weights_to:             {r['ours_bytes'] / mib:8.2f} MiB, "
        f"{r['ours_seconds'] * 1e3:8.1f} ms call with G kept (first call, building G's "
        f"groups and chunks: {r['ours_first_seconds'] * 1e3:.1f} ms), of which transfer "
        f"{r['ours_transfer_seconds'] * 1e3:.1f} ms; optimizer touched: "
        f"{yes[r['ours_optimizer_touched']]}",
        f"  ours, last call's phases on rank 0 (ms): {r['ours_phases']}",
        f"  megatron refit:              {r['refit_bytes'] / mib:8.2f} MiB, "
        f"{r['refit_seconds'] * 1e3:8.1f} ms cached call (first, with planning: "
        f"{r['refit_first_seconds'] * 1e3:.1f} ms; target groups "
        f"{r['refit_groups_seconds'] * 1e3:.1f} ms beforehand); optimizer touched: "
        f"{yes[r['refit_optimizer_touched']]}",
        f"  ratios: bytes ours/refit {r['ours_bytes'] / max(1, r['refit_bytes']):.2f}, "
        f"call ours (G kept) / refit cached "
        f"{r['ours_seconds'] / max(1e-9, r['refit_seconds']):.2f}, first calls "
        f"{r['ours_first_seconds'] / max(1e-9, r['refit_first_seconds']):.2f}",
        f"  same weights at {gen_layout}, every rank: {r['same_weights']}; A's weights in "
        f"every replica at G: ours {r['ours_correct']}, refit {r['refit_correct']}",
    ]
    return out + [f"  refit caveat: {c}" for c in CAVEATS]


__all__ = ("CAVEATS", "compare_with_refit", "report_lines")
