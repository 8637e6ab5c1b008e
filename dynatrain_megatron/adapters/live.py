"""Live binding: this rank's fragments of a running megatron-core job, bound to storage.

Two sources of truth (DESIGN.md): the analytic layout says what *should* be where; this
module reads what *is* where, from megatron-core's own metadata:
  - weights: the model's `sharded_state_dict()` (global offsets, shapes, replica ids; the
    SwiGLU factory applied), each ShardedTensor's data located inside a named parameter;
    grouped experts (GroupedMLP), whose factories build copies, through their build
    function applied to element indices (`grouped_experts`), viewed 2-D in memory order;
  - `main_param`, `exp_avg`, `exp_avg_sq`: each DistributedOptimizer's ownership ranges
    (`gbuf_ranges[...]["param_map"][p]["param"]`), a flat range of the TP-local parameter,
    cut into boxes and mapped to global coordinates with the weight's own blocks; under
    plain DDP (`Float16OptimizerWithFloat16Params`, `FP32Optimizer`) the whole parameter,
    its fp32 main copy (`param.main_param`, or the parameter itself when it is fp32) and
    that copy's Adam state (`param_optimizer_states`).
  - objects (`ShardedObject`s: a module's `_extra_state`): their unique keys and state-dict
    keys (`sharded_objects`); their values are read when asked (`read_objects`).
`LiveState.view(kind, chunk, local_name, local_box)` returns the tensor view that stores a
box, which is what the executor packs from and unpacks into.
"""
from __future__ import annotations

import bisect
import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional

import numpy as np
import torch

from .grouped_experts import grouped_block, grouped_expert_params
from .sharded_objects import (ObjectCarryError, ObjectSlot, chunk_sharded_state_dict,
                              object_slots, object_values, serialize, set_objects)
from ..vps.box import Box
from ..vps.errors import FragmentMismatchError
from ..vps.fragment import KINDS, OPT_KINDS
from ..vps.naming import analytic_param_name

log = logging.getLogger("dynatrain")

_OPT_STATE_KEY = {"main_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


@dataclass(frozen=True, slots=True, order=True)
class LiveFragment:
    """A fragment as read from the live job (`main` = megatron's main replica)."""

    key: str
    kind: str
    box: Box
    rank: int
    chunk: int
    local_name: str
    local_offsets: tuple[int, ...]
    main: bool

    @property
    def local_box(self) -> Box:
        return Box(self.local_offsets, self.box.shape)


@dataclass(frozen=True, slots=True)
class _Block:
    local: Box
    logical: Box


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """DDP -> Float16Module -> GPTModel."""
    while hasattr(module, "module"):
        module = module.module
    return module


def optimizers_of(optimizer) -> list:
    """The DistributedOptimizers inside a (Chained)Optimizer (none for None: model chunks
    built without an optimizer, e.g. a generation layout that holds weights only)."""
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def is_distributed(opt) -> bool:
    """Whether one of `optimizers_of`'s optimizers is megatron-core's DistributedOptimizer
    (its state sharded over DP) rather than a plain one (each DP replica holds all)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


def fp32_copies_of(opt) -> list[list[torch.Tensor]]:
    """The separate fp32 main copies one of `optimizers_of`'s optimizers keeps of bf16/fp16
    weights, per param group (none for fp32 weights, whose main copy is the weight or a
    view of it): what rebuilding the weights from their masters copies from."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    if is_distributed(opt):
        return opt.shard_fp32_from_float16_groups
    if isinstance(opt, Float16OptimizerWithFloat16Params):
        return opt.fp32_from_float16_groups
    return []


def _plain_main_params(opt) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model param, fp32 main param) of a plain megatron optimizer, in its group order:
    `Float16OptimizerWithFloat16Params` keeps an fp32 copy of each bf16/fp16 parameter
    (`float16_groups` beside `fp32_from_float16_groups`) and steps fp32 parameters
    themselves (`fp32_from_fp32_groups`); `FP32Optimizer` steps the model's parameters."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    if isinstance(opt, Float16OptimizerWithFloat16Params):
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            yield from zip(model_group, main_group)
        for group in opt.fp32_from_fp32_groups:
            for p in group:
                yield p, p
        return
    for group in opt.optimizer.param_groups:
        for p in group["params"]:
            yield p, p


def param_optimizer_states(opt) -> Iterator[tuple[torch.nn.Parameter, int, int,
                                                  dict[str, torch.Tensor]]]:
    """Every model parameter `opt` steps, with the flat range `[start, end)` of it whose
    state this rank holds and that state (`param`: the fp32 main copy, `exp_avg`,
    `exp_avg_sq`, ...): the distributed optimizer's owned shard (1-D), or under plain DDP
    the whole parameter's state (shaped as the parameter)."""
    if is_distributed(opt):
        for p, (gbuf_idx, dtype, bucket_idx) in opt.model_param_gbuf_map.items():
            rng = opt.gbuf_ranges[gbuf_idx][dtype][bucket_idx]["param_map"][p]["param"]
            yield p, rng.start, rng.end, opt._get_main_param_and_optimizer_states(p)
        return
    state = opt.optimizer.state
    for p, main in _plain_main_params(opt):
        yield p, 0, p.numel(), {"param": main, **state.get(main, {})}


def steps_in_param_groups(inner: torch.optim.Optimizer) -> bool:
    """Where an Adam keeps its step count: torch's Adam/AdamW in every parameter's state
    (`state[p]['step']`, a tensor), the fused Adams of Transformer Engine and apex (class
    `FusedAdam`, what megatron-core picks when either is installed) in each param group
    (`group['step']`, an int, created at their first step). A torch Adam loaded from a
    Megatron-LM checkpoint also carries a `group['step']` (the checkpoint's param groups
    hold one), which it never advances: its parameters' own steps are the count."""
    if type(inner).__name__ == "FusedAdam":
        return True
    if any("step" in st for st in inner.state.values()):
        return False
    return any("step" in g for g in inner.param_groups)


def read_optimizer_step(optimizer) -> Optional[float]:
    """The optimizer's step count wherever it keeps it (None before its first step)."""
    for opt in optimizers_of(optimizer):
        inner = opt.optimizer
        if steps_in_param_groups(inner):
            for g in inner.param_groups:
                if "step" in g:
                    return float(g["step"])
            continue
        for st in inner.state.values():
            if "step" in st:
                return float(st["step"])
    return None


def write_optimizer_step(optimizer, step: float) -> None:
    """Set the step count (Adam's bias correction) of every parameter, the way the
    optimizer keeps it (`steps_in_param_groups`): one tensor per parameter for torch's
    Adam (never one shared tensor: megatron's checkpoint load shares one and each step
    then advances it once per parameter), or `group['step']` for a fused Adam."""
    for opt in optimizers_of(optimizer):
        inner = opt.optimizer
        if steps_in_param_groups(inner):
            for g in inner.param_groups:
                g["step"] = int(step)
            continue
        for st in inner.state.values():
            if "step" in st:
                st["step"] = torch.tensor(step, dtype=torch.float32)
        for g in inner.param_groups:  # a loaded checkpoint's, kept in step (doc above)
            if "step" in g:
                g["step"] = int(step)


def ensure_optimizer_state(optimizer) -> None:
    """Create zero Adam states where a fresh optimizer has none (no dummy step: a step with
    zero grads would still apply weight decay to the parameters). Zeroed even where a
    switch overwrites them: measured, leaving them uninitialised only moved the cost of
    first touching that memory from here into the transfer."""
    for opt in optimizers_of(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if "exp_avg" not in st:
                    if not steps_in_param_groups(inner):
                        st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def optimizer_state_complete(optimizer) -> bool:
    """Whether every parameter already has its Adam states (after the first step), so that
    binding creates nothing. Reads only: safe beside a training step in another thread."""
    for opt in optimizers_of(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state.get(p)  # not [p]: the defaultdict would insert
                if st is None or "exp_avg" not in st or "exp_avg_sq" not in st:
                    return False
    return True


def storage_fingerprint(model: list, optimizer) -> tuple:
    """Where the tensors a `LiveState` of these objects reads live: every parameter's and
    every optimizer state's address and shape, in a fixed order. Equal fingerprints at two
    moments mean a binding made at the first still views the live storage at the second
    (training updates these tensors in place; a reallocation changes the fingerprint). A
    few microseconds per parameter: cheap enough for the pause, unlike binding."""
    out = []
    for m in model:
        for name, p in unwrap(m).named_parameters():
            out.append((name, p.data_ptr(), tuple(p.shape)))
        for name, b in unwrap(m).named_buffers():  # a buffer may be re-made (its dtype)
            out.append((name, b.data_ptr(), tuple(b.shape), b.dtype))
    for opt in optimizers_of(optimizer):
        for _, _, _, states in param_optimizer_states(opt):
            for k, t in sorted(states.items()):
                out.append((k, t.data_ptr(), tuple(t.shape)) if torch.is_tensor(t) else (k, None))
    return tuple(out)


VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


class LiveState:
    """Fragments and storage of one rank's live model chunks and optimizer."""

    def __init__(self, model: list, optimizer, rank: int, vocab_size: int) -> None:
        self.rank = rank
        self.vocab_size = vocab_size
        self.chunks = [unwrap(m) for m in model]
        self.params: list[dict[str, torch.nn.Parameter]] = [
            dict(c.named_parameters()) for c in self.chunks]
        self._owner = {id(p): (ci, n) for ci, ps in enumerate(self.params) for n, p in ps.items()}
        self.optimizer = optimizer
        ensure_optimizer_state(optimizer)
        self.blocks: dict[tuple[int, str], list[_Block]] = {}
        # vocab padding rows [V, V') of embedding / output layer (not in the VPS)
        self.pad_blocks: dict[tuple[int, str], _Block] = {}
        self.keys: dict[tuple[int, str], str] = {}
        # the shape a parameter is viewed in where it is not its own (grouped experts)
        self.shapes: dict[tuple[int, str], tuple[int, ...]] = {}
        # every logical tensor's global shape, as megatron-core's metadata gives it (vocab
        # tensors: their unpadded rows); what a plan made from metadata checks both sides by
        self.global_shapes: dict[str, tuple[int, ...]] = {}
        self.param_fragments: list[LiveFragment] = []
        # persistent buffers megatron-core checkpoints (a router's expert bias): trained
        # state that is not a parameter, so no optimizer holds it; kind "param" fragments
        # of their own, which a switch planned from the live metadata carries
        self.buffers: list[dict[str, torch.Tensor]] = [
            {n: b for n, b in c.named_buffers() if b is not None} for c in self.chunks]
        self.buffer_fragments: list[LiveFragment] = []
        # sharded tensors found neither in a parameter nor as a buffer (keys): a switch
        # planned from the live metadata refuses to run without them
        self.unplaced: list[str] = []
        # the chunks' ShardedObjects (a module's `_extra_state`): no box, a unique key
        self.objects: list[ObjectSlot] = []
        self._object_bytes: dict[str, bytes] = {}  # their values, once detached
        self._read_model_metadata()
        self.opt_ranges: dict[tuple[int, str], tuple[int, int, dict[str, torch.Tensor]]] = {}
        self._read_optimizer_ranges()

    def detach_from_objects(self) -> "LiveState":
        """Drop the references to the model chunks and the optimizer, keeping only the
        tensors (parameters, optimizer states) that `view` reads and the sharded objects'
        values, serialised now (`read_objects`). After a rank died the survivors free the
        megatron objects, which hold the broken communicators, and still serve their state
        as the sources of the recovery."""
        try:  # the objects' values now (they have no storage to keep a view of)
            self._object_bytes = self.read_objects({s.unique_key for s in self.objects})
        except Exception as e:  # noqa: BLE001 - a switch from here reports what it lacks
            log.warning("rank %d: reading the sharded objects before detaching failed: %s",
                        self.rank, e)
        self.chunks = []
        self.optimizer = None
        # plain tensors on the same storage: a Parameter carries DDP's gradient hooks,
        # whose closures reach DDP and with it every communicator
        self.params = [{n: p.detach() for n, p in ps.items()} for ps in self.params]
        self.buffers = [{n: b.detach() for n, b in bs.items()} for bs in self.buffers]
        self.opt_ranges = {k: (s, e, {n: t.detach() for n, t in st.items()})
                           for k, (s, e, st) in self.opt_ranges.items()}
        return self

    # ------------------------------------------------------------------ weights
    def _locate(self, ci: int, data: torch.Tensor) -> tuple[str, tuple[int, ...]]:
        """Which parameter of chunk `ci` stores `data`, and at which local offsets."""
        ptr = data.data_ptr()
        cands = self._sorted_ptrs[ci]
        i = bisect.bisect_right([c[0] for c in cands], ptr) - 1
        if i >= 0:
            start, name = cands[i]
            p = self.params[ci][name]
            es = p.element_size()
            off = (ptr - start) // es
            if 0 <= off < p.numel() and (data.stride() == p.stride()[-data.dim():] or data.numel() <= 1):
                return name, tuple(int(x) for x in np.unravel_index(off, tuple(p.shape)))
        raise FragmentMismatchError(f"rank {self.rank}: sharded tensor data at {ptr:#x} of chunk "
                                    f"{ci} is not inside any parameter")

    def _read_model_metadata(self) -> None:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        # distributed optimizer shards are distinct across DP, so an optimizer fragment is
        # main when its weight's replica id is main up to the DP coordinate (no TP /
        # tied-copy duplicate); a plain optimizer's state is main where its weight is
        self._opt_main: dict[tuple[int, str], bool] = {}
        self._weight_main: dict[tuple[int, str], bool] = {}
        self._sorted_ptrs = [sorted((p.data_ptr(), n) for n, p in ps.items()) for ps in self.params]
        for ci, chunk in enumerate(self.chunks):
            sd = chunk_sharded_state_dict(chunk)
            self.objects += object_slots(ci, sd)
            self._read_grouped_experts(ci, chunk, sd)
            apply_factories(sd)
            for sh in nested_values(sd):
                if not isinstance(sh, ShardedTensor) or not torch.is_tensor(sh.data):
                    continue
                if sh.data.numel() == 0 or sh.key.endswith("_extra_state"):
                    continue
                try:
                    name, local_off = self._locate(ci, sh.data)
                except FragmentMismatchError:
                    self._add_buffer(ci, sh)  # e.g. a router's expert bias
                    continue
                pre = sh.prepend_axis_num
                key = self._canonical_key(sh.key, name, sh.global_offset[:pre])
                gshape = tuple(int(x) for x in sh.global_shape[pre:])
                self.global_shapes[key] = ((self.vocab_size,) + gshape[1:] if key in VOCAB_KEYS
                                           else gshape)
                gbox = Box(tuple(sh.global_offset[pre:]), tuple(sh.local_shape))
                lbox = Box(local_off, tuple(sh.local_shape))
                rid = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
                self._opt_main[(ci, name)] = all(r == 0 for r in rid[:-1])
                self._weight_main[(ci, name)] = bool(is_main_replica(sh.replica_id))
                self.keys[(ci, name)] = key
                if key in VOCAB_KEYS:
                    keep = max(0, min(gbox.shape[0], self.vocab_size - gbox.offsets[0]))
                    if keep < gbox.shape[0]:  # rows >= V: padding, outside the VPS
                        pad = Box((lbox.offsets[0] + keep,) + lbox.offsets[1:],
                                  (gbox.shape[0] - keep,) + gbox.shape[1:])
                        self.pad_blocks[(ci, name)] = _Block(
                            pad, Box((gbox.offsets[0] + keep,) + gbox.offsets[1:], pad.shape))
                    if keep == 0:
                        continue
                    gbox = Box(gbox.offsets, (keep,) + gbox.shape[1:])
                    lbox = Box(lbox.offsets, gbox.shape)
                self.blocks.setdefault((ci, name), []).append(_Block(lbox, gbox))
                self.param_fragments.append(LiveFragment(
                    key, "param", gbox, self.rank, ci, name, lbox.offsets,
                    bool(is_main_replica(sh.replica_id))))

    def _add_buffer(self, ci: int, sh: Any) -> None:
        """A sharded tensor that is no parameter: a buffer of the chunk, whole (module
        doc), else `unplaced`."""
        name = next((n for n, b in self.buffers[ci].items() if b is sh.data), None)
        if name is None or tuple(sh.local_shape) != tuple(sh.data.shape):
            self.unplaced.append(sh.key)
            return
        pre = sh.prepend_axis_num
        key = self._canonical_key(sh.key, name, sh.global_offset[:pre])
        self.global_shapes[key] = tuple(int(x) for x in sh.global_shape[pre:])
        self.buffer_fragments.append(LiveFragment(
            key, "param", Box(tuple(sh.global_offset[pre:]), tuple(sh.local_shape)), self.rank,
            ci, name, (0,) * len(sh.local_shape), True))

    def shape_of(self, chunk: int, local_name: str) -> tuple[int, ...]:
        """The shape the boxes of a local parameter are given in (module doc)."""
        got = self.shapes.get((chunk, local_name))
        return got if got is not None else tuple(self.params[chunk][local_name].shape)

    def _read_grouped_experts(self, ci: int, chunk: torch.nn.Module, sd: dict) -> None:
        """Grouped experts' factories (module doc) are read here and taken out of `sd`."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        grouped = grouped_expert_params(chunk)
        if not grouped:
            return

        def walk(d: Any) -> None:
            items = d.items() if isinstance(d, dict) else enumerate(d)
            for k, v in list(items):
                if isinstance(v, (dict, list)):
                    walk(v)
                elif isinstance(v, ShardedTensorFactory) and id(v.data) in grouped:
                    name, module = grouped[id(v.data)]
                    self._add_grouped(ci, name, grouped_block(v, name, module, self.rank),
                                      _optimizer_copy(chunk, module, v.data) == 0)
                    d[k] = None

        walk(sd)

    def _add_grouped(self, ci: int, name: str, g: Any, opt_main: bool) -> None:
        key = self._canonical_key(g.sharded_key, name, g.prepended)
        lbox = Box.full(g.view_shape)
        self.shapes[(ci, name)] = g.view_shape
        self._opt_main[(ci, name)] = opt_main
        self.keys[(ci, name)] = key
        self.blocks.setdefault((ci, name), []).append(_Block(lbox, g.logical))
        self.param_fragments.append(LiveFragment(key, "param", g.logical, self.rank, ci, name,
                                                 lbox.offsets, g.main))

    @staticmethod
    def _canonical_key(sharded_key: str, local_name: str, prepended: tuple[int, ...]) -> str:
        """Layout-independent key: the module path with global layer / expert indices.

        The global layer is the first prepended axis of a decoder layer's sharded tensor,
        or, where megatron-core keys the layers one by one (layers that differ, e.g. a
        dense/MoE `moe_layer_freq` pattern), the index in its key; the global expert is the
        next prepended axis."""
        if not sharded_key.startswith("decoder.layers."):
            # embedding, output layer (or its tied copy), final norm, the multi-token
            # prediction layers (keyed one by one); a prepended axis (experts) in the key
            return sharded_key + "".join(f"[{i}]" for i in prepended)
        own = _LAYER.match(sharded_key)
        layer, rest = (int(own.group(1)), prepended) if own else (prepended[0], prepended[1:])
        # TE's fused norm parameters keep the separate norm's logical key
        key = _LAYER.sub(f"decoder.layers.{layer}.", analytic_param_name(local_name), count=1)
        if rest:
            key = _EXPERT.sub(f".mlp.experts.{rest[0]}.", key, count=1)
        return key

    # ------------------------------------------------------------------ objects
    def read_objects(self, unique_keys: set[str]) -> dict[str, bytes]:
        """The current values of this rank's objects among `unique_keys`, serialised as a
        save would write them (`sharded_objects`): read from a fresh sharded state dict of
        each chunk holding one, since they change with training; once detached, the values
        they had then."""
        if not self.chunks:
            return {k: v for k, v in self._object_bytes.items() if k in unique_keys}
        out: dict[str, bytes] = {}
        for ci, chunk in enumerate(self.chunks):
            slots = [s for s in self.objects if s.chunk == ci and s.unique_key in unique_keys]
            if slots:
                values = object_values(chunk_sharded_state_dict(chunk),
                                       [s.local_key for s in slots])
                out.update((s.unique_key, serialize(values[s.local_key])) for s in slots)
        return out

    def write_objects(self, values: Mapping[str, Any]) -> None:
        """Set received objects (by unique key) on this rank's modules, as Megatron-LM's
        load does (`sharded_objects.set_objects`); every slot of this rank must be given."""
        missing = [s.unique_key for s in self.objects if s.unique_key not in values]
        if missing:
            raise ObjectCarryError(f"rank {self.rank}: no value for the objects {missing[:3]}")
        for ci, chunk in enumerate(self.chunks):
            set_objects(chunk, {s.local_key: values[s.unique_key]
                                for s in self.objects if s.chunk == ci})

    # ------------------------------------------------------------------ optimizer
    def _read_optimizer_ranges(self) -> None:
        self._opt_instance: dict[tuple[int, str], int] = {}
        for opt in optimizers_of(self.optimizer):
            distributed = is_distributed(opt)
            for p, start, end, states in param_optimizer_states(opt):
                ci, name = self._owner[id(p)]
                self.opt_ranges[(ci, name)] = (start, end, states)
                # with several optimizer instances the same shard lives once per instance
                self._opt_instance[(ci, name)] = (
                    getattr(opt, "distributed_optimizer_instance_id", 0) if distributed else 0)
                if not distributed and (ci, name) in self._weight_main:
                    self._opt_main[(ci, name)] = self._weight_main[(ci, name)]

    def optimizer_fragments(self, kinds: Iterable[str] = OPT_KINDS,
                            padding: bool = False) -> list[LiveFragment]:
        """Owned optimizer boxes; with `padding`, those of the vocab padding rows instead."""
        out = []
        for (ci, name), (start, end, _) in sorted(self.opt_ranges.items()):
            blocks = ([self.pad_blocks[(ci, name)]] if (ci, name) in self.pad_blocks else []) \
                if padding else self.blocks.get((ci, name), [])
            if end <= start or not blocks:
                continue
            shape = self.shape_of(ci, name)
            main = self._opt_main[(ci, name)] and self._opt_instance[(ci, name)] == 0
            for fb in Box.from_flat_range(shape, start, end):
                for b in blocks:
                    inter = fb.intersect(b.local)
                    if inter is None:
                        continue
                    g = Box(tuple(go + io - lo for go, io, lo in
                                  zip(b.logical.offsets, inter.offsets, b.local.offsets)), inter.shape)
                    for kind in kinds:
                        out.append(LiveFragment(self.keys[(ci, name)], kind, g, self.rank, ci,
                                                name, inter.offsets, main))
        return out

    # ------------------------------------------------------------------ storage
    def view(self, kind: str, chunk: int, local_name: str, local_box: Box) -> torch.Tensor:
        """The tensor view storing `local_box` of a local parameter for state `kind`."""
        if kind == "param" and local_name not in self.params[chunk]:
            return self.buffers[chunk][local_name].detach()[local_box.slices()]
        shape = self.shape_of(chunk, local_name)
        if kind == "param":
            return self.params[chunk][local_name].detach().view(shape)[local_box.slices()]
        start, end, states = self.opt_ranges[(chunk, local_name)]
        first = int(np.ravel_multi_index(local_box.offsets, shape))
        last = int(np.ravel_multi_index(tuple(o + n - 1 for o, n in
                                              zip(local_box.offsets, local_box.shape)), shape))
        if first < start or last >= end:
            raise FragmentMismatchError(
                f"rank {self.rank}: {kind} box {local_box} of c{chunk}:{local_name} is outside "
                f"its owned range [{start}, {end})")
        # the 1-D shard holds flat elements [start, end) of the local tensor; a box inside it
        # is a strided view with the local tensor's row-major strides (it need not be
        # contiguous: a plan may cut columns out of a shard)
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        # detached: for fp32 models the main shard is a view of the (grad-requiring) weight
        shard = states[_OPT_STATE_KEY[kind]].detach()
        return shard.as_strided(local_box.shape, strides, shard.storage_offset() + first - start)

    def write(self, kind: str, chunk: int, local_name: str, local_box: Box,
              data: torch.Tensor) -> None:
        """Write a box of data into its place (the reverse of `view`)."""
        self.view(kind, chunk, local_name, local_box).copy_(data)

    def padding_fragments(self, kinds: Iterable[str] = KINDS) -> list[LiveFragment]:
        """Vocab padding rows (global rows >= V) this rank stores, per kind."""
        kinds = tuple(kinds)
        out = []
        if "param" in kinds:
            for (ci, name), b in sorted(self.pad_blocks.items()):
                out.append(LiveFragment(self.keys[(ci, name)], "param", b.logical, self.rank, ci,
                                        name, b.local.offsets, self._opt_main[(ci, name)]))
        opt_kinds = tuple(k for k in kinds if k in OPT_KINDS)
        if opt_kinds:
            out += self.optimizer_fragments(opt_kinds, padding=True)
        return sorted(out)

    def masters_apart_from_weights(self) -> list[str]:
        """The fp32 master boxes whose storage is not their weight's own at the same place
        (empty where every master is a view of its weight: fp32 weights under the
        distributed optimizer, where moving the weights moves the masters too)."""
        out = []
        for f in self.optimizer_fragments(("main_param",)):
            m = self.view("main_param", f.chunk, f.local_name, f.local_box)
            w = self.view("param", f.chunk, f.local_name, f.local_box)
            if (m.data_ptr(), m.stride(), m.dtype) != (w.data_ptr(), w.stride(), w.dtype):
                out.append(f"c{f.chunk}:{f.local_name} {f.local_box}")
        return out

    def fragments(self, kinds: Iterable[str] = KINDS) -> list[LiveFragment]:
        kinds = tuple(kinds)
        out = [f for f in self.param_fragments if "param" in kinds]
        opt_kinds = tuple(k for k in kinds if k in OPT_KINDS)
        if opt_kinds:
            out += self.optimizer_fragments(opt_kinds)
        return sorted(out)


def _optimizer_copy(chunk: torch.nn.Module, module: Any, param: torch.nn.Parameter) -> int:
    """Which copy of its optimizer shards a grouped-expert parameter's are. In an expert
    buffer (EP > 1) the expert-DP ranks shard them and nothing else repeats them: 0. In the
    dense buffer (EP = 1, megatron's `allreduce` attribute set) the DP x CP ranks shard
    them and the TP ranks holding the same expert-TP block repeat them: copy
    tp_rank // expert-TP size (megatron's GroupedMLP numbers its weights' replicas over
    expert-DP, which folds that repetition in, so it is read from the groups)."""
    if not getattr(param, "allreduce", True):
        return 0
    tp = getattr(getattr(chunk, "pg_collection", None), "tp", None)
    tp_rank = tp.rank() if tp is not None else 0
    return tp_rank // module.tp_group.size()
