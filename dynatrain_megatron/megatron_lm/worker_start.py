"""DataLoader workers that never start, and how a build of data iterators gets past them.

B's data iterators are built by the preparation thread while A trains (`data_ahead`), so
their DataLoader workers are forked by a process whose other threads are running. Before
CPython 3.12 (gh-112275; 3.8-3.11) a child forked while another thread holds the
interpreter's thread-state list lock deadlocks in `PyOS_AfterFork_Child`, before it runs
any Python. gloo's worker threads take that lock whenever a finished collective drops the
last reference to a tensor that has a Python object (they make a thread state to release
it), which a gloo job's training does many times a second. Such a worker is alive, so the
DataLoader never reports it, and never reads its index queue: the iterator waits forever
for its first batch, in B's first step. It was seen once in ~25 runs of
`scripts/bench_stall.py` (the hung child's stack ended in `PyOS_AfterFork_Child`).

While a `StartWatch` is open every child this process forks writes its pid to a pipe from
an `os.register_at_fork` hook, which runs in the child right after the point where such a
child hangs; `started_build` compares the pids of the workers a build forked with those
written, agrees with the other ranks of the build, stops the workers of a build where one
never started (the stuck ones killed) and builds again, a bounded number of times.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import struct
import threading
import time
from typing import Any, Callable, Iterable, Optional, TypeVar

log = logging.getLogger("dynatrain")

T = TypeVar("T")

START_TIMEOUT_S = 10.0  # a child reaches the hook in milliseconds even on a loaded host
BUILD_ATTEMPTS = 3
_PID = struct.Struct("<q")  # one report: 8 bytes, written whole (below PIPE_BUF)

# build outcomes, agreed as the largest over the build's ranks
OK, NOT_STARTED, FAILED = 0, 1, 2

# open while a watch is: read end, write end, and a fault's one-byte token (the child that
# takes it never starts: `DYNATRAIN_FAULTS` phase "worker_start")
_PIPE: dict = {"r": None, "w": None, "stick": None}
_WATCH_LOCK = threading.Lock()  # one watch at a time


def _report_started() -> None:
    """In a child just forked: write this pid to the open watch's pipe, once, and close the
    child's copies of the pipe (its own children report to nobody)."""
    r, w, stick = _PIPE["r"], _PIPE["w"], _PIPE["stick"]
    if w is None:
        return
    _PIPE.update(r=None, w=None, stick=None)
    if stick is not None and _took_token(stick):
        while True:  # as a child deadlocked in PyOS_AfterFork_Child
            time.sleep(3600)
    try:
        os.write(w, _PID.pack(os.getpid()))
    except OSError:  # full or closed: the parent then counts this child as not started
        pass
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def _took_token(fd: int) -> bool:
    try:
        return os.read(fd, 1) == b"x"
    except OSError:  # taken by another child already
        return False


def _after_fork_in_child() -> None:
    _report_started()  # looked up at each fork (tests replace it)


os.register_at_fork(after_in_child=_after_fork_in_child)


class StartWatch:
    """A context: every process forked by this one while it is open reports that it got
    past the fork (`not_started` tells which did not). One at a time per process.
    `stick_first`: the first child forked never starts (fault injection)."""

    def __init__(self, stick_first: bool = False) -> None:
        self.stick_first = stick_first

    def __enter__(self) -> "StartWatch":
        _WATCH_LOCK.acquire()
        try:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)  # a child never blocks on a full pipe
        except OSError:
            _WATCH_LOCK.release()
            raise
        self._seen: set[int] = set()
        self._buf = b""
        stick = None
        if self.stick_first:
            stick, token = os.pipe()
            os.set_blocking(stick, False)
            os.write(token, b"x")
            os.close(token)
        _PIPE.update(r=r, w=w, stick=stick)
        return self

    def __exit__(self, *exc: Any) -> None:
        r, w, stick = _PIPE["r"], _PIPE["w"], _PIPE["stick"]
        _PIPE.update(r=None, w=None, stick=None)
        for fd in (r, w, stick):
            if fd is not None:
                os.close(fd)
        _WATCH_LOCK.release()

    def not_started(self, pids: Iterable[int], timeout: float = START_TIMEOUT_S) -> set[int]:
        """Which of `pids` (children forked while the watch was open) have not reported
        within `timeout` seconds; returns at once when all have."""
        want = set(pids)
        r = _PIPE["r"]
        deadline = time.monotonic() + timeout
        while want - self._seen and r is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                break
            try:
                self._buf += os.read(r, 4096)
            except BlockingIOError:
                continue
            whole = len(self._buf) - len(self._buf) % _PID.size
            for (pid,) in _PID.iter_unpack(self._buf[:whole]):
                self._seen.add(pid)
            self._buf = self._buf[whole:]
        return want - self._seen


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
                        "threads, CPython < 3.12 gh-112275): killed, %s", what,
                        sorted(stuck), f"built again (attempt {attempt + 1} of {attempts})"
                        if attempt < attempts else "given up")
        else:
            log.debug("%s: a data-loader worker never started on another rank", what)
    log.warning("%s: data-loader workers still never started after %d attempts", what,
                attempts)
    return None, NOT_STARTED


__all__ = ("BUILD_ATTEMPTS", "FAILED", "NOT_STARTED", "OK", "START_TIMEOUT_S", "StartWatch",
           "started_build", "stop_workers", "worker_iterators", "worker_pids")
