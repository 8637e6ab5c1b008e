"""DataLoader workers that never start (megatron_lm/worker_start.py): a child stuck right
after its fork (as CPython without gh-112275's fix leaves one forked beside a gloo thread) is
found, killed without torch raising in the main thread, and the build is done again; the
iterators handed on yield the batches a clean build yields. Real torch DataLoaders with
forked workers; the stuck child is made by the fault point "worker_start" (`stick_first`):
the fork hook blocks in the child, where the real one hangs, before any of the worker's
own code."""
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from dynatrain_megatron import fork_watch
from dynatrain_megatron.megatron_lm import worker_start
from dynatrain_megatron.fork_watch import StartWatch
from dynatrain_megatron.megatron_lm.worker_start import (FAILED, NOT_STARTED, OK, started_build,
                                                          worker_pids)


def _iterators():
    """What Megatron-LM's builder returns: a RerunDataIterator-like wrapper over a
    persistent DataLoader iterator with 2 workers, a plain one, and no test iterator."""
    def loader(n):
        return DataLoader(torch.arange(float(n)), batch_size=2, num_workers=2,
                          persistent_workers=True)
    return (SimpleNamespace(iterable=iter(loader(16))), iter(loader(8)), None)


def _first_batches(its, n=3):
    return [next(its[0].iterable).tolist() for _ in range(n)] + [next(its[1]).tolist()]


def test_every_worker_forked_under_a_watch_reports_its_start():
    with StartWatch() as watch:
        its = _iterators()
        pids = worker_pids(its)
        assert len(pids) == 4 and len(set(pids)) == 4
        assert watch.not_started(pids, timeout=30) == set()
        # a pid that was never forked under the watch is reported missing, after the timeout
        t0 = time.monotonic()
        assert watch.not_started(pids + [os.getpid()], timeout=0.3) == {os.getpid()}
        assert time.monotonic() - t0 >= 0.3
    worker_start.stop_workers(its)
    assert _alive(pids) == []


def _alive(pids):
    out = []
    for p in pids:
        try:
            os.waitpid(p, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().split(") ", 1)[1][0] != "Z":
                    out.append(p)
        except FileNotFoundError:
            pass
    return out


def test_a_worker_stuck_after_its_fork_is_killed_and_the_build_done_again():
    built, agreed = [], []

    def build():
        built.append(_iterators())
        return built[-1]

    def agree(code):
        agreed.append(code)
        return code

    # the fault point "worker_start": the first child forked sticks after its fork
    its, outcome = started_build(build, lambda b: b, agree, "test", timeout=5,
                                 stick_first=True)
    assert outcome == OK and agreed == [NOT_STARTED, OK] and its is built[1]
    first = worker_pids(built[0])
    assert _alive(first) == []  # the stuck one killed, the others stopped
    time.sleep(0.5)  # torch's SIGCHLD handler would have raised here (main thread)
    clean = _iterators()
    assert _first_batches(its) == _first_batches(clean)
    worker_start.stop_workers((its, clean))


def test_another_ranks_outcome_is_followed():
    """The build's ranks agree: a worker stuck on another rank makes this one build
    again; a build that failed there makes this one give up, its workers stopped."""
    built = []

    def build():
        built.append(_iterators())
        return built[-1]

    answers = iter([NOT_STARTED, OK])
    its, outcome = started_build(build, lambda b: b, lambda code: next(answers), "test")
    assert outcome == OK and len(built) == 2 and _alive(worker_pids(built[0])) == []
    worker_start.stop_workers(its)
    its, outcome = started_build(build, lambda b: b, lambda code: FAILED, "test")
    assert (its, outcome) == (None, FAILED) and _alive(worker_pids(built[-1])) == []


def test_a_build_that_raises_tells_the_other_ranks_before_it_raises():
    agreed = []

    def build():
        raise OSError("no space left on device")

    with pytest.raises(OSError, match="no space left"):
        started_build(build, lambda b: b, lambda code: agreed.append(code) or code, "test")
    assert agreed == [FAILED]


def test_workers_that_never_start_in_any_attempt_give_up(monkeypatch):
    monkeypatch.setattr(fork_watch, "_report_started", lambda: None)  # nobody reports
    built = []
    its, outcome = started_build(lambda: built.append(_iterators()) or built[-1],
                                 lambda b: b, lambda code: code, "test", attempts=2,
                                 timeout=0.5)
    assert (its, outcome) == (None, NOT_STARTED) and len(built) == 2
    assert _alive([p for b in built for p in worker_pids(b)]) == []


def test_one_watch_at_a_time():
    with StartWatch():
        other = threading.Thread(target=lambda: StartWatch().__enter__())
        other.daemon = True
        other.start()
        other.join(0.3)
        assert other.is_alive()  # waits for the open one
    other.join(5)
    assert not other.is_alive()
    StartWatch().__exit__(None, None, None)  # the one the thread opened
