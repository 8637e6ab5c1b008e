"""Fault injection for switch tests: make a chosen rank fail at a chosen phase of a switch,
corrupt one piece it receives, or arrive late at a transfer round.

A `FaultPlan` is plain data handed to `switch_layout` (tests, or `DYNATRAIN_FAULTS` as JSON
for a whole job); with none, every hook below is a no-op. Phases: "prepare" (after B is
built, before the plan is agreed), "round" (inside transfer round `round`, after its
exchange), "commit" (after the transfer, before the commit vote), and "step" (in training,
after optimizer step `iteration`, outside any switch), and the points inside the training
step after iteration `iteration` of a Megatron-LM job (`STEP_PHASES`: its forward, backward,
first pipeline send, data-parallel gradient reduction, optimizer step before and after the
survivors' vote; placed by `megatron_lm/step_guard.py`), and after it, in iteration
`iteration`'s log line, evaluation and `--save` ("log", "eval", "save";
`megatron_lm/post_step.py`), and "startup": in Megatron-LM's start-up, as `pretrain()`
registers the job before building its data iterators (`megatron_lm/seam.py`). And
"worker_start": the first DataLoader worker forked while B's data iterators are built in
the background on `fail_rank` never starts, as a fork beside running threads can leave
one (`megatron_lm/worker_start.py`, which finds it and builds again). With `kill`, the
failing rank's process exits on the spot instead of raising, as a crash would (its
sockets close). With `dst_layout`, "prepare" and "commit" failures hit only a switch to
that layout (say, a B that cannot be built on one rank), so a later switch of the same job
goes through.
`delay_seconds` delays `delay_rank` before transfer round `round` (`delay_phase` "round"), or
at the end of its background preparation of B (`delay_phase` "prepare", only for a switch
to `dst_layout` when that is set): a B that is not ready when the job ends. A preparation
delay ends early once the job gives the preparation up (`end_preparation_delays`): the job
still waits for the background work as it would for a slow one, not for the whole delay.

`generation` numbers the world a plan's ranks refer to: 0 the launch world, g the world
re-formed by the g-th recovery after a rank death (the survivors renumbered). A job may
carry several plans (`DYNATRAIN_FAULTS` as a JSON list, `plans_from_env`): one per
generation (a second death after the first recovery, at another point, in the new
numbering), or, for deaths inside a Megatron-LM step (`STEP_PHASES`), several in one
generation naming different ranks: ranks that die in the same step, each at its own point,
and are recovered from together.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..vps.errors import DynatrainError

log = logging.getLogger("dynatrain")

STEP_PHASES = ("forward", "backward", "pp_send", "grad_sync", "optimizer", "optimizer_update",
               "log", "eval", "save")
PHASES = ("prepare", "round", "commit", "step", "startup", "worker_start") + STEP_PHASES


class InjectedFault(DynatrainError):
    """Raised by a `FaultPlan` on the rank and phase it names."""


_OPTIONAL = ("fail_rank", "fail_phase", "corrupt_rank", "delay_rank", "dst_layout")
DELAY_PHASES = ("round", "prepare")
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "fail_rank": (int,), "fail_phase": (str,), "corrupt_rank": (int,), "delay_rank": (int,),
    "delay_seconds": (int, float), "round": (int,), "kill": (bool,), "exit_code": (int,),
    "iteration": (int,), "dst_layout": (str,), "delay_phase": (str,), "generation": (int,)}


# set while this process gives a preparation up: its injected delay (if any) ends
_GIVEN_UP = threading.Event()


def start_preparation_delays() -> None:
    """A new preparation begins: its injected delay runs in full unless given up."""
    _GIVEN_UP.clear()


def end_preparation_delays() -> None:
    """The job gives the pending preparation up (it ends, or the world changed): an
    injected preparation delay returns now."""
    _GIVEN_UP.set()


class FaultSpecError(DynatrainError, ValueError):
    """`DYNATRAIN_FAULTS` that does not describe a fault plan."""


@dataclass(frozen=True, slots=True)
class FaultPlan:
    fail_rank: Optional[int] = None
    fail_phase: Optional[str] = None
    corrupt_rank: Optional[int] = None  # flips one byte of the first message it receives
    delay_rank: Optional[int] = None
    delay_seconds: float = 0.0
    round: int = 0  # the round that "round" failures, corruption and delays apply to
    kill: bool = False  # the failing rank dies (os._exit) instead of raising
    exit_code: int = 1  # its exit status (test harnesses read 0 as "left without a result")
    iteration: int = 0  # the training iteration "step" failures apply to
    dst_layout: Optional[str] = None  # "prepare"/"commit" failures: only a switch to this
    delay_phase: str = "round"  # where delays apply: before a round, or ending B's preparation
    generation: int = 0  # the world its ranks are numbered in (module doc)

    def __post_init__(self) -> None:
        if self.fail_phase is not None and self.fail_phase not in PHASES:
            raise ValueError(f"fail_phase {self.fail_phase!r}: one of {PHASES}")
        if (self.fail_rank is None) != (self.fail_phase is None):
            raise ValueError("fail_rank and fail_phase go together")
        if self.delay_seconds < 0 or self.round < 0 or self.generation < 0:
            raise ValueError("delay_seconds, round and generation must be >= 0")
        if self.delay_phase not in DELAY_PHASES:
            raise ValueError(f"delay_phase {self.delay_phase!r}: one of {DELAY_PHASES}")

    @classmethod
    def from_env(cls) -> Optional["FaultPlan"]:
        """The plan of the launch world (generation 0) in `DYNATRAIN_FAULTS` (None when
        unset or when it holds none); FaultSpecError naming every defect otherwise (see
        `plans_from_env`)."""
        return plan_for(cls.plans_from_env(), 0)

    @classmethod
    def plans_from_env(cls) -> tuple["FaultPlan", ...]:
        """Every plan in `DYNATRAIN_FAULTS` (empty when unset): a JSON object, or a list of
        them, one per generation or several step deaths of different ranks in one
        (module doc). FaultSpecError naming every defect otherwise (unknown keys, a value
        of the wrong type: `"kill": "false"` is not a bool, two plans for one generation
        that are not step deaths of different ranks), so a mistyped plan fails at start-up
        instead of never firing."""
        text = os.environ.get("DYNATRAIN_FAULTS")
        return cls.plans_from_json(text) if text else ()

    @classmethod
    def plans_from_json(cls, text: str) -> tuple["FaultPlan", ...]:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise FaultSpecError(f"DYNATRAIN_FAULTS is not valid JSON ({e}): {text[:120]!r}") \
                from None
        if not isinstance(data, list):
            return (cls._from_data(data),)
        if not data:
            raise FaultSpecError("DYNATRAIN_FAULTS: an empty list (unset it for no faults)")
        errs, plans = [], []
        for i, item in enumerate(data):
            try:
                plans.append(cls._from_data(item, f"DYNATRAIN_FAULTS[{i}]"))
            except FaultSpecError as e:
                errs.append(str(e))
        errs += _generation_errors(plans)
        if errs:
            raise FaultSpecError("; ".join(errs))
        return tuple(plans)

    @classmethod
    def from_json(cls, text: str) -> "FaultPlan":
        """One plan from a JSON object (FaultSpecError otherwise)."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise FaultSpecError(f"DYNATRAIN_FAULTS is not valid JSON ({e}): {text[:120]!r}") \
                from None
        return cls._from_data(data)

    @classmethod
    def _from_data(cls, data: object, name: str = "DYNATRAIN_FAULTS") -> "FaultPlan":
        if not isinstance(data, dict):
            raise FaultSpecError(f"{name} must be a JSON object, got {type(data).__name__}")
        errs = []
        for k, v in data.items():
            want = _FIELD_TYPES.get(k)
            if want is None:
                errs.append(f"unknown key {k!r} (known: {sorted(_FIELD_TYPES)})")
            elif not (type(v) in want or (v is None and k in _OPTIONAL)):
                errs.append(f"{k} must be {' or '.join(t.__name__ for t in want)}, got {v!r}")
        if errs:
            raise FaultSpecError(f"{name}: " + "; ".join(errs))
        try:
            return cls(**data)
        except ValueError as e:
            raise FaultSpecError(f"{name}: {e}") from None

    def fail(self, rank: int, phase: str, round_index: int = 0, dst: Optional[str] = None) -> None:
        at = self.round if phase == "round" else (
            self.iteration if phase == "step" or phase in STEP_PHASES else round_index)
        if self.dst_layout is not None and dst is not None and dst != self.dst_layout:
            return
        if self.fail_rank == rank and self.fail_phase == phase and round_index == at:
            log.warning("fault injection: rank %d %s in phase %s", rank,
                        "dies" if self.kill else "fails", phase)
            if self.kill:
                os._exit(self.exit_code)
            raise InjectedFault(f"injected failure of rank {rank} in phase {phase}")

    def delay(self, rank: int, round_index: int) -> None:
        if self.delay_phase == "round" and self.delay_rank == rank \
                and round_index == self.round and self.delay_seconds:
            log.warning("fault injection: rank %d sleeps %.1f s before round %d", rank,
                        self.delay_seconds, round_index)
            time.sleep(self.delay_seconds)

    def delay_preparation(self, rank: int, dst: str) -> None:
        """At the end of B's background preparation (`delay_phase` "prepare"); ends early
        when the job gives the preparation up (`end_preparation_delays`)."""
        if self.delay_phase == "prepare" and self.delay_rank == rank and self.delay_seconds \
                and self.dst_layout in (None, dst):
            log.warning("fault injection: rank %d's preparation of %s takes %.1f s more", rank,
                        dst, self.delay_seconds)
            _GIVEN_UP.wait(self.delay_seconds)

    def corrupt(self, rank: int, round_index: int, received: Sequence[torch.Tensor]) -> None:
        if self.corrupt_rank == rank and round_index == self.round and received:
            b = received[0].view(-1).view(torch.uint8)
            b[0] ^= 0xFF
            log.warning("fault injection: rank %d corrupted a received piece", rank)


def _generation_errors(plans: Sequence[FaultPlan]) -> list[str]:
    """Generations with more than one plan, unless those are all deaths inside a step
    (`STEP_PHASES`) of different ranks."""
    errs = []
    for g in sorted({p.generation for p in plans}):
        same = [p for p in plans if p.generation == g]
        if len(same) < 2:
            continue
        ranks = [p.fail_rank for p in same]
        if any(p.fail_phase not in STEP_PHASES for p in same) or len(set(ranks)) < len(ranks):
            errs.append(f"DYNATRAIN_FAULTS: more than one plan for generation {g} (several "
                        f"only as deaths inside a step of different ranks; got "
                        f"{[(p.fail_rank, p.fail_phase) for p in same]})")
    return errs


def plan_for(plans: Sequence[FaultPlan], generation: int) -> Optional[FaultPlan]:
    """The (first) plan of world `generation` among `plans` (None if there is none)."""
    return next((p for p in plans if p.generation == generation), None)


def plans_for(plans: Sequence[FaultPlan], generation: int) -> tuple[FaultPlan, ...]:
    """Every plan of world `generation` among `plans` (several step deaths, module doc)."""
    return tuple(p for p in plans if p.generation == generation)
