"""The pipeline split a Megatron-LM job fixes by its flags, as a `Layout` describes it.

Megatron-LM places the decoder layers on the model chunks (pipeline rank x virtual stage) by
one of three rules: an even split, `--decoder-first/last-pipeline-num-layers` (the Layout's
`ppf`/`ppl`), `--account-for-embedding/loss-in-pipeline-split` (the embedding and the loss
each counted as a layer of the first and last chunk), or a `--pipeline-model-parallel-layout`
string naming every chunk's layers. Without virtual stages the account-for flags are an
uneven first/last stage (`arguments._stage_split`); with them, and with a layout string, the
Layout carries every chunk's layer count (`Layout.split`).

`PipelineRule` is the job's rule, read once from its args at start (a switch rewrites the
job's args). `complete` gives a requested layout the split Megatron-LM's restart at it
would make (a layout string fixes PP x VPP: another PP or VPP needs B's split named in the
request, as the restart needs a new string); `pipeline_args` sets B's args so that
Megatron-LM builds that split: the job's own flags where they make it, else a layout
string written for it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from ..vps.errors import DynatrainError
from ..vps.layout import Layout


def _flag(args: Any, name: str) -> bool:
    return bool(getattr(args, name, False))


@dataclass(frozen=True)
class PipelineRule:
    """How the job splits its layers over model chunks. `layout`: its
    `--pipeline-model-parallel-layout` (None: none); `embedding`/`loss`: its
    `--account-for-embedding/loss-in-pipeline-split`; `mtp`: multi-token prediction layers
    (a layout string places them, so none is written for such a job); `heterogeneous`: its
    layers come from `--heterogeneous-layers-config-path` (or its encoded JSON), which
    Megatron-LM builds without virtual stages."""

    layout: Optional[str] = None
    embedding: bool = False
    loss: bool = False
    mtp: int = 0
    heterogeneous: bool = False

    def __post_init__(self) -> None:
        if self.layout is not None and (self.embedding or self.loss):
            raise DynatrainError("--pipeline-model-parallel-layout beside --account-for-"
                                 "embedding/loss-in-pipeline-split (megatron-core refuses both)")

    @classmethod
    def from_args(cls, args: Any) -> "PipelineRule":
        text = getattr(args, "pipeline_model_parallel_layout", None)
        return cls(layout=None if text is None else str(text),
                   embedding=_flag(args, "account_for_embedding_in_pipeline_split"),
                   loss=_flag(args, "account_for_loss_in_pipeline_split"),
                   mtp=int(getattr(args, "mtp_num_layers", None) or 0),
                   heterogeneous=bool(
                       getattr(args, "heterogeneous_layers_config_path", None)
                       or getattr(args, "heterogeneous_layers_config_encoded_json", None)))

    def split(self, num_layers: int, pp: int, vpp: int) -> tuple[int, ...]:
        """Decoder layers of every chunk ((vp stage, pp rank), vp-major) at pp x vpp by this
        rule, or () where the Layout's ppf/ppl (or the even split) describe it."""
        if self.layout is not None:
            return _layout_split(self.layout, pp, vpp)
        if not (self.embedding or self.loss) or vpp == 1:
            return ()
        total = num_layers + self.embedding + self.loss
        if total % pp or (total // pp) % vpp:
            raise DynatrainError(
                f"pp{pp} vpp{vpp}: {num_layers} layers + {int(self.embedding) + int(self.loss)} "
                f"(--account-for-embedding/loss-in-pipeline-split) do not split evenly over "
                f"{pp} stages of {vpp} virtual stages (megatron-core refuses it)")
        per = total // (pp * vpp)
        out = [per] * (pp * vpp)
        out[0] -= self.embedding
        out[-1] -= self.loss
        if min(out) < 0:
            raise DynatrainError(f"pp{pp} vpp{vpp}: chunks of {per} layer(s) leave none for "
                                 f"the embedding or the loss")
        return tuple(out)

    def complete(self, layout: Layout, num_layers: int) -> Layout:
        """`layout` with the split a restart at it would make (unchanged where the request
        names its own `split`, `ppf` or `ppl`). DynatrainError where the rule cannot be
        applied at its PP x VPP (a layout string of another length), and for virtual
        stages of heterogeneous layers: Megatron-LM's GPT builder asks megatron-core for
        their layer specs without the virtual stage (`megatron/training/models/gpt.py`,
        core_v0.19.0), which asserts, so its own restart at such a layout fails too."""
        if self.heterogeneous and layout.vpp > 1:
            raise DynatrainError(
                f"vpp{layout.vpp}: heterogeneous layers (--heterogeneous-layers-config-path) "
                f"have no virtual pipeline stages in Megatron-LM (it builds their layer specs "
                f"without the virtual stage; its own restart at this layout fails the same "
                f"way): request a layout without vpp")
        if layout.split or layout.ppf or layout.ppl:
            return layout
        if self.layout is None and (self.embedding or self.loss) and layout.vpp == 1 \
                and layout.pp > 1:
            total = num_layers + self.embedding + self.loss
            per = total // layout.pp
            if total % layout.pp == 0 and per > 1:
                return dataclasses.replace(layout, ppf=per - 1 if self.embedding else 0,
                                           ppl=per - 1 if self.loss else 0)
            return layout  # the even split; the validator names what is wrong
        split = self.split(num_layers, layout.pp, layout.vpp)
        return dataclasses.replace(layout, split=split) if split else layout

    def describes(self, layout: Layout, num_layers: int) -> bool:
        """Whether the job's own flags make `layout`'s split at its PP x VPP."""
        try:
            return bool(layout.split) and self.split(num_layers, layout.pp,
                                                     layout.vpp) == layout.split
        except DynatrainError:
            return False


def _layout_split(text: str, pp: int, vpp: int) -> tuple[int, ...]:
    """Decoder layers of every chunk of Megatron-LM's layout string `text` (its own parser),
    which must have pp x vpp stages."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout)

    stages = PipelineParallelLayerLayout.get_num_stages_from_str(text)
    if stages != pp * vpp:
        raise DynatrainError(
            f"--pipeline-model-parallel-layout {text!r} has {stages} stages, pp{pp} vpp{vpp} "
            f"has {pp * vpp}: a switch to another PP x VPP needs B's split named in the "
            f"request (split<n>-<n>-..., one layer count per chunk), as Megatron-LM's restart "
            f"needs a new layout string")
    parsed = PipelineParallelLayerLayout(text, pp)
    return tuple(parsed.layout[p][v].count(LayerType.decoder)
                 for v in range(vpp) for p in range(pp))


def layout_string(split: tuple[int, ...]) -> str:
    """A `--pipeline-model-parallel-layout` placing `split`'s layers, the embedding on the
    first chunk and the loss on the last (Megatron-LM's letters E, t, L; chunks in
    vp-major order, separated by |)."""
    last = len(split) - 1
    return "|".join(("E" if i == 0 else "") + "t" * n + ("L" if i == last else "")
                    for i, n in enumerate(split))


def pipeline_args(layout: Layout, num_layers: int, like: Any) -> dict[str, Any]:
    """The args that make Megatron-LM build `layout`'s split (`layout.split` set): the job's
    own flags (`like`'s rule) where they make it, else a layout string written for it."""
    rule = PipelineRule.from_args(like)
    vpp = layout.vpp if layout.vpp > 1 else None
    out: dict[str, Any] = {"num_layers_per_virtual_pipeline_stage": None,
                           "decoder_first_pipeline_num_layers": None,
                           "decoder_last_pipeline_num_layers": None}
    if rule.describes(layout, num_layers):
        out.update(pipeline_model_parallel_layout=rule.layout,
                   account_for_embedding_in_pipeline_split=rule.embedding,
                   account_for_loss_in_pipeline_split=rule.loss,
                   num_virtual_stages_per_pipeline_rank=None if rule.layout else vpp)
        return out
    if rule.mtp:
        raise DynatrainError(f"layout {layout}: a split other than the job's own with "
                             f"multi-token prediction (its layers are placed by the layout "
                             f"string, which the switch does not write)")
    out.update(pipeline_model_parallel_layout=layout_string(layout.split),
               account_for_embedding_in_pipeline_split=False,
               account_for_loss_in_pipeline_split=False,
               num_virtual_stages_per_pipeline_rank=None)
    return out


__all__ = ("PipelineRule", "layout_string", "pipeline_args")
