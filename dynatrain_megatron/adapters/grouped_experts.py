"""Live coordinates of grouped experts (megatron-core 0.16's `GroupedMLP`), from its metadata.

`GroupedMLP` keeps the local experts of a layer in two parameters, `weight1` and `weight2`,
whose memory order is not the order of its sharded metadata: its `sharded_state_dict()`
gives `ShardedTensorFactory`s whose build function views each parameter per expert,
transposes it (and splits a GLU fc1 into its gate and up halves) and makes contiguous
*copies*, so the data of the built tensors lies in no parameter and cannot be located by
address as every other tensor's is (`live.LiveState._locate`).

Here the factory's own build function is applied to a tensor of element indices
(`0 .. numel-1` in the parameter's shape): each built tensor then says, element by element,
which element of the parameter sits at which coordinate of megatron's checkpoint tensor.
Those coordinates are turned into the planning layout's logical tensor of the parameter
(`vps.naming`, grouped experts: `weight1` [E*h*g, F], `weight2` [E, F*h], both in memory
order) and the parameter is viewed 2-D in memory order ([E_l*h*g, F/ETP], [E_l, F/ETP*h]).
The result must be one box: the same shift for every element and every element once;
anything else is a `FragmentMismatchError` naming the parameter, never a guess.

Cost: one int64 index tensor per grouped parameter of the chunk, while binding.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..vps.box import Box
from ..vps.errors import FragmentMismatchError

GROUPED_PARAMS = ("weight1", "weight2")


@dataclass(frozen=True, slots=True)
class GroupedBlock:
    """A grouped-expert parameter as one box: `view_shape` is the 2-D memory-order view of
    the parameter, `logical` the box of its logical tensor it holds; `prepended` the
    checkpoint key's prepended coordinates (the layer), `main` whether this rank holds
    megatron's main replica of it."""

    sharded_key: str
    view_shape: tuple[int, int]
    logical: Box
    prepended: tuple[int, ...]
    main: bool


def grouped_expert_params(chunk: torch.nn.Module) -> dict[int, tuple[str, Any]]:
    """`id(parameter) -> (name in the chunk, owning module)` for every grouped-expert
    parameter: modules with `num_local_experts` and the two parameters of `GROUPED_PARAMS`
    (megatron-core's GroupedMLP; TE's grouped MLP keeps one weight per expert instead)."""
    out = {}
    for mname, m in chunk.named_modules():
        ps = [getattr(m, w, None) for w in GROUPED_PARAMS]
        if hasattr(m, "num_local_experts") and all(isinstance(p, torch.nn.Parameter) for p in ps):
            for w, p in zip(GROUPED_PARAMS, ps):
                out[id(p)] = (f"{mname}.{w}" if mname else w, m)
    return out


def grouped_block(factory: Any, name: str, module: Any, rank: int) -> GroupedBlock:
    """The box of `factory`'s parameter (`name`, a GroupedMLP's weight1 or weight2)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    p = factory.data
    n = p.numel()
    idx = torch.arange(n, dtype=torch.int64).view(p.shape)
    built = dataclasses.replace(factory, data=idx).build()
    shards = [x for x in nested_values(built if isinstance(built, dict) else {"x": built})
              if isinstance(x, ShardedTensor)]
    if not shards:
        raise FragmentMismatchError(f"rank {rank}: {name}: its sharded metadata builds no tensor")
    fc1 = name.endswith("weight1")
    glu = 2 if fc1 and bool(module.config.gated_linear_unit) else 1
    pre = shards[0].prepend_axis_num
    # megatron's checkpoint tensor: weight1 [E, g*F, h] (fc1 per expert), weight2 [E, h, F]
    E, mid, last = shards[0].global_shape[pre:]
    h = last if fc1 else mid
    e_local = shards[0].local_shape[0]
    cols = n // (e_local * h * glu) if fc1 else n // e_local
    view = (n // cols, cols)
    F = mid // glu if fc1 else last
    rows_l, cols_l, held = [], [], []
    for sh in shards:
        if sh.prepend_axis_num != pre or tuple(sh.global_offset[:pre]) != \
                tuple(shards[0].global_offset[:pre]):
            raise FragmentMismatchError(f"rank {rank}: {name}: its tensors differ in layer")
        o = sh.global_offset[pre:]
        d = sh.data.to(torch.int64)
        e, a, b = (o[k] + torch.arange(d.shape[k]) for k in range(3))
        e, a, b = e[:, None, None], a[None, :, None], b[None, None, :]
        if fc1:  # a: fc1 output row j*F + f, b: hidden i  ->  row (e, i, j), column f
            row, col = (e * h + b) * glu + a // F, a % F
        else:  # a: hidden i, b: ffn y  ->  row e, column y*h + i
            row, col = e + 0 * a * b, b * h + a
        rows_l.append((row - d // cols).reshape(-1))
        cols_l.append((col - d % cols).reshape(-1))
        held.append(d.reshape(-1))
    seen = int(torch.unique(torch.cat(held)).numel())
    dr, dc = torch.cat(rows_l), torch.cat(cols_l)
    one = bool((dr == dr[0]).all() and (dc == dc[0]).all())
    if not one or seen != n or len(dr) != n:
        raise FragmentMismatchError(
            f"rank {rank}: {name} is not one box of its logical tensor in memory order "
            f"(megatron-core's GroupedMLP layout changed?): {seen} of {n} elements, "
            f"{'one' if one else 'several'} shift(s)")
    logical = Box((int(dr[0]), int(dc[0])), view)
    return GroupedBlock(shards[0].key, view, logical, tuple(shards[0].global_offset[:pre]),
                        bool(is_main_replica(factory.replica_id)))


__all__ = ("GROUPED_PARAMS", "GroupedBlock", "grouped_block", "grouped_expert_params")
