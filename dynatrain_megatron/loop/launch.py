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

The job succeeded when every worker exited 0, or, where some failed, when it *completed*:
a worker said it finished training (`report_completed`, called at the end of the training
loop on every rank that holds training state; through a pipe whose descriptor is in
`DYNATRAIN_LAUNCH_REPORT_FD`), every worker that said so exited 0, and so did every worker
that ended after the last failure; or, where a worker that had said so failed afterwards
(a death in the final save after training), when workers that ended after that failure
exited 0 and one of them said so again after it (the survivors recovered and finished the
job's remaining work: `megatron_lm/after_train.py`). Workers that died earlier were replaced by the recovery;
a survivor the new layout did not need leaves with status 0, and that alone is no success:
a job whose survivors all crashed or left before the end fails with the first failure's
status.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import (Callable, Collection, Iterator, Mapping, Optional, Protocol, Sequence,
                    Union)

from .. import process_env

log = logging.getLogger("dynatrain")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it). Free *now* only: another
    process may take it before the caller binds it; `reserved_port` holds it meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A TCP port on 127.0.0.1 for the job's store (`MASTER_PORT`), held for the caller
    until the context ends: a socket of this process stays bound to it (SO_REUSEADDR,
    never listening), so no other bind and no outgoing connection's local port takes it in
    the seconds before rank 0 binds it (rank 0 starts, imports torch, then binds). Rank 0's
    TCPStore binds it beside this socket (it sets SO_REUSEADDR too, and the first socket
    that listens has the port). Without the hold a busy machine can hand the port to
    another job, whose ranks then meet ours in one store."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
    finally:
        s.close()


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


REPORT_FD = "DYNATRAIN_LAUNCH_REPORT_FD"


def report_completed() -> None:
    """Tell `dynatrain launch` (when it started this process) that this worker finished
    training. Never raises: the launcher may be gone, or the process not launched by it."""
    fd, rank = os.environ.get(REPORT_FD), os.environ.get("RANK", "")
    if not fd or not fd.isdigit() or not rank.isdigit():
        return
    try:
        os.write(int(fd), f"completed {rank}\n".encode())  # < PIPE_BUF: written whole
    except OSError as e:
        log.warning("could not tell the launcher that training completed: %s", e)


def _read_reports(fd: int, completed: dict[int, float], pending: bytearray,
                  now: float) -> None:
    """Note the ranks that reported completion, at `now` (seconds after the launch; the
    last report of each rank counts; non-blocking read of the report pipe)."""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return
        if not chunk:
            return
        pending += chunk
        *lines, rest = bytes(pending).split(b"\n")
        pending[:] = rest
        for line in lines:
            word, _, rank = line.decode(errors="replace").partition(" ")
            if word == "completed" and rank.isdigit():
                completed[int(rank)] = now


class Worker(Protocol):
    """A started worker as `supervise` watches it (`subprocess.Popen` is one)."""

    def poll(self) -> Optional[int]: ...

    def send_signal(self, signum: int) -> None: ...


# start(rank, env, report_fd) -> the worker of `rank`, running with `env` and the report
# pipe's write end `report_fd` open in it
Starter = Callable[[int, dict, int], Worker]


def launch(nproc: int, command: Sequence[str], env: Optional[dict] = None,
           poll_seconds: float = 0.2) -> tuple[int, list[WorkerExit]]:
    """Run `command` (argv) as `nproc` workers; wait for all. Returns (exit status, exits
    in the order the workers ended)."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if not command:
        raise ValueError("no command to launch")

    def start(_rank: int, worker: dict, report_fd: int) -> Worker:
        return subprocess.Popen(list(command), env=worker, pass_fds=(report_fd,))

    return supervise(nproc, start, env, poll_seconds)


def supervise(nproc: int, start: Starter, env: Optional[dict] = None,
              poll_seconds: float = 0.2) -> tuple[int, list[WorkerExit]]:
    """Start `nproc` workers with `start` in torchrun's environment and watch them until all
    ended (a failure ends none of the others); (exit status, exits in the order the workers
    ended). `launch` starts processes; the tests' forked launcher forks them."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    with reserved_port() as port:  # held until every worker ended
        exits, completed = _run_workers(nproc, start, env, poll_seconds, port)
    status = job_status(exits, completed)
    if status and exits and not completed and any(e.code == 0 for e in exits):
        log.error("no worker finished training: the job did not complete (workers that "
                  "exited 0 had left it)")
    return status, exits


def _run_workers(nproc: int, start: Starter, env: Optional[dict],
                 poll_seconds: float, port: int
                 ) -> tuple[list[WorkerExit], dict[int, float]]:
    """Start the workers with the store at `port`, wait for all; (exits in the order the
    workers ended, the ranks that reported completion)."""
    base = dict(os.environ if env is None else env)
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    base[REPORT_FD] = str(write_fd)
    t0 = time.monotonic()
    try:
        procs = {r: start(r, worker_env(base, r, nproc, port), write_fd) for r in range(nproc)}
    finally:
        os.close(write_fd)
    exits: list[WorkerExit] = []
    completed: dict[int, float] = {}
    pending = bytearray()

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
                # before its exit is counted
                _read_reports(read_fd, completed, pending, time.monotonic() - t0)
                del running[r]
                exits.append(WorkerExit(r, code, time.monotonic() - t0))
                if code != 0 and running:
                    log.warning("worker %d exited with %d after %.1f s; %d workers keep "
                                "running (they recover through the rendezvous directory)",
                                r, code, exits[-1].seconds, len(running))
            _read_reports(read_fd, completed, pending, time.monotonic() - t0)
            time.sleep(poll_seconds)
        _read_reports(read_fd, completed, pending, time.monotonic() - t0)
    finally:
        os.close(read_fd)
        for s, h in old.items():
            signal.signal(s, h)
    return exits, completed


def job_status(exits: Sequence[WorkerExit],
               completed: Union[Mapping[int, float], Collection[int]] = ()) -> int:
    """0 when every worker exited 0; or, after failures, when the job completed: some
    worker reported the end of training (`completed`: their ranks, with when each last
    reported, in seconds after the launch), each of those exited 0, and so did every worker
    that ended after the last failure; or every worker that ended after the last failure
    exited 0 and one of them reported after it (a completed worker failed, the survivors
    finished the job). Else the first failure's code (1 for a signal). Module doc."""
    reported = (dict(completed) if isinstance(completed, Mapping)
                else {r: 0.0 for r in completed})
    failures = [e for e in exits if e.code != 0]
    if not failures:
        return 0
    code = failures[0].code if failures[0].code > 0 else 1
    last_failure = max(e.seconds for e in failures)
    after = [e for e in exits if e.seconds > last_failure]
    if not after or any(e.code != 0 for e in after):
        return code
    finished = [e for e in exits if e.rank in reported]
    if finished and all(e.code == 0 for e in finished):
        return 0
    if any(reported.get(e.rank, -1.0) > last_failure for e in after):
        return 0
    return code
