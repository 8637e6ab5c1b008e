"""Which processes forked by this one got past the fork: a watch that the children
themselves answer.

A process whose other threads are running can fork a child that deadlocks before it runs
any Python: in CPython without the fix of gh-112275 (3.12 has it, 3.11 since 3.11.10;
this machine's 3.11.7 does not), `PyOS_AfterFork_Child` takes the interpreter's
thread-state list lock, which another thread may have held at the moment of the fork.
gloo's worker threads take it whenever a finished collective releases the last reference
to a tensor with a Python object (pybind11 makes them a thread state for it, seen with
gdb on a training rank), which a gloo job does many times a second. Such a child
is alive and never does its work: whoever waits for it (a DataLoader for its batches, a
`multiprocessing` manager's parent for its address) waits forever.

While a `StartWatch` is open every child this process forks writes its pid to a pipe from
an `os.register_at_fork` hook, which runs in the child right after the point where such a
child hangs; `not_started` names the children that have not. A caller kills those and
forks again (`megatron_lm/worker_start.py`, `compat/megatron_lm.forked_manager`).
"""
from __future__ import annotations

import os
import select
import struct
import threading
import time
from typing import Any, Iterable

START_TIMEOUT_S = 10.0  # a child reaches the hook in milliseconds even on a loaded host
_PID = struct.Struct("<q")  # one report: 8 bytes, written whole (below PIPE_BUF)

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
    for fd in (r, w, stick):
        if fd is None:
            continue
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
        opened: list[int] = []
        try:
            r, w = os.pipe()
            opened += [r, w]
            os.set_blocking(r, False)
            os.set_blocking(w, False)  # a child never blocks on a full pipe
            stick = None
            if self.stick_first:
                stick, token = os.pipe()
                opened += [stick, token]
                os.set_blocking(stick, False)
                os.write(token, b"x")
                os.close(opened.pop())
        except OSError:
            for fd in opened:
                os.close(fd)
            _WATCH_LOCK.release()
            raise
        self._seen: set[int] = set()
        self._buf = b""
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


__all__ = ("START_TIMEOUT_S", "StartWatch")
