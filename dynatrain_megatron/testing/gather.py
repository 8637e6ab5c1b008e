"""Full logical state of a live job, assembled from any layout (for tests and tools).

Every rank contributes the data of its *main* fragments (megatron's main replicas, see
adapters/live.py); rank 0 of the layout's world assembles `{(kind, key): tensor}` with the
logical (layout-independent) shapes and checks that every element arrived exactly once.
Two layouts' states can then be compared bit for bit. Meant for small models: it moves the
whole state through one rank.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ..adapters.live import LiveState
from ..vps.fragment import KINDS
from ..vps.errors import FragmentMismatchError
from ..vps.model_spec import ModelSpec
from ..vps.naming import logical_tensor_map

FullState = dict[tuple[str, str], torch.Tensor]


def local_main_pieces(live: LiveState, kinds: Iterable[str] = KINDS) -> list[tuple]:
    return [(f.kind, f.key, f.box.offsets, f.box.shape,
             live.view(f.kind, f.chunk, f.local_name, f.local_box).detach().clone())
            for f in live.fragments(kinds) if f.main]


def gather_full_state(live: LiveState, spec: ModelSpec, group=None,
                      kinds: Iterable[str] = KINDS, dst: Optional[int] = None) -> Optional[FullState]:
    """Assemble the full logical state on global rank `dst` (default: the group's first
    member, its virtual rank 0) of the group (None elsewhere)."""
    kinds = tuple(kinds)
    pieces = local_main_pieces(live, kinds)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    dst = ranks[0] if dst is None else dst
    bucket = [None] * len(ranks) if dist.get_rank() == dst else None
    dist.gather_object(pieces, bucket, dst=dst, group=group)
    if dist.get_rank() != dst:
        return None
    shapes = logical_tensor_map(spec)
    full: FullState = {}
    count: dict[tuple[str, str], torch.Tensor] = {}
    for kind in kinds:
        for key in shapes:
            full[(kind, key)] = None  # type: ignore[assignment]
    for rank_pieces in bucket:
        for kind, key, off, shape, data in rank_pieces:
            if key not in shapes:
                raise FragmentMismatchError(f"live key {key!r} is not a logical tensor of {spec.name}")
            k = (kind, key)
            if full.get(k) is None:
                full[k] = torch.zeros(shapes[key].shape, dtype=data.dtype)
                count[k] = torch.zeros(shapes[key].shape, dtype=torch.int32)
            sl = tuple(slice(o, o + s) for o, s in zip(off, shape))
            full[k][sl] = data
            count[k][sl] += 1
    missing = [k for k, v in full.items() if v is None]
    if missing:
        raise FragmentMismatchError(f"no main fragment for {missing[:5]} (+{max(0, len(missing) - 5)})")
    bad = [k for k, c in count.items() if not bool((c == 1).all())]
    if bad:
        raise FragmentMismatchError(f"main fragments do not cover exactly once: {bad[:5]}")
    return full


def broadcast_full_state(full: Optional[FullState], src: int = 0, group=None) -> FullState:
    box = [full]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def scatter_full_state(live: LiveState, full: FullState, kinds: Iterable[str] = KINDS) -> int:
    """Write every fragment this rank holds (all replicas) from a full state. Returns count."""
    n = 0
    for f in live.fragments(kinds):
        src = full[(f.kind, f.key)][f.box.slices()]
        live.write(f.kind, f.chunk, f.local_name, f.local_box, src)
        n += 1
    return n


def mismatches_against(live: LiveState, full: FullState, kinds: Iterable[str] = KINDS) -> list[str]:
    """Fragments of this rank (every replica) whose data differs from `full`, bit for bit."""
    out = []
    for f in live.fragments(kinds):
        ref = full[(f.kind, f.key)][f.box.slices()]
        got = live.view(f.kind, f.chunk, f.local_name, f.local_box)
        if not torch.equal(ref.to(got.dtype), got):
            out.append(f"{f.key}/{f.kind}{f.box}@r{f.rank}")
    return out


def states_equal(a: FullState, b: FullState) -> list[str]:
    """Keys whose tensors differ (dtype, shape or any bit)."""
    diff = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k]):
            diff.append(k)
    return [f"{k}" for k in diff]
