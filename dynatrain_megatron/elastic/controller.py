"""Controller: turns signal files and schedules into one agreed switch decision.

Rank 0 reads the signal file (and the scripted schedule), validates the request against
the model and the world, and all ranks agree with one small broadcast at a step boundary.
A bad request is rejected with its reason (logged, and the file is moved aside as
`rejected`); training continues untouched.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist
import yaml

from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.model_spec import ModelSpec
from . import signal_file as sf
from .join import JoinReviewer, JoinVerdict

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Decision:
    """What all ranks agreed on at a step boundary."""

    target: Optional[str]  # layout string, None: nothing to do
    world: Optional[int]
    source: str  # "signal", "schedule", "auto" (the job chose: --dynatrain-auto-layout)
    rejected: Optional[str] = None  # the reason, when a request was refused
    stop: bool = False  # the job is over: standby ranks leave
    joins: tuple[JoinVerdict, ...] = ()  # join requests reviewed at this poll (elastic/join.py)
    note: str = ""  # why this target, when the job chose it (the advisor's ranking)


def load_schedule(path: str) -> list[tuple[int, str]]:
    """YAML: a list of {iteration: N, layout: "tp2pp2"} (switches for scripted runs)."""
    data = yaml.safe_load(Path(path).read_text())
    items = data.get("switches", data) if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise DynatrainError(f"schedule {path}: expected a list of {{iteration, layout}}")
    out = []
    for i, it in enumerate(items):
        if not isinstance(it, dict) or "iteration" not in it or "layout" not in it:
            raise DynatrainError(f"schedule {path} entry {i}: needs 'iteration' and 'layout'")
        out.append((int(it["iteration"]), str(it["layout"])))
    return sorted(out)


class Controller:
    """Polled once per step boundary by every rank (collective when it polls)."""

    def __init__(self, spec: ModelSpec, signal_path: Optional[str], poll_interval: int = 1,
                 schedule: Optional[list[tuple[int, str]]] = None,
                 extra_check: Optional[Callable[[Layout], None]] = None) -> None:
        self.spec = spec
        self.signal_path = signal_path
        self.poll_interval = max(1, poll_interval)
        self.schedule = list(schedule or [])
        self.extra_check = extra_check
        # False where the training loop cannot put ranks on standby (Megatron-LM's own loop):
        # a request for another device count is then refused up front
        self.allow_device_count_change = True
        # rank 0 only, when the job has a rendezvous store and a secret: reviews join
        # requests at each poll; every rank keeps the verdicts it was sent
        self.joins: Optional[JoinReviewer] = None
        self._claimed: Optional[Path] = None  # rank 0: the accepted request's file
        self.join_verdicts: list[JoinVerdict] = []
        # the layout advisor (integration/auto_layout.py), set by the integration:
        # (device count, reason) -> (layout string, note). It answers requests that name
        # only a world size, and with `auto_layout` the job's own device-count changes.
        self.advise: Optional[Callable[[int, str], tuple[str, str]]] = None
        self.auto_layout = False
        self._auto_processes: Optional[int] = None  # the process count auto-layout acted on

    def validate(self, text: str, world: int) -> Layout:
        layout = Layout.parse(text, world)
        layout.check_model(self.spec)
        if self.extra_check is not None:
            self.extra_check(layout)
        return layout

    def _decide_on_rank0(self, iteration: int, world: int) -> Decision:
        for it, lay in self.schedule:
            if it == iteration:
                try:
                    return Decision(str(self.validate(lay, world)), world, "schedule")
                except DynatrainError as e:
                    log.error("scheduled switch at iteration %d to %r rejected: %s", it, lay, e)
                    return Decision(None, None, "schedule", rejected=str(e))
        auto = self._auto_decision(world)
        if auto is not None:
            return auto
        if not self.signal_path:
            return Decision(None, None, "signal")
        claimed = sf.claim(self.signal_path)  # a request written from now on is the next one
        if claimed is None:
            return Decision(None, None, "signal")
        try:
            req = sf.read_request(claimed)
        except (DynatrainError, OSError, TypeError) as e:
            sf.archive(self.signal_path, "rejected", str(e), request_file=claimed)
            log.error("switch request rejected: %s; training continues", e)
            return Decision(None, None, "signal", rejected=str(e))
        if req is None:  # gone between the rename and the read
            return Decision(None, None, "signal")
        target_world = req.world or world
        processes = dist.get_world_size()
        try:
            if target_world != world and not self.allow_device_count_change:
                raise DynatrainError(f"request for {target_world} ranks: this job's loop cannot "
                                     f"change its device count (it has {world})")
            if target_world > processes:
                raise DynatrainError(f"request for {target_world} ranks, the job has {processes} "
                                     f"processes ({world} training, {processes - world} on "
                                     f"standby); more need a relaunch with more processes")
            text, note = self._layout_of(req.layout, target_world)
            layout = self.validate(text, target_world)
        except DynatrainError as e:
            sf.archive(self.signal_path, "rejected", str(e), request_file=claimed)
            log.error("switch request %r from %s rejected: %s; training continues",
                      req.layout, req.origin or "?", e)
            return Decision(None, None, "signal", rejected=str(e))
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
        except DynatrainError as e:
            log.error("%s; no layout chosen: %s", reason, e)
            return None
        return Decision(str(layout), n, "auto", note=note)

    def poll(self, iteration: int, world: Optional[int] = None) -> Decision:
        """Collective over every process (training and standby ranks) at the same step
        boundary. `world`: ranks of the current layout (default: every process); a request
        may name any count up to the number of processes (scale-in / scale-out)."""
        if iteration % self.poll_interval and not any(it == iteration for it, _ in self.schedule):
            return Decision(None, None, "signal")
        world = world or dist.get_world_size()
        box = [self._decide_on_rank0(iteration, world) if dist.get_rank() == 0 else None]
        if self.joins is not None:  # rides on the same broadcast: no extra collective
            box[0] = replace(box[0], joins=self.joins.review())
        dist.broadcast_object_list(box, src=0)
        self.join_verdicts.extend(box[0].joins)
        return box[0]

    def follow(self) -> Decision:
        """A standby rank's side of `poll`/`stop`: wait for rank 0's next decision (it does
        not step, so it cannot know which iterations poll; it simply takes the next one)."""
        box = [None]
        dist.broadcast_object_list(box, src=0)
        self.join_verdicts.extend(box[0].joins)
        return box[0]

    def stop(self) -> None:
        """Collective: the job is over; standby ranks waiting in `follow` leave."""
        box = [Decision(None, None, "signal", stop=True)]
        dist.broadcast_object_list(box, src=0)

    def done(self, decision: Decision, outcome: str, reason: str = "") -> None:
        """File the accepted request with its outcome (rank 0; the request was taken out
        of the signal path when it was accepted, so a newer one there is left alone)."""
        if decision.source == "signal" and dist.get_rank() == 0 and self.signal_path \
                and self._claimed is not None:
            sf.archive(self.signal_path, outcome, reason, request_file=self._claimed)
            self._claimed = None
