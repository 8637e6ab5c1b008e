"""Functions that run inside spawned gloo ranks (imported by name in the children)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dynatrain_megatron.integration.session import release, start_job
from dynatrain_megatron.integration.train_config import TrainConfig
from dynatrain_megatron.vps.model_spec import ModelSpec

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "models"


def spec(name: str) -> ModelSpec:
    return ModelSpec.from_yaml(CONFIGS / f"{name}.yaml")


def dp_replicas_identical(trainer) -> bool:
    """Exact equality of every parameter across the DP (dense) / expert-DP replicas."""
    objs = trainer.objs
    pgc = objs.groups.pg_collection
    ok = True
    for chunk in objs.model:
        for name, p in chunk.module.named_parameters():
            expert = not getattr(p, "allreduce", True)
            group = pgc.expt_dp if expert else pgc.dp_cp
            n = dist.get_world_size(group)
            if n == 1:
                continue
            gathered = [torch.empty_like(p.data) for _ in range(n)]
            dist.all_gather(gathered, p.data.contiguous(), group=group)
            ok &= all(torch.equal(gathered[0], g) for g in gathered[1:])
    return ok


def train_cases(cases: list[tuple[str, str, int, dict]]) -> list[dict]:
    """Train each (model, layout, steps, train overrides) case from scratch in this group."""
    out = []
    for model, layout, steps, overrides in cases:
        kw = dict(global_batch_size=8, micro_batch_size=2, lr=1e-2, min_lr=1e-3,
                  lr_warmup_iters=1, train_iters=steps)
        kw.update(overrides)
        before = len(dist.distributed_c10d._world.pg_map)
        trainer = start_job(spec(model), layout, TrainConfig(**kw))
        losses = [trainer.step().loss for _ in range(steps)]
        same = dp_replicas_identical(trainer)
        release(trainer.objs)
        after = len(dist.distributed_c10d._world.pg_map)
        out.append(dict(model=model, layout=str(trainer.objs.layout), losses=losses,
                        dp_identical=same, leaked_groups=after - before))
    return out
