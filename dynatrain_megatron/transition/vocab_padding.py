"""Vocabulary padding rows: the one piece of state outside the VPS.

The embedding and output layer hold V' = ceil(V/(m*TP))*m*TP rows, so rows [V, V') exist
or not depending on TP. They are trained (the output layer's padded logits take part in
the softmax), and megatron's checkpoint path carries them wherever both layouts have them
(`allow_shape_mismatch`: rows beyond the stored V' are zero-filled). We do the same, so a
switch stays bit-identical to the checkpoint path: rows [V, min(V'_A, V'_B)) are carried
(weights and optimizer state), rows beyond V'_A start at zero. They are few (< m*TP rows),
so one all-gather of the main copies is enough.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ..adapters.live import LiveState
from ..vps.fragment import KINDS


@torch.no_grad()
def carry_vocab_padding(old: Optional[LiveState], new: Optional[LiveState],
                        kinds: Iterable[str] = KINDS, main_only: bool = True,
                        src_padded: bool = True) -> int:
    """Collective over the world (unless `src_padded` is False). Returns the number of
    padding elements written here.

    `main_only=False` (recovery after a death: the main replica may be gone): every
    replica sends its rows and receivers keep one copy of each (they are identical).
    `src_padded=False`: layout A has no padding rows (V'_A == V, which every rank knows from
    the spec alone): nothing to carry, no collective (it cost ~20 ms of the pause), and
    B's padding rows, if it has any, start at zero as the checkpoint path leaves them."""
    kinds = tuple(kinds)
    everyone: list = []  # A has no padding rows: nothing to gather (every rank knows it)
    if src_padded:
        mine = []
        if old is not None:
            for f in old.padding_fragments(kinds):
                if f.main or not main_only:
                    # a host copy: a pickled CUDA tensor would be unpickled on the
                    # sender's device index on every receiver
                    mine.append((f.kind, f.key, f.box.offsets, f.box.shape,
                                 old.view(f.kind, f.chunk, f.local_name, f.local_box)
                                 .to("cpu", copy=True)))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    if new is None:
        return 0
    have: dict[tuple[str, str], list] = {}
    seen = set()
    for part in everyone:
        for kind, key, off, shape, data in part:
            if (kind, key, off, shape) not in seen:
                seen.add((kind, key, off, shape))
                have.setdefault((kind, key), []).append((off, shape, data))
    written = 0
    for f in new.padding_fragments(kinds):
        dst = new.view(f.kind, f.chunk, f.local_name, f.local_box)
        dst.zero_()
        for off, shape, data in have.get((f.kind, f.key), []):
            lo = max(off[0], f.box.offsets[0])
            hi = min(off[0] + shape[0], f.box.offsets[0] + f.box.shape[0])
            if lo < hi:
                dst[lo - f.box.offsets[0]:hi - f.box.offsets[0]] = data[lo - off[0]:hi - off[0]]
                written += (hi - lo) * (dst[0].numel() if dst.dim() > 1 else 1)
    return written
