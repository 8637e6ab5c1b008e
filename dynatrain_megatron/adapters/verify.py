"""The cheap check before anything moves: live fragments of this rank == analytic ones.

It turns a silent corruption (a megatron version whose layout rules differ from ours, a
model built with another spec) into an error naming the tensor and the rank.
"""
from __future__ import annotations

from typing import Iterable

from ..vps.errors import FragmentMismatchError
from ..vps.fragment import Fragment
from .live import LiveFragment


def _ident(f: Fragment | LiveFragment) -> tuple:
    """What must agree between a live and an analytic fragment (not `replica`/`main`)."""
    return (f.key, f.kind, f.box, f.rank, f.chunk, f.local_name, f.local_offsets)


def check_live_matches_analytic(live: Iterable[LiveFragment], analytic: Iterable[Fragment],
                                rank: int) -> None:
    """Raise FragmentMismatchError listing the tensors whose fragments differ on `rank`."""
    a = {_ident(f) for f in analytic}
    b = {_ident(f) for f in live}
    if a == b:
        return
    only_live = sorted(b - a)
    only_an = sorted(a - b)
    tensors = sorted({x[0] + "/" + x[1] for x in only_live + only_an})
    detail = []
    for x in only_live[:3]:
        detail.append(f"live has {x[0]}/{x[1]}{x[2]} at c{x[4]}:{x[5]}")
    for x in only_an[:3]:
        detail.append(f"analytic expects {x[0]}/{x[1]}{x[2]} at c{x[4]}:{x[5]}")
    raise FragmentMismatchError(
        f"rank {rank}: live fragments disagree with the analytic layout for {len(tensors)} "
        f"tensor(s): {', '.join(tensors[:5])}{' ...' if len(tensors) > 5 else ''}; "
        + "; ".join(detail))


def check_live_matches_analytic_where_both(live: Iterable[LiveFragment],
                                           analytic: Iterable[Fragment], rank: int,
                                           unlike: tuple[str, ...] = ()) -> int:
    """For a model the analytic layout describes only in part (a switch planned from the
    live metadata): the weights' fragments of every logical tensor both place on this rank
    must agree (what the analytic layout leaves out, and the optimizer's owned ranges,
    which the parameters it does not know shift, are not compared). `unlike`: key prefixes
    of tensors the analytic layout names but the model shapes otherwise (a heterogeneous
    model's per-layer blocks), not compared either. Returns how many tensors were
    compared; raises FragmentMismatchError as `check_live_matches_analytic`."""
    live = [f for f in live if f.kind == "param" and not f.key.startswith(unlike)]
    analytic = [f for f in analytic if f.kind == "param"]
    both = {f.key for f in live} & {f.key for f in analytic}
    check_live_matches_analytic([f for f in live if f.key in both],
                                [f for f in analytic if f.key in both], rank)
    return len(both)
