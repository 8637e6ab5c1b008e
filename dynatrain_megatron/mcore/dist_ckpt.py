"""The checkpoint-based path Megatron users take today: `dist_checkpointing` save at layout
A, rebuild at layout B, load. It is our correctness reference (a switch must give the same
training as this) and our speed baseline (`dynatrain bench-switch`).

Follows Megatron-LM's `generate_state_dict`: `model` (or `model0..` per VPP chunk), the
optimizer in the fully reshardable format (needed for TP/PP changes), the scheduler, and
the iteration / consumed samples as common state. megatron-core 0.16.1's torch-Adam load
bugs are fixed in `compat.megatron_fixes`.
"""
from __future__ import annotations

import logging
from typing import Any


log = logging.getLogger("dynatrain")

_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
             "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def sharded_training_state(objs, iteration: int, consumed_samples: int,
                           is_loading: bool = False) -> dict[str, Any]:
    chunks = [m.module for m in objs.model]
    sd: dict[str, Any] = {}
    for i, c in enumerate(chunks):
        sd[_model_key(i, len(chunks))] = c.sharded_state_dict(metadata=dict(_METADATA))
    model_sd = {k: v for k, v in sd.items()}
    sd["optimizer"] = objs.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                        metadata=dict(_METADATA))
    sd["opt_param_scheduler"] = objs.scheduler.state_dict()
    sd["iteration"] = iteration
    sd["consumed_samples"] = consumed_samples
    return sd


def save(objs, iteration: int, consumed_samples: int, ckpt_dir: str) -> None:
    import os

    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    for m in objs.model:  # bf16 params may lag the DistOpt shards with overlap_param_gather
        if m.ddp_config.overlap_param_gather:
            m.start_param_sync(force_sync=True)
    sd = sharded_training_state(objs, iteration, consumed_samples)
    dist_checkpointing.save(sd, ckpt_dir, validate_access_integrity=False)


def load(objs, ckpt_dir: str) -> tuple[int, int]:
    """Load into freshly built objects of any layout. Returns (iteration, consumed_samples)."""
    from megatron.core import dist_checkpointing

    sd = sharded_training_state(objs, 0, 0, is_loading=True)
    state = dist_checkpointing.load(sd, ckpt_dir)
    n = len(objs.model)
    for i, m in enumerate(objs.model):
        m.module.load_state_dict(state[_model_key(i, n)], strict=False)
    objs.optimizer.load_state_dict(state["optimizer"])
    objs.scheduler.load_state_dict(state["opt_param_scheduler"])
    return int(state["iteration"]), int(state["consumed_samples"])
