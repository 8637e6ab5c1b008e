"""Re-forming the torch world after a rank died.

A dead process breaks every communicator it was part of, the default group included, so
the survivors cannot vote or switch on it. They each notice (a collective raises), then
meet again through a store that does not live in any worker: torchrun's agent store
(`TORCHELASTIC_USE_AGENT_STORE=True`) or a `FileStore` in a shared directory. Each
survivor announces itself, waits a grace period, and all read the same set of survivors;
the ranks the recovery needs (the first `keep(survivors)`, in old-rank order) form a new
default group under a fresh key prefix; the others leave. Every survivor computes the same
answer alone from the store's contents.
"""
from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

from .communicators import (create_control_group, forget_control_group, rank_device,
                             warm_up_default)
from ..safe_files import ReadRules, checked_directory, open_checked

log = logging.getLogger("dynatrain")


@dataclass(frozen=True, slots=True)
class NewWorld:
    """The outcome on this process: `rank` is None when it is not part of the new world."""

    old_world: int
    survivors: tuple[int, ...]  # old ranks that announced themselves in time
    members: tuple[int, ...]  # old ranks of the new world, in new-rank order
    rank: Optional[int]
    generation: int

    @property
    def dead(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.old_world) if r not in self.survivors)


def rendezvous_store(directory: Optional[str]) -> dist.Store:
    """The store survivors meet in: torchrun's agent store when the job has one, else a
    FileStore in `directory` (shared by all ranks)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=datetime.timedelta(seconds=60))
    if not directory:
        raise RuntimeError("no rendezvous store to re-form the world in: run under torchrun "
                           "(agent store) or give --dynatrain-rendezvous-dir")
    return dist.FileStore(store_file(directory), -1)


# the FileStore's file: the job user's regular file nobody else may write (torch opens it;
# nothing is read here, so the limit is unused)
_STORE_RULES = ReadRules("rendezvous store", 1 << 40)


def store_file(directory: str) -> str:
    """The path of the FileStore in `directory`, created 0600 (whatever the umask: torch
    would create it 0666 & ~umask) in a checked directory (`safe_files.checked_directory`)
    and checked to be the job user's regular file that nobody else may write: whoever could
    replace it could steer the job's meetings. UnsafeFileError otherwise."""
    with checked_directory(directory, mode=0o700) as dfd:
        try:
            fd = os.open("rendezvous", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                         0o600, dir_fd=dfd)
            os.fchmod(fd, 0o600)
            os.close(fd)
        except FileExistsError:
            pass
    path = os.path.join(directory, "rendezvous")
    os.close(open_checked(path, _STORE_RULES)[0])
    return path


def forget_default_group_defaults() -> None:
    """`torch.distributed.nn.functional` gives its collectives `group=group.WORLD` as a
    default argument, evaluated when it is imported: imported after the world exists (as
    megatron-core does when it is imported late), ten functions hold the default group
    for the life of the process, and a gloo group's sockets close only with its last
    reference. A survivor that keeps the broken default group alive leaves the others
    blocked on it (the broadcast root of the step-boundary poll waits until this process
    exits). Point those defaults back at None (the world, when called)."""
    import sys
    import types

    mod = sys.modules.get("torch.distributed.nn.functional")
    if mod is None:
        return
    for fn in vars(mod).values():
        if isinstance(fn, types.FunctionType) and fn.__defaults__ and \
                any(isinstance(d, dist.ProcessGroup) for d in fn.__defaults__):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d
                                    for d in fn.__defaults__)


def announce_noticed(store: dist.Store, old_rank: int, generation: int) -> None:
    """A survivor marks, as soon as it caught the failure and before it lets go of the broken
    world (which can take many seconds on a loaded host), that it will join the roster:
    `reform_world` waits for every rank so marked, not only for the quiet period."""
    store.set(f"dynatrain/gen{generation}/noticed/{old_rank}", "1")


def reform_world(store: dist.Store, old_rank: int, old_world: int, generation: int,
                 keep: Callable[[tuple[int, ...]], int], quiet_seconds: float = 2.0,
                 max_wait_seconds: float = 60.0, timeout_s: float = 300.0) -> NewWorld:
    """Collective among the survivors (module doc). `keep(survivors)`: how many of the
    survivors (old ranks) the new world takes: all of them when their memory is the
    source of an in-memory recovery, only the new layout's when the job resumes from a
    checkpoint. Destroys the broken default group first.

    Survivors notice a death at different times (one blocked on a live peer learns of it
    only when that peer closes its sockets), so each waits until every old rank announced
    itself, or until every rank that marked the failure noticed (`announce_noticed`)
    announced itself and none new did for `quiet_seconds` (at most `max_wait_seconds`).

    A survivor blocked in a collective with another *survivor* learns of the death only
    when that survivor's communicator closes, which on gloo happens only with the last
    reference to it: callers drop them all first (`forget_default_group_defaults` here,
    `elastic.groups.forget_megatron_groups`, the layout's objects). A survivor that still
    notices after the quiet period is left out of the new world and leaves; the
    recovery decides on the survivors actually in the roster."""
    drop_default_group()
    prefix = f"dynatrain/gen{generation}"
    store.set(f"{prefix}/alive/{old_rank}", "1")
    start = last_change = time.monotonic()
    seen_set: set[int] = set()
    noticed: set[int] = set()
    while True:
        now_seen = {r for r in range(old_world) if store.check([f"{prefix}/alive/{r}"])}
        now_noticed = {r for r in range(old_world) if store.check([f"{prefix}/noticed/{r}"])}
        now = time.monotonic()
        if now_seen != seen_set or now_noticed != noticed:
            seen_set, noticed, last_change = now_seen, now_noticed, now
        quiet = not noticed - seen_set and now - last_change >= quiet_seconds
        if len(seen_set) == old_world or quiet or now - start >= max_wait_seconds:
            break
        time.sleep(0.1)
    seen = ",".join(str(r) for r in sorted(seen_set))
    # the first survivor past its grace fixes the roster; everyone reads that one (a late
    # announcement cannot make two survivors disagree)
    roster = store.compare_set(f"{prefix}/roster", "", seen)
    roster = roster.decode() if isinstance(roster, bytes) else str(roster)
    survivors = tuple(int(r) for r in roster.split(",") if r)
    n = keep(survivors)
    members = survivors[:n]
    log.warning("world re-formed (generation %d): survivors %s of %d ranks, %d kept",
                generation, list(survivors), old_world, n)
    if old_rank not in members:
        return NewWorld(old_world, survivors, members, None, generation)
    new_rank = members.index(old_rank)
    start_default_group(store, f"{prefix}/pg", new_rank, n, timeout_s)
    return NewWorld(old_world, survivors, members, new_rank, generation)


def drop_default_group() -> None:
    """Let go of the default group (broken after a death, or too small after a join)
    and of every reference torch keeps to it (`forget_default_group_defaults`)."""
    forget_default_group_defaults()
    forget_control_group()
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - it is broken; only its resources are freed here
        log.debug("destroying the default group: %s", e)


def start_default_group(store: dist.Store, prefix: str, rank: int, world: int,
                        timeout_s: float = 300.0) -> None:
    """A new default group of `world` processes meeting under `prefix` in `store`."""
    device = rank_device()
    dist.init_process_group("gloo" if device is None else "nccl",
                            store=dist.PrefixStore(prefix, store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    warm_up_default()
    create_control_group()
