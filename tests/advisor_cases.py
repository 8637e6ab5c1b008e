"""Functions that run inside spawned gloo ranks for the advisor's live tests."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dynatrain_megatron.mcore.builders import bucket_size_of
from dynatrain_megatron.mcore.session import release, start_job
from dynatrain_megatron.mcore.train_config import TrainConfig
from rank_cases import spec_variant


def live_state_bytes(objs) -> int:
    """Bytes of the distinct storages holding this rank's training state: the DDP param and
    grad buffers, the optimizer's fp32 main params (views of the param buffer when the
    weights are fp32) and its Adam moments."""
    storages: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()

    for chunk in objs.model:
        for buf in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            add(buf.param_data)
            add(buf.grad_data)
    opts = list(getattr(objs.optimizer, "chained_optimizers", None) or [objs.optimizer])
    for opt in opts:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                add(p)
                for k in ("exp_avg", "exp_avg_sq"):
                    add(opt.optimizer.state[p][k])
    return sum(storages.values())


def adam_stepped_once(optimizer) -> bool:
    """Whether the optimizer has taken exactly one step on this rank: every parameter
    shard it owns has Adam state with step 1 (a shard may own only zero gradients, e.g.
    embedding rows of tokens not in the batch, so the moments can be zero)."""
    opts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    states = [st for o in opts for st in o.optimizer.state.values()]
    return bool(states) and all(float(st["step"]) == 1.0 for st in states)


def train_and_measure(cases: list[tuple[str, str, dict]]) -> list[dict]:
    """Per (model, layout, train overrides): build the layout, train one step, and report
    the live state bytes of this rank beside the advisor's exact figure."""
    from dynatrain_megatron.advisor.memory import state_bytes_per_rank

    out = []
    for model, layout, overrides in cases:
        kw = dict(global_batch_size=8, micro_batch_size=2, lr=1e-2, min_lr=1e-3,
                  lr_warmup_iters=0, train_iters=2)
        kw.update(overrides)
        train = TrainConfig(**kw)
        s = spec_variant(model)
        trainer = start_job(s, layout, train)
        objs = trainer.objs
        loss = trainer.step().loss
        vr = objs.groups.virtual_rank
        predicted = state_bytes_per_rank(s, objs.layout, bucket_size_of(train, objs.layout))[vr]
        out.append(dict(model=model, layout=str(objs.layout), loss=float(loss),
                        finite=math.isfinite(float(loss)),
                        stepped=adam_stepped_once(objs.optimizer),
                        live=live_state_bytes(objs), predicted=predicted.total,
                        rank=dist.get_rank()))
        release(objs)
    return out
