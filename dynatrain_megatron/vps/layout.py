"""Parallel layouts: parsing, printing, validation against a model, and rank coordinates.

A layout is a point in the space of Megatron parallel configurations (TP, PP, VPP, CP, EP,
ETP, DP). Everything else in the package (analytic fragments, process groups, plans) is a
deterministic function of it, so it is frozen, hashable, and validated once, here, with
messages that name the constraint and show every number.

Rank coordinates follow megatron-core's `RankGenerator` with the default order
`tp-cp-ep-dp-pp` (leftmost varies fastest):
  dense:  rank = tp + TP*(cp + CP*(dp + DP*pp))
  expert: rank = etp + ETP*(ep + EP*(edp + EDP*pp))
These are *virtual* ranks; a `Placement` maps them to devices.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .errors import LayoutError
from .model_spec import ModelSpec

_TOKEN = re.compile(r"(vpp|etp|ppf|ppl|doi|tp|pp|cp|ep|dp)([0-9]+)|(split)([0-9]+(?:-[0-9]+)*)",
                    re.ASCII)
MAX_LAYOUT_CHARS = 64  # a layout string names at most 8 axes of a few digits each
# ... and a `split` at most one number per model chunk
MAX_SPLIT_CHARS = 4096
_SPLIT = re.compile(r"split[0-9-]*", re.ASCII)
MAX_AXIS_DIGITS = 7  # up to 9,999,999 per axis
_AXES = ("tp", "pp", "vpp", "cp", "ep", "etp", "dp", "doi")
# every axis a layout string may name, in the order `str(layout)` prints them
GRAMMAR_AXES = ("tp", "pp", "vpp", "cp", "ep", "etp", "ppf", "ppl", "doi", "dp")
# beside the axes, `split<n>-<n>-...` (printed after ppl): every model chunk's layers

# axis names of the two megatron rank grids, fastest first
DENSE_AXES = ("tp", "cp", "dp", "pp")
EXPERT_AXES = ("etp", "ep", "edp", "pp")


# ProcessGroupCollection field -> the axes of the (dense or expert) grid it spans
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "dp_cp": ("cp", "dp"),
    "mp": ("tp", "pp"),
    "tp_cp": ("tp", "cp"),
    "tp_dp_cp": ("tp", "cp", "dp"),
    "ep": ("ep",),
    "expt_tp": ("etp",),
    "tp_ep": ("etp", "ep"),
    "tp_ep_pp": ("etp", "ep", "pp"),
    "expt_dp": ("edp",),
}


@dataclass(frozen=True, slots=True)
class Layout:
    """A parallel configuration. `dp` is part of it, so `world_size` is derived."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 0  # 0 means "same as tp" (megatron's default), resolved in __post_init__
    # uneven pipeline: layers of the first / last stage (0 = even split), megatron's
    # --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers
    ppf: int = 0
    ppl: int = 0
    # distributed-optimizer instances (megatron's --num-distributed-optimizer-instances):
    # the optimizer state is sharded over DPxCP / doi ranks and replicated doi times, so a
    # dead rank's shards survive on its replicas
    doi: int = 1
    # decoder layers of every model chunk, (vp stage, pp rank) in vp-major order (the order
    # megatron-core's layer offsets run): a split Megatron-LM's job fixes that ppf/ppl do not
    # describe (`--account-for-embedding/loss-in-pipeline-split` with virtual stages, a
    # `--pipeline-model-parallel-layout`). Empty: the rule of ppf/ppl. Printed `split1-2-2-2`
    split: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.split, tuple) or any(
                not isinstance(n, int) or n < 0 for n in self.split):
            raise LayoutError(f"split must be a tuple of layer counts >= 0, got {self.split!r}")
        if self.split and len(self.split) != self.pp * self.vpp:
            raise LayoutError(f"split {self.split} names {len(self.split)} model chunks, "
                              f"pp{self.pp} vpp{self.vpp} has {self.pp * self.vpp}")
        if self.split and (self.ppf or self.ppl):
            raise LayoutError(f"split {self.split} fixes every chunk's layers: no ppf/ppl "
                              f"beside it (got ppf{self.ppf} ppl{self.ppl})")
        if self.ppf < 0 or self.ppl < 0:
            raise LayoutError(f"ppf/ppl must be >= 0, got ppf{self.ppf} ppl{self.ppl}")
        if (self.ppf or self.ppl) and self.pp < 2:
            raise LayoutError(f"uneven first/last stages (ppf{self.ppf} ppl{self.ppl}) need pp > 1")
        if self.etp == 0:
            object.__setattr__(self, "etp", self.tp)
        for ax in _AXES:
            v = getattr(self, ax)
            if not isinstance(v, int) or v < 1:
                raise LayoutError(f"layout axis {ax} must be a positive int, got {v!r}")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"vpp{self.vpp} needs pp > 1 (interleaved schedule), got pp1")
        if self.world_size % (self.etp * self.ep * self.pp):
            raise LayoutError(
                f"layout {self}: expert grid etp*ep*pp = {self.etp}*{self.ep}*{self.pp} = "
                f"{self.etp * self.ep * self.pp} does not divide world size {self.world_size} "
                f"(= tp*cp*dp*pp); choose etp/ep so that it does (etp defaults to tp)")
        if self.doi > 1 and (self.dp_cp % self.doi or self.edp % self.doi):
            raise LayoutError(
                f"layout {self}: doi{self.doi} distributed-optimizer instances must divide the "
                f"data-parallel groups (dp*cp = {self.dp_cp}, expert dp = {self.edp})")

    # ------------------------------------------------------------------ parse / print
    @classmethod
    def parse(cls, text: str, world_size: Optional[int] = None) -> "Layout":
        """Parse `tp2pp2dp2`, `tp1pp2ep4etp1dp4`, `tp2pp4vpp2`, `tp1pp2doi2dp4`, ... .

        Missing axes are 1 (etp: = tp); a missing dp is derived from `world_size`.
        """
        if not isinstance(text, str):
            raise LayoutError(f"layout must be a string, got {type(text).__name__}")
        split_chars = len(m.group(0)) if (m := _SPLIT.search(text[:MAX_SPLIT_CHARS])) else 0
        if len(text) - split_chars > MAX_LAYOUT_CHARS or not text.isascii():
            raise LayoutError(f"malformed layout {text[:MAX_LAYOUT_CHARS]!r}"
                              f"{'...' if len(text) > MAX_LAYOUT_CHARS else ''}: at most "
                              f"{MAX_LAYOUT_CHARS} ASCII characters ({len(text)} given)")
        s = text.strip().lower()
        pos, vals = 0, {}
        for m in _TOKEN.finditer(s):
            if m.start() != pos:
                break
            if m.group(3):
                if "split" in vals:
                    raise LayoutError(f"layout {text!r}: split given twice")
                counts = m.group(4).split("-")
                if any(len(n) > MAX_AXIS_DIGITS for n in counts):
                    raise LayoutError(f"layout {text[:MAX_LAYOUT_CHARS]!r}...: a split's layer "
                                      f"count is too large")
                vals["split"] = tuple(int(n) for n in counts)
                pos = m.end()
                continue
            if len(m.group(2)) > MAX_AXIS_DIGITS:
                raise LayoutError(f"layout {text!r}: axis {m.group(1)} size {m.group(2)} is "
                                  f"too large")
            ax, num = m.group(1), int(m.group(2))
            if ax in vals:
                raise LayoutError(f"layout {text!r}: axis {ax} given twice")
            vals[ax] = num
            pos = m.end()
        if pos != len(s) or not vals:
            raise LayoutError(
                f"malformed layout {text!r}: expected tokens like tp2pp2dp2 from "
                f"{{{','.join(GRAMMAR_AXES)}}}<int> or split<int>-<int>-..., stopped at "
                f"{s[pos:]!r}")
        if any(v < 1 for k, v in vals.items() if k != "split"):
            raise LayoutError(f"layout {text!r}: every axis size must be >= 1")
        mp = vals.get("tp", 1) * vals.get("pp", 1) * vals.get("cp", 1)
        if world_size is not None:
            if world_size < 1 or world_size % mp:
                raise LayoutError(
                    f"layout {text!r}: tp*pp*cp = {mp} does not divide world size {world_size}")
            dp = world_size // mp
            if "dp" in vals and vals["dp"] != dp:
                raise LayoutError(
                    f"layout {text!r}: dp{vals['dp']} but world size {world_size} / "
                    f"(tp*pp*cp = {mp}) gives dp{dp}")
            vals["dp"] = dp
        return cls(**vals)

    def __str__(self) -> str:
        s = f"tp{self.tp}pp{self.pp}"
        if self.vpp > 1:
            s += f"vpp{self.vpp}"
        if self.cp > 1:
            s += f"cp{self.cp}"
        if self.ep > 1 or self.etp != self.tp:
            s += f"ep{self.ep}etp{self.etp}"
        if self.ppf:
            s += f"ppf{self.ppf}"
        if self.ppl:
            s += f"ppl{self.ppl}"
        if self.split:
            s += "split" + "-".join(map(str, self.split))
        if self.doi > 1:
            s += f"doi{self.doi}"
        return s + f"dp{self.dp}"

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data-parallel size (CP folds into it, as in megatron-core)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def dp_cp(self) -> int:
        """Size of the dense data-parallel (x CP) group: gradients are averaged over it."""
        return self.dp * self.cp

    @property
    def dense_shards(self) -> int:
        """Size of the distributed-optimizer shard group of dense parameters: one block of
        `dp_cp / doi` consecutive DPxCP ranks (megatron's intra-partial DP group)."""
        return self.dp_cp // self.doi

    @property
    def expert_shards(self) -> int:
        """The same for expert parameters (consecutive expert-DP ranks)."""
        return self.edp // self.doi

    # ------------------------------------------------------------------ validation vs model
    def check_model(self, spec: ModelSpec) -> None:
        """Raise LayoutError naming the first constraint the model violates (all listed)."""
        errs = self.model_errors(spec)
        if errs:
            raise LayoutError(f"layout {self} cannot hold model {spec.name!r}: " + "; ".join(errs))

    def model_errors(self, spec: ModelSpec) -> list[str]:
        e: list[str] = []
        t = self.tp
        if spec.num_attention_heads % t:
            e.append(f"num_attention_heads {spec.num_attention_heads} % tp {t} != 0")
        if spec.num_query_groups % t:
            e.append(f"num_query_groups {spec.num_query_groups} % tp {t} != 0")
        if spec.ffn_hidden_size % t:
            e.append(f"ffn_hidden_size {spec.ffn_hidden_size} % tp {t} != 0")
        e += self._pipeline_errors(spec.num_layers)
        if self.cp > 1 and spec.seq_length % (2 * self.cp):
            e.append(f"seq_length {spec.seq_length} % (2*cp = {2 * self.cp}) != 0")
        if spec.is_moe:
            E = spec.num_moe_experts
            if E % self.ep:
                e.append(f"num_moe_experts {E} % ep {self.ep} != 0")
            if spec.moe_ffn_hidden_size % self.etp:
                e.append(f"moe_ffn_hidden_size {spec.moe_ffn_hidden_size} % etp {self.etp} != 0")
            if t > 1 and spec.seq_length % t:
                # MoE with TP needs sequence parallelism, which splits the sequence over TP
                e.append(f"seq_length {spec.seq_length} % tp {t} != 0 (MoE+TP uses sequence parallel)")
            sh = spec.moe_shared_expert_intermediate_size
            if sh is not None and sh % t:
                e.append(f"moe_shared_expert_intermediate_size {sh} % tp {t} != 0")
            if sh and spec.add_bias_linear:
                e.append("shared experts do not support add_bias_linear (megatron-core "
                         "SharedExpertMLP)")
            if spec.add_bias_linear and self.etp != 1:
                e.append(f"add_bias_linear with MoE needs etp1, got etp{self.etp} (megatron-core "
                         f"TransformerConfig: 'Bias in Moe is only supported when ETP==1')")
        else:
            if self.ep > 1:
                e.append(f"ep{self.ep} needs an MoE model (num_moe_experts is not set)")
        return e

    # ------------------------------------------------------------------ pipeline layers
    def stage_num_layers(self, num_layers: int) -> list[int]:
        """Layers of each pipeline stage (megatron-core's rules: uneven first/last, the rest
        split evenly over the middle stages), or the sums of `split`."""
        if self.split:
            return [sum(self.split[v * self.pp + p] for v in range(self.vpp))
                    for p in range(self.pp)]
        if not (self.ppf or self.ppl):
            return [num_layers // self.pp] * self.pp
        n_mid = self.pp - (1 if self.ppf else 0) - (1 if self.ppl else 0)
        rest = num_layers - self.ppf - self.ppl
        mid = rest // n_mid if n_mid else 0
        out = [mid] * self.pp
        if self.ppf:
            out[0] = self.ppf
        if self.ppl:
            out[-1] = self.ppl
        return out

    def _pipeline_errors(self, num_layers: int) -> list[str]:
        if self.split:  # Megatron-LM's own rule made it (checked where the job runs)
            if sum(self.split) != num_layers:
                return [f"split {'-'.join(map(str, self.split))} holds {sum(self.split)} "
                        f"layers, the model has {num_layers}"]
            return []
        if not (self.ppf or self.ppl):
            stages = self.pp * self.vpp
            if num_layers % stages:
                return [f"num_layers {num_layers} % (pp*vpp = {self.pp}*{self.vpp}) != 0"]
            return []
        e = []
        n_mid = self.pp - (1 if self.ppf else 0) - (1 if self.ppl else 0)
        rest = num_layers - self.ppf - self.ppl
        if rest < 0 or (n_mid == 0 and rest != 0) or (n_mid and (rest == 0 or rest % n_mid)):
            e.append(f"num_layers {num_layers} - ppf {self.ppf} - ppl {self.ppl} = {rest} does "
                     f"not split evenly over the {n_mid} middle stage(s) (every stage needs "
                     f"at least one layer)")
        elif min(self.stage_num_layers(num_layers)) < 1:
            # megatron-core's TransformerConfig refuses it ("0 middle layers remaining but
            # N middle PP stages available")
            e.append(f"stage layer counts {self.stage_num_layers(num_layers)}: every pipeline "
                     f"stage needs at least one layer")
        elif any(n % self.vpp for n in self.stage_num_layers(num_layers)):
            e.append(f"stage layer counts {self.stage_num_layers(num_layers)} are not all "
                     f"divisible by vpp {self.vpp}")
        return e

    def stage_layers(self, spec_num_layers: int, pp_rank: int, vp_stage: int) -> range:
        """Global layer indices of model chunk `vp_stage` on pipeline rank `pp_rank`.

        Chunks are numbered (vp_stage, pp_rank) in vp-major order, each stage's layers split
        evenly over its chunks, as megatron-core's get_transformer_layer_offset does; or as
        `split` says."""
        if self.split:
            i = vp_stage * self.pp + pp_rank
            start = sum(self.split[:i])
            return range(start, start + self.split[i])
        counts = [n // self.vpp for n in self.stage_num_layers(spec_num_layers)]
        start = vp_stage * sum(counts) + sum(counts[:pp_rank])
        return range(start, start + counts[pp_rank])

    # ------------------------------------------------------------------ rank grid
    @property
    def _dense_grid(self) -> np.ndarray:
        # index [pp, dp, cp, tp] -> rank (C order, so tp varies fastest)
        return np.arange(self.world_size).reshape(self.pp, self.dp, self.cp, self.tp)

    @property
    def _expert_grid(self) -> np.ndarray:
        return np.arange(self.world_size).reshape(self.pp, self.edp, self.ep, self.etp)

    def coords(self, rank: int) -> "RankCoords":
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of layout {self} (size {self.world_size})")
        tp = rank % self.tp
        r = rank // self.tp
        cp = r % self.cp
        r //= self.cp
        dp = r % self.dp
        pp = r // self.dp
        etp = rank % self.etp
        r = rank // self.etp
        ep = r % self.ep
        r //= self.ep
        edp = r % self.edp
        return RankCoords(rank=rank, tp=tp, cp=cp, dp=dp, pp=pp, etp=etp, ep=ep, edp=edp,
                          dp_cp=cp + self.cp * dp)

    def groups(self, axes: Sequence[str]) -> list[list[int]]:
        """Rank lists of the groups spanning `axes` (e.g. ("tp",), ("dp","cp"), ("etp","ep")).

        Within a list the ranks run over the axes with the grid's fastest axis fastest,
        exactly as megatron's RankGenerator; the lists are in ascending order of their
        first rank, which makes group creation order identical on every rank.
        """
        axes = tuple(axes)
        if all(a in DENSE_AXES for a in axes):
            grid, names = self._dense_grid, DENSE_AXES
        elif all(a in EXPERT_AXES for a in axes):
            grid, names = self._expert_grid, EXPERT_AXES
        else:
            raise LayoutError(f"axes {axes} mix the dense and expert grids")
        # grid dims are reversed names (slowest first)
        dims = [len(names) - 1 - names.index(a) for a in axes]
        other = [d for d in range(grid.ndim) if d not in dims]
        size = int(np.prod([grid.shape[d] for d in dims]))
        rows = grid.transpose(other + sorted(dims)).reshape(-1, size)
        # ranks are mixed-radix numbers: ascending order within a group makes the fastest
        # masked axis vary fastest, as megatron's RankGenerator does
        out = sorted((sorted(map(int, row)) for row in rows), key=lambda r: r[0])
        return out


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Coordinates of one (virtual) rank in the dense and expert grids."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int

    dp_cp: int  # index in the dense DP x CP group (cp fastest): the DistOpt shard index
