"""Growing the world with accepted joiners (`elastic/join.py`) at a step boundary.

A process launched after the job (`pretrain_gpt.py ... --dynatrain-join`) proves it holds
the job's secret; once rank 0 accepts it at a poll and the joiner says `ready` (tagged with
the secret), every process of the job and the joiner re-form the default process group
one rank larger, in the join store (`elastic/join.py:join_store`) under a prefix derived
from the secret, which a process without it can neither find nor write. Megatron's objects hold the old communicators, so the training ranks bind
their tensors (`LiveState.detach_from_objects`), free the objects, and switch from the
current layout to *the same layout* on the new world: every piece is a local copy,
nothing crosses the network, the state is bit-identical. The joiner holds nothing and
waits on standby; a later scale-out request (`dynatrain request --world N`) puts it to
work like any standby rank.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Optional

import torch.distributed as dist

from ..adapters.live import LiveState
from ..elastic.job_secret import JobSecret
from ..elastic.join import JoinError, JoinVerdict
from ..elastic.rejoin import drop_default_group, start_default_group
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.placement import Placement
from .death_recovery import let_go_of_layout, switch_from_held
from ..mcore.builders import MegatronBuilder
from ..mcore.session import freeze_long_lived_objects
from ..mcore.train_config import TrainConfig
from ..mcore.training import Trainer

log = logging.getLogger("dynatrain")

PREFIX = "dynatrain/grow"
_PROTOCOL = "dynatrain-grow-v1"


def _tagged(secret: JobSecret, *fields) -> str:
    return secret.tag(json.dumps([_PROTOCOL, *fields], separators=(",", ":")).encode())


def meeting_prefix(secret: JobSecret, nonce: str, generation: int) -> str:
    """Where the grown world of `generation` meets in the store: a prefix derived from the
    secret, so a process without it can neither find nor write the keys of the new world
    (the announcement, the process-group rendezvous), even in torchrun's agent store."""
    return f"{PREFIX}{generation}/{_tagged(secret, 'meet', nonce, generation)[:32]}"


def _ready_key(generation: int, rank: int) -> str:
    return f"{PREFIX}{generation}/ready/{rank}"


def ready(store: dist.Store, generation: int, rank: int, secret: JobSecret, nonce: str,
          request_id: str) -> None:
    """The joiner, once accepted: it is a training process and enters the world now. The
    word is tagged with the secret over (nonce, generation, rank, request id)."""
    store.set(_ready_key(generation, rank), json.dumps(
        {"id": request_id, "mac": _tagged(secret, "ready", nonce, generation, rank, request_id)}))


def all_ready(store: dist.Store, generation: int, accepted: list[JoinVerdict],
              secret: JobSecret, nonce: str, wait_seconds: float = 10.0) -> bool:
    """Rank 0: whether every accepted joiner said `ready` with a valid tag (it does so right
    after reading its verdict, which this poll just wrote). An untagged or forged word is
    ignored (the joiner's own may still come); nobody without the secret can make one."""
    deadline = time.monotonic() + wait_seconds
    pending = list(accepted)
    while True:
        pending = [v for v in pending if not _ready_ok(store, generation, v, secret, nonce)]
        if not pending:
            return True
        if time.monotonic() >= deadline:
            log.warning("no valid 'ready' from accepted joiner(s) %s",
                        ", ".join(f"rank {v.rank} ({v.origin})" for v in pending))
            return False
        time.sleep(0.05)


def _ready_ok(store: dist.Store, generation: int, v: JoinVerdict, secret: JobSecret,
              nonce: str) -> bool:
    key = _ready_key(generation, v.rank)
    if not store.check([key]):
        return False
    try:
        word = json.loads(store.get(key)[:1024])
        mac = word["mac"] if isinstance(word, dict) and isinstance(word.get("mac"), str) else ""
    except (ValueError, UnicodeDecodeError):
        mac = ""
    return secret.verify(json.dumps([_PROTOCOL, "ready", nonce, generation, v.rank,
                                     v.request_id], separators=(",", ":")).encode(), mac)


def announce(store: dist.Store, prefix: str, world: int, layout: Layout,
             placement: Placement, secret: JobSecret) -> None:
    """Rank 0: what a joiner needs to take part (plain data, tagged; under the secret
    `meeting_prefix`)."""
    info = {"world": world, "layout": str(layout), "layout_world": layout.world_size,
            "devices": list(placement.devices)}
    info["mac"] = _tagged(secret, "announce", prefix, info)
    store.set(f"{prefix}/info", json.dumps(info))


def grow_world(trainer: Optional[Trainer], spec: ModelSpec, train: TrainConfig,
               store: dist.Store, prefix: str, world: int, layout: Layout,
               placement: Placement, timeout: Optional[float] = None,
               builder: Optional[MegatronBuilder] = None) -> Optional[Trainer]:
    """Every process of the job (standby ones with `trainer` None), with the meeting
    `prefix` rank 0 broadcast. Returns the trainer rebuilt on the grown world, or None on
    a standby process. `builder`: the job's (default `MegatronBuilder`)."""
    held, scalars = let_go_of_layout(trainer, spec, placement, broken=False)
    _reinit(store, prefix, dist.get_rank(), world)
    return _rebuild(spec, train, layout, placement, held, scalars, timeout, builder)


def join_world(spec: ModelSpec, train: TrainConfig, store: dist.Store, prefix: str,
               rank: int, secret: JobSecret, wait_seconds: float = 300.0,
               timeout: Optional[float] = None) -> tuple[Layout, Placement]:
    """The joiner, once accepted as `rank` and ready: enter the grown world (meeting under
    `prefix`) and take part in the rebuild (holding nothing). Returns the job's layout and
    placement, as announced with the job's tag."""
    from ..elastic.join import wait_for

    info = json.loads(wait_for(store, f"{prefix}/info", wait_seconds,
                                "the job did not grow its world"))
    mac = info.pop("mac", "") if isinstance(info, dict) else ""
    if not isinstance(mac, str) or not secret.verify(json.dumps(
            [_PROTOCOL, "announce", prefix, info], separators=(",", ":")).encode(), mac):
        raise JoinError("the grown world's announcement is not tagged with the job's secret")
    world = int(info["world"])
    layout = Layout.parse(info["layout"], int(info["layout_world"]))
    placement = Placement(tuple(int(d) for d in info["devices"]))
    if not 0 <= rank < world:
        raise JoinError(f"accepted as rank {rank} of a world of {world}: inconsistent verdict")
    _reinit(store, prefix, rank, world)
    _rebuild(spec, train, layout, placement, None, None, timeout)
    return layout, placement


def _reinit(store: dist.Store, prefix: str, rank: int, world: int) -> None:
    drop_default_group()
    start_default_group(store, f"{prefix}/pg", rank, world)
    log.warning("world grown: rank %d of %d", rank, world)


def _rebuild(spec: ModelSpec, train: TrainConfig, layout: Layout, placement: Placement,
             held: Optional[LiveState], scalars, timeout: Optional[float],
             builder: Optional[MegatronBuilder] = None) -> Optional[Trainer]:
    """The switch from `layout` to itself on the new world: local copies only."""
    freeze_long_lived_objects()
    trainer, report = switch_from_held(spec, train, layout, placement, layout,
                                       placement.devices, held, scalars, timeout,
                                       f"rebuilding {layout} on the grown world",
                                       builder=builder)
    log.info("rebuilt %s on the grown world: %d bytes moved, %.3f s", layout,
             report.bytes_moved, report.pause_seconds)
    return trainer
