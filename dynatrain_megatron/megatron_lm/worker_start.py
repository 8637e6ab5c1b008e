"""DataLoader workers that never start, and how a build of data iterators gets past them.

B's data iterators are built by the preparation thread while A trains (`data_ahead`), so
their DataLoader workers are forked beside running threads, and one can deadlock right
after its fork (`fork_watch` says why: CPython before gh-112275's fix, beside gloo's
threads). Such a worker is alive, so the DataLoader never reports it, and never reads its
index queue: the iterator would wait forever for its first batch, in B's first step (seen
once in ~25 runs of `scripts/bench_stall.py`; the hung child's stack ended in
`PyOS_AfterFork_Child`).

`started_build` runs a build under a `fork_watch.StartWatch`, compares the pids of the
workers it forked with those that reported their start, agrees with the other ranks of
the build, stops the workers of a build where one never started (the stuck ones killed)
and builds again, a bounded number of times.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Any, Callable, Iterable, Optional, TypeVar

from ..fork_watch import START_TIMEOUT_S, StartWatch

log = logging.getLogger("dynatrain")

T = TypeVar("T")

BUILD_ATTEMPTS = 3

# build outcomes, agreed as the largest over the build's ranks
OK, NOT_STARTED, FAILED = 0, 1, 2


def worker_iterators(obj: Any, out: list, depth: int = 0) -> list:
    """The multi-process DataLoader iterators inside what Megatron-LM's builder returned:
    lists (one per virtual stage), its RerunDataIterator wrapper, a DataLoader's
    persistent iterator, and the `cyclic` generator's DataLoader."""
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    if obj is None or depth > 4:
        return out
    if isinstance(obj, _MultiProcessingDataLoaderIter):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            worker_iterators(o, out, depth + 1)
    elif isinstance(obj, DataLoader):
        worker_iterators(getattr(obj, "_iterator", None), out, depth + 1)
    elif getattr(obj, "gi_frame", None) is not None:  # cyclic_iter(dataloader)
        for v in obj.gi_frame.f_locals.values():
            if isinstance(v, (DataLoader, _MultiProcessingDataLoaderIter)):
                worker_iterators(v, out, depth + 1)
    elif hasattr(obj, "iterable"):  # megatron's RerunDataIterator
        worker_iterators(obj.iterable, out, depth + 1)
    return out


def worker_pids(iterators: Any) -> list[int]:
    """The pids of the DataLoader worker processes inside `iterators`."""
    return [w.pid for it in worker_iterators(iterators, []) for w in it._workers
            if w.pid is not None]


def stop_workers(iterators: Any, stuck: Iterable[int] = ()) -> None:
    """Stop the DataLoader workers inside `iterators`, the `stuck` ones (pids) killed
    first. Their pids leave torch's SIGCHLD watch before any is killed: a worker killed
    while watched makes torch raise in the main thread, wherever it is."""
    from torch.utils.data import _utils

    its = worker_iterators(iterators, [])
    for it in its:
        if getattr(it, "_worker_pids_set", False):
            _utils.signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
    stuck = set(stuck)
    for it in its:
        for w in it._workers:
            if w.pid in stuck:
                try:
                    os.kill(w.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    for it in its:
        try:
            it._shutdown_workers()
        except Exception as e:  # noqa: BLE001 - their end is not the job's
            log.debug("stopping a data-loader's workers: %s", e)


def started_build(build: Callable[[], T], iterators_of: Callable[[T], Any],
                  agree: Callable[[int], int], what: str,
                  attempts: int = BUILD_ATTEMPTS, timeout: float = START_TIMEOUT_S,
                  stick_first: bool = False) -> tuple[Optional[T], int]:
    """Run `build` (collective over some ranks: every one of them calls this at the same
    point) under a `StartWatch` until every DataLoader worker in `iterators_of(result)`
    started on every rank, at most `attempts` times. `agree(code)`: the largest code over
    those ranks (one collective). Returns (the result, OK), or (None, NOT_STARTED) when
    workers still did not start, or (None, FAILED) when the build raised on some rank;
    the workers of a result not returned are stopped. On the rank where it raised the
    exception propagates, after the agreement. `stick_first`: the first attempt's first
    child never starts (fault injection)."""
    for attempt in range(1, attempts + 1):
        result, error, stuck = None, None, set()
        try:
            with StartWatch(stick_first and attempt == 1) as watch:
                result = build()
                stuck = watch.not_started(worker_pids(iterators_of(result)), timeout)
        except Exception as e:  # noqa: BLE001 - told to the other ranks first
            error = e
        code = agree(FAILED if error is not None else NOT_STARTED if stuck else OK)
        if code == OK:
            return result, OK
        if result is not None:
            stop_workers(iterators_of(result), stuck)
        if error is not None:
            raise error
        if code == FAILED:
            return None, FAILED
        if stuck:  # the rank it happened on says so; the others follow quietly
            log.warning("%s: data-loader workers %s never started (a fork beside running "
                        "threads, CPython gh-112275): killed, %s", what,
                        sorted(stuck), f"built again (attempt {attempt + 1} of {attempts})"
                        if attempt < attempts else "given up")
        else:
            log.debug("%s: a data-loader worker never started on another rank", what)
    log.warning("%s: data-loader workers still never started after %d attempts", what,
                attempts)
    return None, NOT_STARTED


__all__ = ("BUILD_ATTEMPTS", "FAILED", "NOT_STARTED", "OK", "started_build", "stop_workers",
           "worker_iterators", "worker_pids")
