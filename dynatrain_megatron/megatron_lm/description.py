"""What a switch needs to know about a running Megatron-LM job, read from its validated
`args` and its tokenizer: the model (`ModelSpec`), the training schedule (`TrainConfig`)
and the layout; and the check of the job's live state against that description, before
any switch. The step-boundary hook (`adapter.MegatronLMSession`) and the public API
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


def check_live_state(spec: ModelSpec, train: TrainConfig, objs, metadata: bool = False,
                     unlike: tuple[str, ...] = ()) -> None:
    """The switch's own pre-flight check, run once up front: the live model/optimizer state
    must be exactly what the analytic layout says, or we refuse before training goes on
    (`metadata`: planned from the live metadata; the tensors both describe must agree, but
    those under the key prefixes `unlike`)."""
    from ..adapters.live import LiveState
    from ..adapters.verify import check_live_matches_analytic, check_live_matches_analytic_where_both
    from ..vps.analytic import analytic_layout
    from ..vps.fragment import KINDS, OPT_KINDS
    from ..mcore.builders import bucket_size_of

    vr = objs.groups.virtual_rank
    live = LiveState(objs.model, objs.optimizer, vr, spec.vocab_size)
    expected = analytic_layout(spec, objs.layout, bucket_size_of(train, objs.layout))
    kinds = KINDS if metadata else OPT_KINDS
    sides = (live.fragments(kinds), expected.fragments(vr, kinds), vr)
    if metadata:
        check_live_matches_analytic_where_both(*sides, unlike)
    else:
        check_live_matches_analytic(*sides)


__all__ = ("check_live_state", "describe_job")
