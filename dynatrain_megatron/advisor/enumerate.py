"""Every layout string of N devices that the one validator accepts.

The grammar (vps/layout.py) has the axes tp, pp, vpp, cp, ep, etp, dp, doi and the uneven
first/last pipeline stages ppf/ppl. A layout of N devices has tp*cp*pp*dp = N; etp*ep*pp
must divide N; doi must divide the dense and expert data-parallel sizes. Within that
space this module proposes candidates and keeps exactly those for which
`vps.validate.layout_errors` returns no error: the model's constraints (heads, groups,
experts, layers, sequence) are the validator's alone, so the advisor and the job cannot
disagree about what megatron-core can build.

The only restrictions of the search space are `SearchSpace`'s: how uneven the first/last
pipeline stages may be (`max_stage_spread`, layers more or fewer than a middle stage;
None = any), whether CP and partial distributed optimizers (doi) are considered, and the
largest tp, cp, etp, vpp (default: tp, cp, etp <= 8, one NVLink domain). Layout strings
that build the same job (`canonical_key`) are proposed once.
Candidates are generated from divisors, so the count stays in the thousands even for
4096 devices (README, benchmark).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator, Optional

from ..vps.errors import LayoutError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.validate import layout_errors
from .errors import AdvisorError


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """Which parts of the layout grammar the advisor explores.

    `max_stage_spread`: uneven first/last stages (ppf/ppl) are considered when they differ
    from the middle stages' layer count by at most this many layers (None: any ppf/ppl;
    0: even pipelines only). `context_parallel`, `optimizer_instances`: whether cp > 1
    and doi > 1 are considered. `max_vpp`, `max_tp`, `max_cp`, `max_etp`: the largest
    size of those axes (None: any). The defaults keep TP, CP and expert-TP inside one
    8-GPU NVLink domain, where Megatron-LM's published configurations keep them; a
    larger group crosses the NICs on every layer."""

    max_stage_spread: Optional[int] = 2
    context_parallel: bool = True
    optimizer_instances: bool = False
    max_vpp: Optional[int] = None
    max_tp: Optional[int] = 8
    max_cp: Optional[int] = 8
    max_etp: Optional[int] = 8

    def __post_init__(self) -> None:
        if self.max_stage_spread is not None and (not isinstance(self.max_stage_spread, int)
                                                  or self.max_stage_spread < 0):
            raise AdvisorError(f"search space: max_stage_spread must be None or an int >= 0, "
                               f"got {self.max_stage_spread!r}")
        for f in ("max_vpp", "max_tp", "max_cp", "max_etp"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise AdvisorError(f"search space: {f} must be None or an int >= 1, got {v!r}")

    def allows(self, axis: str, size: int) -> bool:
        """Whether `size` is within the space's cap of `axis` (tp, cp, etp, vpp)."""
        cap = getattr(self, f"max_{axis}")
        return cap is None or size <= cap


@functools.lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """Positive divisors of `n`, ascending."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def stage_spread(counts: tuple[int, ...]) -> int:
    """How uneven a pipeline is: the largest difference between the first or last stage's
    layer count and a middle stage's (two stages: between the two)."""
    if len(counts) < 2:
        return 0
    mid = counts[1] if len(counts) > 2 else counts[0]
    return max(abs(counts[0] - mid), abs(counts[-1] - mid))


@functools.lru_cache(maxsize=1024)
def _stage_splits(num_layers: int, pp: int, space: SearchSpace) -> tuple[tuple[int, int], ...]:
    out, seen = [], set()
    for ppf, ppl in _iter_stage_splits(num_layers, pp, space):
        # pairs that give the same layers per stage as an earlier one build the same job
        # (canonical_key); the even split comes first
        counts = tuple(Layout(pp=pp, ppf=ppf, ppl=ppl).stage_num_layers(num_layers))
        if space.max_stage_spread is not None and stage_spread(counts) > space.max_stage_spread:
            continue
        if counts not in seen:
            seen.add(counts)
            out.append((ppf, ppl))
    return tuple(out)


def _iter_stage_splits(num_layers: int, pp: int, space: SearchSpace
                       ) -> Iterator[tuple[int, int]]:
    """(ppf, ppl) pairs of the grammar for `pp` stages: (0, 0) and the uneven ones within
    the space's spread. Layers must split evenly over the middle stages (the validator
    checks; this only avoids proposing pairs whose middle split is fractional)."""
    yield 0, 0
    if pp < 2 or space.max_stage_spread == 0:
        return
    for ppf in range(0, num_layers + 1):
        for ppl in range(0, num_layers + 1 - ppf):
            if ppf == ppl == 0:
                continue
            n_mid = pp - (ppf > 0) - (ppl > 0)
            rest = num_layers - ppf - ppl
            if (n_mid == 0 and rest != 0) or (n_mid and (rest < 0 or rest % n_mid)):
                continue
            yield ppf, ppl


def candidate_layouts(spec: ModelSpec, world: int, space: SearchSpace = SearchSpace()
                      ) -> Iterator[Layout]:
    """Every layout of the grammar with `world` devices in the search space (unchecked
    against the model: `enumerate_layouts` asks the validator)."""
    moe = spec.is_moe
    for tp in (t for t in divisors(world) if space.allows("tp", t)):
        for cp in ([c for c in divisors(world // tp) if space.allows("cp", c)]
                   if space.context_parallel else (1,)):
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                splits = _stage_splits(spec.num_layers, pp, space)
                vpps = [1] if pp == 1 else [v for v in divisors(spec.num_layers)
                                            if space.allows("vpp", v)]
                eps = divisors(world // pp) if moe else (1,)
                for ep in eps:
                    etps = ([e for e in divisors(world // (pp * ep)) if space.allows("etp", e)]
                            if moe else [tp])
                    for etp in etps:
                        edp = world // (etp * ep * pp)
                        dois = (divisors(_gcd(dp * cp, edp)) if space.optimizer_instances
                                else (1,))
                        for doi in dois:
                            for vpp in vpps:
                                for ppf, ppl in splits:
                                    try:
                                        yield Layout(tp=tp, pp=pp, dp=dp, vpp=vpp, cp=cp,
                                                     ep=ep, etp=etp, ppf=ppf, ppl=ppl,
                                                     doi=doi)
                                    except LayoutError:
                                        continue


def canonical_key(layout: Layout, spec: ModelSpec) -> tuple:
    """What makes two layout strings the same megatron-core job: ppf/ppl that give the
    same layer count per stage as another string (e.g. `pp4ppf20` of 80 layers is
    `pp4`) build the same model, and a dense model has no expert weights, so its etp
    changes nothing. `enumerate_layouts` keeps the first string of each key: the even
    split, and etp = tp."""
    L = layout
    return (L.tp, L.pp, L.dp, L.vpp, L.cp, L.ep, L.etp if spec.is_moe else L.tp, L.doi,
            tuple(L.stage_num_layers(spec.num_layers)))


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def enumerate_layouts(spec: ModelSpec, world: int, space: SearchSpace = SearchSpace(), *,
                      transformer_engine: bool = False) -> list[Layout]:
    """The layouts of `world` devices that `vps.validate.layout_errors` accepts for
    `spec` (memory is not checked here: the advisor's memory model does that), one string
    per distinct job (`canonical_key`), in a deterministic order."""
    if not isinstance(world, int) or world < 1:
        raise AdvisorError(f"world size must be a positive int, got {world!r}")
    seen: set[tuple] = set()
    out = []
    for lay in candidate_layouts(spec, world, space):
        key = canonical_key(lay, spec)
        if key in seen:
            continue
        seen.add(key)
        if not layout_errors(spec, lay, transformer_engine=transformer_engine):
            out.append(lay)
    return out


__all__ = ["SearchSpace", "candidate_layouts", "canonical_key", "stage_spread",
           "enumerate_layouts", "divisors"]
