"""Process groups of a layout, built explicitly and released completely.

Why not `parallel_state.initialize_model_parallel`: (a) it fixes the rank order, while a
switch wants to *choose* which device takes which coordinate of the new layout (placement);
(b) during a switch the old and the new layout's groups must be alive together; (c) its
`destroy_model_parallel()` leaks most groups (ref doc: ~17 per re-init, setup time grows).

So we create every group of the layout ourselves, in the same order on every rank (gloo
creates groups eagerly: a different order deadlocks), give megatron-core a
`ProcessGroupCollection`, and `destroy()` releases exactly the groups we made.

Any placement: each group is created with its members in *virtual-rank* order
(`new_group(..., sort_ranks=False)`), so a member's group rank is its coordinate in the
layout whatever the order of the global ranks of the devices that host it. megatron-core
reads every coordinate from the groups (`get_pg_rank`, `get_process_group_ranks`,
`get_global_rank` for pipeline peers, the DistOpt's shard index, all-to-all split
positions) and we fill the global-rank lists (`_PIPELINE_GLOBAL_RANKS`, embedding,
data-parallel) in the same order, so the whole of megatron sees the virtual rank. Every
process keeps its global rank, device and default group; the groups are built through
torch's own `new_group`, so they get the backend and options it would give any group, and
reductions run in the same member order as at megatron's default placement (the same
rounding). `install()`
also points megatron's `parallel_state` globals at these groups, because some megatron code
paths (schedules, RNG helpers, Megatron-LM's training loop) still read the globals.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch.distributed as dist

from ..compat.torch_features import new_group
from ..transition.transport import abort_groups
from ..vps.layout import GROUP_AXES, Layout
from ..vps.placement import Placement
from ..transition.transport import is_nccl
from .communicators import cpu_group_for, group_device

log = logging.getLogger("dynatrain")



@dataclass
class ParallelGroups:
    """The live process groups of one layout on this process."""

    layout: Layout
    placement: Placement
    rank: int  # this process's global rank
    pg_collection: object  # megatron.core.process_groups_config.ProcessGroupCollection
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    created: list = field(default_factory=list)
    # every process of the world, for the point-to-point exchange of the switch *into*
    # this layout: its own communicator, so that a transfer that times out (which breaks
    # gloo's and NCCL's communicators) leaves the default group usable for the rollback vote
    transfer: object = None
    # every device of the layout (with one optimizer instance: megatron's intra_dist_opt);
    # loss averaging, state gathers and megatron's construction-time object gathers use it
    layout_group: object = None
    # a gloo twin of layout_group where the backend is NCCL (else layout_group itself):
    # megatron's construction-time object gathers, made while another layout trains, run
    # on the CPU and never on the device's streams (elastic.communicators). Shared by
    # every layout on the same devices and not destroyed with the layout
    layout_group_cpu: object = None
    # the layout's devices in global-rank order, where they are the job's first ranks and
    # others are left on standby: the default group Megatron-LM's code is given meanwhile
    # (compat/stand_in_world.py; None elsewhere and on processes outside the layout)
    stand_in_world: object = None
    # the layout's devices in global-rank order, for the collectives of the thread that
    # prepares this layout while another one trains (B's construction-time object gathers,
    # the votes and the stand-in world of its data-iterator build): a group of its own,
    # never one the training thread may use meanwhile (the control group, which its ready
    # votes use and which is B's CPU twin where B spans the world under NCCL, or A's twin,
    # which is B's where both are on the same devices). Under NCCL a gloo group made with
    # B's groups, connected lazily, destroyed with them; under gloo one of B's own groups
    background: object = None

    @property
    def virtual_rank(self) -> Optional[int]:
        return self.placement.virtual_rank(self.rank)

    def coords(self):
        vr = self.virtual_rank
        if vr is None:
            raise RuntimeError(f"rank {self.rank} is not part of layout {self.layout}")
        return self.layout.coords(vr)

    def destroy(self, broken: bool = False) -> None:
        """Destroy every group this object created (nothing else). `broken`: a peer died,
        so a group may already be unusable; freeing its handle is all that is wanted:
        its NCCL communicators are first aborted together (destroying a broken one can
        hang), every rank in the same order."""
        if broken:
            abort_groups(self.created)
        for g in self.created:
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                try:
                    dist.destroy_process_group(g)
                except Exception:  # noqa: BLE001
                    if not broken:
                        raise
        self.created.clear()

    def release_transfer(self) -> None:
        """Destroy the transfer group now (it serves only the switch into this layout).
        Every rank of the world calls it at the same point (after the switch's last
        vote): its members destroy it together, as NCCL wants."""
        g, self.transfer = self.transfer, None
        if g is None or g == dist.GroupMember.NON_GROUP_MEMBER:
            return
        self.created = [x for x in self.created if x is not g]
        dist.destroy_process_group(g)

    def take_handles(self) -> list:
        """Move this object's references to its process-group handles out (after
        `destroy`), so that holding this object no longer keeps them alive: whoever takes
        them decides where their destructors run."""
        handles = [self.pg_collection, self.transfer, self.layout_group, self.layout_group_cpu,
                   self.stand_in_world, self.background]
        self.pg_collection = self.transfer = self.layout_group = self.layout_group_cpu = None
        self.stand_in_world = self.background = None
        return handles


@dataclass(frozen=True)
class GroupOptions:
    """The job's per-group NCCL settings, by megatron's group name (`tp`, `dp_cp`, ...):
    Megatron-LM's `--nccl-communicator-config-path` (a YAML of `{name: {cga_cluster_size,
    max_ctas, min_ctas, net_name, is_high_priority_stream}}`) with
    `--high-priority-stream-groups` folded in, as megatron-core folds them. B's groups get
    the same options as the job's first ones (megatron's own `get_nccl_options` makes
    them)."""

    nccl: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()

    @classmethod
    def from_config(cls, cfgs: Optional[dict], high_priority: Sequence[str] = ()) -> "GroupOptions":
        merged: dict[str, dict] = {k: dict(v or {}) for k, v in (cfgs or {}).items()}
        for name in high_priority or ():
            merged.setdefault(name, {})["is_high_priority_stream"] = True
        bad = [k for k, v in merged.items() if not isinstance(k, str) or not isinstance(v, dict)]
        if bad:
            raise ValueError(f"NCCL communicator config: entries {bad} are not name: mapping")
        return cls(tuple(sorted((k, tuple(sorted(v.items()))) for k, v in merged.items())))

    @classmethod
    def from_megatron_args(cls, args) -> "GroupOptions":
        path = getattr(args, "nccl_communicator_config_path", None)
        cfgs = None
        if path:
            import yaml

            cfgs = yaml.safe_load(_read_config(path))
        return cls.from_config(cfgs, getattr(args, "high_priority_stream_groups", None) or ())

    def config(self) -> dict[str, dict]:
        return {name: dict(kv) for name, kv in self.nccl}


def _read_config(path: str, limit: int = 1 << 20) -> bytes:
    """A small config file read whole, without following a link: a regular file of this
    user (or root) that nobody else may write."""
    import os
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.getuid(), 0) \
                or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_size > limit:
            raise ValueError(f"NCCL communicator config {path}: not a regular file of this "
                             f"user, writable by others, or over {limit} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


_OPTIONS: dict = {"value": GroupOptions()}


def set_group_options(options: GroupOptions) -> None:
    """The options every later `build_groups` gives its NCCL groups (set once, at start)."""
    _OPTIONS["value"] = options


def _pg_options(name: str):
    """megatron-core's NCCL options for group `name` (None: torch's defaults)."""
    cfg = _OPTIONS["value"].config()
    if name not in cfg or not is_nccl():
        return None
    from megatron.core.parallel_state import get_nccl_options

    return get_nccl_options(name, cfg)


def optimizer_instance_groups(layout: Layout) -> dict[str, list[list[int]]]:
    """Virtual-rank groups of megatron's (partial) distributed optimizer.

    With `doi` instances (megatron-core 0.16.1 `initialize_model_parallel`): each DPxCP
    and expert-DP group splits into `doi` blocks of consecutive ranks (`intra_dp_cp`,
    `intra_expt_dp`: the shard groups); the ranks at the same place of every block form
    `inter_dist_opt` (built from the expert grid; dense and expert parts share it); an
    instance (`intra_dist_opt`) is every rank whose expert-DP index falls in its block.
    With one instance only `intra_dist_opt` (the whole layout) is needed."""
    if layout.doi == 1:
        return {"intra_dist_opt": [list(range(layout.world_size))]}
    sd, se = layout.dense_shards, layout.expert_shards
    dense, expert = layout.groups(("cp", "dp")), layout.groups(("edp",))
    edp = [layout.coords(r).edp for r in range(layout.world_size)]
    return {
        "intra_dp_cp": [g[i:i + sd] for g in dense for i in range(0, len(g), sd)],
        "intra_expt_dp": [g[i:i + se] for g in expert for i in range(0, len(g), se)],
        "inter_dist_opt": [g[i::se] for g in expert for i in range(se)],
        "intra_dist_opt": [[r for r in range(layout.world_size) if edp[r] // se == i]
                           for i in range(layout.doi)],
    }


def build_groups(layout: Layout, placement: Optional[Placement] = None) -> ParallelGroups:
    """Create all groups of `layout` on `placement`, members in virtual-rank order (module
    doc). Collective over the default group."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    placement = placement or Placement.default(layout.world_size)
    if len(placement.devices) != layout.world_size:
        raise ValueError(f"placement has {len(placement.devices)} devices, layout {layout} needs "
                         f"{layout.world_size}")
    rank = dist.get_rank()
    dev = placement.devices
    cache: dict[tuple[int, ...], object] = {}
    created: list = []

    device = group_device()  # NCCL: each communicator created with its group, eagerly

    def make(ranks: Sequence[int], name: str = ""):
        # groups with the same members are shared, unless the job gives a name options
        options = _pg_options(name) if name else None
        key = (tuple(ranks), name if options is not None else "")
        if key not in cache:
            # group rank = position; an ascending list keeps torch's default call (the
            # only one TorchComms' split path takes: transition.switch checks that)
            g = new_group(key[0], device=device, keep_order=list(key[0]) != sorted(key[0]),
                          pg_options=options)
            cache[key] = g
            created.append(g)
        return cache[key]

    pgc = ProcessGroupCollection()
    mine: dict[str, list[int]] = {}

    def add(name: str, groups_virtual: list[list[int]]) -> None:
        for gv in groups_virtual:
            ranks = [dev[v] for v in gv]
            g = make(ranks, name)
            if rank in ranks:
                setattr(pgc, name, g)
                mine[name] = ranks

    for name, axes in GROUP_AXES.items():
        add(name, layout.groups(axes))
    pp_groups = layout.groups(("pp",))
    add("embd", [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pp_groups])
    add("pos_embd", [[g[0]] for g in pp_groups])
    for name, groups_virtual in optimizer_instance_groups(layout).items():
        add(name, groups_virtual)
    _gtp_collection_fields(pgc, add, layout, mine)
    everyone = make(list(dev))  # the same group as intra_dist_opt when doi == 1
    # with processes left out, the world Megatron-LM sees: possible only where the layout's
    # devices are the first ranks (a member's rank in it must be its global rank)
    stand_in = (make(sorted(dev)) if sorted(dev) == list(range(len(dev)))
                and len(dev) < dist.get_world_size() else None)
    for name in ("embd", "pos_embd"):  # megatron wants them explicitly None off-stage
        if not hasattr(pgc, name):
            setattr(pgc, name, None)
    if rank in dev and layout.doi == 1:
        pgc.intra_dp_cp = pgc.dp_cp
        pgc.intra_expt_dp = pgc.expt_dp
        mine["intra_dp_cp"] = mine["dp_cp"]
        mine["intra_expt_dp"] = mine["expt_dp"]
    # under NCCL the layout's CPU twin: one per device set for the life of the world
    # (communicators.cpu_group_for), not a new world-sized gloo group per switch; where one
    # is made, its members connect lazily
    everyone_cpu = everyone
    if dist.get_backend() != "gloo":
        with _lazy_gloo():
            everyone_cpu = cpu_group_for(dev)
            # B's own: a twin is shared with the control group or with A (field doc). Lazy,
            # it costs what making any group costs (a store barrier) plus, at use, the
            # connections its collectives take (two per rank for a ring all-reduce)
            background = new_group(sorted(dev), backend="gloo")
        created.append(background)
    else:
        background = make(sorted(dev))  # B's groups serve nothing else before the switch
    transfer = new_group(range(dist.get_world_size()), device=device)
    created.append(transfer)
    log.debug("built %d groups for %s", len(created), layout)
    return ParallelGroups(layout=layout, placement=placement, rank=rank, pg_collection=pgc,
                          group_ranks=mine, created=created, transfer=transfer,
                          layout_group=everyone if rank in dev else None,
                          layout_group_cpu=everyone_cpu if rank in dev else None,
                          stand_in_world=stand_in if rank in dev else None,
                          background=background if rank in dev else None)


def _install_gtp_globals(ps, p, r: dict) -> None:
    """megatron-core 0.19+ (keyed by its `_GTP_WEIGHT_REMAT_GROUP` global): the
    generalized-TP weight-remat groups and the "with GTP remat" data-parallel groups. We
    run with a GTP size of 1 only (larger is refused at start-up), where megatron-core makes
    the remat groups single ranks and the "with GTP remat" groups the plain ones: so here."""
    if not hasattr(ps, "_GTP_WEIGHT_REMAT_GROUP"):
        return
    ps._GTP_WEIGHT_REMAT_GROUP = getattr(p, "gtp_remat", None)
    ps._GTP_WEIGHT_REMAT_GLOBAL_RANKS = r.get("gtp_remat")
    ps._EXPERT_GTP_WEIGHT_REMAT_GROUP = getattr(p, "expt_gtp_remat", None)
    ps._EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS = r.get("expt_gtp_remat")
    ps._DATA_PARALLEL_GROUP_WITH_GTP_REMAT = ps._DATA_PARALLEL_GROUP
    ps._DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT = ps._DATA_PARALLEL_GROUP_WITH_CP
    ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT = (
        ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP)
    ps._EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT = ps._EXPERT_DATA_PARALLEL_GROUP
    ps._INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT = (
        ps._INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP)
    ps._EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP = (
        ps._EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP)


def _gtp_collection_fields(pgc, add, layout: Layout, mine: dict) -> None:
    """megatron-core 0.19+ (keyed by the `gtp_remat` field of `ProcessGroupCollection`):
    the GTP fields of a layout without GTP, as megatron-core's own collection has them: the
    remat groups are single ranks (the same groups as any other single-rank axis, so no new
    group where one exists), the "with GTP remat" groups are the plain ones, and the
    all-gather groups it leaves unset are None."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(type(pgc))}
    if "gtp_remat" not in names:
        return
    single = [[v] for v in range(layout.world_size)]
    add("gtp_remat", single)
    add("expt_gtp_remat", single)
    for new, plain in (("dp_cp_gtp_remat", "dp_cp"), ("expt_dp_gtp_remat", "expt_dp"),
                       ("tp_ep_pp_with_egtp_remat", "tp_ep_pp")):
        if new in names and plain in mine:  # a member of that group (not a standby rank)
            setattr(pgc, new, getattr(pgc, plain))
            if plain in mine:  # a process outside the layout is in none of its groups
                mine[new] = mine[plain]
    for name in ("dp_cp_ag", "expt_dp_ag"):
        if name in names:
            setattr(pgc, name, None)


@contextlib.contextmanager
def _lazy_gloo():
    """Gloo groups made inside connect a pair of members at its first use, instead of
    every member connecting to every other (and reading each one's address from the
    store) when the group is made: torch's `TORCH_GLOO_LAZY_INIT`, read as a gloo group
    is created. For a group over the world that is n - 1 connections and store reads per
    rank, of which its ring collectives use two."""
    old = os.environ.get("TORCH_GLOO_LAZY_INIT")
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
        else:
            os.environ["TORCH_GLOO_LAZY_INIT"] = old


def forget_megatron_groups() -> None:
    """Every process group held by a `parallel_state` global set to None, then
    megatron-core's `destroy_model_parallel()` for the rest: 0.16.1's destroy leaves some behind
    (`_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP` and its gloo twin, which `install`
    sets). A group lives, and a gloo group keeps its sockets open, as long as anything
    references it; after a rank died the survivors must let go of every one."""
    from megatron.core import parallel_state as ps

    # unhook first: destroy_model_parallel would destroy the groups in its gloo globals,
    # which are ours (`install`), and their owner destroys them (ParallelGroups.destroy)
    for name, value in list(vars(ps).items()):
        if name.startswith("_") and isinstance(value, dist.ProcessGroup):
            setattr(ps, name, None)
    ps.destroy_model_parallel()


def install(groups: ParallelGroups, target: Any = None) -> None:
    """Point megatron-core's parallel_state globals at `groups` (this rank must be a member).
    `target`: another namespace of parallel_state's to set instead (a thread's view of it,
    `compat.parallel_state_view`)."""
    if target is None:
        from megatron.core import parallel_state as target
    ps = target

    p, r = groups.pg_collection, groups.group_ranks
    L = groups.layout
    # destroy_model_parallel() resets the globals but also destroys whatever sits in the
    # gloo globals, which may be groups of ours (of a layout still alive): unhook them first
    for name in ("_DATA_PARALLEL_GROUP_GLOO", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                 "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                 "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
                 "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO"):
        setattr(ps, name, None)
    ps.destroy_model_parallel()
    ps._TENSOR_MODEL_PARALLEL_GROUP = getattr(p, "tp", None)
    ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = r.get("tp")
    ps._PIPELINE_MODEL_PARALLEL_GROUP = getattr(p, "pp", None)
    ps._PIPELINE_GLOBAL_RANKS = r.get("pp")
    ps._MODEL_PARALLEL_GROUP = getattr(p, "mp", None)
    ps._MODEL_PARALLEL_GLOBAL_RANKS = r.get("mp")
    ps._EMBEDDING_GROUP = getattr(p, "embd", None)
    ps._EMBEDDING_GLOBAL_RANKS = r.get("embd")
    ps._POSITION_EMBEDDING_GROUP = getattr(p, "pos_embd", None)
    ps._POSITION_EMBEDDING_GLOBAL_RANKS = r.get("pos_embd")
    ps._DATA_PARALLEL_GROUP = getattr(p, "dp", None)
    gloo = dist.get_backend() == "gloo"  # on NCCL megatron-made gloo twins are not needed by us
    ps._DATA_PARALLEL_GROUP_GLOO = (getattr(p, "dp", None) if gloo else None)
    ps._DATA_PARALLEL_GLOBAL_RANKS = r.get("dp")
    ps._DATA_PARALLEL_GROUP_WITH_CP = getattr(p, "dp_cp", None)
    ps._DATA_PARALLEL_GROUP_WITH_CP_GLOO = getattr(p, "dp_cp", None) if gloo else None
    ps._DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = r.get("dp_cp")
    ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = getattr(p, "intra_dp_cp", None)
    ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = (getattr(p, "intra_dp_cp", None)
                                                           if gloo else None)
    ps._CONTEXT_PARALLEL_GROUP = getattr(p, "cp", None)
    ps._CONTEXT_PARALLEL_GLOBAL_RANKS = r.get("cp")
    ps._TENSOR_AND_CONTEXT_PARALLEL_GROUP = getattr(p, "tp_cp", None)
    ps._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = getattr(p, "tp_dp_cp", None)
    ps._TENSOR_AND_DATA_PARALLEL_GROUP = getattr(p, "tp_dp_cp", None) if L.cp == 1 else None
    ps._EXPERT_MODEL_PARALLEL_GROUP = getattr(p, "ep", None)
    ps._EXPERT_MODEL_PARALLEL_RANKS = r.get("ep")
    ps._EXPERT_TENSOR_PARALLEL_GROUP = getattr(p, "expt_tp", None)
    ps._EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP = getattr(p, "tp_ep", None)
    ps._EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP = getattr(p, "tp_ep_pp", None)
    ps._EXPERT_DATA_PARALLEL_GROUP = getattr(p, "expt_dp", None)
    ps._EXPERT_DATA_PARALLEL_GROUP_GLOO = getattr(p, "expt_dp", None) if gloo else None
    ps._INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP = getattr(p, "intra_expt_dp", None)
    ps._INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO = (getattr(p, "intra_expt_dp", None)
                                                         if gloo else None)
    ps._INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP = getattr(p, "inter_dist_opt", None)
    ps._INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP = getattr(p, "intra_dist_opt", None)
    _install_gtp_globals(ps, p, r)
    ps._set_global_memory_buffer()
    if L.vpp > 1:
        ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = L.vpp
        ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
