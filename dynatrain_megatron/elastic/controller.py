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
    source: str  # "signal", "schedule"
    rejected: Optional[str] = None  # the reason, when a request was refused
    stop: bool = False  # the job is over: standby ranks leave
    joins: tuple[JoinVerdict, ...] = ()  # join requests reviewed at this poll (elastic/join.py)
    at: Optional[int] = None  # a scheduled switch: the iteration after which it must land


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
                 extra_check: Optional[Callable[[Layout], None]] = None,
                 schedule_lead: int = 1) -> None:
        self.spec = spec
        self.signal_path = signal_path
        self.poll_interval = max(1, poll_interval)
        self.schedule = sorted(schedule or [])
        # a scheduled switch is decided this many iterations before the one it must land
        # after, so that B is prepared in the background meanwhile; entries are taken in
        # order, each once (the same on every rank: every rank reads the same schedule)
        self.schedule_lead = max(0, schedule_lead)
        self._next_scheduled = 0
        self.extra_check = extra_check
        # False where the training loop cannot put ranks on standby (Megatron-LM's own loop):
        # a request for another device count is then refused up front
        self.allow_device_count_change = True
        # rank 0 only, when the job has a rendezvous store and a secret: reviews join
        # requests at each poll; every rank keeps the verdicts it was sent
        self.joins: Optional[JoinReviewer] = None
        self._claimed: Optional[Path] = None  # rank 0: the accepted request's file
        self.join_verdicts: list[JoinVerdict] = []

    def validate(self, text: str, world: int) -> Layout:
        layout = Layout.parse(text, world)
        layout.check_model(self.spec)
        if self.extra_check is not None:
            self.extra_check(layout)
        return layout

    def _due(self, iteration: int) -> Optional[tuple[int, str]]:
        """The next scheduled switch, once `iteration` is within the lead of it."""
        if self._next_scheduled < len(self.schedule):
            it, lay = self.schedule[self._next_scheduled]
            if iteration >= it - self.schedule_lead:
                return it, lay
        return None

    def _decide_on_rank0(self, iteration: int, world: int) -> Decision:
        due = self._due(iteration)
        if due is not None:
            it, lay = due
            try:
                return Decision(str(self.validate(lay, world)), world, "schedule", at=it)
            except DynatrainError as e:
                log.error("scheduled switch at iteration %d to %r rejected: %s", it, lay, e)
                return Decision(None, None, "schedule", rejected=str(e), at=it)
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
            layout = self.validate(req.layout, target_world)
        except DynatrainError as e:
            sf.archive(self.signal_path, "rejected", str(e), request_file=claimed)
            log.error("switch request %r from %s rejected: %s; training continues",
                      req.layout, req.origin or "?", e)
            return Decision(None, None, "signal", rejected=str(e))
        log.info("switch request to %s from %s accepted", layout, req.origin or "?")
        self._claimed = claimed  # filed with its outcome by `done`
        return Decision(str(layout), target_world, "signal")

    def poll(self, iteration: int, world: Optional[int] = None) -> Decision:
        """Collective over every process (training and standby ranks) at the same step
        boundary. `world`: ranks of the current layout (default: every process); a request
        may name any count up to the number of processes (scale-in / scale-out)."""
        due = self._due(iteration)
        if iteration % self.poll_interval and due is None:
            return Decision(None, None, "signal")
        world = world or dist.get_world_size()
        box = [self._decide_on_rank0(iteration, world) if dist.get_rank() == 0 else None]
        if self.joins is not None:  # rides on the same broadcast: no extra collective
            box[0] = replace(box[0], joins=self.joins.review())
        dist.broadcast_object_list(box, src=0)
        self.join_verdicts.extend(box[0].joins)
        if due is not None and box[0].source == "schedule":
            self._next_scheduled += 1
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
