"""Controller: turns signal files and schedules into one agreed switch decision.

Rank 0 reads the signal file (and the scripted schedule), validates the request against
the model and the world, and all ranks agree with one small broadcast at a step boundary.
A bad request is rejected with its reason (logged, and the file is moved aside as
`rejected`); training continues untouched.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch.distributed as dist

from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from ..vps.validate import validate_layout
from . import signal_file as sf
from .join import JoinReviewer, JoinVerdict

log = logging.getLogger("dynatrain")


@dataclass(frozen=True, slots=True)
class Decision:
    """What all ranks agreed on at a step boundary."""

    target: Optional[str]  # layout string, None: nothing to do
    world: Optional[int]
    source: str  # "signal", "schedule", "auto" (the job chose: --dynatrain-auto-layout)
    rejected: Optional[str] = None  # the reason, when a request was refused
    stop: bool = False  # the job is over: standby ranks leave
    joins: tuple[JoinVerdict, ...] = ()  # join requests reviewed at this poll (elastic/join.py)
    schedule_next: Optional[int] = None  # rank 0's first schedule entry not yet run
    at: Optional[int] = None  # a scheduled switch: the iteration after which it must land
    note: str = ""  # why this target, when the job chose it (the advisor's ranking)
    schedule_lead: Optional[int] = None  # rank 0's lead (`schedule_lead`), for every rank


class Controller:
    """Polled once per step boundary by every rank (collective when it polls).

    `schedule`: (iteration, layout) entries, sorted (see `schedule.load_schedule`); an
    entry whose iteration passes while a switch is pending (the job does not poll then)
    runs at the next poll, after that switch. `check_options(layout)`: the job's keywords
    of the one validator (`vps.validate.layout_errors`: Transformer Engine, device memory,
    batch) for a layout.
    `extra_check`: any further check of the caller (LayoutError / DynatrainError).
    `complete(layout)`: the layout a request means for this job (Megatron-LM's pipeline
    split at it), validated and switched to in its place.
    """

    def __init__(self, spec: ModelSpec, signal_path: Optional[str], poll_interval: int = 1,
                 schedule: Optional[list[tuple[int, str]]] = None,
                 extra_check: Optional[Callable[[Layout], None]] = None,
                 check_options: Optional[Callable[[Layout], Mapping[str, Any]]] = None,
                 schedule_lead: int = 1,
                 complete: Optional[Callable[[Layout], Layout]] = None) -> None:
        self.spec = spec
        self.signal_path = signal_path
        self.poll_interval = max(1, poll_interval)
        self.schedule = sorted(schedule or [])
        # a scheduled switch is decided this many iterations before the one it must land
        # after, so that B is prepared in the background meanwhile; entries are taken in
        # order, each once (the same on every rank: every rank reads the same schedule)
        self.schedule_lead = max(0, schedule_lead)
        # rank 0: a fresh lead before each decision (loop/schedule_lead.py); it travels with
        # the decision, so every rank gates its polls on the same value
        self.lead_source: Optional[Callable[[], int]] = None
        self.extra_check = extra_check
        self.check_options = check_options
        # the job's completion of a requested layout (the pipeline split its builder would
        # make there, `MegatronBuilder.complete_layout`), before it is validated
        self.complete = complete
        # False where the training loop cannot put ranks on standby (Megatron-LM's own loop):
        # a request for another device count is then refused up front
        self.allow_device_count_change = True
        # rank 0 only, when the job has a rendezvous store and a secret: reviews join
        # requests at each poll; every rank keeps the verdicts it was sent
        self.joins: Optional[JoinReviewer] = None
        self._claimed: Optional[Path] = None  # rank 0: the accepted request's file
        # rank 0: the id of the last request read from the signal file (None: it had none)
        self.last_request: Optional[str] = None
        self._next_entry = 0  # every rank: the first schedule entry not yet run
        self._unmovable: set[tuple[int, int, int]] = set()  # rank 0: refused, left in place
        self.join_verdicts: list[JoinVerdict] = []
        # the layout advisor (loop/auto_layout.py), set by the integration:
        # (device count, reason) -> (layout string, note). It answers requests that name
        # only a world size, and with `auto_layout` the job's own device-count changes.
        self.advise: Optional[Callable[[int, str], tuple[str, str]]] = None
        self.auto_layout = False
        self._auto_processes: Optional[int] = None  # the process count auto-layout acted on

    def validate(self, text: str, world: int) -> Layout:
        """The layout `text` on `world` ranks, checked by the one validator (and the
        caller's `extra_check`); LayoutError / DynatrainError with every reason."""
        layout = Layout.parse(text, world)
        if self.complete is not None:
            layout = self.complete(layout)
        validate_layout(self.spec, layout,
                        **(self.check_options(layout) if self.check_options else {}))
        if self.extra_check is not None:
            self.extra_check(layout)
        return layout

    def check_schedule(self, world: int) -> None:
        """Start-up check of every schedule entry for the world it will run on (the
        job's; a signal request that changes the world is checked again at its poll)."""
        errs = []
        for it, lay in self.schedule:
            try:
                self.validate(lay, world)
            except DynatrainError as e:
                errs.append(f"iteration {it}: {e}")
        if errs:
            raise DynatrainError(f"schedule refused on {world} ranks: " + "; ".join(errs))

    def _schedule_due(self, iteration: int) -> bool:
        """The next entry is decided `schedule_lead` iterations before the one it must land
        after, so that B is prepared in the background meanwhile."""
        return (self._next_entry < len(self.schedule)
                and self.schedule[self._next_entry][0] - self.schedule_lead <= iteration)

    def _decide_on_rank0(self, iteration: int, world: int) -> Decision:
        """Rank 0's decision; never raises: anything that goes wrong with a request
        (reading, parsing, validating, claiming, filing) rejects it with its reason."""
        if self._schedule_due(iteration):
            return self._scheduled(iteration, world)
        auto = self._auto_decision(world)
        if auto is not None:
            return auto
        if not self.signal_path:
            return Decision(None, None, "signal")
        try:
            return self._from_signal(world)
        except Exception as e:  # noqa: BLE001 - hostile input must never reach training
            reason = f"{type(e).__name__}: {sf.excerpt(str(e), 400)}"
            log.error("switch request refused: %s; training continues", reason)
            return Decision(None, None, "signal", rejected=reason)

    def _scheduled(self, iteration: int, world: int) -> Decision:
        pos = self._next_entry
        it, lay = self.schedule[pos]
        if it < iteration:  # its iteration passed while another switch was pending
            log.warning("scheduled switch of iteration %d to %s runs at iteration %d, after "
                        "the switch that was pending at its iteration", it, lay, iteration)
        try:
            return Decision(str(self.validate(lay, world)), world, "schedule",
                            schedule_next=pos + 1, at=it)
        except Exception as e:  # noqa: BLE001 - e.g. the world changed since start-up
            log.error("scheduled switch at iteration %d to %r rejected: %s", it, lay, e)
            return Decision(None, None, "schedule", rejected=str(e), schedule_next=pos + 1,
                            at=it)

    def _from_signal(self, world: int) -> Decision:
        path = Path(self.signal_path)
        try:
            claimed = sf.claim(path)  # a request written from now on is the next one
        except sf.RequestError as e:
            return self._refuse_in_place(path, e)
        if claimed is None:
            return Decision(None, None, "signal")
        self.last_request = None
        try:
            self.last_request = sf.request_id_in(claimed.read_bytes()[:sf.MAX_REQUEST_BYTES]) \
                if claimed.is_file() and not claimed.is_symlink() else None
        except OSError:
            pass
        try:
            req = sf.read_request(claimed)
            if req is None:  # gone between the rename and the read
                return Decision(None, None, "signal")
            layout, target_world, note = self._check_request(req, world)
        except Exception as e:  # noqa: BLE001 - see _decide_on_rank0
            reason = sf.excerpt(str(e), 2000) if not isinstance(e, DynatrainError) else str(e)
            sf.archive(path, "rejected", reason, request_file=claimed)
            log.error("switch request rejected: %s; training continues", reason)
            return Decision(None, None, "signal", rejected=reason)
        log.info("switch request to %s from %s accepted", layout, req.origin or "?")
        self._claimed = claimed  # filed with its outcome by `done`
        return Decision(str(layout), target_world, "signal", note=note)

    # ------------------------------------------------------------------ the job's own choice
    def _layout_of(self, text: Optional[str], world: int) -> tuple[str, str]:
        """The layout a request asks for: its own, or (none named) the advisor's best for
        `world`, with the note saying why."""
        if text is not None:
            return text, ""
        if self.advise is None:
            raise DynatrainError(f"request names no layout, and this job has no layout "
                                 f"advisor to choose one for {world} ranks")
        return self.advise(world, f"request for {world} ranks without a layout")

    def _auto_decision(self, world: int) -> Optional[Decision]:
        """With `auto_layout`: when the number of processes differs from the last one acted
        on and from the layout's (standby ranks at start, an admitted joiner), the
        advisor's best layout on all of them (rank 0; None: nothing to do). A count the
        advisor cannot serve is logged once and left alone."""
        n = dist.get_world_size()
        if not self.auto_layout or self.advise is None or n == self._auto_processes \
                or not self.allow_device_count_change:
            return None
        self._auto_processes = n
        if n == world:
            return None
        reason = f"auto-layout: {n} processes, the layout uses {world}"
        try:
            text, note = self.advise(n, reason)
            layout = self.validate(text, n)
        except Exception as e:  # noqa: BLE001 - the job's own choice must never end it
            log.error("%s; no layout chosen: %s", reason, e)
            return None
        return Decision(str(layout), n, "auto", note=note)

    def _check_request(self, req: sf.SwitchRequest, world: int) -> tuple[Layout, int, str]:
        target_world = req.world or world
        processes = dist.get_world_size()
        if target_world != world and not self.allow_device_count_change:
            raise DynatrainError(f"request for {target_world} ranks: this job's loop cannot "
                                 f"change its device count (it has {world})")
        if target_world > processes:
            raise DynatrainError(f"request for {target_world} ranks, the job has {processes} "
                                 f"processes ({world} training, {processes - world} on "
                                 f"standby); more need a relaunch with more processes")
        text, note = self._layout_of(req.layout, target_world)
        return self.validate(text, target_world), target_world, note

    def _refuse_in_place(self, path: Path, e: Exception) -> Decision:
        """A request that cannot be moved out of the signal path (another user's file in
        a sticky directory): refused and filed once, then ignored until it changes."""
        try:
            st = os.lstat(path)
            key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        except OSError:
            return Decision(None, None, "signal")
        if key in self._unmovable:
            return Decision(None, None, "signal")
        self._unmovable.add(key)
        sf.archive(path, "rejected", str(e), request_file=path)
        log.error("switch request refused: %s; training continues", e)
        return Decision(None, None, "signal", rejected=str(e))

    def poll(self, iteration: int, world: Optional[int] = None, layout_group: Any = None,
             standby: Any = None) -> Decision:
        """Collective over every process (training and standby ranks) at the same step
        boundary. `world`: ranks of the current layout (default: every process); a request
        may name any count up to the number of processes (scale-in / scale-out).
        `standby`: where ranks are on standby, their channel (`standby_channel.py`): the
        decision goes to the layout's ranks on `layout_group` (with the job's deadline),
        then on to the standby ranks on the channel (none: one broadcast over the world)."""
        if iteration % self.poll_interval and not self._schedule_due(iteration):
            return Decision(None, None, "signal")
        world = world or dist.get_world_size()
        box = [None]
        if dist.get_rank() == 0:
            if self.lead_source is not None:
                self.schedule_lead = max(0, int(self.lead_source()))
            d = self._decide_on_rank0(iteration, world)
            box = [replace(d, schedule_next=d.schedule_next or self._next_entry,
                           schedule_lead=self.schedule_lead)]
        if self.joins is not None:  # rides on the same broadcast: no extra collective
            box[0] = replace(box[0], joins=self.joins.review())
        if standby is None:
            dist.broadcast_object_list(box, src=0)
        else:
            dist.broadcast_object_list(box, src=0, group=layout_group)
            dist.broadcast_object_list(box, src=0, group=standby)
        return self._received(box[0])

    def follow(self, standby: Any = None) -> Decision:
        """A standby rank's side of `poll`/`stop`: wait for rank 0's next decision (it does
        not step, so it cannot know which iterations poll; it simply takes the next one),
        on the standby channel when there is one: as long as the job lives."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=standby)
        return self._received(box[0])

    def _received(self, d: Decision) -> Decision:
        """Every rank (standby ones and joiners too) takes rank 0's schedule position, so
        all agree which iterations poll, whenever they came in."""
        self.join_verdicts.extend(d.joins)
        if d.schedule_next is not None:
            self._next_entry = d.schedule_next
        if d.schedule_lead is not None:
            self.schedule_lead = d.schedule_lead
        return d

    def stop(self, standby: Any = None) -> None:
        """Collective: the job is over; standby ranks waiting in `follow` (on the channel
        `standby`, when there is one) leave."""
        box = [Decision(None, None, "signal", stop=True, schedule_next=self._next_entry)]
        dist.broadcast_object_list(box, src=0, group=standby)

    def done(self, decision: Decision, outcome: str, reason: str = "") -> None:
        """File the accepted request with its outcome (rank 0; the request was taken out
        of the signal path when it was accepted, so a newer one there is left alone)."""
        if decision.source == "signal" and dist.get_rank() == 0 and self.signal_path \
                and self._claimed is not None:
            claimed, self._claimed = self._claimed, None
            try:
                sf.archive(self.signal_path, outcome, reason, request_file=claimed)
            except Exception as e:  # noqa: BLE001 - filing must never end training
                log.error("could not file the request %s as %s (%s): %s", claimed, outcome,
                          reason, e)
