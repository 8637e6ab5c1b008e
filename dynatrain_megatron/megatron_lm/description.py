"""What a switch needs to know about a running Megatron-LM job, read from its validated
`args` and its tokenizer: the model (`ModelSpec`), the training schedule (`TrainConfig`)
and the layout. The step-boundary hook (`adapter.MegatronLMSession`) and the public API
(`job.elastic_job`) use the same answer."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from ..mcore.train_config import TrainConfig
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from .arguments import (arg_value, layout_from_megatron_args, spec_from_megatron_args,
                        train_config_from_megatron_args)

log = logging.getLogger("dynatrain")


def _tokenizer_vocab_size() -> Optional[int]:
    """The unpadded vocabulary of Megatron-LM's global tokenizer, when it has one."""
    try:
        from megatron.training import get_tokenizer

        tok = get_tokenizer()
        return int(tok.vocab_size) if tok is not None else None
    except Exception:  # no global tokenizer in this release/config: fall back to args
        return None


def describe_job(args: Any, world_size: int) -> tuple[ModelSpec, TrainConfig, Layout]:
    """(the model, the training schedule, the layout) of the Megatron-LM job of `args` on
    `world_size` ranks. The model's names follow the layers Megatron-LM builds (TE's or
    the local ones, grouped experts or not)."""
    try:
        spec = spec_from_megatron_args(args, vocab_size=_tokenizer_vocab_size())
    except DynatrainError as e:  # a tokenizer whose size does not explain the padding
        log.warning("dynatrain: %s; treating all %s rows as vocabulary", e,
                    arg_value(args, "padded_vocab_size"))
        spec = spec_from_megatron_args(args)
    spec = spec.replace(transformer_engine=arg_value(
        args, "transformer_impl", "transformer_engine") == "transformer_engine")
    if spec.is_moe and arg_value(args, "moe_grouped_gemm", False) and not spec.transformer_engine:
        from ..compat.megatron_lm import local_spec_groups_experts

        spec = spec.replace(moe_grouped_gemm=local_spec_groups_experts())
    from ..compat.megatron_lm import live_batch_ramp

    # the batch-size ramp as the job's calculator runs it (a release may ignore the flag)
    train = dataclasses.replace(train_config_from_megatron_args(args),
                                rampup_batch_size=live_batch_ramp())
    return spec, train, layout_from_megatron_args(args, spec, world_size)


__all__ = ("describe_job",)
