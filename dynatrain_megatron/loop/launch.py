"""`dynatrain launch`: start the workers of a training job on this machine so that the
survivors keep running when one of them dies.

torchrun's agent stops every worker as soon as one fails (and, with restarts, starts them
all again from the last checkpoint), so the in-memory recovery after a rank death
(`loop/death_recovery.py`) can never run under it. This launcher sets the same
environment torchrun gives a worker (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and only *watches*: a worker that dies is reported, the others
go on, re-form the world through `--dynatrain-rendezvous-dir` and recover. On a cluster
the same is had from a scheduler that does not kill a job step on one bad exit (Slurm:
`srun --kill-on-bad-exit=0`).

The job succeeded when its last workers to end exited 0 and at least one did: workers that
died earlier were replaced by the recovery (or left because the new layout did not need
them, which is a clean exit).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from .. import process_env

log = logging.getLogger("dynatrain")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True, slots=True)
class WorkerExit:
    rank: int
    code: int
    seconds: float  # after the launch


def worker_env(base: dict, rank: int, nproc: int, port: int) -> dict:
    """The environment torchrun gives worker `rank` of a single-node job."""
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    return process_env.apply(env)


def launch(nproc: int, command: Sequence[str], env: Optional[dict] = None,
           poll_seconds: float = 0.2) -> tuple[int, list[WorkerExit]]:
    """Run `command` (argv) as `nproc` workers; wait for all. Returns (exit status, exits
    in the order the workers ended)."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if not command:
        raise ValueError("no command to launch")
    port = free_port()
    base = dict(os.environ if env is None else env)
    t0 = time.monotonic()
    procs = {r: subprocess.Popen(list(command), env=worker_env(base, r, nproc, port))
             for r in range(nproc)}
    exits: list[WorkerExit] = []

    def forward(signum, _frame):  # Ctrl-C / SIGTERM: pass it on, then wait as usual
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        running = dict(procs)
        while running:
            for r, p in list(running.items()):
                code = p.poll()
                if code is None:
                    continue
                del running[r]
                exits.append(WorkerExit(r, code, time.monotonic() - t0))
                if code != 0 and running:
                    log.warning("worker %d exited with %d after %.1f s; %d workers keep "
                                "running (they recover through the rendezvous directory)",
                                r, code, exits[-1].seconds, len(running))
            time.sleep(poll_seconds)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return job_status(exits), exits


def job_status(exits: Sequence[WorkerExit]) -> int:
    """0 when the workers that ended last (after every failure) all exited 0; else the
    first failure's code (module doc)."""
    failures = [e for e in exits if e.code != 0]
    if not failures:
        return 0
    last_failure = max(e.seconds for e in failures)
    after = [e for e in exits if e.seconds > last_failure]
    if after and all(e.code == 0 for e in after):
        return 0
    return failures[0].code if failures[0].code > 0 else 1
